"""Benchmark: ovkit's token-in/token-out multi-turn loop against the decode-and-re-encode loop, in one run.

The peer is how many multi-turn rollout loops build the next turn's context: keep the conversation as text (each
assistant turn decoded, each observation appended as a message) and re-render it with the chat template every turn.
Both loops sample the same prompts with the same model, environment (`verifier`: "incorrect, try again") and seeds.
Reported:

  drift      share of trajectories whose re-rendered token ids differ from the tokens the model actually sampled
             (for those, the learner would score other tokens than the sampler produced: the log-prob ratio of
             PPO is no longer a ratio of the same action), and the share of sampled tokens affected
  s/turn     wall time of the rollout per assistant turn, each loop
  tokens     context tokens processed per second of rollout (prompt + response, summed over turns)

    python bench/multiturn.py --model runs/tiny/models/sft --data runs/tiny/rl-data/stage1
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import _result

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, required=True, help="a VLM directory (e.g. the pipeline's SFT output)")
    p.add_argument("--data", type=Path, required=True, help="RL prompts (e.g. rl-curate's OUT/stage1)")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--n", type=int, default=4, help="trajectories per prompt")
    p.add_argument("--max-turns", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def rerender(processor, prompt_messages, images, turn_texts, feedback) -> list[int]:
    """The peer's context after the last turn: the conversation as text, rendered again by the chat template."""
    from ovkit.models.encode import encode_messages

    messages = list(prompt_messages)
    for k, text in enumerate(turn_texts):
        messages.append({"role": "assistant", "content": text})
        if k < len(turn_texts) - 1:
            messages.append({"role": "user", "content": feedback})
    full = encode_messages(processor, messages, images, generation_prompt=False).input_ids
    return full


def main() -> None:
    import torch

    from ovkit.data import read_samples
    from ovkit.envs import load_env
    from ovkit.envs.verifier import FEEDBACK
    from ovkit.generate import HFEngine
    from ovkit.models import load
    from ovkit.models.encode import decode_images
    from ovkit.prompts import with_instruction
    from ovkit.rollouts.episodes import EpisodeRunner, MultiTurn
    from ovkit.rollouts.prompts import encode_prompts

    args = parse_args()
    torch.manual_seed(args.seed)
    model, processor = load(args.model)
    model.eval()
    table = read_samples(args.data).table.slice(0, args.prompts)
    prompts = encode_prompts(table, processor, mode="answer", system=False)
    engine = HFEngine(model, processor, batch_size=64)
    runner = EpisodeRunner(
        engine, processor, MultiTurn(env=load_env("verifier"), max_turns=args.max_turns), model=model
    )
    t0 = time.perf_counter()
    outs = runner.run(
        prompts, n=args.n, max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=1.0, seed=args.seed
    )
    ours_s = time.perf_counter() - t0
    trajectories = [(p, c) for p, cs in zip(prompts, outs) for c in cs]
    turns = sum(c.turns for _, c in trajectories)

    drifted = drifted_tokens = sampled = 0
    rows = table.to_pylist()
    by_id = {str(r["id"]): r for r in rows}
    t0 = time.perf_counter()
    for p, c in trajectories:
        if c.turns == 0:
            continue
        row = by_id[p.id]
        messages = with_instruction([m for m in row["messages"] if m["role"] != "assistant"], "answer")
        peer = rerender(processor, messages, decode_images(row["images"]), c.turn_texts, FEEDBACK)
        ours = list(p.encoded.input_ids) + list(c.token_ids)
        sampled += sum(c.mask)
        if peer[: len(ours)] != ours:
            drifted += 1
            common = next((i for i, (a, b) in enumerate(zip(ours, peer)) if a != b), min(len(ours), len(peer)))
            drifted_tokens += sum(c.mask[max(0, common - p.encoded.length) :])
    rerender_s = time.perf_counter() - t0

    n = len(trajectories)
    context_tokens = sum(p.encoded.length * c.turns + len(c.token_ids) for p, c in trajectories)
    print(f"{n} trajectories, {turns} assistant turns ({turns / n:.2f} per trajectory), {sampled} sampled tokens")
    rows = [
        {
            "loop": "token-in/token-out (ovkit)",
            "drifted trajectories": 0,
            "drifted sampled tokens": 0,
            "rollout s": ours_s,
            "ms/turn": ours_s / turns * 1000,
            "context tokens/s": context_tokens / ours_s,
        },
        {
            "loop": "decode + re-render (peer)",
            "drifted trajectories": drifted,
            "drifted sampled tokens": drifted_tokens,
            "re-render s": rerender_s,
        },
    ]
    _result.table(
        "multiturn",
        f"multi-turn context: {n} trajectories, {sampled} sampled tokens (drift at or after the first differing token)",
        rows,
        columns=[
            "loop",
            "drifted trajectories",
            "drifted sampled tokens",
            "rollout s",
            "ms/turn",
            "context tokens/s",
            "re-render s",
        ],
        formats={"rollout s": ".1f", "ms/turn": ".1f", "context tokens/s": ".0f", "re-render s": ".2f"},
    )


if __name__ == "__main__":
    main()
