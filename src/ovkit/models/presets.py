"""Named model presets and the `init-model` builder that dispatches on them.

`tiny` is built here, offline. The published sizes are documentation: ovkit never downloads weights, so their rows
say which hub checkpoints to fetch and how to use them (a ready checkpoint as `--model`, or `--vision DIR --llm DIR`
to compose a stage-0 model from local copies).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from ovkit.errors import OvkitError


@dataclass(frozen=True)
class Preset:
    name: str
    kind: str  # "tiny": built offline here; "hub": a published VLM, use as --model; "compose": vision + LLM recipe
    summary: str
    model: str | None = None  # hub id of the ready checkpoint
    stage0: str | None = None  # hub id of the published stage-0 (vision + LLM + fresh projector) checkpoint
    vision: str | None = None  # hub id of the vision encoder to compose from
    llm: str | None = None  # hub id of the LLM to compose from
    llm_hidden_size: int | None = None  # checked against --llm so a preset name cannot silently mean another model
    notes: str = ""


_RICE_NOTE = (
    "the published stage-0 and instruct checkpoints ship their own modelling code (trust_remote_code); RICE-ViT is "
    "not a transformers AutoModel, so compose a LLaVA-architecture stand-in from the same LLM and an encoder "
    "transformers knows (e.g. a SigLIP directory) as --vision"
)

PRESETS: dict[str, Preset] = {
    p.name: p
    for p in [
        Preset(
            "tiny",
            "tiny",
            "Qwen2.5-VL architecture, ~2.5M parameters: text hidden 192 x 4 layers (4 heads, 2 KV heads, MLP 512), "
            "vision hidden 96 x 4 layers, patch 14, 2x2 merger, byte-level BPE (~330 + 7 special tokens) trained "
            "on --corpus; 84x84 images -> 9 visual tokens, images capped at 448x448.",
            notes="built offline by `ovkit init-model --preset tiny --corpus DATA --out DIR`",
        ),
        Preset(
            "tiny-clip",
            "tiny-clip",
            "CLIP dual encoder, ~0.5M parameters (vision hidden 128 x 3 layers on 84x84 images, text hidden 128 x 2 "
            "layers), trained contrastively on the image/caption pairs of --corpus: the embedded default's concept "
            "encoder for `ovkit balance --method embed`.",
            notes="built offline by `ovkit init-model --preset tiny-clip --corpus data/pretrain --out DIR`",
        ),
        Preset(
            "qwen2.5-vl-3b",
            "hub",
            "Qwen2.5-VL 3B Instruct: the architecture of `tiny` at full size (native-resolution ViT, 2x2 merger).",
            model="Qwen/Qwen2.5-VL-3B-Instruct",
            notes="ready to train: download it and pass the directory as --model to every stage",
        ),
        Preset(
            "qwen2.5-vl-7b",
            "hub",
            "Qwen2.5-VL 7B Instruct, the baseline LLaVA-OV-1.5-8B is compared with.",
            model="Qwen/Qwen2.5-VL-7B-Instruct",
            notes="ready to train: download it and pass the directory as --model to every stage",
        ),
        Preset(
            "llava-ov-1.5-4b",
            "compose",
            "LLaVA-OneVision-1.5 4B: RICE-ViT-L/14 (0.3B) + 2x2 patch-merger MLP + Qwen3-4B-Instruct-2507 (4.4B); "
            "4.7B in total.",
            stage0="lmms-lab/LLaVA-OneVision-1.5-4B-stage0",
            vision="DeepGlint-AI/rice-vit-large-patch14-560",
            llm="Qwen/Qwen3-4B-Instruct-2507",
            llm_hidden_size=2560,
            notes=_RICE_NOTE,
        ),
        Preset(
            "llava-ov-1.5-8b",
            "compose",
            "LLaVA-OneVision-1.5 8B: RICE-ViT-L/14 (0.3B) + 2x2 patch-merger MLP + Qwen3-8B-Base (8.2B); 8.5B in "
            "total.",
            model="lmms-lab/LLaVA-OneVision-1.5-8B-Instruct",
            stage0="lmms-lab/LLaVA-OneVision-1.5-8B-stage0",
            vision="DeepGlint-AI/rice-vit-large-patch14-560",
            llm="Qwen/Qwen3-8B-Base",
            llm_hidden_size=4096,
            notes=_RICE_NOTE,
        ),
    ]
}


def preset(name: str) -> Preset:
    if name not in PRESETS:
        raise OvkitError(f"--preset {name!r} is not a preset; choose one of: {', '.join(PRESETS)} (see --list-presets)")
    return PRESETS[name]


def presets_table() -> str:
    """The presets as a plain-text table (what `init-model --list-presets` prints)."""
    lines = []
    for p in PRESETS.values():
        lines.append(f"{p.name}  [{p.kind}]")
        lines.append(f"    {p.summary}")
        for label, value in (("checkpoint", p.model), ("stage-0", p.stage0), ("vision", p.vision), ("llm", p.llm)):
            if value:
                lines.append(f"    {label + ':':12}{value}")
        if p.notes:
            lines.append(f"    {p.notes}")
    return "\n".join(lines)


DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass
class InitModelConfig:
    """Options of `ovkit init-model` (see commands/init-model.md)."""

    out: Path | None = None  # the model directory to write
    preset: str | None = None  # tiny (default without --vision/--llm) or a published name
    corpus: list[Path] = field(default_factory=list)  # tiny: datasets whose text trains the tokenizer
    vision: Path | None = None  # compose: a local vision encoder directory
    llm: Path | None = None  # compose: a local causal LM directory
    dtype: str = "auto"  # compose: weight dtype of the composed model ("auto" keeps the checkpoints')
    vision_feature_layer: int = -2  # compose: which encoder layer feeds the projector (LLaVA uses the penultimate)
    list_presets: bool = False  # print the preset table and exit
    seed: int = 0
    overwrite: bool = False
    quiet: bool = False

    def __post_init__(self) -> None:
        self.corpus = [Path(p) for p in (self.corpus or [])]
        if self.list_presets:
            return
        if self.out is None:
            raise OvkitError("--out is required (the model directory to write)")
        self.out = Path(self.out)
        if self.dtype not in DTYPES:
            raise OvkitError(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        composing = self.vision is not None or self.llm is not None
        if self.preset is None:
            self.preset = "compose" if composing else "tiny"
        kind = "compose" if self.preset == "compose" else preset(self.preset).kind  # unknown names fail here
        if kind == "compose":
            self._check_compose()
        elif composing:
            raise OvkitError(f"--preset {self.preset} is not composed; drop --vision/--llm, or drop --preset to compose them")
        elif kind == "hub":
            p = PRESETS[self.preset]
            raise OvkitError(
                f"--preset {p.name} is a published checkpoint that init-model does not build: download {p.model} "
                f"(e.g. `huggingface-cli download {p.model} --local-dir models/{p.name}`) and pass that directory "
                "as --model to the stages"
            )
        elif not self.corpus:
            raise OvkitError(f"--corpus is required for --preset {self.preset}: a dataset whose text trains the tokenizer (e.g. the "
                             "directory `ovkit synth --out data/` wrote)")

    def _check_compose(self) -> None:
        if self.vision is not None and self.llm is not None:
            self.vision, self.llm = Path(self.vision), Path(self.llm)
            return
        if self.preset in PRESETS:
            p = PRESETS[self.preset]
            raise OvkitError(
                f"--preset {p.name} is composed from local copies of its vision encoder and LLM; ovkit does not "
                f"download weights. Download {p.vision} and {p.llm}, then pass --vision DIR --llm DIR (published "
                f"stage-0: {p.stage0}). Note: {p.notes}"
            )
        raise OvkitError("composing needs both --vision DIR and --llm DIR")


def build(cfg: InitModelConfig, out_dir: Path) -> dict[str, Any]:
    """Build the model `cfg` asks for into `out_dir`; returns headline metrics."""
    if cfg.vision is not None:
        return _compose(cfg, out_dir)
    if cfg.preset == "tiny-clip":
        from ovkit.balance.encoder import build_tiny_clip

        return build_tiny_clip(out_dir, cfg.corpus, seed=cfg.seed, quiet=cfg.quiet)
    return _tiny(cfg, out_dir)


def _tiny(cfg: InitModelConfig, out_dir: Path) -> dict[str, Any]:
    from transformers import AutoConfig, AutoTokenizer

    from ovkit.models.encode import image_token_count
    from ovkit.models.tiny import build_tiny, tiny_processor

    texts = list(corpus_texts(cfg.corpus))
    if not texts:
        raise OvkitError(f"--corpus {' '.join(map(str, cfg.corpus))}: no message text to train the tokenizer on")
    build_tiny(out_dir, texts, seed=cfg.seed)
    tokenizer = AutoTokenizer.from_pretrained(out_dir)
    config = AutoConfig.from_pretrained(out_dir)
    text, vision = config.text_config, config.vision_config
    return {
        "preset": "tiny",
        "architecture": config.architectures[0],
        "parameters": _count_tiny(config),
        "vocab_size": len(tokenizer),
        "text": f"hidden {text.hidden_size} x {text.num_hidden_layers} layers",
        "vision": f"hidden {vision.hidden_size} x {vision.depth} layers, patch {vision.patch_size}",
        "tokenizer_texts": len(texts),
        "image_tokens_84x84": image_token_count(tiny_processor(tokenizer), 84, 84),
    }


def _count_tiny(config) -> int:
    import torch
    from transformers import AutoModelForImageTextToText

    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config)
    return sum(p.numel() for p in model.parameters())


def _compose(cfg: InitModelConfig, out_dir: Path) -> dict[str, Any]:
    from transformers import AutoConfig

    from ovkit.models.compose import compose

    if cfg.preset in PRESETS and PRESETS[cfg.preset].llm_hidden_size:
        want = PRESETS[cfg.preset].llm_hidden_size
        got = getattr(AutoConfig.from_pretrained(cfg.llm), "hidden_size", None)
        if got != want:
            raise OvkitError(
                f"--llm {cfg.llm}: hidden size {got}, but --preset {cfg.preset} uses {PRESETS[cfg.preset].llm} "
                f"(hidden size {want}); drop --preset to compose any vision encoder with any LLM"
            )
    metrics = compose(cfg.vision, cfg.llm, out_dir, seed=cfg.seed, dtype=cfg.dtype, vision_feature_layer=cfg.vision_feature_layer)
    return {"preset": cfg.preset, **metrics}


def corpus_texts(paths: list[Path]) -> Iterator[str]:
    """Message texts (and answers) of every dataset under `paths`, `<image>` markers removed. A directory written by
    `ovkit synth` contributes through ovkit.data.synth.corpus_texts (all splits and the concept names)."""
    from ovkit.data.schema import IMAGE_TOKEN

    for path in paths:
        for text in _texts(Path(path)):
            text = text.replace(IMAGE_TOKEN, "")
            if text.strip():
                yield text


def _texts(path: Path) -> Iterator[str]:
    import pyarrow.parquet as pq

    from ovkit.data import parquet_files
    from ovkit.data.synth import SPLITS
    from ovkit.data.synth import corpus_texts as synth_texts

    if path.is_dir() and any((path / s).is_dir() for s in SPLITS):
        yield from synth_texts(path)
        return
    found = False
    for f in parquet_files(path):
        names = pq.ParquetFile(f).schema_arrow.names
        if "messages" not in names:
            continue  # e.g. a pack plan beside the data
        found = True
        columns = [c for c in ("messages", "answer") if c in names]
        for batch in pq.ParquetFile(f).iter_batches(columns=columns, batch_size=1024):
            data = batch.to_pydict()
            for i in range(batch.num_rows):
                for m in data["messages"][i] or []:
                    if m and m.get("content"):
                        yield m["content"]
                if data.get("answer") and data["answer"][i]:
                    yield data["answer"][i]
    if not found:
        raise OvkitError(f"--corpus {path}: no parquet file with a 'messages' column")
