"""`ovkit init-model`: build the tiny default model, or compose a stage-0 VLM from a vision encoder and an LLM."""

from __future__ import annotations

from pathlib import Path

import typer

from ovkit.commands._common import CONFIG, IO, OUT, OVERWRITE, QUIET, SEED, done, resolve, skipped, stage

_O = typer.Option


MODEL = "Model"


@stage(
    "ovkit.models.presets:InitModelConfig",
    required=("out",),
    example="ovkit init-model --preset tiny --corpus runs/tiny/data --out runs/tiny/models/stage0",
)
def init_model(
    ctx: typer.Context,
    out: Path = OUT,
    preset: str = _O(
        None, "--preset", help="tiny (default), or a published name (see --list-presets).", rich_help_panel=MODEL
    ),
    corpus: list[Path] = _O(
        None,
        "--corpus",
        help="tiny: dataset(s) whose text trains the tokenizer (repeatable), e.g. data/ from `ovkit synth`.",
        rich_help_panel=IO,
    ),
    vision: Path = _O(
        None, "--vision", help="Compose: local vision encoder directory (CLIP, SigLIP, ...).", rich_help_panel=IO
    ),
    llm: Path = _O(None, "--llm", help="Compose: local causal LM directory (with its tokenizer).", rich_help_panel=IO),
    dtype: str = _O(
        None,
        "--dtype",
        help="Compose / random init: weight dtype (auto keeps the checkpoints' / float32; float32, bfloat16, ...).",
        rich_help_panel=MODEL,
    ),
    vision_feature_layer: int = _O(
        None, "--vision-feature-layer", help="Compose: encoder layer that feeds the projector.", rich_help_panel=MODEL
    ),
    random_init: bool = _O(
        None,
        "--random-init",
        help="Build a published architecture (qwen2.5-vl-2b/3b/7b) with random weights, offline.",
        rich_help_panel=MODEL,
    ),
    processor: Path = _O(
        None,
        "--processor",
        help="Random init: a processor directory to save with it (default: the tiny tokenizer, vocabulary padded).",
        rich_help_panel=IO,
    ),
    list_presets: bool = _O(None, "--list-presets", help="Print the preset table and exit.", rich_help_panel=MODEL),
    seed: int = SEED,
    overwrite: bool = OVERWRITE,
    quiet: bool = QUIET,
    config: Path = CONFIG,
) -> None:
    """Build the tiny model (Qwen2.5-VL architecture, tokenizer trained on --corpus) or the tiny CLIP, or compose --vision + --llm."""
    from ovkit.models.presets import build, presets_table
    from ovkit.runs import Stage

    cfg = resolve(ctx)
    if cfg.list_presets:
        return done(presets_table())
    inputs = [*cfg.corpus, *[p for p in (cfg.vision, cfg.llm) if p is not None]]
    stage = Stage("init-model", cfg, cfg.out, inputs=inputs, overwrite=cfg.overwrite, seed=cfg.seed)
    if stage.skipped:
        return skipped(cfg.out)
    with stage:
        stage.metrics.update(build(cfg, stage.path))
    m = stage.metrics
    arch = m.get(
        "architecture",
        "CLIPModel, contrastive loss {loss_first} -> {loss_last}".format(**m) if "loss_last" in m else "",
    )
    done(f"init-model: {m['preset']} ({arch}, {m['parameters'] / 1e6:.2f}M parameters) -> {cfg.out}")
