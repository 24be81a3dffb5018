"""`ovkit eval`: score a model on held-out rows per category; `ovkit eval --compare`: one table across runs."""

from __future__ import annotations

from pathlib import Path

import typer

from ovkit.commands._common import (
    ATTN_IMPLEMENTATION,
    CONFIG,
    ENV,
    ENV_ARG,
    ENV_RETRIES,
    ENV_TIMEOUT,
    IO,
    MAX_RESPONSE_TOKENS,
    MAX_TURNS,
    OVERWRITE,
    PRECISION,
    QUIET,
    RUNTIME,
    SEED,
    done,
    resolve,
    skipped,
    stage,
)

_O = typer.Option


GENERATION, COMPARE = "Generation", "Compare finished evals"


@stage(
    "ovkit.evaluate.run:EvalConfig",
    required=("data",),
    example="ovkit eval runs/tiny/data/eval --model runs/tiny/models/sft --out runs/tiny/eval/sft --config examples/tiny/eval.yaml",
)
def evaluate(
    ctx: typer.Context,
    data: list[Path] = typer.Argument(
        None, help="Eval datasets (parquet file or directory); with --compare: eval outputs (DIR or LABEL=DIR)."
    ),
    model: Path = _O(None, "--model", help="Model directory (save_pretrained) or hub id.", rich_help_panel=IO),
    out: Path = _O(
        None,
        "--out",
        "--output-dir",
        help="Output directory (written atomically); with --compare: a markdown file for the table.",
        rich_help_panel=IO,
    ),
    compare: bool = _O(
        None,
        "--compare",
        help="Tabulate finished evals (the DATA arguments) instead of running one.",
        rich_help_panel=COMPARE,
    ),
    metric: str = _O(
        None, "--metric", help="--compare: reward, accuracy, pass@K or truncated.", rich_help_panel=COMPARE
    ),
    prompt: str = _O(
        None,
        "--prompt",
        help="Instruction added to each prompt: answer, think, none, or auto (each row in the mode of its RL stage: think for rl-curate's stage-2 categories).",
        rich_help_panel=GENERATION,
    ),
    engine: str = _O(None, "--engine", help="hf (transformers, any device) or vllm (GPU).", rich_help_panel=RUNTIME),
    batch_size: int = _O(
        None, "--batch-size", help="Sequences per generate call (rows x n), hf engine.", rich_help_panel=RUNTIME
    ),
    max_new_tokens: int = _O(
        None,
        "--max-new-tokens",
        help="Tokens per completion (default: per category, 1.25 x its longest gold answer, at least 32; +256 with --prompt think).",
        rich_help_panel=GENERATION,
    ),
    n: int = _O(None, "--n", help="Completions per row; more than 1 reports pass@k.", rich_help_panel=GENERATION),
    temperature: float = _O(
        None, "--temperature", help="0 = greedy (default: 0 for --n 1, 1.0 for --n > 1).", rich_help_panel=GENERATION
    ),
    top_p: float = _O(
        None, "--top-p", help="Nucleus sampling mass (with --temperature > 0).", rich_help_panel=GENERATION
    ),
    limit: int = _O(
        None, "--limit", help="At most this many rows per category (the first ones).", rich_help_panel=GENERATION
    ),
    shuffle_images: bool = _O(
        None,
        "--shuffle-images",
        help="Give each row another row's images (same category, seeded): the drop from the plain eval is what the model reads from the image.",
        rich_help_panel=GENERATION,
    ),
    save_logprobs: bool = _O(
        None,
        "--save-logprobs",
        help="Also write OUT/rollouts.parquet (token ids, sampler log-probs, rewards).",
        rich_help_panel=IO,
    ),
    precision: str = PRECISION,
    attn_implementation: str = ATTN_IMPLEMENTATION,
    env: str = ENV,
    env_arg: list[str] = ENV_ARG,
    max_turns: int = MAX_TURNS,
    max_response_tokens: int = MAX_RESPONSE_TOKENS,
    env_retries: int = ENV_RETRIES,
    env_timeout: float = ENV_TIMEOUT,
    trust_remote_code: bool = _O(
        None, "--trust-remote-code", help="Allow model code from the model directory / hub.", rich_help_panel=RUNTIME
    ),
    seed: int = SEED,
    overwrite: bool = OVERWRITE,
    quiet: bool = QUIET,
    config: Path = CONFIG,
) -> None:
    """Evaluate a model on held-out rows: mean reward and accuracy per category, per source and overall."""
    from ovkit.evaluate import compare_table, load_run, run_eval
    from ovkit.evaluate.results import unmapped
    from ovkit.files import is_complete
    from ovkit.launch import processes
    from ovkit.runs import Stage

    cfg = resolve(ctx)
    if cfg.compare:
        runs = [load_run(p) for p in cfg.data]
        for note in unmapped(runs, cfg.metric):
            typer.echo(f"warning: {note}", err=True)
        table = compare_table(runs, cfg.metric)
        typer.echo(table, nl=False)
        if cfg.out is not None:
            _write_text(cfg.out, table)
            done(f"eval --compare: {len(cfg.data)} runs -> {cfg.out}")
        return
    rank, world = processes()
    if rank > 0:  # under a launcher: score this process's share of the rows; the main process writes OUT
        if not is_complete(cfg.out) or cfg.overwrite:
            run_eval(cfg, None)
        return
    stage = Stage(
        "eval", cfg, cfg.out, inputs=[*cfg.data, cfg.model], overwrite=cfg.overwrite, seed=cfg.seed, parent=cfg.model
    )
    if stage.skipped:
        return skipped(cfg.out)
    with stage:
        stage.extra["runtime"] = {"processes": world}
        stage.metrics.update(run_eval(cfg, stage.path))
    m = stage.metrics
    done(
        f"eval: reward {m['overall']:.3f}, accuracy {m['accuracy']:.3f} on {m['rows']} rows x {cfg.n} "
        f"({len(m['categories'])} categories, {m['truncated']:.0%} truncated) in {m['seconds']['total']}s -> {cfg.out}"
    )


def _write_text(path: Path, text: str) -> None:
    path = Path(path)
    if path.is_dir():
        path = path / "compare.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    tmp.replace(path)
