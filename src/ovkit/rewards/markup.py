"""HTML and SVG code: token and tag-name Jaccard overlap, plus for SVG the SSIM of the two renders.

Rendering model-written SVG is the dangerous part (see docs/rewards.md, "Security"): it happens only from bytes
(`bytestring=`, never a URL or file), with cairosvg's safe mode (no XML entities, only `data:` URLs), gzip input
rejected, the source capped at MAX_SVG_CHARS, and a fixed 336x336 output surface whatever size the SVG declares. The
svg scorer runs in a killable worker process (deep `<use>` nesting can hang cairosvg) with an address-space limit.
"""

from __future__ import annotations

import functools
import io
import re

from ovkit.rewards.base import Reward, clip01
from ovkit.rewards.extract import extract_code

MAX_SVG_CHARS = 50_000  # released: rendering skipped for code >= 50,000 characters
RENDER_SIZE = 336  # released: 336 x 336 on white
# Blank-image guard: SSIM of an empty canvas against a mostly white target is close to 1. A prediction whose render
# has less than BLANK_RATIO of the target's non-background pixels gets no image score.
INK_LEVEL = 24  # a pixel is "ink" if some channel differs from white by more than this (of 255)
BLANK_RATIO = 0.2
MIN_TARGET_INK = 0.002

_TOKENS = re.compile(r"\w+")
_TAGS = re.compile(r"<\s*([A-Za-z][\w:-]{0,63})")
_BETWEEN_TAGS = re.compile(r">\s+<")
_SPACES = re.compile(r"\s+")


def jaccard(a: set[str], b: set[str]) -> float:
    """|a & b| / |a | b|; two empty sets are identical (1.0)."""
    union = a | b
    return 1.0 if not union else len(a & b) / len(union)


def token_jaccard(pred: str, gold: str) -> float:
    return jaccard(set(_TOKENS.findall(pred.lower())), set(_TOKENS.findall(gold.lower())))


def tag_jaccard(pred: str, gold: str) -> float:
    return jaccard({t.lower() for t in _TAGS.findall(pred)}, {t.lower() for t in _TAGS.findall(gold)})


def _normalise(code: str) -> str:
    return _SPACES.sub(" ", _BETWEEN_TAGS.sub("><", code)).strip()


def html(completion: str, answer: str, *, strict: bool = False) -> Reward:
    """1 for the same code up to whitespace, else 0.6 * token Jaccard + 0.4 * tag Jaccard (released weights)."""
    pred = extract_code(completion, strict=strict)
    if pred is None:
        return Reward(0.0, {"exact": False, "token_jaccard": 0.0, "tag_jaccard": 0.0})
    if _normalise(pred) == _normalise(answer):
        return Reward(1.0, {"exact": True, "token_jaccard": 1.0, "tag_jaccard": 1.0})
    tokens, tags = token_jaccard(pred, answer), tag_jaccard(pred, answer)
    return Reward(clip01(0.6 * tokens + 0.4 * tags), {"exact": False, "token_jaccard": tokens, "tag_jaccard": tags})


def svg_source(text: str) -> str:
    """From the first `<svg` to the last `</svg>` (the text around the element is not SVG)."""
    start = text.find("<svg")
    if start < 0:
        return text
    end = text.rfind("</svg>")
    return text[start : end + len("</svg>")] if end > start else text[start:]


def render(svg: str | bytes):
    """RGB uint8 array (RENDER_SIZE x RENDER_SIZE x 3) of the SVG composited on white, or None if it can't render."""
    import numpy as np

    data = svg if isinstance(svg, bytes) else svg.encode("utf-8", "replace")
    if len(data) >= MAX_SVG_CHARS or data[:2] == b"\x1f\x8b":  # cairosvg would gunzip without a size limit
        return None
    import cairosvg
    from PIL import Image

    try:
        png = cairosvg.svg2png(bytestring=data, output_width=RENDER_SIZE, output_height=RENDER_SIZE, unsafe=False)
        with Image.open(io.BytesIO(png)) as img:
            rgba = img.convert("RGBA")
    except MemoryError:
        raise
    except Exception:  # malformed XML, forbidden entities, unsupported content: no image score
        return None
    if rgba.size != (RENDER_SIZE, RENDER_SIZE):
        rgba = rgba.resize((RENDER_SIZE, RENDER_SIZE))
    white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
    return np.asarray(Image.alpha_composite(white, rgba).convert("RGB"))


def _ink(image) -> float:
    return float((255 - image.min(axis=2) > INK_LEVEL).mean())


@functools.lru_cache(maxsize=32)
def _render_gold(svg: str):
    """(float32 image, ink) of a gold SVG: a GRPO group scores 16 completions against one gold, render it once."""
    image = render(svg)
    return (None, 0.0) if image is None else (image.astype("float32"), _ink(image))


def image_similarity(pred_svg: str, gold_svg: str) -> tuple[float, dict]:
    from skimage.metrics import structural_similarity

    gold, gold_ink = _render_gold(gold_svg)
    pred = render(pred_svg)
    if gold is None or pred is None:
        return 0.0, {"rendered": pred is not None, "blank": False}
    if gold_ink >= MIN_TARGET_INK and _ink(pred) < BLANK_RATIO * gold_ink:
        return 0.0, {"rendered": True, "blank": True}
    # float32 input keeps scikit-image in float32 (uint8 would be promoted to float64): half the time, same value
    ssim = structural_similarity(gold, pred.astype("float32"), channel_axis=2, data_range=255)
    return clip01(float(ssim)), {"rendered": True, "blank": False}


def svg(completion: str, answer: str, *, strict: bool = False) -> Reward:
    """1 for the same code up to whitespace, else 0.5 * SSIM(renders) + 0.25 * (token Jaccard + tag Jaccard)."""
    code = extract_code(completion, strict=strict)
    if code is None:
        return Reward(0.0, {"exact": False, "ssim": 0.0, "token_jaccard": 0.0, "tag_jaccard": 0.0, "rendered": False})
    pred = svg_source(code)
    if _normalise(pred) == _normalise(answer):
        return Reward(1.0, {"exact": True, "ssim": 1.0, "token_jaccard": 1.0, "tag_jaccard": 1.0, "rendered": True})
    ssim, flags = image_similarity(pred, answer)
    tokens, tags = token_jaccard(pred, answer), tag_jaccard(pred, answer)
    reward = clip01(0.5 * ssim + 0.25 * (tokens + tags))
    return Reward(reward, {"exact": False, "ssim": ssim, "token_jaccard": tokens, "tag_jaccard": tags, **flags})
