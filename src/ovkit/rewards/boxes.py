"""Grounding and detection: IoU of one box, and ROLL's detection reward (One-RL-to-See-Them-All / V-Triune).

Boxes are [x1, y1, x2, y2]. The coordinate convention is explicit per row (`reward_kwargs`): `coords` names the
convention of the gold answer and, unless `pred_coords` says otherwise, of the prediction: "pixel", "norm1000"
(0-1000, Qwen2-VL / Qwen3-VL) or "norm1" (0-1, RefCOCO in lmms-eval). Converting between pixels and a normalised
convention needs `image_size: [w, h]`.
"""

from __future__ import annotations

import json
import re
from typing import Any

from ovkit.errors import OvkitError
from ovkit.rewards.base import Reward, clip01, gold_json
from ovkit.rewards.extract import extract_answer

Box = tuple[float, float, float, float]
CONVENTIONS = ("pixel", "norm1000", "norm1")
_NUM = r"\s*(-?\d+(?:\.\d+)?)\s*"
_BOX_LIST = re.compile(rf"[\[(]{_NUM},{_NUM},{_NUM},{_NUM}[\])]")
_BARE_BOX = re.compile(rf"^{_NUM}[,\s]{_NUM}[,\s]{_NUM}[,\s]{_NUM}$")
MAX_PRED_BOXES = 100  # COCO's maxDets; also bounds the O(pred x gold) matching on untrusted output


def iou(a: Box, b: Box) -> float:
    """Intersection over union; 0 for a degenerate (zero-area or inverted) box."""
    area_a = (a[2] - a[0]) * (a[3] - a[1])
    area_b = (b[2] - b[0]) * (b[3] - b[1])
    if a[2] <= a[0] or a[3] <= a[1] or b[2] <= b[0] or b[3] <= b[1]:
        return 0.0
    w = min(a[2], b[2]) - max(a[0], b[0])
    h = min(a[3], b[3]) - max(a[1], b[1])
    if w <= 0 or h <= 0:
        return 0.0
    inter = w * h
    return clip01(inter / (area_a + area_b - inter))


def _scale(convention: str | None, image_size: Any) -> tuple[float, float]:
    """Factors that take a box in `convention` to the 0-1 convention."""
    if convention == "norm1":
        return 1.0, 1.0
    if convention == "norm1000":
        return 1000.0, 1000.0
    if convention == "pixel":
        if not (isinstance(image_size, (list, tuple)) and len(image_size) == 2 and min(image_size) > 0):
            raise OvkitError(
                "column 'reward_kwargs': converting pixel boxes needs \"image_size\": [width, height], "
                f"got {image_size!r}"
            )
        return float(image_size[0]), float(image_size[1])
    raise OvkitError(f"column 'reward_kwargs': \"coords\" must be one of {', '.join(CONVENTIONS)}, got {convention!r}")


def _converter(coords: str | None, pred_coords: str | None, image_size: Any):
    """A function mapping a predicted box into the gold box's convention (identity when they agree)."""
    for name in (coords, pred_coords):
        if name is not None and name not in CONVENTIONS:
            _scale(name, image_size)  # raises the explanatory error
    if pred_coords is None or pred_coords == coords:
        return lambda box: box
    if coords is None:
        raise OvkitError('column \'reward_kwargs\': "pred_coords" needs "coords" (the gold convention) as well')
    pw, ph = _scale(pred_coords, image_size)
    gw, gh = _scale(coords, image_size)
    return lambda b: (b[0] / pw * gw, b[1] / ph * gh, b[2] / pw * gw, b[3] / ph * gh)


def _box(value: Any) -> Box | None:
    if isinstance(value, dict):
        value = value.get("box", value.get("bbox_2d", value.get("bbox")))
    if (
        isinstance(value, (list, tuple))
        and len(value) == 4
        and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)
    ):
        return (float(value[0]), float(value[1]), float(value[2]), float(value[3]))
    return None


def parse_pred_box(text: str) -> Box | None:
    """The first `[x1, y1, x2, y2]` (or `(...)`) in the answer, else an answer that is just four numbers."""
    m = _BOX_LIST.search(text)
    if m is None:
        m = _BARE_BOX.match(text.strip())
    return None if m is None else tuple(float(g) for g in m.groups())  # type: ignore[return-value]


def bbox(
    completion: str,
    answer: str,
    *,
    coords: str | None = None,
    pred_coords: str | None = None,
    image_size: list[float] | None = None,
    strict: bool = False,
) -> Reward:
    """IoU of the first box in the answer with the gold box (JSON `[x1, y1, x2, y2]`)."""
    gold = _box(gold_json(answer, "box [x1, y1, x2, y2]"))
    if gold is None:
        raise OvkitError(f"column 'answer': expected a box [x1, y1, x2, y2], got {answer[:80]!r}")
    to_gold = _converter(coords, pred_coords, image_size)
    text = extract_answer(completion, strict=strict)
    pred = parse_pred_box(text) if text else None
    if pred is None:
        return Reward(0.0, {"iou": 0.0, "parsed": False})
    value = iou(to_gold(pred), gold)
    return Reward(value, {"iou": value, "parsed": True})


# ---- detection -------------------------------------------------------------------------------------------------

IOU_THRESHOLDS = (0.5, 0.55, 0.6, 0.65, 0.7, 0.75, 0.8, 0.85, 0.9, 0.95, 0.99)
COCO_THRESHOLDS = (0.5, 0.55, 0.6, 0.65, 0.7, 0.75, 0.8, 0.85, 0.9, 0.95)
# ROLL's `det_reward_ratio` names. Defaults from ROLL's documented detection sample (its code defaults every weight
# to 0, which makes the reward 0): label-first IoU with completeness weight 0.3.
DEFAULT_WEIGHTS = {
    "iou_max_label_first": 1.0,
    "iou_max_iou_first": 0.0,
    "iou_completeness": 0.3,
    "map": 0.0,
    "map50": 0.0,
    "map75": 0.0,
}
SIZE_PENALTY = 0.6  # ROLL: reward * 0.6 ** |n_pred - n_gold|

Det = tuple[str, Box]


def _dets(value: Any) -> list[Det] | None:
    """Valid, de-duplicated (label, box) pairs; boxes need x1 <= x2 and y1 <= y2 (ROLL's filter)."""
    if not isinstance(value, list):
        return None
    out: list[Det] = []
    seen: set[Box] = set()
    for item in value:
        if not isinstance(item, dict) or not isinstance(item.get("label"), str):
            continue
        box = _box(item)
        if box is None or box[0] > box[2] or box[1] > box[3] or box in seen:
            continue
        seen.add(box)
        out.append((item["label"].strip().lower(), box))
    return out


def parse_pred_dets(text: str) -> list[Det] | None:
    """A JSON list of {"label", "box" | "bbox_2d"} in the answer; single quotes and a cut-off tail are tolerated."""
    start = text.find("[")
    if start < 0:
        return None
    body = text[start:].replace("'", '"')
    end = body.rfind("]")
    candidates = [body[: end + 1]] if end >= 0 else []
    cut = body.rfind("},")  # ROLL: a list cut by the token limit keeps its complete items
    if cut >= 0:
        candidates.append(body[: cut + 1] + "]")
    for candidate in candidates:
        try:
            value = json.loads(candidate)
        except ValueError:
            continue
        dets = _dets(value)
        if dets:
            return dets[:MAX_PRED_BOXES]
    return None


def _match_iou_first(pred: list[Det], gold: list[Det], ious: list[list[float]], threshold: float) -> list[float]:
    """ROLL greedy_match_by_iou_max_iou_first: repeatedly pair the highest-IoU unmatched (pred, gold); a pair with
    the wrong label is still matched but scores 0. Returns the IoU credited to each match."""
    pairs = sorted(
        ((ious[i][j], i, j) for i in range(len(pred)) for j in range(len(gold))), key=lambda t: -t[0]
    )  # stable: ties keep prediction order, as ROLL's strict '>' scan does
    used_p: set[int] = set()
    used_g: set[int] = set()
    credits = []
    for value, i, j in pairs:
        if value < threshold:
            break
        if i in used_p or j in used_g:
            continue
        used_p.add(i)
        used_g.add(j)
        credits.append(value if pred[i][0] == gold[j][0] else 0.0)
    return credits


def _match_label_first(pred: list[Det], gold: list[Det], ious: list[list[float]], threshold: float) -> list[float]:
    """ROLL greedy_match_by_iou_max_label_first: each gold box in order takes the unmatched same-label prediction
    with the highest IoU, if that IoU reaches the threshold."""
    used: set[int] = set()
    credits = []
    for j, (label, _) in enumerate(gold):
        best, best_i = -1.0, -1
        for i, (pred_label, _) in enumerate(pred):
            if i not in used and pred_label == label and ious[i][j] > best:
                best, best_i = ious[i][j], i
        if best_i >= 0 and best >= threshold:
            used.add(best_i)
            credits.append(best)
    return credits


def _iou_score(credits: list[float], n_pred: int, n_gold: int, completeness_weight: float) -> float:
    """ROLL: (1 - w) * mean IoU over gold + w * completeness, completeness = 1 - (miss + false alarm) / 2."""
    mean_iou = sum(credits) / n_gold
    miss = (n_gold - len(credits)) / n_gold
    false_alarm = (n_pred - len(credits)) / n_pred if n_pred else 0.0
    completeness = 1.0 - (miss + false_alarm) / 2.0
    return (1.0 - completeness_weight) * mean_iou + completeness_weight * completeness


def _average_precision(pred: list[Det], gold: list[Det], ious: list[list[float]], threshold: float, label: str):
    """COCO AP (101-point interpolated) of one class at one IoU threshold; every prediction has score 1, so the
    ranking is the prediction order (COCOeval's stable sort). None when the class has no gold box."""
    gold_idx = [j for j, (lab, _) in enumerate(gold) if lab == label]
    if not gold_idx:
        return None
    matched: set[int] = set()
    tps = []
    for i, (lab, _) in enumerate(pred):
        if lab != label:
            continue
        best, best_j = min(threshold, 1 - 1e-10), -1
        for j in gold_idx:
            if j not in matched and ious[i][j] >= best:
                best, best_j = ious[i][j], j
        if best_j >= 0:
            matched.add(best_j)
        tps.append(best_j >= 0)
    if not tps:
        return 0.0
    precision, recall = [], []
    tp = 0
    for k, hit in enumerate(tps, 1):
        tp += hit
        precision.append(tp / k)
        recall.append(tp / len(gold_idx))
    for k in range(len(precision) - 2, -1, -1):  # precision envelope
        precision[k] = max(precision[k], precision[k + 1])
    total, k = 0.0, 0
    for r in range(101):
        while k < len(recall) and recall[k] < r / 100 - 1e-12:
            k += 1
        total += precision[k] if k < len(recall) else 0.0
    return total / 101


def _mean_ap(pred: list[Det], gold: list[Det], ious: list[list[float]], thresholds: tuple[float, ...]) -> float:
    labels = sorted({lab for lab, _ in gold})
    pred = [d for d in pred if d[0] in labels]  # ROLL drops predictions of classes absent from the gold
    if not pred:
        return 0.0
    values = [
        ap for t in thresholds for lab in labels if (ap := _average_precision(pred, gold, ious, t, lab)) is not None
    ]
    return sum(values) / len(values) if values else 0.0


def _select_threshold(iou_threshold: Any, step: int | None, total_steps: int | None) -> float | str:
    if iou_threshold == "dynamic":
        # ROLL: 0.85 for the first 10% of training steps, 0.95 up to 25%, then 0.99.
        if not step or not total_steps:
            progress = 0.0
        else:
            progress = step / total_steps
        return 0.85 if progress <= 0.1 else 0.95 if progress <= 0.25 else 0.99
    if iou_threshold == "average" or iou_threshold in IOU_THRESHOLDS:
        return iou_threshold
    raise OvkitError(
        f"column 'reward_kwargs': \"iou_threshold\" must be 'average', 'dynamic' or one of {list(IOU_THRESHOLDS)}, "
        f"got {iou_threshold!r}"
    )


def _weights(weights: dict | None) -> dict[str, float]:
    merged = dict(DEFAULT_WEIGHTS)
    for key, value in (weights or {}).items():
        if key not in DEFAULT_WEIGHTS or not isinstance(value, (int, float)) or not 0 <= value <= 1:
            raise OvkitError(
                f"column 'reward_kwargs': detection weight {key!r}={value!r}; keys are {', '.join(DEFAULT_WEIGHTS)} "
                "with values in [0, 1]"
            )
        merged[key] = float(value)
    if sum(v for k, v in merged.items() if k != "iou_completeness") <= 0:
        raise OvkitError("column 'reward_kwargs': detection weights other than iou_completeness are all 0")
    return merged


def detection(
    completion: str,
    answer: str,
    *,
    weights: dict | None = None,
    iou_threshold: float | str = "average",
    step: int | None = None,
    total_steps: int | None = None,
    coords: str | None = None,
    pred_coords: str | None = None,
    image_size: list[float] | None = None,
    strict: bool = False,
) -> Reward:
    """ROLL's detection reward: weighted IoU scores of both greedy matchers and mAP / mAP50 / mAP75, each times the
    size penalty 0.6 ** |n_pred - n_gold|, normalised by the sum of the weights used."""
    gold = _dets(gold_json(answer, 'list of {"label": ..., "box": [x1, y1, x2, y2]}'))
    if not gold:
        raise OvkitError(f"column 'answer': expected a non-empty list of {{label, box}}, got {answer[:80]!r}")
    w = _weights(weights)
    threshold = _select_threshold(iou_threshold, step, total_steps)
    to_gold = _converter(coords, pred_coords, image_size)
    text = extract_answer(completion, strict=strict)
    pred = parse_pred_dets(text) if text else None
    if not pred:
        return Reward(0.0, {"parsed": False, "n_pred": 0, "size_penalty": 0.0})
    pred = [(label, to_gold(box)) for label, box in pred]
    ious = [[iou(p, g) for _, g in gold] for _, p in pred]
    penalty = SIZE_PENALTY ** abs(len(pred) - len(gold))
    thresholds = IOU_THRESHOLDS if threshold == "average" else (threshold,)
    cw = w["iou_completeness"]
    scores = {
        name: sum(_iou_score(match(pred, gold, ious, t), len(pred), len(gold), cw) for t in thresholds)
        / len(thresholds)
        for name, match in (("iou_max_iou_first", _match_iou_first), ("iou_max_label_first", _match_label_first))
    }
    scores["map"] = _mean_ap(pred, gold, ious, COCO_THRESHOLDS)
    scores["map50"] = _mean_ap(pred, gold, ious, (0.5,))
    scores["map75"] = _mean_ap(pred, gold, ious, (0.75,))
    used = {k: v for k, v in w.items() if k != "iou_completeness"}
    reward = sum(scores[k] * penalty * v for k, v in used.items()) / sum(used.values())
    return Reward(clip01(reward), {"parsed": True, "n_pred": len(pred), "size_penalty": penalty, **scores})
