"""Trainable module groups: which parameters are the projector, the vision encoder and the language model.

A VLM is three parts, and the recipe's stages train different subsets of them (LLaVA-OneVision-1.5: alignment trains
the projector only, mid-training and instruction tuning train everything). The parts are found by module-name
patterns, one small table for the architectures ovkit knows. Names are those of `model.named_parameters()` in
transformers 5.x, e.g.

    Qwen2.5-VL / Qwen3-VL     model.visual.patch_embed/blocks.*   model.visual.merger.*    model.language_model.*,
                                                                                           lm_head
                              (Qwen3-VL adds model.visual.deepstack_merger_list.*, also a projector)
    LLaVA-OneVision-1.5       model.visual.* (RICE-ViT)           model.visual.merger.*    model.language_model.*,
                                                                                           lm_head
                              (the "adapter" of the paper is the 2x2 patch-merger MLP stored as visual.merger)
    LLaVA / LLaVA-OneVision   model.vision_tower.*                model.multi_modal_projector.* (+ image_newline)
    SmolVLM / Idefics3        model.vision_model.*                model.connector.*        model.text_model.*

A parameter belongs to the first group whose pattern matches (projector before vision: the Qwen merger lives inside
`visual`). A pattern that is not a group name is a regular expression searched in parameter names.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from ovkit.errors import OvkitError

GROUP_PATTERNS: dict[str, tuple[str, ...]] = {
    "projector": (
        r"(^|\.)visual\.merger\.",
        r"(^|\.)visual\.deepstack_merger_list\.",
        r"(^|\.)multi_modal_projector\.",
        r"(^|\.)image_newline$",
        r"(^|\.)connector\.",
    ),
    "vision": (r"(^|\.)visual\.", r"(^|\.)vision_tower\.", r"(^|\.)vision_model\."),
    "llm": (r"(^|\.)language_model\.", r"(^|\.)text_model\.", r"^lm_head\."),
}
GROUPS = tuple(GROUP_PATTERNS)  # "all" selects every parameter

# What each supervised stage trains by default (the LLaVA-OneVision-1.5 repository and paper).
STAGE_TRAINABLE: dict[str, tuple[str, ...]] = {
    "align": ("projector",),
    "midtrain": ("llm", "projector", "vision"),
    "sft": ("all",),
}


def group_of(name: str) -> str | None:
    """The group a parameter name belongs to, or None for parameters outside the three parts."""
    for group, patterns in GROUP_PATTERNS.items():
        if any(re.search(p, name) for p in patterns):
            return group
    return None


def param_groups(model) -> dict[str, list[str]]:
    """Parameter names per group (plus 'other' for unmatched ones), in model order."""
    out: dict[str, list[str]] = {g: [] for g in (*GROUPS, "other")}
    for name, _ in model.named_parameters():
        out[group_of(name) or "other"].append(name)
    return out


def trainable_names(model, preset_or_patterns: str | Iterable[str], *, freeze_vision: bool = False) -> list[str]:
    """Names of the parameters to train.

    `preset_or_patterns` is a stage name (`align`, `midtrain`, `sft`), or a list of group names (`projector`,
    `vision`, `llm`, `all`) and regular expressions over parameter names. `freeze_vision` then removes the vision
    group. Raises OvkitError when a group or pattern selects nothing, so a wrong architecture is not trained silently.
    """
    if isinstance(preset_or_patterns, str):
        items = STAGE_TRAINABLE.get(preset_or_patterns, (preset_or_patterns,))
    else:
        items = tuple(preset_or_patterns)
    if not items:
        raise OvkitError("--trainable: give at least one group (projector, vision, llm, all) or name pattern")
    names = [n for n, _ in model.named_parameters()]
    groups = {n: group_of(n) for n in names}
    chosen: set[str] = set()
    for item in items:
        if item == "all":
            hit = set(names)
        elif item in GROUP_PATTERNS:
            hit = {n for n in names if groups[n] == item}
        else:
            try:
                rx = re.compile(item)
            except re.error as e:
                raise OvkitError(
                    f"--trainable {item!r} is neither a group ({', '.join(GROUPS)}, all) nor a valid regular "
                    f"expression: {e}"
                ) from None
            hit = {n for n in names if rx.search(n)}
        if not hit:
            arch = type(model).__name__
            raise OvkitError(
                f"--trainable {item!r} matches no parameter of {arch}; groups are found by name patterns "
                f"(ovkit/models/groups.py), so pass --trainable REGEX naming its modules (e.g. a prefix of "
                f"`model.named_parameters()`)"
            )
        chosen |= hit
    if freeze_vision:
        chosen = {n for n in chosen if groups[n] != "vision"}
        if not chosen:
            raise OvkitError("--freeze-vision leaves nothing to train with this --trainable selection")
    return [n for n in names if n in chosen]


def set_trainable(model, names: Iterable[str]) -> tuple[int, int]:
    """Freeze every parameter except `names`; return (trainable, total) parameter counts."""
    keep = set(names)
    trainable = total = 0
    for name, p in model.named_parameters():
        p.requires_grad_(name in keep)
        total += p.numel()
        trainable += p.numel() if name in keep else 0
    return trainable, total
