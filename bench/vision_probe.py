"""Does a VLM's visual input carry what the synthetic shape tasks ask about? A linear probe per merged visual token.

    python bench/vision_probe.py runs/tiny/models/stage0 runs/tiny/models/midtrain runs/tiny/models/sft

Draws 3,000 shape scenes of the synthetic corpus (84x84, a 3x3 grid of 28-pixel cells; each cell empty with
probability 0.45, else one shape of a random colour and kind, drawn as `ovkit synth` draws them), runs each model's
vision encoder and projector (`get_image_features`: the tokens the language model receives, one per cell for a
patch-14, 2x2-merge model), and fits one linear classifier per question on 2,000 scenes' tokens (standardised, Adam,
300 full-batch steps) to read the token's cell: its colour (6 + empty) and its shape (4 + empty). Prints accuracy on
the other 1,000 scenes, over all cells and over occupied cells only.

High accuracy means the information reaches the language model linearly; a model that still answers a colour or shape
question at chance is failing in the language model, not in the encoder. Models whose image gives other than 9 tokens
(another patch size or merge) are refused. CPU, about 10 s per model.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))  # tests import this file by path
import _result  # noqa: E402

from ovkit.data.synth_tasks import COLOURS, SHAPES, place, scene_image  # noqa: E402

SCENES, TRAIN, EMPTY = 3000, 2000, 0.45
COLOUR_NAMES = list(COLOURS)


def scenes(seed: int) -> tuple[list, torch.Tensor]:
    """Images and labels [N, 9, 2] (colour index, shape index; 0 = empty cell)."""
    rng = random.Random(seed)
    images, labels = [], []
    for _ in range(SCENES):
        objs, lab = [], []
        for cell in range(9):
            if rng.random() < EMPTY:
                lab.append((0, 0))
                continue
            colour, shape = rng.choice(COLOUR_NAMES), rng.choice(SHAPES)
            objs.append(place(rng, colour, shape, cell))
            lab.append((1 + COLOUR_NAMES.index(colour), 1 + SHAPES.index(shape)))
        images.append(scene_image(objs))
        labels.append(lab)
    return images, torch.tensor(labels)


@torch.no_grad()
def visual_tokens(path: str, images: list) -> torch.Tensor:
    """[N, tokens, hidden]: what the language model receives for each image."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    model = AutoModelForImageTextToText.from_pretrained(path).eval()
    processor = AutoProcessor.from_pretrained(path)
    out = []
    for i in range(0, len(images), 200):
        enc = processor.image_processor(images=images[i : i + 200], return_tensors="pt")
        feats = model.model.get_image_features(enc["pixel_values"], enc["image_grid_thw"]).pooler_output
        out.append(torch.stack(list(feats)))
    return torch.cat(out)


def probe(x: torch.Tensor, y: torch.Tensor, seed: int) -> tuple[float, float]:
    """(accuracy on all held-out cells, on occupied held-out cells) of a linear classifier from token to label."""
    torch.manual_seed(seed)
    n = TRAIN * 9
    mu, sd = x[:n].mean(0), x[:n].std(0) + 1e-6
    x = (x - mu) / sd
    head = torch.nn.Linear(x.shape[1], int(y.max()) + 1)
    opt = torch.optim.Adam(head.parameters(), lr=1e-2)
    for _ in range(300):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(head(x[:n]), y[:n]).backward()
        opt.step()
    with torch.no_grad():
        right = head(x[n:]).argmax(-1) == y[n:]
    return right.float().mean().item(), right[y[n:] > 0].float().mean().item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="+", help="model directories (a Qwen2.5-VL-family VLM, e.g. the tiny preset)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    images, labels = scenes(args.seed)
    rows = []
    for path in args.models:
        tokens = visual_tokens(path, images)
        if tokens.shape[1] != 9:
            sys.exit(f"{path}: {tokens.shape[1]} visual tokens per 84x84 scene, the probe needs 9 (one per cell)")
        flat = tokens.reshape(-1, tokens.shape[-1])
        colour = probe(flat, labels[..., 0].reshape(-1), args.seed)
        shape = probe(flat, labels[..., 1].reshape(-1), args.seed)
        print(f"{path}: colour {colour[0]:.3f}, shape {shape[0]:.3f}", flush=True)
        rows.append(
            {
                "model": path,
                "colour (all cells)": colour[0],
                "colour (occupied)": colour[1],
                "shape (all cells)": shape[0],
                "shape (occupied)": shape[1],
            }
        )
    _result.table(
        "vision_probe",
        f"linear probe of each merged visual token: accuracy on {SCENES - TRAIN} held-out scenes x 9 cells",
        rows,
        formats=dict.fromkeys(
            ("colour (all cells)", "colour (occupied)", "shape (all cells)", "shape (occupied)"), ".3f"
        ),
    )


if __name__ == "__main__":
    main()
