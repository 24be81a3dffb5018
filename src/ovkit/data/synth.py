"""The embedded synthetic corpus (`ovkit synth`): deterministic PIL renders with verifiable answers.

Splits, each a dataset directory with one parquet shard:
- `pretrain/`: image-caption pairs (English, and Chinese for a quarter of the rows) for alignment and mid-training.
  Most images are shape scenes whose colour-shape concepts follow Zipf's law (`concepts.txt` + the `concepts`
  column let `balance` flatten that); the rest are the text, equation, chart, diagram, seesaw and SVG images of the
  other tasks, so the vision tower also learns to read before instruction tuning.
- `instruct/`: one question per image with the stage instruction of `ovkit.prompts` and the target
  `<answer>X</answer>` (70%) or `<think>templated rationale</think><answer>X</answer>` (30%).
- `rl/`, `val/` and `eval/`: prompt-only rows (`<image>` + question; the command adds the instruction) with
  `answer`, `answer_type` (the reward scorer), `reward_kwargs` where the scorer needs them, `category` and `source`.
  `val/` is the validation split that hyper-parameters are chosen on; `eval/` is the held-out split the pipeline
  table reports, and nothing is tuned on it.

Held out: eval uses only compositions whose key a fixed hash puts in eval's bucket and val only those of val's
bucket (synth_tasks.side_of: one in eight colour-shape-count triples, word pairs, sums, bar-value lists, ... each),
and the train splits never use either for the same category; every split draws from its own random stream, and no
image of one split family (train, val, eval) has the same PNG bytes as an image of another. Every row carries its
key in the `composition` column so this can be checked.
"""

from __future__ import annotations

import hashlib
import io
import json
import random
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import pyarrow.parquet as pq
from PIL import Image, ImageDraw

from ovkit import options as O
from ovkit.data import image_cell, parquet_files, samples_table, write_samples
from ovkit.data.synth_tasks import (
    ANSWER_TYPES,
    CATEGORIES,
    COMBOS,
    GENERATORS,
    KIND_CONCEPTS,
    UNSEEN_CONCEPTS,
    Picker,
    Task,
    font,
)
from ovkit.errors import OvkitError
from ovkit.options import option
from ovkit.prompts import with_instruction

Rows = list[dict[str, Any]]
Tick = Callable[[], Any]  # advances the progress bar by one image

SPLITS = ("pretrain", "instruct", "rl", "val", "eval")
CONCEPTS_FILE = "concepts.txt"
PREVIEW_FILE = "preview.png"

# Rows at --scale 1: sized so the whole CPU pipeline trains in minutes on 2 CPU cores.
PRETRAIN_ROWS = 4000
INSTRUCT_ROWS = 8000
RL_ROWS = 600
# eval: 300 rows per category, so a cell's 95% interval is at most +-5.7 points (Wilson, at 50%) and a paired
# change of 5 points between two stages is well outside noise; val is smaller (it picks hyper-parameters).
EVAL_PER_CATEGORY = 300
VAL_PER_CATEGORY = 60
MAX_SCALE = 100  # rows are held in memory until written (about 2 KB each)

# What the pretrain images show: mostly shape scenes (the long-tailed concepts), plus every other kind of image.
PRETRAIN_KINDS = {
    "caption": 0.55, "ocr": 0.10, "math": 0.08, "chart": 0.08, "diagram": 0.07, "science": 0.07, "svg": 0.05,
}  # fmt: skip
CHINESE_SHARE = 0.25  # LLaVA-OV-1.5's recaptioned mid-training data is about 20M Chinese of 85M
THINK_SHARE = 0.30
CAPTION_PROMPTS = {
    "en": ("Describe the image.", "What is in this picture?", "Write a short caption for the image."),
    "zh": ("描述这张图片。", "图片里有什么？"),
}


@dataclass
class SynthConfig(O.StageConfig):
    launcher: ClassVar[str] = O.ONE_PROCESS  # what it does under torchrun / accelerate launch (ovkit.launch)

    out: Path | None = O.out()
    scale: float = option(
        1.0,
        help="Multiplies every split's size (1.0: about 8,000 images).",
        panel="Corpus",
        gt=0,
        max=MAX_SCALE,
        doc="multiplies every split's size (at least one row per category and split)",
    )
    seed: int = O.seed(
        doc="random seed; the same seed gives byte-identical parquet files, `concepts.txt` and `preview.png`"
    )
    overwrite: bool = O.overwrite()
    quiet: bool = O.quiet()

    def __post_init__(self) -> None:
        if not isinstance(self.scale, (int, float)) or isinstance(self.scale, bool):
            raise OvkitError(f"--scale must be a number, got {self.scale!r}")
        O.validate(self)  # each option's declared range and choices; the checks across options follow
        if self.out is None:
            raise OvkitError("--out is required (the directory to write the corpus to)")
        self.out = Path(self.out)
        self.scale = float(self.scale)


def build_corpus(cfg: SynthConfig, out_dir: Path) -> dict[str, Any]:
    """Render every split into `out_dir`; returns the headline metrics (rows per split and category, concepts)."""
    # heavy: tqdm loads on first use, not at CLI start or in config checks
    from tqdm import tqdm

    started = time.perf_counter()
    out_dir = Path(out_dir)
    sizes = split_sizes(cfg.scale)
    bar = tqdm(total=sum(sum(s.values()) for s in sizes.values()), desc="synth", unit="img", disable=cfg.quiet)
    images: dict[str, str] = {}  # PNG digest -> the side (eval, val, train) whose split drew it first
    rows: dict[str, Rows] = {}
    # held-out splits first: their images are recorded so that no other side repeats one
    rows["eval"] = prompt_rows("eval", cfg.seed, sizes["eval"], images, bar.update)
    rows["val"] = prompt_rows("val", cfg.seed, sizes["val"], images, bar.update)
    rows["pretrain"] = pretrain_rows(cfg.seed, sizes["pretrain"], images, bar.update)
    rows["instruct"] = instruct_rows(cfg.seed, sizes["instruct"], images, bar.update)
    rows["rl"] = prompt_rows("rl", cfg.seed, sizes["rl"], images, bar.update)
    bar.close()
    for split in SPLITS:
        write_samples(samples_table(rows[split]), out_dir / split)
    (out_dir / CONCEPTS_FILE).write_text("\n".join(concept_vocabulary()) + "\n")
    contact_sheet(rows["instruct"]).save(out_dir / PREVIEW_FILE, format="PNG", optimize=False)
    counts = concept_counts(rows["pretrain"])
    return {
        "rows": sum(len(r) for r in rows.values()),
        "splits": {split: len(rows[split]) for split in SPLITS},
        "categories": {split: _count_by(rows[split], "category") for split in SPLITS},
        "concepts": {
            "vocabulary": len(concept_vocabulary()),
            "seen_in_pretrain": len(counts),
            "head_to_median": round(max(counts.values()) / statistics.median(counts.values()), 2) if counts else None,
        },
        "seconds": round(time.perf_counter() - started, 2),
    }


def _nothing() -> None:
    pass


def split_sizes(scale: float) -> dict[str, dict[str, int]]:
    """Rows per split and category (pretrain: per image kind, drawn row by row)."""
    per = lambda total: max(1, round(total * scale / len(CATEGORIES)))  # noqa: E731
    return {
        "pretrain": {"all": max(len(PRETRAIN_KINDS), round(PRETRAIN_ROWS * scale))},
        "instruct": {c: per(INSTRUCT_ROWS) for c in CATEGORIES},
        "rl": {c: per(RL_ROWS) for c in CATEGORIES},
        "val": {c: max(1, round(VAL_PER_CATEGORY * scale)) for c in CATEGORIES},
        "eval": {c: max(1, round(EVAL_PER_CATEGORY * scale)) for c in CATEGORIES},
    }


def _stream(seed: int, split: str, name: str) -> random.Random:
    """An independent random stream per (seed, split, category): eval never shares a stream with training."""
    return random.Random(f"ovkit-synth/{seed}/{split}/{name}")


def _render(category: str, rng: random.Random, picker: Picker, side: str, images: dict[str, str]) -> tuple[Task, dict]:
    """A task and its image cell, redrawn while its PNG equals an image of another side (tiny scenes can coincide);
    the images of held-out sides are recorded in `images`."""

    while True:
        task = GENERATORS[category](rng, picker, side)
        cell = image_cell(task.image)
        digest = hashlib.sha1(cell["bytes"]).hexdigest()
        if images.get(digest, side) != side:
            continue
        if side != "train":
            images[digest] = side
        return task, cell


def _common(task: Task, cell: dict, rid: str) -> dict[str, Any]:
    return {
        "id": rid,
        "images": [cell],
        "source": f"synth/{task.category}",
        "category": task.category,
        "concepts": json.dumps(task.concepts, ensure_ascii=False),
        "composition": task.key,
    }


def _with_answer(row: dict[str, Any], task: Task) -> dict[str, Any]:
    row["answer"] = task.answer
    row["answer_type"] = ANSWER_TYPES[task.category]
    row["reward_kwargs"] = json.dumps(task.reward_kwargs) if task.reward_kwargs else None
    return row


def prompt_rows(split: str, seed: int, sizes: dict[str, int], images: dict[str, str], tick: Tick = _nothing) -> Rows:
    """The rl, val or eval split: prompt-only rows with their gold answer; val and eval draw their own held-out
    compositions only."""
    side = split if split in ("val", "eval") else "train"
    rows = []
    for category in CATEGORIES:
        rng = _stream(seed, split, category)
        picker = Picker(rng, zipf=False)
        for i in range(sizes[category]):
            task, cell = _render(category, rng, picker, side, images)
            rows.append(_with_answer(_common(task, cell, f"{split}-{category}-{i:05d}") | _prompt(task), task))
            tick()
    if side == "train":  # val and eval stay grouped by category; training data is mixed
        _stream(seed, split, "order").shuffle(rows)
    return rows


def _prompt(task: Task) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": f"<image>\n{task.question}"}]}


def instruct_rows(seed: int, sizes: dict[str, int], images: dict[str, str], tick: Tick = _nothing) -> Rows:

    rows = []
    for category in CATEGORIES:
        rng = _stream(seed, "instruct", category)
        picker = Picker(rng, zipf=False)
        for i in range(sizes[category]):
            task, cell = _render(category, rng, picker, "train", images)
            mode = "think" if rng.random() < THINK_SHARE else "answer"
            target = f"<answer>{task.answer}</answer>"
            if mode == "think":
                target = f"<think>{task.rationale}</think>{target}"
            prompt = with_instruction(_prompt(task)["messages"], mode)
            row = _common(task, cell, f"instruct-{category}-{i:05d}")
            row["messages"] = [*prompt, {"role": "assistant", "content": target}]
            rows.append(_with_answer(row, task))
            tick()
    _stream(seed, "instruct", "order").shuffle(rows)
    return rows


def pretrain_rows(seed: int, sizes: dict[str, int], images: dict[str, str], tick: Tick = _nothing) -> Rows:
    rng = _stream(seed, "pretrain", "kinds")
    kinds, weights = list(PRETRAIN_KINDS), list(PRETRAIN_KINDS.values())
    streams = {k: _stream(seed, "pretrain", k) for k in kinds}
    pickers = {k: Picker(streams[k], zipf=True) for k in kinds}
    rows = []
    for i in range(sizes["all"]):
        kind = rng.choices(kinds, weights)[0]
        task, cell = _render(kind, streams[kind], pickers[kind], "train", images)
        lang = "zh" if rng.random() < CHINESE_SHARE else "en"
        prompt = rng.choice(CAPTION_PROMPTS[lang])
        row = _common(task, cell, f"pretrain-{i:06d}")
        row["source"], row["category"], row["lang"] = "synth/caption", "caption", lang
        row["messages"] = [
            {"role": "user", "content": f"<image>\n{prompt}"},
            {"role": "assistant", "content": task.caption_zh if lang == "zh" else task.caption_en},
        ]
        rows.append(row)
        tick()
    return rows


def concept_vocabulary() -> list[str]:
    """Every concept a row can name, plus a few that no image shows (as in any real vocabulary)."""
    return sorted({*COMBOS, *KIND_CONCEPTS, *UNSEEN_CONCEPTS})


def concept_counts(rows: Rows) -> dict[str, int]:
    """Rows per concept (a concept counts once per row)."""
    counts: dict[str, int] = {}
    for row in rows:
        for c in set(json.loads(row["concepts"])):
            counts[c] = counts.get(c, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def _count_by(rows: Rows, column: str) -> dict[str, int]:
    counts: dict[str, int] = {}
    for row in rows:
        counts[row[column]] = counts.get(row[column], 0) + 1
    return dict(sorted(counts.items()))


def contact_sheet(rows: Rows, per_category: int = 4, zoom: int = 2):
    """A grid of the first images of each category (zoomed, answer underneath) for a person to look at."""

    picked: dict[str, list[tuple[Image.Image, str]]] = {c: [] for c in CATEGORIES}
    for row in sorted(rows, key=lambda r: r["id"]):
        if len(picked[row["category"]]) < per_category:
            img = Image.open(io.BytesIO(row["images"][0]["bytes"])).convert("RGB")
            img = img.resize((img.width * zoom, img.height * zoom), Image.NEAREST)
            picked[row["category"]].append((img, row["answer"]))
    cell_w = max(img.width for items in picked.values() for img, _ in items) + 12
    cell_h = max(img.height for items in picked.values() for img, _ in items) + 34
    label_w = 110
    sheet = Image.new("RGB", (label_w + cell_w * per_category, cell_h * len(CATEGORIES)), (235, 235, 235))
    draw = ImageDraw.Draw(sheet)
    for r, category in enumerate(CATEGORIES):
        y = r * cell_h
        draw.text((8, y + cell_h // 2), category, fill=(0, 0, 0), font=font(16), anchor="lm")
        for k, (img, answer) in enumerate(picked[category]):
            x = label_w + k * cell_w
            sheet.paste(img, (x + 6, y + 6))
            answer = answer if len(answer) <= 44 else answer[:41] + "..."
            draw.text((x + 6, y + 10 + img.height), answer, fill=(0, 0, 0), font=font(13))
    return sheet


def corpus_texts(data_dir: Path | str) -> Iterator[str]:
    """Every message text and answer of every split (and the concept names): what the tiny tokenizer learns from."""

    data_dir = Path(data_dir)
    found = [data_dir / s for s in SPLITS if (data_dir / s).is_dir()]
    if not found:
        raise OvkitError(f"{data_dir}: no synth splits ({', '.join(SPLITS)}); run `ovkit synth --out {data_dir}` first")
    for split_dir in found:
        for f in parquet_files(split_dir):
            pf = pq.ParquetFile(f)
            columns = [c for c in ("messages", "answer") if c in pf.schema_arrow.names]
            for batch in pf.iter_batches(columns=columns, batch_size=1024):
                data = batch.to_pydict()
                for i in range(batch.num_rows):
                    for m in data["messages"][i]:
                        yield m["content"]
                    if data.get("answer") and data["answer"][i]:
                        yield data["answer"][i]
    concepts = data_dir / CONCEPTS_FILE
    if concepts.is_file():
        yield from concepts.read_text().splitlines()
