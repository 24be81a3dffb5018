"""Activation memory per token: the bytes autograd keeps for backward, per token and per block, at real widths.

One Qwen2.5-VL decoder layer and one ViT block of the qwen2.5-vl-2b and qwen2.5-vl-7b presets (ovkit.models.presets),
in bf16 with sdpa attention (the tower through ovkit's varlen attention, as the runtime runs it), over a sequence of
--tokens tokens, with each --activation-checkpointing mode applied to
the block the way ovkit applies it (ovkit.runtime.checkpointing.wrap): off, mlp (only the MLP recomputed), full (the
block keeps its input). Bytes are counted with torch.autograd.graph.saved_tensors_hooks, de-duplicated by storage,
weights left out (ovkit.runtime.checkpointing.saved_bytes). A block's cost is the *marginal* cost of a second block
stacked on the first (bytes of 2 blocks - bytes of 1), so what a model shares between its blocks (rotary cos/sin,
the first block's input) is not counted per block, and `full` is exactly one block input. The head is the chunked
log-prob head of ovkit.runtime.loss over the full vocabulary. Then the arithmetic for one packed row.

    OMP_NUM_THREADS=1 python bench/activation_bytes.py [--tokens 1024] [--row 16384]

Forward passes only (what is kept is decided in forward); about a minute on a 2-core CPU with bf16 matmuls.
"""

from __future__ import annotations

import argparse
import time

import _result
import torch

from ovkit.models.presets import random_config
from ovkit.runtime import checkpointing as ac
from ovkit.runtime.loss import ChunkedHeadLogprob, chunk_rows

MODES = ("off", "mlp", "full")
DTYPE = torch.bfloat16
GIB = 1 << 30


class _Tokens:
    """Just enough tokenizer for random_config: Qwen-VL's special tokens at distinct ids below the vocabulary."""

    unk_token_id = -1

    def __len__(self) -> int:
        return 1000

    def convert_tokens_to_ids(self, token: str) -> int:
        return 900 + sum(map(ord, token)) % 100


def _text_blocks(config, n: int, tokens: int):
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLDecoderLayer, Qwen2_5_VLRotaryEmbedding

    text = config.text_config
    text._attn_implementation = "sdpa"
    blocks = [Qwen2_5_VLDecoderLayer(text, layer_idx=i).to(DTYPE) for i in range(n)]
    positions = torch.arange(tokens)[None, None].expand(3, 1, tokens)
    x = torch.randn(1, tokens, text.hidden_size, dtype=DTYPE)
    with torch.no_grad():
        rope = Qwen2_5_VLRotaryEmbedding(config=text)(x, positions)
    return blocks, x, lambda b, h: b(h, position_ids=positions, position_embeddings=rope)


def _vision_blocks(config, n: int, tokens: int):
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLVisionBlock

    from ovkit.models.attention import VARLEN, register

    register()  # ovkit's varlen attention for the tower, as the runtime sets it (ovkit.models.attention)
    vision = config.vision_config
    vision._attn_implementation = VARLEN
    blocks = [Qwen2_5_VLVisionBlock(vision, attn_implementation=VARLEN).to(DTYPE) for _ in range(n)]
    head_dim = vision.hidden_size // vision.num_heads
    angles = torch.randn(tokens, head_dim)
    rope = (angles.cos(), angles.sin())
    cu_seqlens = torch.tensor([0, tokens], dtype=torch.int32)  # one full-attention window (as in every 8th block)
    x = torch.randn(tokens, vision.hidden_size, dtype=DTYPE)
    return blocks, x, lambda b, h: b(h, cu_seqlens=cu_seqlens, position_embeddings=rope)


def per_block(make, config, tokens: int) -> dict[str, float]:
    """Marginal saved bytes per token of one block, per mode."""
    blocks, x, call = make(config, 2, tokens)
    owner = torch.nn.ModuleList(blocks)
    out = {}
    for mode in MODES:
        ac.remove(owner)
        for b in blocks:
            if mode != "off":
                ac.wrap(b.mlp if mode == "mlp" else b)
        kept = []
        for n in (1, 2):
            h = x.clone().requires_grad_(True)  # the residual stream requires grad in a real model

            def run(h=h, n=n):
                for b in blocks[:n]:
                    h = call(b, h)
                return h

            kept.append(ac.saved_bytes(run, exclude=owner)[0])
        out[mode] = (kept[1] - kept[0]) / tokens
    ac.remove(owner)
    return out


def head(config, tokens: int) -> float:
    """Saved bytes per token of the chunked log-prob head (no [tokens x vocab] tensor is kept)."""
    text = config.text_config
    weight = torch.randn(text.vocab_size, text.hidden_size, dtype=DTYPE, requires_grad=True)
    h = torch.randn(tokens, text.hidden_size, dtype=DTYPE, requires_grad=True)
    targets = torch.randint(0, text.vocab_size, (tokens,))
    kept, _ = ac.saved_bytes(
        lambda: ChunkedHeadLogprob.apply(h * 1, weight, None, targets, 1.0, chunk_rows(text.vocab_size))
    )
    return (kept - weight.numel() * weight.element_size()) / tokens


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=1024, help="sequence length of the measurement")
    p.add_argument("--row", type=int, default=16384, help="packed row length of the arithmetic")
    p.add_argument("--presets", nargs="+", default=["qwen2.5-vl-2b", "qwen2.5-vl-7b"])
    args = p.parse_args()
    torch.manual_seed(0)
    rows, results = [], {}
    for name in args.presets:
        config = random_config(name, _Tokens())
        t0 = time.perf_counter()
        results[name] = {
            "llm": per_block(_text_blocks, config, args.tokens),
            "vit": per_block(_vision_blocks, config, args.tokens),
            "head": head(config, args.tokens),
            "config": config,
        }
        t, v = config.text_config, config.vision_config
        for part, (h, i) in (
            ("llm", (t.hidden_size, t.intermediate_size)),
            ("vit", (v.hidden_size, v.intermediate_size)),
        ):
            r = results[name][part]
            block = "decoder layer" if part == "llm" else "ViT block"
            rows.append(
                {"preset": name, "block": block, "hidden / intermediate": f"{h} / {i}"}
                | {m: r[m] for m in MODES}
                | {"off / hidden": r["off"] / h}
            )
        rows.append(
            {
                "preset": name,
                "block": "head + loss (chunked)",
                "hidden / intermediate": f"{t.hidden_size} / vocab {t.vocab_size:,}",
                "off": results[name]["head"],
            }
        )
        print(f"# {name}: {time.perf_counter() - t0:.1f} s", flush=True)
    _result.table(
        "activation_bytes",
        f"bytes kept for backward per token per block (bf16, sdpa, {args.tokens} tokens; marginal block)",
        rows,
        columns=["preset", "block", "hidden / intermediate", *MODES, "off / hidden"],
        formats=dict.fromkeys(MODES, ",.0f") | {"off / hidden": ".1f"},
    )
    _fit(results)
    _arithmetic(results.get("qwen2.5-vl-2b") or next(iter(results.values())), args.row)


def _fit(results: dict) -> None:
    """off = a * hidden + b * intermediate from the decoder layers of two presets (ovkit's auto estimate)."""
    pts = [
        (r["config"].text_config.hidden_size, r["config"].text_config.intermediate_size, r["llm"]["off"])
        for r in results.values()
    ]
    if len(pts) < 2:
        return
    A = torch.tensor([[h, i] for h, i, _ in pts[:2]], dtype=torch.float64)
    y = torch.tensor([o for _, _, o in pts[:2]], dtype=torch.float64)
    a, b = torch.linalg.solve(A, y).tolist()
    print(f"\nfit of the decoder layers (off): bytes/token/layer = {a:.2f} x hidden + {b:.2f} x intermediate")
    for name, r in results.items():
        v = r["config"].vision_config
        print(
            f"  {name} ViT block predicted {a * v.hidden_size + b * v.intermediate_size:,.0f}, measured "
            f"{r['vit']['off']:,.0f}"
        )


def _arithmetic(r: dict, row: int) -> None:
    """One packed row of `row` tokens: text only, and half of it image tokens (2x2 merge: 4 ViT patches each)."""
    config = r["config"]
    layers, blocks = config.text_config.num_hidden_layers, config.vision_config.depth
    params = 2.21e9
    print(
        f"\none packed row of {row:,} tokens, {layers} decoder layers, {blocks} ViT blocks; weights + optimiser "
        f"10-18 bytes/param"
        f" x {params / 1e9:.2f}B = {10 * params / GIB:.1f}-{18 * params / GIB:.1f} GiB of an 80 GB card "
        f"({80e9 / GIB:.1f} GiB)\n"
    )
    rows = []
    for mode in MODES:  # mlp and full also hold one block's (or MLP's) activations while it is recomputed (below)
        llm = layers * r["llm"][mode] * row
        vit = blocks * r["vit"][mode] * (row // 2) * 4
        text_only, with_images = llm + r["head"] * row, llm + r["head"] * row + vit
        room = (80e9 - 18 * params) / GIB
        fits = "both" if with_images / GIB < room else "the text-only row" if text_only / GIB < room else "neither"
        rows.append(
            {
                "mode": mode,
                "LLM layers GiB": llm / GIB,
                "head GiB": r["head"] * row / GIB,
                "text-only row GiB": text_only / GIB,
                "+ ViT, half the row image tokens GiB": with_images / GIB,
                "fits next to 18 B/param?": f"{fits} ({room:.1f} GiB left)",
            }
        )
    _result.table(
        "activation_bytes",
        f"one packed row of {row:,} tokens: activations kept per --activation-checkpointing mode",
        rows,
        formats={"LLM layers GiB": ".1f", "head GiB": ".2f", "text-only row GiB": ".1f"}
        | {"+ ViT, half the row image tokens GiB": ".1f"},
    )
    print(
        f"\nwhile a block is recomputed in backward it holds its own activations once more: "
        f"{r['llm']['off'] * row / GIB:.2f} GiB for a "
        f"decoder layer of this row, {r['vit']['off'] * row * 2 / GIB:.2f} GiB for a ViT block of its patches"
    )


if __name__ == "__main__":
    main()
