"""The synthetic data set: small images of one coloured shape, deterministic from their index.

Everything downstream (captioning, training, evaluation, the demo) agrees on this module's palette,
shapes, image ids and held-out split.
"""

from __future__ import annotations

import hashlib
import io
import random

from PIL import Image, ImageDraw

# Named palette; saturated and far apart so the nearest-colour match is unambiguous.
COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 80, 220),
    "yellow": (235, 200, 30),
    "purple": (140, 60, 180),
    "orange": (245, 130, 30),
}
SHAPES: tuple[str, ...] = ("circle", "square", "triangle")
BACKGROUND = (255, 255, 255)


def image_id(index: int) -> str:
    """The id of image ``index``, e.g. ``img-00042``."""
    return f"img-{index:05d}"


def caption_text(color: str, shape: str) -> str:
    """The caption sentence for a (colour, shape) pair, e.g. ``a red circle``."""
    return f"a {color} {shape}"


def is_heldout(image_id: str) -> bool:
    """Whether ``image_id`` belongs to the held-out (evaluation) split, about 20% of ids.

    A hash of the id rather than of the index, so the split is stable whatever order or subset of
    images a data set holds.
    """
    digest = hashlib.sha256(image_id.encode("utf-8")).digest()
    return int.from_bytes(digest[:4], "big") % 5 == 0


def generate_image(
    index: int, size: int = 32, color: str | None = None, shape: str | None = None
) -> tuple[bytes, str, str]:
    """Draw image ``index``: one shape in one palette colour on white, with jittered size and place.

    Args:
        index: seeds everything, so the same index always gives the same image.
        size: width and height in pixels.
        color: force this palette colour instead of the one the index picks.
        shape: force this shape instead of the one the index picks.

    Returns:
        (PNG bytes, colour name, shape name).
    """
    rng = random.Random(index)
    picked_color = rng.choice(list(COLORS))
    picked_shape = rng.choice(SHAPES)
    color = color or picked_color
    shape = shape or picked_shape
    if color not in COLORS or shape not in SHAPES:
        raise ValueError(f"unknown colour/shape {color!r}/{shape!r}")

    side = rng.randint(int(size * 0.45), int(size * 0.7))
    x0 = rng.randint(1, size - side - 1)
    y0 = rng.randint(1, size - side - 1)
    x1, y1 = x0 + side - 1, y0 + side - 1
    image = Image.new("RGB", (size, size), BACKGROUND)
    draw = ImageDraw.Draw(image)  # no anti-aliasing: every shape pixel is exactly the palette colour
    fill = COLORS[color]
    if shape == "circle":
        draw.ellipse((x0, y0, x1, y1), fill=fill)
    elif shape == "square":
        draw.rectangle((x0, y0, x1, y1), fill=fill)
    else:
        draw.polygon([(x0, y1), (x1, y1), ((x0 + x1) / 2, y0)], fill=fill)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue(), color, shape
