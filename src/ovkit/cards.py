"""Dataset and model cards: a README.md in every data and model output, generated from its ovkit.json.

A dataset card's YAML front matter has `configs:` with `data_files` globs, so `datasets.load_dataset(DIR)` returns
every split with its rows (and images decoded through the `datasets` Image feature the parquet metadata declares);
without it `datasets` guesses splits from directory names and, for synth's output, returned only `eval/` as `test`.
Layout rules (the sample table of ovkit.data.schema):
- part files directly in DIR are one table: config `default`, split `train`;
- each subdirectory holding part files (synth's pretrain/instruct/rl/eval, rl-curate's stage1/stage2) is a subset:
  one config of that name with one split of that name, and the `default` config lists every subset as a split. A
  config's splits must share their columns, so where subsets differ (synth's pretrain has `lang` and no `answer`) the
  default config loads only the shared columns (`columns:`) and the subset's own config has all of them;
- a sharded output (OUT/part-I-of-N/...) gets the same configs with every pattern under `part-?????-of-NNNNN/`, which
  matches each part directory and no temporary `.tmp-<pid>` one; parts write this top-level card from what they all
  share (no row counts, no times, `--shard I/N` shown as such), so parts finishing together write identical bytes;
- a pack plan (no sample table) is config `default` of `plan.parquet`;
- an eval output (lmms-eval layout, ovkit.evaluate.results) is its per-row samples: each task's
  `<model>/<timestamp>_samples_<task>.jsonl` is a split of the `default` config and a config of its own (never the
  `_results.json` beside them: one config over mixed json/jsonl fails to build). Tasks score with different reward
  parts, so `reward_parts` differs in type from task to task; the `default` config declares its features
  (`dataset_info`) as the union of every task's, where each task's missing fields load as None.
A model card (HF model card metadata: library_name, pipeline_tag, base_model, tags, datasets) says what produced the
model, from what, with which command and settings, its headline metrics and how to load it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ovkit.files import read_provenance
from ovkit.hub import is_hub_id, is_remote, parse_spec

CARD = "README.md"
PART_DIR = re.compile(r"part-(\d{5})-of-(\d{5})")
PART_GLOB = "part-*.parquet"
PLAN = "plan.parquet"
EVAL_SUMMARY = "summary.json"
EVAL_RESULTS = "*_results.json"
WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
MAX_LINEAGE = 20

# Settings shown on a model card when the stage's config has them (ovkit.json spells options with dashes).
MODEL_SETTINGS = (
    "preset",
    "vision",
    "llm",
    "plan",
    "trainable",
    "freeze-vision",
    "lr",
    "min-lr",
    "warmup-ratio",
    "weight-decay",
    "max-grad-norm",
    "batch-size",
    "grad-accum",
    "max-steps",
    "epochs",
    "max-len",
    "precision",
    "stage",
    "prompts-per-step",
    "group-size",
    "max-new-tokens",
    "temperature",
    "eps-clip",
    "eps-clip-high",
    "reward-bias",
    "reward-scale",
    "kl-coef",
    "behave-cap",
    "correction",
    "max-staleness",
    "format-weight",
    "env",
    "max-turns",
    "seed",
)


@dataclass
class Table:
    """One split of a data output: its config, split name, glob (relative to the output) and what it holds."""

    config: str
    split: str
    pattern: str
    columns: list[str]
    rows: int | None
    trl: bool = False
    files: list[Path] = field(default_factory=list)


# ------------------------------------------------------------------------------------------------ entry points


def write_card(directory: Path, prov: dict[str, Any], shown: Path | str) -> Path | None:
    """Write DIR/README.md for a model, data or eval output (`shown`: the path the output will have, for the
    snippets). Nothing for other outputs (reports) or where the stage wrote a README itself."""
    directory = Path(directory)
    if (directory / CARD).exists():
        return None
    if is_model_dir(directory):
        text = model_card(directory, prov, str(shown))
    elif (directory / EVAL_SUMMARY).is_file():
        tables = eval_tables(directory)
        if not tables:
            return None
        text = eval_card(directory, tables, prov, str(shown))
    else:
        tables = data_tables(directory)
        if not tables:
            return None
        # `datasets` cannot load a split without rows ("corresponds to no data"): such tables stay out of the configs
        empty = [t.config for t in tables if not t.rows]
        text = dataset_card([t for t in tables if t.rows], prov, str(shown), empty=empty)
    return _write_atomic(directory / CARD, text)


def write_parts_card(out: Path, part: Path, prov: dict[str, Any]) -> Path | None:
    """OUT/README.md for the sharded output OUT whose part `part` (OUT/part-I-of-N) just finished."""
    m = PART_DIR.fullmatch(Path(part).name)
    if m is None or not (Path(part) / CARD).is_file():
        return None
    n = int(m.group(2))
    prefix = f"part-?????-of-{n:05d}/"
    tables = [Table(t.config, t.split, prefix + t.pattern, t.columns, None, t.trl) for t in data_tables(Path(part))]
    if not tables:
        return None
    return _write_atomic(Path(out) / CARD, dataset_card(tables, prov, str(out), parts=n, key=shared_key(prov)))


# ------------------------------------------------------------------------------------------------ data outputs


def data_tables(directory: Path) -> list[Table]:
    """The tables of a data output, by the layout rules of the module docstring."""
    directory = Path(directory)
    top = _table_files(directory)
    tables = [_table("default", "train", PART_GLOB, top)] if top else []
    for sub in sorted(p for p in directory.iterdir() if p.is_dir() and not _hidden(p.name)):
        files = _table_files(sub)
        if files:
            tables.append(_table(sub.name, _split_name(sub.name), f"{sub.name}/{PART_GLOB}", files))
    if not tables and (directory / PLAN).is_file():
        tables.append(_table("default", "train", PLAN, [directory / PLAN]))
    return tables


def _table_files(directory: Path) -> list[Path]:
    """DIR's part files if they hold chat rows with images (not rollouts or other side tables)."""
    # heavy: pyarrow loads on first use, not at CLI start or in config checks
    import pyarrow.parquet as pq

    files = sorted(p for p in directory.glob(PART_GLOB) if p.is_file() and not _hidden(p.name))
    if not files:
        return []
    names = pq.read_schema(files[0]).names
    chat = bool({"messages", "prompt"} & set(names)) and bool({"images", "image"} & set(names))
    return files if chat else []


def _table(config: str, split: str, pattern: str, files: list[Path]) -> Table:
    # heavy: pyarrow, numpy load on first use, not at CLI start or in config checks
    import pyarrow.parquet as pq

    from ovkit.data.formats import schema_has_parts

    schema = pq.read_schema(files[0])
    rows = sum(pq.ParquetFile(f).metadata.num_rows for f in files)
    return Table(config, split, pattern, list(schema.names), rows, schema_has_parts(schema), files)


def _hidden(name: str) -> bool:
    return name.startswith((".", "_")) or ".tmp-" in name or ".old-" in name


def _split_name(name: str) -> str:
    """`datasets` split names are \\w+(\\.\\w+)*: pretrain-balanced -> pretrain_balanced."""
    return re.sub(r"\W", "_", name) or "train"


def card_configs(tables: list[Table]) -> list[dict[str, Any]]:
    """The `configs:` entries for these tables."""
    if tables[0].config == "default":  # part files in DIR itself: the default config; subsets beside it
        head, rest = tables[0], tables[1:]
        configs = [{"config_name": "default", "data_files": [{"split": head.split, "path": head.pattern}]}]
    else:
        rest = tables
        configs = [{"config_name": "default", "data_files": [{"split": t.split, "path": t.pattern} for t in tables]}]
        shared = [c for c in tables[0].columns if all(c in t.columns for t in tables)]
        if any(set(t.columns) != set(shared) for t in tables):
            configs[0]["columns"] = shared
    for t in rest:
        configs.append({"config_name": t.config, "data_files": [{"split": t.split, "path": t.pattern}]})
    return configs


def content_key(tables: list[Table]) -> str:
    """A hash of the tables' files (name, size, parquet footer: row counts, offsets, column statistics) for the card.

    `datasets` names the cache of `load_dataset(DIR)` after DIR's last path component, the config and a hash of the
    card's configs, whose `data_files` are relative globs: two outputs `a/data` and `b/data` with the same layout
    got one cache entry, so the second load returned the first one's rows. The configs' `description` enters that
    hash, so the card carries this key there: same content, same key (outputs stay byte-identical per seed); other
    content, another cache entry."""

    h = hashlib.sha256()
    for t in tables:
        for i, f in enumerate(t.files):  # by position: the output's own directory name is a temporary one here
            size = f.stat().st_size
            h.update(f"{t.split}/{i}:{size}".encode())
            if f.suffix != ".parquet":  # an eval's samples jsonl: no footer to stand for it, the bytes themselves
                h.update(f.read_bytes())
            elif size >= 8:
                with open(f, "rb") as fh:
                    fh.seek(-8, os.SEEK_END)
                    footer = int.from_bytes(fh.read(4), "little")
                    fh.seek(max(0, size - 8 - footer))
                    h.update(fh.read())
    return h.hexdigest()[:16]


def shared_key(prov: dict[str, Any]) -> str:
    """`content_key` of a sharded output, whose parts each write the top-level card (identical bytes whichever part
    finishes last): what determines the rows (command, settings, inputs' fingerprints, seed, version), not a part's
    own `--out` and `--shard`."""

    config = {
        k: v for k, v in (prov.get("config") or {}).items() if k not in ("out", "shard", "quiet", "overwrite", "resume")
    }
    what = {k: prov.get(k) for k in ("command", "inputs", "seed", "ovkit_version")}
    return hashlib.sha256(json.dumps({**what, "config": config}, sort_keys=True, default=str).encode()).hexdigest()[:16]


def dataset_card(
    tables: list[Table],
    prov: dict[str, Any],
    shown: str,
    *,
    parts: int | None = None,
    empty: list[str] = (),
    key: str | None = None,
) -> str:
    # heavy: yaml loads on first use, not at CLI start or in config checks
    import yaml

    if not tables:
        return _empty_card(prov, shown, empty)
    configs = card_configs(tables)
    for cfg in configs:  # in each config, so `load_dataset(DIR)` caches this content apart from any other
        cfg["description"] = f"ovkit data {key or content_key(tables)}"
    meta = {"configs": configs, "tags": ["ovkit"], "task_categories": ["image-text-to-text"]}
    if prov.get("command") == "pack":
        meta.pop("task_categories")
    lines = ["---", yaml.safe_dump(meta, sort_keys=False, allow_unicode=True).rstrip(), "---", ""]
    lines += [f"# {Path(shown).name}", "", _data_summary(tables, prov, parts), ""]
    lines += ["## Load it", "", "```python", "from datasets import load_dataset", ""]
    if len(configs) > 1:
        lines.append(f'ds = load_dataset("{shown}")  # every split: {", ".join(t.split for t in tables)}')
        lines.append(f'ds = load_dataset("{shown}", "{tables[-1].config}")  # one subset with all its columns')
    else:
        lines.append(f'ds = load_dataset("{shown}", split="{tables[0].split}")')
    lines += ["```", ""]
    if prov.get("command") != "pack":
        sel = f"`{shown}:{tables[-1].config}`" if len(configs) > 1 else None
        lines += [
            f"Every ovkit command that reads a sample table takes `{shown}` as it is"
            + (f" ({sel} or `{shown}@SPLIT` picks one subset)." if sel else ".")
            + " `ovkit convert DIR --to trl` writes a copy in TRL's format.",
            "",
        ]
    lines += ["## Contents", "", *_contents_table(tables, configs), ""]
    if empty:
        lines += [
            f"Without rows, so not in the configs (`datasets` cannot load an empty split): "
            f"{', '.join(f'`{e}`' for e in empty)}.",
            "",
        ]
    for note in _layout_notes(tables, configs):
        lines += [note, ""]
    lines += ["## Provenance", "", *_provenance_lines(prov, parts), ""]
    return "\n".join(lines)


def _empty_card(prov: dict[str, Any], shown: str, empty: list[str]) -> str:
    lines = ["---", "tags:", "- ovkit", "---", "", f"# {Path(shown).name}", ""]
    lines += [
        f"Written by `ovkit {prov.get('command')}` (ovkit {prov.get('ovkit_version')}) with no rows in "
        f"{', '.join(f'`{e}`' for e in empty)}, so it has no `configs:` for `datasets` to load. Generated from "
        f"`ovkit.json`.",
        "",
    ]
    lines += ["## Provenance", "", *_provenance_lines(prov, None), ""]
    return "\n".join(lines)


def _data_summary(tables: list[Table], prov: dict[str, Any], parts: int | None) -> str:
    what = (
        "A pack plan"
        if prov.get("command") == "pack"
        else "A sample table in TRL's conversational VLM layout"
        if tables[0].trl
        else "An ovkit sample table"
    )
    rows = None if parts else sum(t.rows or 0 for t in tables)
    made = f"written by `ovkit {prov.get('command')}` (ovkit {prov.get('ovkit_version')})"
    size = (
        f", {rows} rows"
        if rows is not None
        else f", in {parts} parts (`part-IIIII-of-{parts:05d}/`, each with its own card and ovkit.json)"
    )
    return f"{what}{size}, {made}. Generated from `ovkit.json`."


def _contents_table(tables: list[Table], configs: list[dict[str, Any]]) -> list[str]:
    rows = ["| config | split | files | rows | columns |", "|---|---|---|---|---|"]
    by_split = {t.pattern: t for t in tables}
    for cfg in configs:
        for df in cfg["data_files"]:
            t = by_split[df["path"]]
            cols = cfg.get("columns", t.columns)
            n = "see the parts" if t.rows is None else str(t.rows)
            rows.append(
                f"| {cfg['config_name']} | {df['split']} | `{df['path']}` | {n} | {', '.join(f'`{c}`' for c in cols)} |"
            )
    return rows


def _layout_notes(tables: list[Table], configs: list[dict[str, Any]]) -> list[str]:
    notes = []
    if tables[0].config != "default":
        if "columns" in configs[0]:
            only = sorted({c for t in tables for c in t.columns} - set(configs[0]["columns"]))
            notes.append(
                "Each subset is a config of its own because their columns differ ("
                + ", ".join(f"`{c}`" for c in only)
                + " are not in every subset): a config's splits share one set of features in `datasets`. The `default` "
                "config loads every subset as a split with the columns they share."
            )
        else:
            notes.append("The `default` config loads every subset as a split; each subset is also a config of its own.")
    if tables[0].trl:
        notes.append(
            "`messages` content is a list of `{type: text|image}` parts; TRL (SFTTrainer, "
            "`prepare_multimodal_messages`) "
            "fills the image parts from `images` in order and the processor's chat template renders them as image "
            "tokens."
        )
    elif tables[0].pattern.endswith(PART_GLOB):
        notes.append(
            "Columns (the sample table of ovkit.data.schema): `images` is a list of images (the `datasets` Image "
            "feature, "
            "decoded to PIL), `messages` the chat turns with `<image>` where each image goes, `source` the origin "
            "of the "
            "row; RL and eval rows hold the prompt only, with `answer` and `answer_type` (the reward's scorer)."
        )
    return notes


def _provenance_lines(prov: dict[str, Any], parts: int | None, *, full: bool = True) -> list[str]:
    """Command, version, inputs, parent, seed, times, headline metrics (`full=False`: a model card shows inputs,
    lineage and metrics in sections of their own)."""
    lines = [f"- command: `{command_line(prov, parts)}`", f"- ovkit version: {prov.get('ovkit_version')}"]
    inputs = prov.get("inputs") or [] if full else []
    if inputs:
        lines.append("- inputs:")
        lines += [f"  - {_describe_input(i)}" for i in inputs]
    parent = prov.get("parent") if full else None
    if parent:
        lines.append(f"- parent: `{parent.get('path')}` ({parent.get('command') or 'not an ovkit output'})")
    if prov.get("seed") is not None:
        lines.append(f"- seed: {prov['seed']}")
    if not parts:
        lines.append(f"- run: {prov.get('started')} to {prov.get('finished')}")
        headline = _headline(prov.get("metrics") or {}) if full else []
        if headline:
            lines.append("- metrics: " + ", ".join(f"{k} {v}" for k, v in headline))
    return lines


def command_line(prov: dict[str, Any], parts: int | None = None) -> str:
    """The command as typed (argv), or `ovkit COMMAND` when the stage ran from Python; a part's `--shard I/N` is
    shown as `--shard I/N` in a card shared by all parts."""
    argv = [str(a) for a in prov.get("argv") or []]
    command = str(prov.get("command"))
    if command not in argv[1:2]:
        return f"ovkit {command}"
    args = argv[1:]
    if parts:
        args = [
            re.sub(r"^(--shard=)?\d+/(\d+)$", r"\1I/\2", a)
            if k and (args[k - 1] == "--shard" or a.startswith("--shard="))
            else a
            for k, a in enumerate(args)
        ]
    return shlex.join(["ovkit", *args])


def _describe_input(i: dict[str, Any]) -> str:
    if "sha256" in i:
        return f"`{i['path']}` ({i['files']} file(s), {i['bytes']} bytes, fingerprint {i['sha256']})"
    if i.get("converted"):
        return (
            f"`{i['path']}` (Hub dataset {i.get('hub') or ''}, read as {i.get('format')}, `datasets` fingerprint "
            f"{i.get('source_fingerprint')})"
        )
    seen = f", `datasets` fingerprint {i['source_fingerprint']}" if i.get("source_fingerprint") else ""
    return f"`{i['path']}`" + (f" (Hub dataset {i['hub']}{seen})" if i.get("hub") else "")


def _headline(metrics: dict[str, Any], limit: int = 14) -> list[tuple[str, Any]]:
    """Scalar metrics (numbers, short strings), first `limit` of them; floats rounded for reading."""
    out = []
    for k, v in metrics.items():
        if isinstance(v, bool) or v is None:
            continue
        if isinstance(v, float):
            out.append((k, f"{v:.4g}"))
        elif isinstance(v, int) or isinstance(v, str) and len(v) <= 60:
            out.append((k, v))
        if len(out) >= limit:
            break
    return out


# ------------------------------------------------------------------------------------------------ eval outputs


def eval_tables(directory: Path) -> list[Table]:
    """The per-task samples files of an eval output: one Table per task (config: the task, split: its `datasets`
    name), from the newest `<model>/<timestamp>_results.json` and the `_samples_<task>.jsonl` written with it."""
    directory = Path(directory)
    results = sorted(
        (p for p in directory.glob(f"*/{EVAL_RESULTS}") if not _hidden(p.parent.name)), key=lambda p: p.name
    )
    if not results:
        return []
    path = results[-1]
    prefix = path.name.removesuffix("_results.json") + "_samples_"
    tables = []
    for f in sorted(path.parent.glob(f"{prefix}*.jsonl")):
        task = f.stem[len(prefix) :]
        with open(f, encoding="utf-8") as fh:
            lines = [line for line in fh if line.strip()]
        if not lines:
            continue
        columns = list(json.loads(lines[0]))
        rel = f.relative_to(directory).as_posix()
        tables.append(Table(task, _split_name(task), rel, columns, len(lines), False, [f]))
    return tables


def eval_features(tables: list[Table]) -> list[dict[str, Any]] | None:
    """The `default` config's features in the card's YAML: every task's inferred schema, unified (a struct's fields
    are the union of the tasks'; `datasets` fills a task's missing ones with None). None where two tasks disagree on
    a column's type (then `load_dataset(DIR)` asks for a task's config)."""
    # heavy: pyarrow loads on first use, not at CLI start or in config checks
    import pyarrow as pa
    import pyarrow.json as pj
    from datasets import Features

    try:
        schemas = [pj.read_json(f).schema for t in tables for f in t.files]
        schema = pa.unify_schemas(schemas, promote_options="permissive")
        return Features.from_arrow_schema(schema)._to_yaml_list()
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError, NotImplementedError):
        return None


def eval_card(directory: Path, tables: list[Table], prov: dict[str, Any], shown: str) -> str:
    # heavy: yaml loads on first use, not at CLI start or in config checks
    import yaml

    key = content_key(tables)
    features = eval_features(tables) if len(tables) > 1 else None
    configs = []
    if features is not None or len(tables) == 1:
        configs.append(
            {"config_name": "default", "data_files": [{"split": t.split, "path": t.pattern} for t in tables]}
        )
    configs += [
        {"config_name": t.config, "data_files": [{"split": t.split, "path": t.pattern}]}
        for t in tables
        if t.config != "default"
    ]
    for cfg in configs:  # in each config, so `load_dataset(DIR)` caches this content apart from any other
        cfg["description"] = f"ovkit eval {key}"
    meta: dict[str, Any] = {"configs": configs}
    if features is not None:
        meta["dataset_info"] = [{"config_name": "default", "features": features}]
    meta["tags"] = ["ovkit", "evaluation"]
    summary = _json(Path(directory) / EVAL_SUMMARY)
    results = Path(tables[0].pattern).parent / Path(tables[0].pattern).name.split("_samples_")[0]
    lines = ["---", yaml.safe_dump(meta, sort_keys=False, allow_unicode=True).rstrip(), "---", ""]
    lines += [f"# {Path(shown).name}", ""]
    model = summary.get("model") or (prov.get("config") or {}).get("model")
    lines += [
        f"Eval of `{model}`, {sum(t.rows or 0 for t in tables)} rows in {len(tables)} task(s), written by "
        f"`ovkit {prov.get('command')}` (ovkit {prov.get('ovkit_version')}) in the lmms-eval layout: "
        f"`{results}_results.json` (the aggregate metrics lmms-eval tools read), one `_samples_<task>.jsonl` per task "
        "(one line per row) and `summary.json`. Generated from `ovkit.json`.",
        "",
    ]
    overall, cats = summary.get("overall"), summary.get("categories") or {}
    if isinstance(overall, (int, float)):
        lines += [
            f"## Scores ({summary.get('metric', 'reward')})",
            "",
            "| task | score |",
            "|---|---|",
            f"| overall | {overall:.4g} |",
        ]
        lines += [f"| {c} | {v:.4g} |" for c, v in cats.items() if isinstance(v, (int, float))]
        lines.append("")
    lines += ["## Load it", "", "```python", "from datasets import load_dataset", ""]
    if configs[0]["config_name"] == "default" and len(tables) > 1:
        lines.append(
            f'ds = load_dataset("{shown}")  # every task\'s rows, a split per task: '
            f"{', '.join(t.split for t in tables)}"
        )
    elif len(tables) == 1:
        lines.append(f'ds = load_dataset("{shown}", split="{tables[0].split}")')
    lines.append(f'ds = load_dataset("{shown}", "{tables[-1].config}")  # one task')
    lines += ["```", "", f"`ovkit eval --compare {shown} ...` reads `summary.json` (or the `_results.json`).", ""]
    lines += ["## Contents", "", "| task (config) | split | file | rows |", "|---|---|---|---|"]
    lines += [f"| {t.config} | {t.split} | `{t.pattern}` | {t.rows} |" for t in tables]
    lines += [
        "",
        "Columns (lmms-eval's samples, one line per row): " + ", ".join(f"`{c}`" for c in tables[0].columns) + ".",
        "",
    ]
    if features is not None:
        lines += [
            "Each task scores with its own reward parts, so `reward_parts` differs across tasks: the `default` config "
            "declares the union of the tasks' fields (a task's missing ones load as None); a task's own config has "
            "only its fields.",
            "",
        ]
    elif len(tables) > 1:
        lines += ["The tasks' columns disagree in type, so there is no `default` config: load one task's config.", ""]
    lines += ["## Provenance", "", *_provenance_lines(prov, None), ""]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ model outputs


def is_model_dir(directory: Path) -> bool:
    d = Path(directory)
    return (d / "config.json").is_file() and any((d / w).is_file() for w in WEIGHTS)


def model_card(directory: Path, prov: dict[str, Any], shown: str) -> str:
    # heavy: yaml loads on first use, not at CLI start or in config checks
    import yaml

    config = _json(Path(directory) / "config.json")
    arch = (config.get("architectures") or ["?"])[0]
    clip = "CLIP" in arch
    cfg = prov.get("config") or {}
    base = base_models(prov)
    hub_data = [d for d in _as_list(cfg.get("data")) if _is_hub(d)]
    meta: dict[str, Any] = {
        "library_name": "transformers",
        "pipeline_tag": "zero-shot-image-classification" if clip else "image-text-to-text",
    }
    if base:
        meta["base_model"] = base[0] if len(base) == 1 else base
    meta["tags"] = ["ovkit", str(prov.get("command")), *([config["model_type"]] if config.get("model_type") else [])]
    if hub_data:
        meta["datasets"] = sorted({_hub_base(d) for d in hub_data})
    lines = ["---", yaml.safe_dump(meta, sort_keys=False, allow_unicode=True).rstrip(), "---", ""]
    lines += [f"# {Path(shown).name}", "", _model_summary(arch, config, prov, base), ""]
    auto = "AutoModel" if clip else "AutoModelForImageTextToText"
    lines += [
        "## Load it",
        "",
        "```python",
        f"from transformers import {auto}, AutoProcessor",
        "",
        f'model = {auto}.from_pretrained("{shown}")',
        f'processor = AutoProcessor.from_pretrained("{shown}")',
        "```",
        "",
    ]
    lines += ["## How it was made", "", *_lineage_lines(prov), *_data_lines(prov), ""]
    settings = [(k, cfg[k]) for k in MODEL_SETTINGS if k in cfg and cfg[k] not in (None, [], "")]
    if settings:
        lines += ["| setting | value |", "|---|---|", *[f"| `{k}` | {_cell(v)} |" for k, v in settings], ""]
    lines += _held_out_lines(prov.get("metrics") or {})
    headline = _headline(prov.get("metrics") or {}, limit=20)
    if headline:
        lines += [
            "## Metrics",
            "",
            "| metric | value |",
            "|---|---|",
            *[f"| {k} | {_cell(v)} |" for k, v in headline],
            "",
        ]
    lines += ["## Provenance", "", *_provenance_lines(prov, None, full=False), ""]
    return "\n".join(lines)


def _held_out_lines(metrics: dict[str, Any]) -> list[str]:
    """The card's section for the evaluation while training (--eval-data): the last one, per metric and category."""
    found = metrics.get("eval")
    if not isinstance(found, dict) or not found:
        return []
    rows = [(k, v) for k, v in found.items() if k not in ("step", "runtime") and isinstance(v, (int, float))]
    return [
        "## Held-out evaluation",
        "",
        f"Scored while training (`--eval-data`), at step {found.get('step')}, the last one: what `ovkit eval` reports "
        "for that step's weights (`reward`, `accuracy` per category as `reward/<category>`), and the held-out loss.",
        "",
        "| metric | value |",
        "|---|---|",
        *[f"| {k} | {v:.4g} |" for k, v in rows],
        "",
    ]


def base_models(prov: dict[str, Any]) -> list[str]:
    """What the model started from: the parent checkpoint, else the encoder and LLM a composed model was built from."""
    parent = prov.get("parent")
    cfg = prov.get("config") or {}
    typed = [parent["path"]] if parent and parent.get("path") else [cfg[k] for k in ("vision", "llm") if cfg.get(k)]
    return [b for b in map(_base_model_id, typed) if b]


def _base_model_id(text: Any) -> str | None:
    """HF's `base_model` names a Hub id; a local model is named by its absolute path, never the relative one typed on
    the command line (which means nothing to whoever reads the card elsewhere). A relative path that is no longer
    here and is no Hub id: unknown, left out."""

    text = str(text)
    local = Path(text).expanduser()
    if local.exists():
        return str(local.resolve())
    if local.is_absolute() or is_hub_id(text):
        return text
    return None


def _model_summary(arch: str, config: dict[str, Any], prov: dict[str, Any], base: list[str]) -> str:
    m = prov.get("metrics") or {}
    n = m.get("total_params") or m.get("parameters")
    size = f", {n / 1e6:.2f}M parameters" if isinstance(n, (int, float)) else ""
    origin = f" from `{base[0]}`" if len(base) == 1 else f" from {' + '.join(f'`{b}`' for b in base)}" if base else ""
    if prov.get("command") == "init-model" and not base:
        origin = f" (preset `{(prov.get('config') or {}).get('preset')}`, built from scratch)"
    return (
        f"A `{arch}`{size}, made by `ovkit {prov.get('command')}` (ovkit {prov.get('ovkit_version')}){origin}. "
        f"Generated from `ovkit.json`."
    )


def _lineage_lines(prov: dict[str, Any]) -> list[str]:
    """The chain of ovkit stages behind this model, read from each parent's ovkit.json."""

    chain, seen = [f"this model (`{prov.get('command')}`)"], set()
    parent = prov.get("parent")
    while parent and parent.get("path") and parent["path"] not in seen and len(chain) < MAX_LINEAGE:
        seen.add(parent["path"])
        chain.append(f"`{parent['path']}` ({parent.get('command') or 'not an ovkit output'})")
        up = read_provenance(Path(parent["path"])) if Path(parent["path"]).is_dir() else None
        parent = (up or {}).get("parent")
    return ["- lineage: " + " <- ".join(chain)] if len(chain) > 1 else []


def _data_lines(prov: dict[str, Any]) -> list[str]:
    inputs = prov.get("inputs") or []
    return ["- data:", *[f"  - {_describe_input(i)}" for i in inputs]] if inputs else []


def _cell(v: Any) -> str:
    return ", ".join(map(str, v)) if isinstance(v, list) else str(v).replace("|", "\\|")


def _as_list(v: Any) -> list[str]:
    return [str(x) for x in v] if isinstance(v, list) else [str(v)] if v else []


def _is_hub(text: str) -> bool:

    return is_remote(text)


def _hub_base(text: str) -> str:

    return parse_spec(text).base


def _json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def _write_atomic(path: Path, text: str) -> Path:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)
    return path
