"""`ovkit caption`: recaption every image with a VLM, filter the new captions, keep the old ones beside them.

    one machine:  caption DATA --model DIR --out OUT
    N machines:   caption DATA --model DIR --shard I/N --out OUT      (writes OUT/part-I-of-N/, each complete or absent)

One caption per image (LLaVA-OneVision-1.5 recaptioned each of its 85M images once, ~65M in English and ~20M in
Chinese): the language of a row is drawn from `--lang` with the shares of `--lang-ratio` by a hash of its id and the
seed, so it does not depend on sharding or row order. The prompt is the language's (`--prompt LANG=TEXT` overrides).

Generation is resumable: recaptions are saved every `--chunk-rows` rows into a work directory beside the output
(`.OUT.caption-work/`); a rerun after a crash reads the finished chunks and generates only the rest, and the output
appears at the end, atomically (`ovkit.runs.Stage`). The work directory records the settings that shape the
generations (data, model, languages, prompts, sampling, chunk size, seed); chunks of other settings are discarded.
The filter and the replacement rule run after generation, so changing them reuses the generations.

What happens to a row (`caption_status`):

    recaption                   the recaption passed the filter and is the new last assistant turn
    original: not better        it passed, but targets were kept (`--replace-if-better` measured the originals better)
    original: rejected (...)    it failed the filter and `--keep-original-on-reject` (or no replacement) kept the row
    original: no image          nothing to caption
    (rejects.parquet)           it failed the filter and the originals were being replaced: the row moves to
                                rejects with the reason, so rows in == rows out + rejects
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ovkit import options as O
from ovkit.caption.filter import CaptionFilter, rule
from ovkit.caption.quality import has_cjk, mean_recall, parse_concepts
from ovkit.data import IMAGE_TOKEN, MESSAGE, parse_shard, read_samples, write_rejects, write_samples, write_table
from ovkit.errors import OvkitError
from ovkit.files import fingerprint, write_json, written_by_ovkit
from ovkit.generate import ENGINES, close_engine
from ovkit.models.encode import decode_images, encode_prompt
from ovkit.options import option

DEFAULT_PROMPTS = {"en": "Describe this image in detail.", "zh": "请详细描述这张图片。"}
DEFAULT_SHARES = {"en": 0.75, "zh": 0.25}  # the recipe's recaptions: ~65M English, ~20M Chinese
CAPTION_COLUMNS = ("original_caption", "recaption", "caption_lang", "caption_model", "caption_status")
NO_IMAGE = "no-image"  # finish_reason of rows that were not sent to the captioner
CHUNK_SCHEMA = pa.schema(
    [
        ("row", pa.int64()),
        ("id", pa.string()),
        ("caption_lang", pa.string()),
        ("recaption", pa.string()),
        ("finish_reason", pa.string()),
        ("new_tokens", pa.int32()),
    ]
)


# --help panels of this config's own options (ovkit.options holds the shared ones)
CAPTIONING = "Captioning"
CAPTION_FILTER = "Caption filter"


@dataclass(init=False)
class CaptionConfig(O.StageConfig):
    launcher: ClassVar[str] = O.RANK_SHARDED  # what it does under torchrun / accelerate launch (ovkit.launch)
    loading: O.GeneratorLoading = O.group(O.GeneratorLoading, after=True)  # listed after the command's own options

    data: Path | None = option(
        None,
        help="Sample table to recaption (parquet file or directory of shards).",
        argument=True,
    )
    model: Path | None = option(
        None,
        help="Captioner: any VLM directory (save_pretrained) or hub id.",
        panel=O.IO,
    )
    out: Path | None = O.out()
    lang: str = option(
        "en,zh",
        help="Caption languages; each image gets one, drawn by --lang-ratio.",
        panel=CAPTIONING,
    )
    lang_ratio: str | None = option(
        None,
        help="Shares of the --lang languages, e.g. 0.75,0.25 (default for en,zh; else equal).",
        panel=CAPTIONING,
        default_doc="0.75,0.25 for en,zh; else equal",
    )
    prompt: list[str] | None = option(
        None,
        help="LANG=TEXT: the prompt of a language (repeatable; en and zh have defaults).",
        panel=CAPTIONING,
        default_doc="see above",
    )
    engine: str = O.engine(choices=ENGINES)
    batch_size: int = option(
        32,
        help="Sequences per generate call, hf engine.",
        panel=O.RUNTIME,
        min=1,
        doc="sequences per generate call (hf engine; vLLM batches itself)",
    )
    # the recipe's filter allows 3500 characters, about 800 tokens
    max_new_tokens: int = O.max_new_tokens(
        512, panel=CAPTIONING, doc="tokens per caption at most (the filter's 3500 characters are about 800 tokens)"
    )
    temperature: float = O.temperature(0.0, panel=CAPTIONING)
    top_p: float = O.top_p(panel=CAPTIONING)
    min_chars: int = option(
        50,
        help="Filter: captions shorter than this are rejected.",
        panel=CAPTION_FILTER,
        min=0,
    )
    max_chars: int = option(3500, help="Filter: captions longer than this are rejected.", panel=CAPTION_FILTER)
    # filter: a run of this many identical consecutive words rejects the caption
    repeat_limit: int = option(
        8,
        help="Filter: this many identical consecutive words reject a caption.",
        panel=CAPTION_FILTER,
        min=2,  # a run of 2 identical words rejects
    )
    keep_original_on_reject: bool = option(
        False,
        help=("A rejected recaption keeps its row with the original caption instead of moving it to rejects."),
        panel=CAPTION_FILTER,
        doc="keep a row whose recaption was rejected, with its original caption",
    )
    # with a `concepts` column: replace targets only if recaption concept recall >= original's
    replace_if_better: bool = option(
        True,
        help=("With a `concepts` column: replace the targets only if recaption concept recall >= the originals'."),
        panel=CAPTION_FILTER,
        negatable=True,
        doc="replace only when concept recall does not drop / always replace",
    )
    chunk_rows: int = option(
        256,
        help="Rows per saved chunk of generations (a rerun resumes after the last one).",
        panel=O.RUN,
        min=1,
    )
    shard: str | None = O.shard(doc="`I/N`: caption part I of N into `OUT/part-I-of-N/`")
    on_error: str = O.on_error()
    seed: int = O.seed(doc="language draw and sampling seed")
    overwrite: bool = O.overwrite(doc="redo a complete output (and discard saved chunks)")
    quiet: bool = O.quiet()

    def __post_init__(self) -> None:
        O.validate(self)  # each option's declared range and choices; the checks across options follow
        for name in ("data", "model", "out"):
            if getattr(self, name) is None:
                raise OvkitError("DATA is required" if name == "data" else f"--{name} is required")
        self.lang = _csv(self.lang)
        self.lang_ratio = _csv(self.lang_ratio) if self.lang_ratio is not None else None
        self.languages()
        self.prompts()
        parse_shard(self.shard)
        if self.min_chars > self.max_chars:
            raise OvkitError(f"need --min-chars <= --max-chars, got {self.min_chars} and {self.max_chars}")

    def languages(self) -> list[tuple[str, float]]:
        """(language, share) pairs, shares summing to 1."""
        langs = [x for x in self.lang.split(",") if x]
        if not langs or len(set(langs)) != len(langs):
            raise OvkitError(f"--lang must list distinct languages separated by commas (e.g. en,zh), got {self.lang!r}")
        if self.lang_ratio is None:
            shares = [DEFAULT_SHARES[x] for x in langs] if set(langs) == set(DEFAULT_SHARES) else [1.0] * len(langs)
        else:
            try:
                shares = [float(x) for x in self.lang_ratio.split(",")]
            except ValueError:
                raise OvkitError(
                    f"--lang-ratio must be numbers separated by commas (e.g. 0.75,0.25), got {self.lang_ratio!r}"
                ) from None
            if len(shares) != len(langs) or any(s < 0 for s in shares) or sum(shares) <= 0:
                raise OvkitError(
                    f"--lang-ratio needs one share >= 0 per --lang language ({self.lang}), not all 0; got "
                    f"{self.lang_ratio!r}"
                )
        total = sum(shares)
        return [(x, s / total) for x, s in zip(langs, shares)]

    def prompts(self) -> dict[str, str]:
        """The prompt of each --lang language: the defaults, overridden by --prompt LANG=TEXT."""
        prompts = dict(DEFAULT_PROMPTS)
        for item in self.prompt or []:
            lang, sep, text = str(item).partition("=")
            if not sep or not lang.strip() or not text.strip():
                raise OvkitError(f"--prompt must look like LANG=TEXT (e.g. 'en=Describe this image.'), got {item!r}")
            prompts[lang.strip()] = text.strip()
        missing = [x for x, _ in self.languages() if x not in prompts]
        if missing:
            raise OvkitError(f"no prompt for --lang {missing[0]}: give one with --prompt '{missing[0]}=...'")
        return {x: prompts[x] for x, _ in self.languages()}

    def caption_filter(self) -> CaptionFilter:
        return CaptionFilter(self.min_chars, self.max_chars, self.repeat_limit)


def _csv(value: Any) -> str:
    """`en,zh` or a YAML list ['en', 'zh'] -> 'en,zh'."""
    items = value if isinstance(value, (list, tuple)) else str(value).split(",")
    return ",".join(str(x).strip() for x in items if str(x).strip())


# ---- languages and prompts ---------------------------------------------------------------------------------------


def pick_language(row_id: str, seed: int, shares: Sequence[tuple[str, float]]) -> str:
    """The caption language of a row: a uniform number from the hash of (seed, id), cut by the cumulative shares."""
    digest = hashlib.sha256(f"{seed}:{row_id}".encode()).digest()
    u = int.from_bytes(digest[:8], "big") / 2**64
    acc = 0.0
    for lang, share in shares:
        acc += share
        if u < acc:
            return lang
    return shares[-1][0]


def caption_messages(n_images: int, prompt: str) -> list[dict[str, str]]:
    """The captioning prompt of a row: its images, then the language's prompt."""
    return [{"role": "user", "content": f"{IMAGE_TOKEN}\n" * n_images + prompt}]


def last_assistant(messages: Sequence[dict[str, Any]]) -> str | None:
    return next((m["content"] for m in reversed(messages) if m["role"] == "assistant"), None)


# ---- generation --------------------------------------------------------------------------------------------------


def build_engine(cfg: CaptionConfig) -> tuple[Any, Any]:
    """(engine, processor) for `cfg.model`: transformers (on the GPU when there is one) or vLLM."""
    # heavy: torch loads on first use, not at CLI start or in config checks
    from ovkit.generate.engines import build_engine as build

    engine = build(
        cfg.engine,
        model_dir=cfg.model,
        precision=cfg.precision,
        batch_size=cfg.batch_size,
        seed=cfg.seed,
        progress=not cfg.quiet,
        trust_remote_code=cfg.trust_remote_code,
        attn_implementation=cfg.attn_implementation,
    )
    return engine, engine.processor


class Captioner:
    """Encodes caption prompts and generates; the engine is built on first use, so a resumed run whose chunks are
    all finished never loads the model."""

    def __init__(self, cfg: CaptionConfig, engine: Any = None, processor: Any = None):
        self.cfg = cfg
        self.engine = engine
        self.processor = processor
        self.prompts = cfg.prompts()

    def __call__(self, rows: Sequence[dict[str, Any]], langs: Sequence[str], seed: int) -> list[Any]:

        if self.engine is None:
            self.engine, self.processor = build_engine(self.cfg)
        images = [decode_images(r["images"]) for r in rows]
        prompts = [
            encode_prompt(self.processor, caption_messages(len(pics), self.prompts[lang]), pics)
            for pics, lang in zip(images, langs)
        ]
        outs = self.engine.generate(
            prompts,
            n=1,
            max_new_tokens=self.cfg.max_new_tokens,
            temperature=self.cfg.temperature,
            top_p=self.cfg.top_p,
            seed=seed,
            images=images,
        )
        return [o[0] for o in outs]


def work_dir(out: Path) -> Path:
    """Where the chunks of an unfinished run of `out` live: a hidden directory beside it (hidden, so that a dataset
    reader of the parent directory never mistakes chunks for data)."""
    out = Path(out)
    return out.parent / f".{out.name}.caption-work"


def work_key(cfg: CaptionConfig, shard: tuple[int, int] | None) -> dict[str, Any]:
    """Everything that shapes the generations: chunks made under another key are not reused."""

    model = Path(str(cfg.model))
    key = {
        "data": fingerprint(Path(cfg.data)),
        "model": fingerprint(model) if model.exists() else str(cfg.model),
        "shard": shard,
        "on_error": cfg.on_error,
        "languages": cfg.languages(),
        "prompts": cfg.prompts(),
        "engine": cfg.engine,
        "precision": cfg.precision,
        "max_new_tokens": cfg.max_new_tokens,
        "temperature": cfg.temperature,
        "top_p": cfg.top_p,
        "chunk_rows": cfg.chunk_rows,
        "seed": cfg.seed,
    }
    for k in ("data", "model"):
        if isinstance(key[k], dict):
            key[k].pop("path", None)  # the same files under another path are the same input
    return json.loads(json.dumps(key))


def _work_key(work: Path) -> Any:
    try:
        return json.loads((work / "work.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None


def check_work(work: Path) -> None:
    """Exit 2 when `work` exists and is not caption's work directory (a work.json of its own, or ovkit's mark, or
    empty): ovkit removes only what it wrote. The command checks it before the model loads; prepare_work again."""
    key = _work_key(work) if work.is_dir() else None
    if (work.exists() or work.is_symlink()) and not (isinstance(key, dict) and "chunk_rows" in key):
        if not written_by_ovkit(work):
            raise OvkitError(
                f"{work} exists and is not caption's work directory (no work.json of ovkit's): ovkit did not write "
                f"it, so it never removes it; move it away yourself, or choose another --out"
            )


def prepare_work(work: Path, key: dict[str, Any], *, fresh: bool) -> None:
    """Start or continue the work directory: kept when its key matches (and not `fresh`), else emptied."""

    meta = work / "work.json"
    check_work(work)
    if work.exists():
        old = _work_key(work)
        if fresh or old != key:
            n = len(list(work.glob("chunk-*.parquet")))
            if n and not fresh:
                print(f"caption: {work} holds {n} chunk(s) made with other settings; starting over", file=sys.stderr)
            shutil.rmtree(work)
    work.mkdir(parents=True, exist_ok=True)
    write_json(meta, key)


def generate_chunks(
    cfg: CaptionConfig, table: pa.Table, rows: Sequence[int], langs: Sequence[str], work: Path, captioner: Captioner
) -> tuple[pa.Table, dict[str, Any]]:
    """The recaption of every row of `table` (CHUNK_SCHEMA, in row order), generated `chunk_rows` rows at a time and
    saved per chunk under `work`; chunks already saved with the same row ids are read instead of generated."""
    # heavy: tqdm loads on first use, not at CLI start or in config checks
    from tqdm.auto import tqdm

    ids = table.column("id").to_pylist()
    chunks, stats = [], {"resumed_rows": 0, "generated_rows": 0, "generate_seconds": 0.0}
    bar = tqdm(total=table.num_rows, desc="caption", unit="row", disable=cfg.quiet)
    for start in range(0, table.num_rows, cfg.chunk_rows):
        end = min(start + cfg.chunk_rows, table.num_rows)
        path = work / f"chunk-{start:010d}.parquet"
        chunk = _read_chunk(path, ids[start:end])
        if chunk is not None:
            stats["resumed_rows"] += chunk.num_rows
        else:
            began = time.perf_counter()
            part = table.slice(start, end - start).select(["id", "images"]).to_pylist()
            chunk = _generate_chunk(part, rows[start:end], langs[start:end], captioner, seed=cfg.seed + start)
            write_table(chunk, path)
            stats["generate_seconds"] += time.perf_counter() - began
            stats["generated_rows"] += sum(1 for r in part if r["images"])
        chunks.append(chunk)
        bar.update(end - start)
    bar.close()
    return (pa.concat_tables(chunks) if chunks else CHUNK_SCHEMA.empty_table()), stats


def _read_chunk(path: Path, ids: list[str]) -> pa.Table | None:
    if not path.is_file():
        return None
    try:
        chunk = pq.read_table(path).replace_schema_metadata(None)
    except (pa.ArrowInvalid, OSError):
        return None  # a torn file cannot happen with atomic writes, but a damaged one is simply regenerated
    if chunk.schema != CHUNK_SCHEMA or chunk.column("id").to_pylist() != ids:
        return None
    return chunk


def _generate_chunk(
    part: list[dict[str, Any]], rows: Sequence[int], langs: Sequence[str], captioner: Captioner, seed: int
) -> pa.Table:
    todo = [i for i, r in enumerate(part) if r["images"]]
    done = captioner([part[i] for i in todo], [langs[i] for i in todo], seed) if todo else []
    texts: list[str | None] = [None] * len(part)
    finish = [NO_IMAGE] * len(part)
    tokens = [0] * len(part)
    for i, c in zip(todo, done):
        texts[i], finish[i], tokens[i] = c.text.strip(), c.finish_reason, len(c.token_ids)
    columns = [list(rows), [r["id"] for r in part], list(langs), texts, finish, tokens]
    return pa.table([pa.array(c, f.type) for c, f in zip(columns, CHUNK_SCHEMA)], schema=CHUNK_SCHEMA)


# ---- filter, measure, decide, assemble -----------------------------------------------------------------------------


@dataclass
class Decision:
    replace: bool  # do passing recaptions become the last assistant turn?
    reason: str  # one sentence for the summary line and ovkit.json
    recall: dict[str, Any]  # concept recall of originals and recaptions (English captions with ground truth)


def decide(cfg: CaptionConfig, table: pa.Table, gen: pa.Table, originals: Sequence[str | None]) -> Decision:
    """Replace the targets, or keep them: the concept-recall comparison of `--replace-if-better`."""
    concepts = (
        [parse_concepts(c) for c in table.column("concepts").to_pylist()]
        if "concepts" in table.column_names
        else [None] * table.num_rows
    )
    texts, langs, finish = (gen.column(k).to_pylist() for k in ("recaption", "caption_lang", "finish_reason"))
    # Both sides over the rows that were captioned: originals written in English, recaptions asked for in English.
    before, n_before = mean_recall(
        (o, c)
        for o, c, f in zip(originals, concepts, finish)
        if c and f != NO_IMAGE and o is not None and not has_cjk(o)
    )
    after, n_after = mean_recall(
        (t, c) for t, c, lang, f in zip(texts, concepts, langs, finish) if c and lang == "en" and f != NO_IMAGE
    )
    recall = {
        "original": _round(before),
        "recaption": _round(after),
        "rows_original": n_before,
        "rows_recaption": n_after,
    }
    if not cfg.replace_if_better:
        return Decision(True, "recaptions replace the originals (--no-replace-if-better)", recall)
    if before is None or after is None:
        return Decision(
            True,
            "recaptions replace the originals (no `concepts` ground truth on English captions to compare them with)",
            recall,
        )
    if after >= before:
        return Decision(True, f"recaptions replace the originals: concept recall {after:.3f} >= {before:.3f}", recall)
    return Decision(
        False,
        f"targets unchanged because concept recall {after:.3f} < {before:.3f} (originals); recaptions kept in "
        f"column `recaption`",
        recall,
    )


def assemble(cfg: CaptionConfig, table: pa.Table, gen: pa.Table) -> tuple[pa.Table, pa.Table | None, dict[str, Any]]:
    """(rows out, rows rejected by the filter with a `reason`, metrics) from the input rows and their recaptions."""
    messages = table.column("messages").to_pylist()
    originals = [last_assistant(m) for m in messages]
    texts, langs, finish = (gen.column(k).to_pylist() for k in ("recaption", "caption_lang", "finish_reason"))
    filt = cfg.caption_filter()
    problems = [filt.problem(t) if f != NO_IMAGE else None for t, f in zip(texts, finish)]
    decision = decide(cfg, table, gen, originals)
    prompts = cfg.prompts()
    n_images = pc.list_value_length(table.column("images")).to_pylist()  # counts only: image bytes stay in Arrow

    new_messages, status, keep = [], [], []
    for msgs, text, lang, f, problem, k in zip(messages, texts, langs, finish, problems, n_images):
        target, state, kept = _outcome(
            msgs, text, k, prompts.get(lang, ""), f, problem, decision.replace, cfg.keep_original_on_reject
        )
        new_messages.append(target)
        status.append(state)
        keep.append(kept)
    reasons = [f"caption filter: {p}" for p, k in zip(problems, keep) if not k]

    full = table.drop_columns([c for c in CAPTION_COLUMNS if c in table.column_names])
    full = full.set_column(full.column_names.index("messages"), "messages", pa.array(new_messages, pa.list_(MESSAGE)))
    extra = {
        "original_caption": originals,
        "recaption": texts,
        "caption_lang": langs,
        "caption_model": [str(cfg.model)] * table.num_rows,
        "caption_status": status,
    }
    for name, values in extra.items():
        full = full.append_column(name, pa.array(values, pa.string()))
    mask = pa.array(keep, pa.bool_())
    out = full.filter(mask)
    rejected = full.filter(pc.invert(mask))
    rejected = rejected.append_column("reason", pa.array(reasons, pa.string())) if rejected.num_rows else None
    return out, rejected, _metrics(decision, originals, texts, langs, finish, problems, status)


def _outcome(msgs, text, n_images, prompt, finish, problem, replace, keep_on_reject) -> tuple[list[dict], str, bool]:
    """(messages, caption_status, kept?) of one row."""
    if finish == NO_IMAGE:
        return msgs, "original: no image", True
    if problem is not None:
        return msgs, f"original: rejected ({problem})", keep_on_reject or not replace
    if replace:
        return [*caption_messages(n_images, prompt), {"role": "assistant", "content": text}], "recaption", True
    return msgs, "original: not better", True


def _metrics(decision, originals, texts, langs, finish, problems, status) -> dict[str, Any]:
    captioned = [i for i, f in enumerate(finish) if f != NO_IMAGE]
    passed = [i for i in captioned if problems[i] is None]
    by_rule: dict[str, int] = {}
    for i in captioned:
        if problems[i]:
            by_rule[rule(problems[i])] = by_rule.get(rule(problems[i]), 0) + 1
    by_lang: dict[str, int] = {}
    for i in captioned:
        by_lang[langs[i]] = by_lang.get(langs[i], 0) + 1
    by_status: dict[str, int] = {}
    for s in status:
        key = "original: rejected" if s.startswith("original: rejected") else s
        by_status[key] = by_status.get(key, 0) + 1
    return {
        "captioned": len(captioned),
        "languages": dict(sorted(by_lang.items())),
        "pass_rate": _round(len(passed) / len(captioned)) if captioned else None,
        "rejected_by_rule": dict(sorted(by_rule.items())),
        "truncated": _round(sum(1 for i in captioned if finish[i] == "length") / len(captioned)) if captioned else None,
        "mean_chars": {
            "original": _round(_mean([len(o) for o in originals if o is not None])),
            "recaption": _round(_mean([len(texts[i]) for i in captioned])),
            "recaption_passed": _round(_mean([len(texts[i]) for i in passed])),
        },
        "concept_recall": decision.recall,
        "replaced": decision.replace,
        "decision": decision.reason,
        "status": dict(sorted(by_status.items())),
    }


def _mean(xs: Sequence[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


# ---- the stage ---------------------------------------------------------------------------------------------------


def run(
    cfg: CaptionConfig,
    out: Path,
    shard: tuple[int, int] | None,
    *,
    work: Path,
    engine: Any = None,
    processor: Any = None,
) -> dict[str, Any]:
    """Recaption `cfg.data` (this shard of it) into `out`; generations are saved under `work` as they finish and
    read back on a rerun. `engine`/`processor` may be given (tests, or a caller holding a model). Returns metrics."""
    started = time.perf_counter()
    samples = read_samples(cfg.data, shard=shard, on_error=cfg.on_error)
    table = samples.table
    shares = cfg.languages()
    langs = [pick_language(rid, cfg.seed, shares) for rid in table.column("id").to_pylist()]
    prepare_work(work, work_key(cfg, shard), fresh=cfg.overwrite)
    captioner = Captioner(cfg, engine, processor)
    try:
        gen, stats = generate_chunks(cfg, table, samples.rows, langs, work, captioner)
    finally:
        if engine is None and captioner.engine is not None:  # built here: shut down here (vLLM's worker)
            close_engine(captioner.engine)
    kept, rejected, metrics = assemble(cfg, table, gen)
    write_samples(kept, out, shard)
    parts = [t for t in (samples.rejects, rejected) if t is not None]
    write_rejects(pa.concat_tables(parts, promote_options="default") if parts else None, out)
    seconds = time.perf_counter() - started
    rate = stats["generated_rows"] / stats["generate_seconds"] if stats["generate_seconds"] > 0 else None
    return {
        "rows_in": table.num_rows + samples.n_rejects,
        "rows_out": kept.num_rows,
        "rejects": samples.n_rejects + (rejected.num_rows if rejected is not None else 0),
        "input_rejects": samples.n_rejects,
        **metrics,
        "resumed_rows": stats["resumed_rows"],
        "generated_rows": stats["generated_rows"],
        "new_tokens": int(pc.sum(gen.column("new_tokens")).as_py() or 0),
        "seconds": {"generate": round(stats["generate_seconds"], 2), "total": round(seconds, 2)},
        "rows_per_second": _round(rate),
    }


def remove_work(work: Path) -> None:
    """After the output is complete, the chunks are no longer needed."""
    shutil.rmtree(work, ignore_errors=True)
