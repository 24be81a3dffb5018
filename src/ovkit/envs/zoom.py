"""The zoom tool: the model writes `<zoom>[x1,y1,x2,y2]</zoom>` (pixel coordinates of the first image, as the model
sees it) and gets the cropped region back, enlarged, as a new image; a response without a zoom call is its answer.
It is the smallest environment whose observations are images, which is what makes later turns of a VLM rollout
different from an LLM's: the new image must be processed, placed in the context and really seen by the model."""

from __future__ import annotations

import re
from typing import Any

from ovkit.data.schema import IMAGE_TOKEN

ZOOM = re.compile(r"<zoom>\s*\[?\s*([-\d.]+)\s*,\s*([-\d.]+)\s*,\s*([-\d.]+)\s*,\s*([-\d.]+)\s*\]?\s*</zoom>", re.S)
ZOOM_TAG = re.compile(r"<zoom>", re.I)


class ZoomEnv:
    """env args: `scale` (enlargement, default 2), `max_side` (the crop's longer side after enlarging is at most
    this, default 448), `min_side` (and at least this, default 28: one merged patch of a Qwen-VL ViT),
    `max_zooms` (calls answered with an image; later ones are told to answer, default 3)."""

    instruction = "To see a region of the image enlarged, reply only with <zoom>[x1,y1,x2,y2]</zoom> in pixels."

    def __init__(
        self, task: dict[str, Any], scale: float = 2.0, max_side: int = 448, min_side: int = 28, max_zooms: int = 3
    ):
        images = task.get("images") or []
        self.image = images[0] if images else None
        self.scale, self.max_side, self.min_side, self.max_zooms = (
            float(scale),
            int(max_side),
            int(min_side),
            int(max_zooms),
        )
        self.zooms = 0

    def reset(self) -> None:
        self.zooms = 0

    def step(self, response_text: str) -> tuple[dict[str, Any] | None, bool, dict[str, Any]]:
        if not ZOOM_TAG.search(response_text):
            return None, True, {"reason": "completed"}
        found = ZOOM.search(response_text)
        if self.image is None:
            return {"text": "There is no image to zoom into. Give your final answer."}, False, {"zoom": "no_image"}
        if found is None:
            return (
                {"text": "Write the region as <zoom>[x1,y1,x2,y2]</zoom> with four numbers."},
                False,
                {"zoom": "unparsed"},
            )
        if self.zooms >= self.max_zooms:
            return {"text": "No zooms left. Give your final answer."}, False, {"zoom": "exhausted"}
        box = self._clamp([float(v) for v in found.groups()])
        if box is None:
            return (
                {"text": "That region is empty or outside the image. Try another region or answer."},
                False,
                {"zoom": "empty"},
            )
        self.zooms += 1
        return (
            {"text": f"Region [{box[0]},{box[1]},{box[2]},{box[3]}] enlarged:", "image": self._crop(box)},
            False,
            {"zoom": "ok"},
        )

    def format_observation(self, observation: dict[str, Any]) -> dict[str, Any]:
        if "image" in observation:
            return {
                "role": "user",
                "content": f"{observation['text']}\n{IMAGE_TOKEN}",
                "images": [observation["image"]],
            }
        return {"role": "user", "content": observation["text"], "images": []}

    def close(self) -> None:
        self.image = None

    def _clamp(self, box: list[float]) -> tuple[int, int, int, int] | None:
        w, h = self.image.size
        x1, y1, x2, y2 = (int(round(v)) for v in box)
        x1, x2 = sorted((min(max(x1, 0), w), min(max(x2, 0), w)))
        y1, y2 = sorted((min(max(y1, 0), h), min(max(y2, 0), h)))
        return (x1, y1, x2, y2) if x2 - x1 >= 2 and y2 - y1 >= 2 else None

    def _crop(self, box: tuple[int, int, int, int]) -> Any:
        from PIL import Image

        crop = self.image.crop(box)
        f = self.scale
        f = min(f, self.max_side / max(crop.size))
        f = max(f, self.min_side / min(crop.size))
        size = (max(1, round(crop.width * f)), max(1, round(crop.height * f)))
        return crop.resize(size, Image.BICUBIC)
