"""The ``color-shape-v1`` captioner: a tiny, exact captioner for the synthetic images.

The colour is the palette colour most of the ink pixels are nearest to; the shape comes from how
much of its bounding box the ink fills (~1.0 square, ~0.785 circle, ~0.5 triangle). The pixel math
runs on torch tensors, on the GPU when there is one.
"""

from __future__ import annotations

import torch

from gpudoor_pipelines.data.synthetic import COLORS, caption_text
from workloads.model import decode_pixels, pick_device

# Distance from white (summed over channels) beyond which a pixel is ink, not background.
_INK_THRESHOLD = 90.0
# An image whose every pixel is this close to white (summed over channels) is blank: nothing to caption. A
# pale image (nothing past the ink threshold, as (235, 252, 195)) is not: what it shows is what is not white.
BLANK_TOLERANCE = 12.0
_SQUARE_MIN_FILL = 0.9
_CIRCLE_MIN_FILL = 0.65  # midway between a circle's pi/4 and a triangle's 1/2, with pixel edges


class ColorShapeCaptioner:
    """Captions images of one coloured shape on white."""

    def __init__(self, device: torch.device | None = None) -> None:
        self.device = device or pick_device()
        self.palette = torch.tensor(list(COLORS.values()), dtype=torch.float32, device=self.device)
        self.color_names = list(COLORS)

    def describe(self, pixels: torch.Tensor) -> tuple[str, str]:
        """Return (colour, shape) for an (H, W, 3) uint8 image.

        Raises:
            ValueError: the image is blank (every pixel within :data:`BLANK_TOLERANCE` of white), saying what
                it measured.
        """
        x = pixels.to(self.device, torch.float32)
        from_white = (255.0 - x).sum(-1)
        ink = from_white > _INK_THRESHOLD
        if not bool(ink.any()):
            ink = from_white > BLANK_TOLERANCE
        if not bool(ink.any()):
            raise ValueError(
                f"blank image: every pixel is within {BLANK_TOLERANCE:g} of white (R+G+B below 255 each; "
                f"the farthest is {float(from_white.max()):g})"
            )
        # Every ink pixel votes for its nearest palette colour: robust to stray edge pixels.
        votes = torch.cdist(x[ink], self.palette).argmin(1)
        color = self.color_names[int(torch.bincount(votes, minlength=len(self.color_names)).argmax())]
        rows = ink.any(1).nonzero()
        cols = ink.any(0).nonzero()
        box = (rows.max() - rows.min() + 1) * (cols.max() - cols.min() + 1)
        fill = float(ink.sum() / box)
        if fill >= _SQUARE_MIN_FILL:
            return color, "square"
        if fill >= _CIRCLE_MIN_FILL:
            return color, "circle"
        return color, "triangle"

    def caption(self, png: bytes) -> str:
        """The caption sentence for a PNG image."""
        return caption_text(*self.describe(decode_pixels(png)))
