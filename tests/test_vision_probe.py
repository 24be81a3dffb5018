"""bench/vision_probe.py: the linear probe reads a label that is linearly present and does not read one that is not."""

import importlib.util
from pathlib import Path

import torch

from ovkit.data.synth_tasks import CELL

SPEC = importlib.util.spec_from_file_location("vision_probe", Path(__file__).parents[1] / "bench" / "vision_probe.py")
vision_probe = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(vision_probe)


def _tokens(n: int, classes: int, informative: bool):
    g = torch.Generator().manual_seed(0)
    y = torch.randint(0, classes, (n,), generator=g)
    x = torch.randn(n, 16, generator=g) * torch.cat([torch.ones(8), torch.full((8,), 20.0)])  # unequal scales
    if informative:
        x[:, :classes] += torch.nn.functional.one_hot(y, 16)[:, :classes] * 6.0  # each class on its own direction
    return x, y


def test_probe_reads_a_linear_label_and_not_noise():
    n = vision_probe.SCENES * 9
    x, y = _tokens(n, 7, informative=True)
    all_cells, occupied = vision_probe.probe(x, y, seed=0)
    assert all_cells > 0.95 and occupied > 0.95
    x, y = _tokens(n, 7, informative=False)
    all_cells, _ = vision_probe.probe(x, y, seed=0)
    assert all_cells < 0.25  # chance is 1/7


def test_scenes_label_every_cell_and_draw_what_they_label():
    images, labels = vision_probe.scenes(seed=0)
    assert len(images) == vision_probe.SCENES and labels.shape == (vision_probe.SCENES, 9, 2)
    empty = (labels[..., 0] == 0).float().mean().item()
    assert abs(empty - vision_probe.EMPTY) < 0.02
    assert ((labels[..., 0] == 0) == (labels[..., 1] == 0)).all()  # a cell is empty in both labels or in neither
    img, lab = images[0].convert("RGB"), labels[0]
    for cell in range(9):  # an occupied cell has non-white pixels, an empty one none
        x, y = (cell % 3) * CELL, (cell // 3) * CELL
        crop = img.crop((x, y, x + CELL, y + CELL))
        inked = any(p != (255, 255, 255) for p in crop.getdata())
        assert inked == bool(lab[cell, 0] > 0), cell
