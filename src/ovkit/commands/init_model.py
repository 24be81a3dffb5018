"""`ovkit init-model`: build the tiny default model, or compose a stage-0 VLM from a vision encoder and an LLM."""

from __future__ import annotations

import typer

from ovkit.commands._common import done, resolve, skipped, stage


@stage(
    "ovkit.models.presets:InitModelConfig",
    required=("out",),
    example="ovkit init-model --preset tiny --corpus runs/tiny/data --out runs/tiny/models/stage0",
)
def init_model(ctx: typer.Context) -> None:
    """Build the tiny model (Qwen2.5-VL architecture, tokenizer trained on --corpus) or the tiny CLIP, or compose
    --vision + --llm."""
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
