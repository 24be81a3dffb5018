"""Named model presets and the `init-model` builder that dispatches on them.

`tiny` is built here, offline. ovkit never downloads weights, so the published sizes say which hub checkpoints to
fetch and how to use them (a ready checkpoint as `--model`, or `--vision DIR --llm DIR` to compose a stage-0 model
from local copies). Presets with an `arch` can also be built with random weights, offline, at their real size
(`init-model --preset NAME --random-init`): the architecture of the published model with a given processor
(`--processor DIR`) or the tiny byte-level tokenizer, its vocabulary padded to the published size, to benchmark or
smoke-test a cluster without a download.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from ovkit import options as O
from ovkit.errors import OvkitError
from ovkit.models.compose import compose
from ovkit.models.tiny import TINY, build_tiny, tiny_processor, train_tokenizer
from ovkit.options import option
from ovkit.prompts import ANSWER_PROMPT, SYSTEM_PROMPT, THINK_PROMPT


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
    arch: dict | None = None  # Qwen2.5-VL dimensions for --random-init: {"text": {...}, "vision": {...}, "tie": bool}


_RICE_NOTE = (
    "the published stage-0 and instruct checkpoints ship their own modelling code (trust_remote_code); RICE-ViT is "
    "not a transformers AutoModel, so compose a LLaVA-architecture stand-in from the same LLM and an encoder "
    "transformers knows (e.g. a SigLIP directory) as --vision"
)

# Qwen2.5-VL's vision tower (every published size shares it: 32 blocks of 1280, full attention every 8th block,
# 112-pixel windows) and the text dimensions of the published sizes (their config.json files).
QWEN25_VIT = dict(
    depth=32,
    hidden_size=1280,
    intermediate_size=3420,
    num_heads=16,
    patch_size=14,
    spatial_merge_size=2,
    temporal_patch_size=2,
    window_size=112,
    fullatt_block_indexes=[7, 15, 23, 31],
)


def _qwen25(hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int, vocab: int, tie: bool) -> dict:
    text = dict(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        intermediate_size=intermediate,
        vocab_size=vocab,
        rope_theta=1_000_000.0,
        max_position_embeddings=128000,
    )
    return {"text": text, "vision": {**QWEN25_VIT, "out_hidden_size": hidden}, "tie": tie}


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
            notes="ready to train: download it and pass the directory as --model to every stage; --random-init builds "
            "the architecture offline",
            arch=_qwen25(2048, 36, 16, 2, 11008, 151936, tie=True),
        ),
        Preset(
            "qwen2.5-vl-7b",
            "hub",
            "Qwen2.5-VL 7B Instruct, the baseline LLaVA-OV-1.5-8B is compared with.",
            model="Qwen/Qwen2.5-VL-7B-Instruct",
            notes="ready to train: download it and pass the directory as --model to every stage; --random-init builds "
            "the architecture offline",
            arch=_qwen25(3584, 28, 28, 4, 18944, 152064, tie=False),
        ),
        Preset(
            "qwen2.5-vl-2b",
            "random",
            "Benchmark size, random weights only (no published checkpoint): the Qwen2.5-VL ViT (0.67B) + a "
            "Qwen2-1.5B-sized LLM (hidden 1536 x 28 layers), vocabulary 151,936; 2.2B in total.",
            notes="built offline by `ovkit init-model --preset qwen2.5-vl-2b --random-init --out DIR`",
            arch=_qwen25(1536, 28, 12, 2, 8960, 151936, tie=True),
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


# --help panels of this config's own options (ovkit.options holds the shared ones)
MODEL = "Model"


@dataclass
class InitModelConfig(O.StageConfig):
    """Options of `ovkit init-model` (see commands/init-model.md)."""

    launcher: ClassVar[str] = O.ONE_PROCESS  # what it does under torchrun / accelerate launch (ovkit.launch)

    out: Path | None = O.out(doc="the model directory (written atomically; a complete one is skipped)")
    # tiny (default without --vision/--llm) or a published name
    preset: str | None = option(
        None,
        help="tiny (default), or a published name (see --list-presets).",
        panel=MODEL,
        doc="a row of the preset table",
        default_doc="`tiny` (`compose` with `--vision/--llm`)",
    )
    # tiny: datasets whose text trains the tokenizer
    corpus: list[Path] = option(
        [],
        help=("tiny: dataset(s) whose text trains the tokenizer (repeatable), e.g. data/ from `ovkit synth`."),
        panel=O.IO,
        default_doc="required for tiny",
    )
    vision: Path | None = option(
        None,
        help="Compose: local vision encoder directory (CLIP, SigLIP, ...).",
        panel=O.IO,
    )
    llm: Path | None = option(None, help="Compose: local causal LM directory (with its tokenizer).", panel=O.IO)
    # compose: weight dtype of the composed model ("auto" keeps the checkpoints')
    dtype: str = option(
        "auto",
        help=(
            "Compose / random init: weight dtype (auto keeps the checkpoints' / float32; float32, bfloat16, float16)."
        ),
        panel=MODEL,
        choices=DTYPES,
        doc=(
            "compose: `auto` (keep the checkpoints'), `float32`, `bfloat16`, `float16`; random init: the weights'"
            " dtype (`auto` = float32)"
        ),
    )
    vision_feature_layer: int = option(
        -2,
        help="Compose: encoder layer that feeds the projector.",
        panel=MODEL,
        doc=("compose: encoder hidden state fed to the projector (LLaVA uses the penultimate layer)"),
    )
    # build a published architecture with random weights (presets with an `arch`)
    random_init: bool = option(
        False,
        help="Build a published architecture (qwen2.5-vl-2b/3b/7b) with random weights, offline.",
        panel=MODEL,
        doc=(
            "build a published architecture with random weights, offline: `qwen2.5-vl-2b` (2.21B, a benchmark "
            "size), `qwen2.5-vl-3b` (3.75B), `qwen2.5-vl-7b` (8.29B), the dimensions of their config.json files; "
            "vocabulary padded to the published size"
        ),
    )
    processor: Path | None = option(
        None,
        help=("Random init: a processor directory to save with it (default: the tiny tokenizer, vocabulary padded)."),
        panel=O.IO,
        doc=(
            "random init: the processor to save with the model (it must have Qwen-VL's special tokens); default: "
            "the tiny byte-level BPE (trained on `--corpus` if given, else on ovkit's prompts) with Qwen2.5-VL's "
            "image processing capped at 448x448 (256 visual tokens)"
        ),
        default_doc="tiny tokenizer",
    )
    list_presets: bool = option(False, help="Print the preset table and exit.", panel=MODEL)
    seed: int = O.seed(doc=("tokenizer/model initialisation (tiny), projector and new embedding rows (compose)"))
    overwrite: bool = O.overwrite()
    quiet: bool = O.quiet()

    def __post_init__(self) -> None:
        O.validate(self)  # each option's declared range and choices; the checks across options follow
        self.corpus = [Path(p) for p in (self.corpus or [])]
        if self.list_presets:
            return
        if self.out is None:
            raise OvkitError("--out is required (the model directory to write)")
        self.out = Path(self.out)
        composing = self.vision is not None or self.llm is not None
        if self.preset is None:
            self.preset = "compose" if composing else "tiny"
        kind = "compose" if self.preset == "compose" else preset(self.preset).kind  # unknown names fail here
        if self.random_init or kind == "random":
            self._check_random()
        elif kind == "compose":
            self._check_compose()
        elif composing:
            raise OvkitError(
                f"--preset {self.preset} is not composed; drop --vision/--llm, or drop --preset to compose them"
            )
        elif kind == "hub":
            p = PRESETS[self.preset]
            raise OvkitError(
                f"--preset {p.name} is a published checkpoint that init-model does not build: download {p.model} "
                f"(e.g. `huggingface-cli download {p.model} --local-dir models/{p.name}`) and pass that directory "
                "as --model to the stages"
            )
        elif not self.corpus:
            raise OvkitError(
                f"--corpus is required for --preset {self.preset}: a dataset whose text trains the tokenizer (e.g. the "
                "directory `ovkit synth --out data/` wrote)"
            )

    def _check_random(self) -> None:
        p = PRESETS.get(self.preset)
        if p is None or p.arch is None:
            buildable = ", ".join(n for n, q in PRESETS.items() if q.arch)
            raise OvkitError(
                f"--random-init builds the architecture of a preset with known dimensions ({buildable}); "
                f"{self.preset} has none"
            )
        if not self.random_init:
            raise OvkitError(
                f"--preset {p.name} has no published weights: add --random-init to build it with random weights"
            )
        if self.vision is not None or self.llm is not None:
            raise OvkitError("--random-init builds from the preset's dimensions: drop --vision/--llm")
        self.processor = Path(self.processor) if self.processor is not None else None

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
    if cfg.random_init:
        return _random(cfg, out_dir)
    if cfg.vision is not None:
        return _compose(cfg, out_dir)
    if cfg.preset == "tiny-clip":
        # heavy: torch, pyarrow, numpy load on first use, not at CLI start or in config checks
        from ovkit.models.tiny_clip import build_tiny_clip

        return build_tiny_clip(out_dir, cfg.corpus, seed=cfg.seed, quiet=cfg.quiet)
    return _tiny(cfg, out_dir)


def _tiny(cfg: InitModelConfig, out_dir: Path) -> dict[str, Any]:
    # heavy: torch, transformers, pyarrow, numpy load on first use, not at CLI start or in config checks
    from transformers import AutoConfig, AutoTokenizer

    from ovkit.models.encode import image_token_count

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


def random_config(name: str, tokenizer: Any):
    """The Qwen2.5-VL config of preset `name` at its published dimensions, its special tokens taken from
    `tokenizer` (whose ids must fit the published vocabulary, which pads the tiny tokenizer's)."""
    # heavy: torch, transformers load on first use, not at CLI start or in config checks
    from transformers import Qwen2_5_VLConfig

    arch = PRESETS[name].arch
    text = dict(arch["text"])
    if len(tokenizer) > text["vocab_size"]:
        raise OvkitError(
            f"--processor: its tokenizer has {len(tokenizer)} tokens, more than {name}'s vocabulary "
            f"({text['vocab_size']})"
        )
    ids = {
        k: tokenizer.convert_tokens_to_ids(t)
        for k, t in (
            ("image", "<|image_pad|>"),
            ("video", "<|video_pad|>"),
            ("start", "<|vision_start|>"),
            ("end", "<|vision_end|>"),
            ("eos", "<|im_end|>"),
            ("pad", "<|endoftext|>"),
        )
    }
    missing = [k for k, v in ids.items() if v is None or v == getattr(tokenizer, "unk_token_id", -1)]
    if missing:
        raise OvkitError(
            f"--processor: the tokenizer lacks Qwen-VL's special tokens ({', '.join(missing)}); use a Qwen2.5-VL "
            f"processor or none"
        )
    head_dim = text["hidden_size"] // text["num_attention_heads"]
    rope = {
        "rope_type": "default",
        "rope_theta": text.pop("rope_theta"),
        "mrope_section": [head_dim // 8, head_dim * 3 // 16, head_dim * 3 // 16],
    }
    text.update(rope_parameters=rope, eos_token_id=ids["eos"], pad_token_id=ids["pad"], bos_token_id=ids["pad"])
    return Qwen2_5_VLConfig(
        text_config=text,
        vision_config=dict(arch["vision"]),
        image_token_id=ids["image"],
        video_token_id=ids["video"],
        vision_start_token_id=ids["start"],
        vision_end_token_id=ids["end"],
        tie_word_embeddings=arch["tie"],
    )


def _random(cfg: InitModelConfig, out_dir: Path) -> dict[str, Any]:
    """The preset's architecture with random weights (initialised as transformers initialises a new model), saved
    with a processor: the given one, or the tiny byte-level tokenizer (trained on --corpus, else on ovkit's prompts)
    with Qwen2.5-VL's image processing (14-pixel patches, 2x2 merge, up to 448x448: 256 tokens per image)."""
    # heavy: torch loads on first use, not at CLI start or in config checks
    import torch
    from transformers import AutoProcessor, GenerationConfig, Qwen2_5_VLForConditionalGeneration

    if cfg.processor is not None:
        processor = AutoProcessor.from_pretrained(cfg.processor)
    else:
        texts = list(corpus_texts(cfg.corpus)) if cfg.corpus else []
        texts += [SYSTEM_PROMPT, ANSWER_PROMPT, THINK_PROMPT, "user", "assistant"] * 20
        processor = tiny_processor(train_tokenizer(texts, TINY.vocab_size))
    config = random_config(cfg.preset, processor.tokenizer)
    dtype = {"auto": torch.float32, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[
        cfg.dtype
    ]
    torch.manual_seed(cfg.seed)
    model = Qwen2_5_VLForConditionalGeneration._from_config(config, dtype=dtype)
    model.generation_config = GenerationConfig(
        eos_token_id=config.text_config.eos_token_id, pad_token_id=config.text_config.pad_token_id
    )
    model.save_pretrained(out_dir)
    processor.save_pretrained(out_dir)
    return {
        "preset": cfg.preset,
        "random_init": True,
        "architecture": config.architectures[0] if config.architectures else type(model).__name__,
        "parameters": sum(p.numel() for p in model.parameters()),
        "vocab_size": config.text_config.vocab_size,
        "tokenizer_tokens": len(processor.tokenizer),
        "dtype": str(dtype).removeprefix("torch."),
    }


def _count_tiny(config) -> int:
    # heavy: torch loads on first use, not at CLI start or in config checks
    import torch
    from transformers import AutoModelForImageTextToText

    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config)
    return sum(p.numel() for p in model.parameters())


def _compose(cfg: InitModelConfig, out_dir: Path) -> dict[str, Any]:
    # heavy: torch, transformers load on first use, not at CLI start or in config checks
    from transformers import AutoConfig

    if cfg.preset in PRESETS and PRESETS[cfg.preset].llm_hidden_size:
        want = PRESETS[cfg.preset].llm_hidden_size
        got = getattr(AutoConfig.from_pretrained(cfg.llm), "hidden_size", None)
        if got != want:
            raise OvkitError(
                f"--llm {cfg.llm}: hidden size {got}, but --preset {cfg.preset} uses {PRESETS[cfg.preset].llm} "
                f"(hidden size {want}); drop --preset to compose any vision encoder with any LLM"
            )
    metrics = compose(
        cfg.vision, cfg.llm, out_dir, seed=cfg.seed, dtype=cfg.dtype, vision_feature_layer=cfg.vision_feature_layer
    )
    return {"preset": cfg.preset, **metrics}


def corpus_texts(paths: list[Path]) -> Iterator[str]:
    """Message texts (and answers) of every dataset under `paths`, `<image>` markers removed. A directory written by
    `ovkit synth` contributes through ovkit.data.synth.corpus_texts (all splits and the concept names)."""
    # heavy: pyarrow, numpy load on first use, not at CLI start or in config checks
    from ovkit.data.schema import IMAGE_TOKEN

    for path in paths:
        for text in _texts(Path(path)):
            text = text.replace(IMAGE_TOKEN, "")
            if text.strip():
                yield text


def _texts(path: Path) -> Iterator[str]:
    # heavy: pyarrow, numpy load on first use, not at CLI start or in config checks
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
