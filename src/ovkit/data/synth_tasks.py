"""The task families of the synthetic corpus: what each image shows, the question, the verifiable answer.

Every generator draws a *composition* first (the facts a question is about, e.g. "3 red stars"), keyed by a string
such as `counting:red star x3`. A fixed hash of that key puts the composition on one side (`side_of`), the same for
every seed: one bucket of eight is held out for eval, another for validation, the rest trains. Train splits
(pretrain, instruct, rl) never use a held-out key, eval and val use only their own, so both ask about combinations
the model has not been trained on (though it has seen every colour, shape, word and digit involved), and choosing
hyper-parameters on val never looks at an eval composition.

Sizes are what the tiny model was measured to learn from (ovkit.models.tiny: 84x84 scenes were learnt in ~700 steps,
56x56 ones stayed at chance): shape scenes are 84x84 with 18-24 pixel shapes on a 3x3 grid of 28-pixel
cells (one shape per 2x2-merged visual token of a patch-14 model); text-reading tasks get wider images and big glyphs.
"""

from __future__ import annotations

import hashlib
import io
import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from math import cos, hypot, pi, sin
from typing import Any

from PIL import Image, ImageDraw, ImageFont

# SVG named colours, so that a scene drawn with PIL and one rendered from SVG code agree on every pixel colour.
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (255, 0, 0),
    "green": (0, 128, 0),
    "blue": (0, 0, 255),
    "yellow": (255, 255, 0),
    "purple": (128, 0, 128),
    "orange": (255, 165, 0),
}
COLOURS_ZH = {
    "red": "红色", "green": "绿色", "blue": "蓝色", "yellow": "黄色", "purple": "紫色", "orange": "橙色",
}  # fmt: skip
SHAPES = ("circle", "square", "triangle", "star")
SHAPES_ZH = {"circle": "圆形", "square": "正方形", "triangle": "三角形", "star": "星形"}
COMBOS = tuple(f"{c} {s}" for c in COLOURS for s in SHAPES)  # the concepts of shape scenes, e.g. "red circle"

# Concept names of the other image kinds, and vocabulary entries no image ever shows (a real concept vocabulary
# is mostly entries that a given corpus never matches).
KIND_CONCEPTS = ("text", "equation", "bar chart", "arrow", "seesaw")
UNSEEN_CONCEPTS = ("pink heart", "black hexagon", "brown cross", "grey moon", "white cloud", "cyan diamond")

WORDS = (
    "cat", "dog", "sun", "sky", "box", "cup", "hat", "pen", "map", "key", "bus", "car", "egg", "fish", "bird", "tree",
    "book", "door", "moon", "star", "rain", "milk", "ball", "lamp", "ship", "cake", "frog", "leaf", "rose", "coin",
    "kite", "bell",
)  # fmt: skip
NUMBER_EN = {1: "a", 2: "two", 3: "three", 4: "four", 5: "five", 6: "six"}
NUMBER_ZH = {1: "一个", 2: "两个", 3: "三个", 4: "四个", 5: "五个", 6: "六个"}
CELL_NAMES = ("top-left", "top", "top-right", "left", "middle", "right", "bottom-left", "bottom", "bottom-right")

SCENE = 84  # shape scenes: 84x84, a 3x3 grid of 28-pixel cells
CELL = 28
TEXT_SIZE = (168, 84)  # ocr and math
CHART_SIZE = (168, 112)
WHITE = (255, 255, 255)
INK = (20, 20, 20)

# Compositions are split by a fixed hash bucket of their key, the same for every seed: one bucket of HELDOUT_BUCKETS
# is eval's, one val's, the rest train.
HELDOUT_BUCKETS = 8
SIDES = ("train", "val", "eval")

# Zipf's law over the colour-shape concepts of the pretrain split: the concept of rank k is drawn with probability
# proportional to 1 / k**ZIPF_EXPONENT, so a few concepts dominate and many are rare (what `balance` corrects).
ZIPF_EXPONENT = 1.3
ZIPF_RANKING = list(COMBOS)
random.Random("ovkit-synth-zipf-ranking").shuffle(ZIPF_RANKING)  # fixed: the head concepts are the same every seed

CATEGORIES = (
    "caption", "counting", "ocr", "grounding", "detection", "spatial", "math", "chart", "diagram", "science", "svg",
)  # fmt: skip
ANSWER_TYPES = {
    "caption": "ocr",  # similarity to the gold caption (1 - normalised edit distance)
    "counting": "number",
    "ocr": "ocr",
    "grounding": "bbox",
    "detection": "detection",
    "spatial": "multiple_choice",
    "math": "number",
    "chart": "number",
    "diagram": "multiple_choice",
    "science": "multiple_choice",
    "svg": "svg",
}


@dataclass
class Task:
    """One rendered example: the image and everything the splits make of it."""

    category: str
    key: str  # the composition, e.g. "counting:red star x3"; its side (train, val, eval) is `side_of(key)`
    image: Image.Image
    question: str
    answer: str
    rationale: str  # a short templated reasoning for the think format
    caption_en: str
    caption_zh: str
    concepts: list[str]
    reward_kwargs: dict[str, Any] | None = None


@dataclass
class Obj:
    colour: str
    shape: str
    cell: int
    box: tuple[int, int, int, int]  # [x1, y1, x2, y2] in pixels: the shape's square frame

    @property
    def name(self) -> str:
        return f"{self.colour} {self.shape}"


def side_of(key: str) -> str:
    """Which split family may use a composition: "eval", "val" (one hash bucket each) or "train"."""
    bucket = hashlib.sha1(key.encode()).digest()[0] % HELDOUT_BUCKETS
    return "eval" if bucket == 0 else "val" if bucket == 1 else "train"


def is_heldout(key: str) -> bool:
    """Whether training splits must not use the composition (it belongs to eval or val)."""
    return side_of(key) != "train"


class Picker:
    """Draws colour-shape concepts: uniformly, or long-tailed (Zipf) for the pretrain split."""

    def __init__(self, rng: random.Random, zipf: bool):
        self.rng = rng
        self.combos = ZIPF_RANKING if zipf else list(COMBOS)
        self.weights = [1.0 / (k + 1) ** ZIPF_EXPONENT for k in range(len(COMBOS))] if zipf else None

    def combos_distinct(self, n: int) -> list[tuple[str, str]]:
        picked: list[str] = []
        while len(picked) < n:
            c = self.rng.choices(self.combos, self.weights)[0]
            if c not in picked:
                picked.append(c)
        return [tuple(c.split(" ")) for c in picked]  # type: ignore[misc]


# ---------------------------------------------------------------------------------------------------------- drawing


def place(rng: random.Random, colour: str, shape: str, cell: int) -> Obj:
    """A shape of 18-24 pixels at a random offset inside its grid cell (shapes never overlap)."""
    size = rng.randint(18, 24)
    x = (cell % 3) * CELL + rng.randint(0, CELL - size)
    y = (cell // 3) * CELL + rng.randint(0, CELL - size)
    return Obj(colour, shape, cell, (x, y, x + size, y + size))


def draw_shape(draw: ImageDraw.ImageDraw, shape: str, box: tuple[int, int, int, int], fill: tuple[int, ...]) -> None:
    x1, y1, x2, y2 = box
    x2, y2 = x2 - 1, y2 - 1  # PIL boxes include their last pixel
    if shape == "circle":
        draw.ellipse((x1, y1, x2, y2), fill=fill)
    elif shape == "square":
        draw.rectangle((x1, y1, x2, y2), fill=fill)
    elif shape == "triangle":
        draw.polygon([((x1 + x2) / 2, y1), (x2, y2), (x1, y2)], fill=fill)
    elif shape == "star":
        cx, cy, r = (x1 + x2) / 2, (y1 + y2) / 2 + (y2 - y1) * 0.05, (x2 - x1) / 2
        points = []
        for k in range(10):
            radius = r if k % 2 == 0 else r * 0.45
            angle = -pi / 2 + k * pi / 5
            points.append((cx + radius * cos(angle), cy + radius * sin(angle)))
        draw.polygon(points, fill=fill)
    else:
        raise ValueError(f"unknown shape {shape!r}")


def scene_image(objs: list[Obj], size: tuple[int, int] = (SCENE, SCENE)) -> Image.Image:
    img = Image.new("RGB", size, WHITE)
    draw = ImageDraw.Draw(img)
    for o in objs:
        draw_shape(draw, o.shape, o.box, COLOURS[o.colour])
    return img


_FONTS: dict[int, Any] = {}


def font(size: int) -> Any:
    """Pillow's embedded scalable font (no font files needed); None where Pillow was built without FreeType."""
    if size not in _FONTS:
        try:
            _FONTS[size] = ImageFont.load_default(size=size)
        except (TypeError, ImportError, OSError, AttributeError):
            _FONTS[size] = None
    return _FONTS[size]


def draw_text(img: Image.Image, centre: tuple[float, float], text: str, size: int, fill=INK) -> None:
    """Draw `text` centred on `centre`, `size` pixels tall (the bitmap default font scaled up as a fallback)."""
    f = font(size)
    if f is not None:
        ImageDraw.Draw(img).text(centre, text, font=f, fill=fill, anchor="mm")
        return
    small = ImageFont.load_default()
    x1, y1, x2, y2 = small.getbbox(text)
    mask = Image.new("L", (x2 + 1, y2 + 1), 0)
    ImageDraw.Draw(mask).text((0, 0), text, font=small, fill=255)
    scale = max(1, round(size / 11))
    mask = mask.resize((mask.width * scale, mask.height * scale), Image.NEAREST)
    corner = (int(centre[0] - mask.width / 2), int(centre[1] - mask.height / 2))
    img.paste(Image.new("RGB", mask.size, fill), corner, mask)


def objects_en(objs: list[Obj]) -> str:
    """`a red circle and two blue squares`: groups of the same concept, in reading order of their first shape."""
    return _join_en([_count_en(n, name) for name, n in _groups(objs)])


def objects_zh(objs: list[Obj]) -> str:
    parts = [f"{NUMBER_ZH[n]}{COLOURS_ZH[name.split()[0]]}{SHAPES_ZH[name.split()[1]]}" for name, n in _groups(objs)]
    return parts[0] if len(parts) == 1 else "、".join(parts[:-1]) + "和" + parts[-1]


def _groups(objs: list[Obj]) -> list[tuple[str, int]]:
    counts: dict[str, int] = {}
    for o in sorted(objs, key=lambda o: o.cell):
        counts[o.name] = counts.get(o.name, 0) + 1
    return list(counts.items())


def _count_en(n: int, name: str) -> str:
    if n == 1:
        return ("an " if name[0] in "aeiou" else "a ") + name
    return f"{NUMBER_EN[n]} {name}s"


def _a(name: str) -> str:
    return _count_en(1, name)


def _join_en(parts: list[str]) -> str:
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]


def concepts_of(objs: list[Obj]) -> list[str]:
    return [name for name, _ in _groups(objs)]


def options_text(options: list[str]) -> str:
    return "\n".join(f"{'ABCD'[i]}. {o}" for i, o in enumerate(options))


def draw_until(rng: random.Random, side: str, sample: Callable[[], tuple[str, Any]]) -> tuple[str, Any]:
    """Sample compositions until one lands on the wanted side (train, val or eval)."""
    for _ in range(10_000):
        key, params = sample()
        if side_of(key) == side:
            return key, params
    raise RuntimeError("no composition on the wanted side of the held-out split; the key space is too small")


# --------------------------------------------------------------------------------------------------- shape scenes


def caption(rng: random.Random, pick: Picker, side: str) -> Task:
    """1-3 concepts, 1-3 of each (at most 6 shapes); the caption names them in reading order."""

    def sample():
        combos = pick.combos_distinct(rng.randint(1, 3))
        counts = [rng.randint(1, 3) for _ in combos]
        while sum(counts) > 6:
            counts[counts.index(max(counts))] -= 1
        return "caption:" + ", ".join(f"{c} {s} x{n}" for (c, s), n in sorted(zip(combos, counts))), (combos, counts)

    key, (combos, counts) = draw_until(rng, side, sample)
    cells = rng.sample(range(9), sum(counts))
    objs = [place(rng, c, s, cells.pop()) for (c, s), n in zip(combos, counts) for _ in range(n)]
    en, zh = objects_en(objs), objects_zh(objs)
    where = _join_en([f"{_a(o.name)} at the {CELL_NAMES[o.cell]}" for o in sorted(objs, key=lambda o: o.cell)])
    return Task(
        "caption", key, scene_image(objs), "Describe the image in a short phrase.", en,
        f"Row by row, I see {where}. Grouping the same shapes gives {en}.", en, zh, concepts_of(objs),
    )  # fmt: skip


def counting(rng: random.Random, pick: Picker, side: str) -> Task:
    """1-5 shapes of one colour and kind, and 0-2 distractors of other kinds; asks how many of the kind."""

    def sample():
        (colour, shape), n = pick.combos_distinct(1)[0], rng.randint(1, 5)
        return f"counting:{colour} {shape} x{n}", (colour, shape, n)

    key, (colour, shape, n) = draw_until(rng, side, sample)
    cells = rng.sample(range(9), n + rng.randint(0, 2))
    objs = [place(rng, colour, shape, c) for c in cells[:n]]
    for c in cells[n:]:
        objs.append(place(rng, rng.choice(list(COLOURS)), rng.choice([s for s in SHAPES if s != shape]), c))
    others = len(cells) - n
    why = f"I count the {shape}s one by one: {', '.join(str(k) for k in range(1, n + 1))}."
    if others:
        rest = f"shape is not a {shape}" if others == 1 else f"shapes are not {shape}s"
        why += f" The other {rest}."
    en = objects_en(objs)
    return Task(
        "counting", key, scene_image(objs), f"How many {shape}s are there in the image?", str(n), why, en,
        objects_zh(objs), concepts_of(objs),
    )  # fmt: skip


def grounding(rng: random.Random, pick: Picker, side: str) -> Task:
    """2-3 different shapes; asks for the pixel box of one of them."""

    def sample():
        (colour, shape), cell = pick.combos_distinct(1)[0], rng.randrange(9)
        return f"grounding:{colour} {shape} @{CELL_NAMES[cell]}", (colour, shape, cell)

    key, (colour, shape, cell) = draw_until(rng, side, sample)
    target = place(rng, colour, shape, cell)
    others = [c for c in pick.combos_distinct(4) if c != (colour, shape)][: rng.randint(1, 2)]
    cells = rng.sample([c for c in range(9) if c != cell], len(others))
    objs = [target] + [place(rng, c, s, k) for (c, s), k in zip(others, cells)]
    answer = json.dumps(list(target.box))
    w, h = SCENE, SCENE
    return Task(
        "grounding", key, scene_image(objs),
        f"Where is the {target.name}? Answer with its bounding box [x1, y1, x2, y2] in pixels.", answer,
        f"The {target.name} is at the {CELL_NAMES[cell]} of the image; its box is {answer}.",
        objects_en(objs), objects_zh(objs), concepts_of(objs), {"coords": "pixel", "image_size": [w, h]},
    )  # fmt: skip


def detection(rng: random.Random, pick: Picker, side: str) -> Task:
    """2-3 different shapes; asks for every shape's label and pixel box (in reading order)."""

    def sample():
        combos = pick.combos_distinct(rng.randint(2, 3))
        cells = rng.sample(range(9), len(combos))
        parts = sorted(f"{c} {s} @{CELL_NAMES[k]}" for (c, s), k in zip(combos, cells))
        return "detection:" + ", ".join(parts), (combos, cells)

    key, (combos, cells) = draw_until(rng, side, sample)
    objs = sorted((place(rng, c, s, k) for (c, s), k in zip(combos, cells)), key=lambda o: o.cell)
    answer = json.dumps([{"label": o.name, "box": list(o.box)} for o in objs])
    where = _join_en([f"{_a(o.name)} at the {CELL_NAMES[o.cell]}" for o in objs])
    return Task(
        "detection", key, scene_image(objs),
        'Detect every shape. Answer with a JSON list of {"label": ..., "box": [x1, y1, x2, y2]} in pixels.', answer,
        f"There are {len(objs)} shapes: {where}.", objects_en(objs), objects_zh(objs), concepts_of(objs),
        {"coords": "pixel", "image_size": [SCENE, SCENE]},
    )  # fmt: skip


RELATIONS = {"left": (0, -1), "right": (0, 1), "above": (-1, 0), "below": (1, 0)}  # (row, col) step from B to A


def spatial(rng: random.Random, pick: Picker, side: str) -> Task:
    """Two shapes in one row or one column; multiple choice: where is A relative to B. The four relations are always
    listed in the same order (A. left, B. right, C. above, D. below): a shuffled order made the tiny model look the
    relation up among the options as well, and it stayed at chance."""

    def sample():
        (a, b), relation = pick.combos_distinct(2), rng.choice(list(RELATIONS))
        return f"spatial:{' '.join(a)} {relation} {' '.join(b)}", (a, b, relation)

    key, (a, b, relation) = draw_until(rng, side, sample)
    dr, dc = RELATIONS[relation]
    b_cells = [c for c in range(9) if 0 <= c // 3 + dr * 1 <= 2 and 0 <= c % 3 + dc <= 2]
    b_cell = rng.choice(b_cells)
    steps = [k for k in (1, 2) if 0 <= b_cell // 3 + dr * k <= 2 and 0 <= b_cell % 3 + dc * k <= 2]
    k = rng.choice(steps)
    a_cell = (b_cell // 3 + dr * k) * 3 + b_cell % 3 + dc * k
    oa, ob = place(rng, *a, a_cell), place(rng, *b, b_cell)
    options = list(RELATIONS)
    letter = "ABCD"[options.index(relation)]
    phrase = {"left": "to the left of", "right": "to the right of", "above": "above", "below": "below"}[relation]
    return Task(
        "spatial", key, scene_image([oa, ob]),
        f"Where is the {oa.name} relative to the {ob.name}?\n{options_text(options)}", letter,
        f"The {oa.name} is {phrase} the {ob.name}, which is option {letter}.",
        objects_en([oa, ob]), objects_zh([oa, ob]), concepts_of([oa, ob]),
    )  # fmt: skip


# Cell pairs two cells apart (same row, column or diagonal), so an arrow between them is long enough to see.
ARROW_PAIRS = [(a, b) for a in range(9) for b in range(9) if max(abs(a // 3 - b // 3), abs(a % 3 - b % 3)) == 2]


def diagram(rng: random.Random, pick: Picker, side: str) -> Task:
    """An arrow from one shape to another; multiple choice: which shape does it point to. The options name the two
    shapes in reading order (top-left first), then one shape that is not in the picture, so the answer is read off
    the arrow's head rather than looked up among shuffled names."""

    def sample():
        src, dst = pick.combos_distinct(2)
        return f"diagram:{' '.join(src)} -> {' '.join(dst)}", (src, dst)

    key, (src, dst) = draw_until(rng, side, sample)
    cs, cd = rng.choice(ARROW_PAIRS)
    os_, od = place(rng, *src, cs), place(rng, *dst, cd)
    img = scene_image([os_, od])
    _arrow(ImageDraw.Draw(img), _centre(os_.box), _centre(od.box), shorten=13)
    absent = next(" ".join(c) for c in pick.combos_distinct(3) if c not in (src, dst))
    options = [o.name for o in sorted((os_, od), key=lambda o: o.cell)] + [absent]
    letter = "ABCD"[options.index(od.name)]
    en, zh = f"an arrow from {_a(os_.name)} to {_a(od.name)}", f"一个箭头从{_zh(os_.name)}指向{_zh(od.name)}"
    return Task(
        "diagram", key, img, f"Which shape does the arrow point to?\n{options_text(options)}", letter,
        f"The arrow starts at the {os_.name} and its head is at the {od.name}, which is option {letter}.",
        en, zh, ["arrow", *concepts_of([os_, od])],
    )  # fmt: skip


def _centre(box: tuple[int, int, int, int]) -> tuple[float, float]:
    return (box[0] + box[2]) / 2, (box[1] + box[3]) / 2


def _arrow(draw: ImageDraw.ImageDraw, p: tuple[float, float], q: tuple[float, float], shorten: float) -> None:
    dx, dy = q[0] - p[0], q[1] - p[1]
    length = hypot(dx, dy)
    ux, uy = dx / length, dy / length
    start = (p[0] + ux * shorten, p[1] + uy * shorten)
    tip = (q[0] - ux * shorten, q[1] - uy * shorten)
    draw.line([start, tip], fill=INK, width=3)
    back = (tip[0] - ux * 10, tip[1] - uy * 10)
    draw.polygon([tip, (back[0] - uy * 6, back[1] + ux * 6), (back[0] + uy * 6, back[1] - ux * 6)], fill=INK)


def _zh(name: str) -> str:
    colour, shape = name.split()
    return f"{COLOURS_ZH[colour]}{SHAPES_ZH[shape]}"


def science(rng: random.Random, pick: Picker, side: str) -> Task:
    """A seesaw tipped towards the heavier of two shapes; multiple choice: which one is heavier. The options list the
    shapes as they sit, left then right, so the answer is read off the tilt (a shuffled order would add a name-to-
    letter lookup that the tiny model never learnt: the first design stayed at chance)."""

    def sample():
        (left, right), heavier = pick.combos_distinct(2), rng.choice(("left", "right"))
        return f"science:{' '.join(left)} | {' '.join(right)} heavier {heavier}", (left, right, heavier)

    key, (left, right, heavier) = draw_until(rng, side, sample)
    drop, dx, size = rng.randint(9, 13), rng.randint(-4, 4), rng.randint(18, 22)
    tilt = drop if heavier == "left" else -drop  # the left end goes down by `tilt` pixels
    img = Image.new("RGB", (SCENE, SCENE), WHITE)
    draw = ImageDraw.Draw(img)
    draw.polygon([(42 + dx, 58), (52 + dx, 78), (32 + dx, 78)], fill=(110, 110, 110))  # the fulcrum
    yl, yr = 58 + tilt, 58 - tilt
    x1, x2 = 6 + dx, 78 + dx
    draw.line([(x1, yl), (x2, yr)], fill=INK, width=3)
    objs = [
        Obj(*left, 3, (x1, yl - 2 - size, x1 + size, yl - 2)),
        Obj(*right, 5, (x2 - size, yr - 2 - size, x2, yr - 2)),
    ]
    for o in objs:
        draw_shape(draw, o.shape, o.box, COLOURS[o.colour])
    names = [o.name for o in objs]
    heavy = names[0] if heavier == "left" else names[1]
    letter = "A" if heavier == "left" else "B"
    side_zh = "左" if heavier == "left" else "右"
    return Task(
        "science", key, img,
        f"The seesaw tips towards the heavier side. Which shape is heavier?\n{options_text(names)}",
        letter, f"The seesaw is lower on the {heavier}, under the {heavy}, so the {heavy} is heavier: option {letter}.",
        f"a seesaw with {_a(names[0])} on the left and {_a(names[1])} on the right, lower on the {heavier}",
        f"一个向{side_zh}倾斜的跷跷板，左边是{_zh(names[0])}，右边是{_zh(names[1])}",
        ["seesaw", *names],
    )  # fmt: skip


# ------------------------------------------------------------------------------------------- text-reading tasks


def ocr(rng: random.Random, pick: Picker, side: str) -> Task:
    """Two different words, one per line; held out: word pairs (every single word also appears in training)."""

    def sample():
        w1, w2 = rng.sample(WORDS, 2)
        return f"ocr:{w1} {w2}", (w1, w2)

    key, (w1, w2) = draw_until(rng, side, sample)
    img = Image.new("RGB", TEXT_SIZE, WHITE)
    w, h = TEXT_SIZE
    draw_text(img, (w / 2 + rng.randint(-20, 20), h * 0.3), w1, 32)
    draw_text(img, (w / 2 + rng.randint(-20, 20), h * 0.72), w2, 32)
    text = f"{w1} {w2}"
    return Task(
        "ocr", key, img, "What words are written in the image?", text,
        f'The first line reads "{w1}" and the second line reads "{w2}".',
        f'the words "{text}"', f'文字"{text}"', ["text"],
    )  # fmt: skip


def math(rng: random.Random, pick: Picker, side: str) -> Task:
    """`a + b = ?` or `a - b = ?` with digits 0-9 rendered in the image; the answer is an integer."""

    def sample():
        a, b, op = rng.randint(0, 9), rng.randint(0, 9), rng.choice("+-")
        if op == "-" and b > a:
            a, b = b, a
        return f"math:{a} {op} {b}", (a, b, op)

    key, (a, b, op) = draw_until(rng, side, sample)
    value = a + b if op == "+" else a - b
    img = Image.new("RGB", TEXT_SIZE, WHITE)
    w, h = TEXT_SIZE
    expr = f"{a} {op} {b} = ?"
    draw_text(img, (w / 2 + rng.randint(-8, 8), h / 2 + rng.randint(-8, 8)), expr, 36)
    return Task(
        "math", key, img, "What is the value of the expression in the image?", str(value),
        f"The image shows {a} {op} {b}. {a} {op} {b} = {value}.",
        f"the expression {expr}", f"算式 {expr}", ["equation"],
    )  # fmt: skip


def chart(rng: random.Random, pick: Picker, side: str) -> Task:
    """A bar chart of 3-4 bars labelled A-D with their values (1-9) printed on top; asks one bar's value."""

    def sample():
        values = [rng.randint(1, 9) for _ in range(rng.randint(3, 4))]
        return "chart:" + ",".join(map(str, values)), values

    key, values = draw_until(rng, side, sample)
    labels = "ABCD"[: len(values)]
    colour = rng.choice([c for c in COLOURS if c != "yellow"])  # printed digits must stay readable
    img = Image.new("RGB", CHART_SIZE, WHITE)
    draw = ImageDraw.Draw(img)
    w, h = CHART_SIZE
    base, unit, slot = 88, 6, w / len(values)
    draw.line([(4, base), (w - 4, base)], fill=INK, width=1)
    for i, v in enumerate(values):
        cx = slot * (i + 0.5)
        draw.rectangle((cx - 12, base - unit * v, cx + 11, base - 1), fill=COLOURS[colour])
        draw_text(img, (cx, base - unit * v - 13), str(v), 24)  # digits span two patches: 18 px ones were not read
        draw_text(img, (cx, base + 12), labels[i], 18)
    i = rng.randrange(len(values))
    pairs = [f"{lab} is {v}" for lab, v in zip(labels, values)]
    return Task(
        "chart", key, img, f"What is the value of bar {labels[i]} in the chart?", str(values[i]),
        f"Bar {labels[i]} has the value {values[i]} written above it.",
        "a bar chart: " + ", ".join(pairs),
        "柱状图：" + "，".join(f"{lab} 为 {v}" for lab, v in zip(labels, values)),
        ["bar chart"],
    )  # fmt: skip


# --------------------------------------------------------------------------------------------------------- code

SVG_SHAPES = ("circle", "square", "triangle")
SVG_HALF = (8, 10, 12)  # half the size of a shape, in pixels


def svg_code(shapes: list[tuple[str, str, int, int]]) -> str:
    """Canonical SVG source for shapes (colour, kind, cell, half-size), centred on their grid cells."""
    parts = []
    for colour, kind, cell, r in shapes:
        cx, cy = (cell % 3) * CELL + CELL // 2, (cell // 3) * CELL + CELL // 2
        if kind == "circle":
            parts.append(f'<circle cx="{cx}" cy="{cy}" r="{r}" fill="{colour}"/>')
        elif kind == "square":
            parts.append(f'<rect x="{cx - r}" y="{cy - r}" width="{2 * r}" height="{2 * r}" fill="{colour}"/>')
        else:
            parts.append(f'<polygon points="{cx},{cy - r} {cx + r},{cy + r} {cx - r},{cy + r}" fill="{colour}"/>')
    return f'<svg xmlns="http://www.w3.org/2000/svg" width="{SCENE}" height="{SCENE}">{"".join(parts)}</svg>'


def render_svg(code: str) -> Image.Image:
    # optional: the package (or this name in it) may be missing; imported only where it is used
    import cairosvg

    png = cairosvg.svg2png(bytestring=code.encode(), output_width=SCENE, output_height=SCENE)
    rgba = Image.open(io.BytesIO(png)).convert("RGBA")
    img = Image.new("RGB", rgba.size, WHITE)
    img.paste(rgba, mask=rgba.getchannel("A"))
    return img


def svg(rng: random.Random, pick: Picker, side: str) -> Task:
    """1-2 circles, squares or triangles centred on grid cells; the answer is the SVG source that draws them."""

    def sample():
        n = rng.randint(1, 2)
        cells = sorted(rng.sample(range(9), n))
        shapes = []
        for cell in cells:
            colour, _ = pick.combos_distinct(1)[0]
            shapes.append((colour, rng.choice(SVG_SHAPES), cell, rng.choice(SVG_HALF)))
        return "svg:" + svg_code(shapes), shapes

    key, shapes = draw_until(rng, side, sample)
    code = svg_code(shapes)
    objs = [Obj(c, k, cell, (0, 0, 0, 0)) for c, k, cell, _ in shapes]
    where = _join_en([f"{_a(o.name)} at the {CELL_NAMES[o.cell]}" for o in objs])
    return Task(
        "svg", key, render_svg(code), "Write SVG code that draws this image.", code, f"The image shows {where}.",
        objects_en(objs), objects_zh(objs), concepts_of(objs),
    )  # fmt: skip


GENERATORS: dict[str, Callable[[random.Random, Picker, str], Task]] = {
    "caption": caption,
    "counting": counting,
    "ocr": ocr,
    "grounding": grounding,
    "detection": detection,
    "spatial": spatial,
    "math": math,
    "chart": chart,
    "diagram": diagram,
    "science": science,
    "svg": svg,
}
assert set(GENERATORS) == set(CATEGORIES) == set(ANSWER_TYPES)
