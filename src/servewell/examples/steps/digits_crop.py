"""Find the digit on a page and cut it out as the digits model's 8x8 input.

A page is a grey image (values 0..255, dark ink on light paper) of any size, one channel first:
[1, H, W]. The crop is servewell's own image transform with the digits model's preprocessing
(ink bounding box, 8x8, values 0..16), so the classifier sees what `/predict` would give it;
`box` says where the ink was found: [x0, y0, x1, y1] in page pixels (all 0 on a blank page).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from PIL import Image

from servewell.config.processing import ImagePreprocess
from servewell.imaging import transform_image


class Cropper:
    """`execute`: {"page": [n, 1, H, W]} -> {"digit": [n, 1, 8, 8], "box": [n, 4]}."""

    def setup(self, config: dict[str, Any]) -> None:
        settings = config["settings"]
        self.spec = ImagePreprocess.model_validate(settings["preprocess"])
        self.ink_share = float(settings.get("ink_share", 0.25))

    def execute(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        pages = inputs["page"]
        digits, boxes = [], []
        for page in pages:
            grey = np.clip(page[0], 0, 255).astype(np.uint8)
            digits.append(transform_image(Image.fromarray(grey, "L"), self.spec))
            boxes.append(self._box(grey))
        return {"digit": np.stack(digits).astype(np.float32), "box": np.asarray(boxes, dtype=np.int64)}

    def _box(self, grey: np.ndarray) -> list[int]:
        ink = 255.0 - grey.astype(np.float32)
        ink -= np.median(ink)  # the paper's own grey is not ink
        peak = float(ink.max())
        if peak <= 0:
            return [0, 0, 0, 0]
        ys, xs = np.nonzero(ink > peak * self.ink_share)
        return [int(xs.min()), int(ys.min()), int(xs.max()) + 1, int(ys.max()) + 1]
