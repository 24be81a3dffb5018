"""`ovkit init-model`: build the tiny default model, or compose a stage-0 VLM from a vision encoder and an LLM."""

from __future__ import annotations

from pathlib import Path

import typer

from ovkit.commands._common import CONFIG, OUT, OVERWRITE, QUIET, SEED, done, resolve, skipped


def init_model(
    ctx: typer.Context,
    out: Path = OUT,
    preset: str = typer.Option(None, "--preset", help="tiny (default), or a published name (see --list-presets)."),
    corpus: list[Path] = typer.Option(None, "--corpus", help="tiny: dataset(s) whose text trains the tokenizer (repeatable), e.g. data/ from `ovkit synth`."),
    vision: Path = typer.Option(None, "--vision", help="Compose: local vision encoder directory (CLIP, SigLIP, ...)."),
    llm: Path = typer.Option(None, "--llm", help="Compose: local causal LM directory (with its tokenizer)."),
    dtype: str = typer.Option("auto", "--dtype", help="Compose / random init: weight dtype (auto keeps the checkpoints' / float32; float32, bfloat16, ...)."),
    vision_feature_layer: int = typer.Option(-2, "--vision-feature-layer", help="Compose: encoder layer that feeds the projector."),
    random_init: bool = typer.Option(False, "--random-init", help="Build a published architecture (qwen2.5-vl-2b/3b/7b) with random weights, offline."),
    processor: Path = typer.Option(None, "--processor", help="Random init: a processor directory to save with it (default: the tiny tokenizer, vocabulary padded)."),
    list_presets: bool = typer.Option(False, "--list-presets", help="Print the preset table and exit."),
    seed: int = SEED,
    overwrite: bool = OVERWRITE,
    quiet: bool = QUIET,
    config: Path = CONFIG,
) -> None:
    """Build the tiny model (Qwen2.5-VL architecture, tokenizer trained on --corpus) or the tiny CLIP, or compose --vision + --llm."""
    from ovkit.models.presets import InitModelConfig, build, presets_table
    from ovkit.runs import Stage

    cfg = resolve(ctx, InitModelConfig)
    if cfg.list_presets:
        return done(presets_table())
    inputs = [*cfg.corpus, *[p for p in (cfg.vision, cfg.llm) if p is not None]]
    stage = Stage("init-model", cfg, cfg.out, inputs=inputs, overwrite=cfg.overwrite, seed=cfg.seed)
    if stage.skipped:
        return skipped(cfg.out)
    with stage:
        stage.metrics.update(build(cfg, stage.path))
    m = stage.metrics
    arch = m.get("architecture", "CLIPModel, contrastive loss {loss_first} -> {loss_last}".format(**m) if "loss_last" in m else "")
    done(f"init-model: {m['preset']} ({arch}, {m['parameters'] / 1e6:.2f}M parameters) -> {cfg.out}")
