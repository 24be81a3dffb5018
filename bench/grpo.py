"""Benchmark: `ovkit rl-train` against TRL's GRPOTrainer on CPU, in one run.

Both train the same tiny VLM on the same RL prompts (the synthetic RL split, answer-only instruction), with the same
group size, completion length, prompts per step, number of steps, learning rate, clip range (0.2 / 0.28), no KL,
token-mean loss, one optimizer step per batch, and the same reward (ovkit.rewards, the task scorer of each row).
Reported per trainer:

  samples/s   trajectories trained per second of wall time, from the call to return (loading and saving included)
  reward      mean training reward over the last half of the steps (from each trainer's own logs)
  held-out    greedy reward of the final model on held-out prompts, scored by the same code for both

ovkit runs twice: synchronous on-policy (--max-staleness 0, the same algorithm as TRL) and asynchronous
(--max-staleness 2, a rollout thread samples the next batch while the learner trains). TRL runs with every torch
thread count in --trl-threads and the best is the reference, so thread oversubscription never favours ovkit.

    python bench/grpo.py --model runs/tiny/sft --data runs/tiny/data/rl --eval-data runs/tiny/data/eval
    python bench/grpo.py            # no model given: a fresh tiny model (rewards stay near 0: a speed check only)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import _result

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model",
        type=Path,
        help="tiny VLM directory (e.g. the pipeline's SFT output); default: build a fresh tiny model",
    )
    p.add_argument("--data", type=Path, help="RL prompts; default: `ovkit synth --scale 0.25` into a temp dir")
    p.add_argument(
        "--eval-data", type=Path, help="held-out prompts for the final greedy score (default: the synth eval split)"
    )
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--prompts-per-step", type=int, default=4)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--eval-limit", type=int, default=64, help="held-out prompts scored per model")
    p.add_argument(
        "--threads",
        type=int,
        default=os.cpu_count() or 1,
        help="torch threads for ovkit (async splits them between its two workers)",
    )
    p.add_argument("--trl-threads", default="1,2", help="torch thread counts to run TRL with; the best one is reported")
    p.add_argument("--out", type=Path, help="keep outputs here (default: a temp dir)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def prepare(args, work: Path) -> tuple[Path, Path, Path]:
    """(model, rl data, eval data), building what was not given."""
    from ovkit.data import read_table

    data, eval_data = args.data, args.eval_data
    if data is None or eval_data is None:
        from ovkit.data.synth import SynthConfig, build_corpus

        corpus = work / "data"
        if not (corpus / "rl").exists():
            corpus.mkdir(parents=True, exist_ok=True)
            build_corpus(SynthConfig(out=corpus, scale=0.25, quiet=True), corpus)
        data, eval_data = data or corpus / "rl", eval_data or corpus / "eval"
    model = args.model
    if model is None:
        from ovkit.models.tiny import build_tiny

        model = work / "tiny"
        if not (model / "config.json").is_file():
            texts = [
                m["content"] for msgs in read_table(data, ["messages"]).column("messages").to_pylist() for m in msgs
            ]
            build_tiny(model, texts, seed=args.seed)
        print(
            "note: no --model given; a fresh tiny model scores ~0 reward, so only the speed comparison means much",
            file=sys.stderr,
        )
    return model, data, eval_data


def run_ovkit(args, model: Path, data: Path, out: Path, eta: int) -> dict:
    import torch

    from ovkit.rl.config import RLTrainConfig
    from ovkit.rl.loop import train_rl

    torch.set_num_threads(args.threads)
    cfg = RLTrainConfig(
        data=[data],
        model=model,
        out=out,
        stage=1,
        prompts_per_step=args.prompts_per_step,
        group_size=args.group_size,
        max_new_tokens=args.max_new_tokens,
        max_steps=args.steps,
        lr=args.lr,
        warmup_ratio=0.0,
        max_staleness=eta,
        system_prompt=False,
        micro_batch_size=args.prompts_per_step * args.group_size,
        rollout_batch_size=args.prompts_per_step * args.group_size,
        save_every=0,
        seed=args.seed,
        overwrite=True,
        quiet=True,
    )
    t0 = time.perf_counter()
    summary = train_rl(cfg)
    wall = time.perf_counter() - t0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    tail = rows[len(rows) // 2 :]
    mean = lambda key: sum(r[key] for r in rows) / len(rows)  # noqa: E731
    return {
        "samples_per_s": summary["samples"] / wall,
        "train_reward": sum(r["reward"] for r in tail) / len(tail),
        "wall_s": wall,
        "model": out,
        "step_s": {
            "waiting for rollouts": mean("ovkit/time/rollout"),
            "update": mean("ovkit/time/train"),
            "weight sync": mean("ovkit/time/sync"),
        },
    }


def trl_dataset(data: Path):
    """The same prompts as ovkit's (answer-only instruction, no system prompt), in TRL's VLM format."""
    from datasets import Dataset

    from ovkit.data import read_samples
    from ovkit.models.encode import decode_images
    from ovkit.prompts import with_instruction

    rows = []
    for r in read_samples(data).table.to_pylist():
        msgs = with_instruction([m for m in r["messages"] if m["role"] != "assistant"], "answer")
        text = msgs[-1]["content"]
        images = decode_images(r["images"])
        # TRL puts the images before the text of the first user turn; ovkit's rows start with "<image>" too
        msgs[-1] = {"role": "user", "content": text.replace("<image>", "")}
        rows.append(
            {
                "prompt": msgs,
                "images": images,
                "answer": r["answer"],
                "answer_type": r["answer_type"],
                "source": r["source"],
                "reward_kwargs": r.get("reward_kwargs"),
            }
        )
    return Dataset.from_list(rows)


def task_reward(completions, answer, answer_type, source, reward_kwargs, **_):
    from ovkit.rewards import score_batch

    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    items = [
        {"completion": t, "answer": a, "answer_type": at, "source": s, "reward_kwargs": k, "prompt_type": "answer"}
        for t, a, at, s, k in zip(texts, answer, answer_type, source, reward_kwargs)
    ]
    return [r.reward for r in score_batch(items, workers=2)]


def run_trl(args, model: Path, data: Path, out: Path, threads: int) -> dict:
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    batch = args.prompts_per_step * args.group_size
    config = GRPOConfig(
        output_dir=str(out),
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_generations=args.group_size,
        max_completion_length=args.max_new_tokens,
        max_steps=args.steps,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.01,
        adam_epsilon=1e-5,
        max_grad_norm=1.0,
        beta=0.0,
        epsilon=0.2,
        epsilon_high=0.28,
        loss_type="dapo",
        scale_rewards="group",
        num_iterations=1,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        use_cpu=True,
        bf16=False,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=args.seed,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    processor = AutoProcessor.from_pretrained(model)
    trainer = GRPOTrainer(
        model=AutoModelForImageTextToText.from_pretrained(model, dtype=torch.float32),
        reward_funcs=[task_reward],
        args=config,
        train_dataset=trl_dataset(data),
        processing_class=processor,
    )
    trainer.train()
    trainer.model.save_pretrained(out / "final")
    processor.save_pretrained(out / "final")
    wall = time.perf_counter() - t0
    logs = [h for h in trainer.state.log_history if "reward" in h]
    tail = logs[len(logs) // 2 :]
    return {
        "samples_per_s": args.steps * batch / wall,
        "train_reward": sum(h["reward"] for h in tail) / len(tail),
        "wall_s": wall,
        "model": out / "final",
    }


def held_out(model_dir: Path, eval_data: Path, limit: int) -> float:
    """Greedy reward on held-out prompts, scored by ovkit.rewards (the same code for every model)."""
    from ovkit.data import read_samples
    from ovkit.generate import HFEngine
    from ovkit.models import load
    from ovkit.rollouts.groups import Group, score_groups
    from ovkit.rollouts.prompts import encode_prompts, limit_per_category

    model, processor = load(model_dir)
    table = read_samples(eval_data).table
    n_categories = len(set(table.column("category").to_pylist())) if "category" in table.column_names else 1
    table = limit_per_category(table, max(1, limit // n_categories))  # every category, not the first few
    prompts = encode_prompts(table, processor, mode="answer", system=False)
    outs = HFEngine(model, processor, batch_size=64).generate(
        [p.encoded for p in prompts], n=1, max_new_tokens=32, temperature=0.0
    )
    groups = [Group(p, i, 0, list(o)) for i, (p, o) in enumerate(zip(prompts, outs))]
    score_groups(groups, mode="answer", format_weight=0.0)
    return sum(g.task_rewards[0] for g in groups) / len(groups)


def main() -> None:
    args = parse_args()
    work = args.out or Path(tempfile.mkdtemp(prefix="ovkit-bench-grpo-"))
    work.mkdir(parents=True, exist_ok=True)
    model, data, eval_data = prepare(args, work)
    results = {}
    for threads in [int(t) for t in args.trl_threads.split(",") if t]:
        results[f"trl (threads {threads})"] = run_trl(args, model, data, work / f"trl-{threads}", threads)
    for eta in (0, 2):
        results[f"ovkit (max-staleness {eta})"] = run_ovkit(args, model, data, work / f"ovkit-eta{eta}", eta)
    base = held_out(model, eval_data, args.eval_limit)
    for r in results.values():
        r["held_out"] = held_out(r["model"], eval_data, args.eval_limit)
    trl_best = max((v for k, v in results.items() if k.startswith("trl")), key=lambda v: v["samples_per_s"])
    print(
        f"\nGRPO on CPU: {args.steps} steps x {args.prompts_per_step} prompts x {args.group_size} completions, "
        f"<= {args.max_new_tokens} new tokens, model {model}, torch threads {args.threads}"
    )
    print(f"held-out greedy reward before training: {base:.3f}")
    rows = [
        {
            "trainer": name,
            "samples/s": r["samples_per_s"],
            "vs TRL": r["samples_per_s"] / trl_best["samples_per_s"],
            "train reward": r["train_reward"],
            "held-out": r["held_out"],
            "wall s": r["wall_s"],
        }
        for name, r in results.items()
    ]
    _result.table(
        "grpo",
        "GRPO on CPU against TRL's GRPOTrainer",
        rows,
        formats={"samples/s": ".2f", "vs TRL": ".2f", "train reward": ".3f", "held-out": ".3f", "wall s": ".1f"},
    )
    summary = {k: {kk: (str(vv) if isinstance(vv, Path) else vv) for kk, vv in v.items()} for k, v in results.items()}
    (work / "bench_grpo.json").write_text(
        json.dumps(
            {"args": {k: str(v) for k, v in vars(args).items()}, "base_held_out": base, "results": summary}, indent=2
        )
    )
    for name, r in results.items():
        if "step_s" in r:
            print(f"{name}: mean seconds per step: " + ", ".join(f"{k} {v:.2f}" for k, v in r["step_s"].items()))
    print(f"details: {work / 'bench_grpo.json'}")


if __name__ == "__main__":
    main()
