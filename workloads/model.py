"""The model shared by train, evaluate and serve: network, labels, pixels, data and checkpoints."""

from __future__ import annotations

import io
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from PIL import Image
from torch import nn

from gpudoor_pipelines.data.synthetic import COLORS, SHAPES, is_heldout
from gpudoor_pipelines.transit.uris import read_bytes
from workloads.checkpoints import checkpoint_file_uri

IMAGE_SIZE = 32


def default_vocab() -> dict[str, list[str]]:
    """The label vocabulary: index -> word for each head."""
    return {"colors": list(COLORS), "shapes": list(SHAPES)}


def parse_caption(caption: str, vocab: dict[str, list[str]]) -> tuple[int, int]:
    """Turn a caption such as ``"a red circle"`` into (colour index, shape index).

    Raises:
        ValueError: the caption names no known colour or no known shape.
    """
    words = re.findall(r"[a-z]+", caption.lower())
    colors = [vocab["colors"].index(w) for w in words if w in vocab["colors"]]
    shapes = [vocab["shapes"].index(w) for w in words if w in vocab["shapes"]]
    if not colors or not shapes:
        raise ValueError(f"caption names no known colour and shape: {caption!r}")
    return colors[0], shapes[0]


def pick_device() -> torch.device:
    """The first GPU when there is one, else the CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def decode_pixels(png: bytes, size: int | None = None) -> torch.Tensor:
    """Decode an image into a (height, width, 3) uint8 tensor, resized to ``size`` if given."""
    image = Image.open(io.BytesIO(png)).convert("RGB")
    if size is not None and image.size != (size, size):
        image = image.resize((size, size), Image.Resampling.NEAREST)
    width, height = image.size
    # bytearray: torch.frombuffer wants a writable buffer, and this avoids needing numpy.
    return torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8).view(height, width, 3)


def image_to_input(png: bytes) -> torch.Tensor:
    """Decode an image into the model's input: a (3, 32, 32) float tensor in [0, 1]."""
    return decode_pixels(png, IMAGE_SIZE).permute(2, 0, 1).float().div(255.0)


class ShapeColorNet(nn.Module):
    """A tiny CNN with two heads: which colour and which shape the image shows."""

    def __init__(self, num_colors: int, num_shapes: int) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),  # 16x16
            nn.Conv2d(8, 16, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),  # 8x8
            nn.Conv2d(16, 32, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),  # 4x4: keeps where the edges are, which is what tells shapes apart
            nn.Flatten(),
            nn.Linear(32 * 4 * 4, 64),
            nn.ReLU(),
        )
        self.color_head = nn.Linear(64, num_colors)
        self.shape_head = nn.Linear(64, num_shapes)

    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Return (colour logits, shape logits) for a (batch, 3, 32, 32) input."""
        hidden = self.features(images)
        return self.color_head(hidden), self.shape_head(hidden)


def build_model(vocab: dict[str, list[str]]) -> ShapeColorNet:
    """A fresh model sized for ``vocab``."""
    return ShapeColorNet(len(vocab["colors"]), len(vocab["shapes"]))


def save_checkpoint(
    path: str, model: nn.Module, optimizer: torch.optim.Optimizer, step: int, vocab: dict[str, list[str]]
) -> None:
    """Write model and optimizer state, step and vocabulary to a local file."""
    torch.save(
        {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step, "vocab": vocab},
        path,
    )


def load_checkpoint(data: bytes, device: torch.device | str = "cpu") -> dict[str, Any]:
    """Read a checkpoint written by :func:`save_checkpoint` (tensors and plain data only)."""
    return torch.load(io.BytesIO(data), map_location=device, weights_only=True)


def load_model(checkpoint_uri: str, device: torch.device) -> tuple[ShapeColorNet, dict[str, Any]]:
    """Load a checkpoint folder (or model file) from storage into an eval-mode model on ``device``.

    Returns:
        (model, the checkpoint dict).
    """
    state = load_checkpoint(read_bytes(checkpoint_file_uri(checkpoint_uri)), device)
    model = build_model(state["vocab"])
    model.load_state_dict(state["model"])
    return model.to(device).eval(), state


def predict(model: ShapeColorNet, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Predicted (colour indices, shape indices) for a batch already on the model's device."""
    with torch.inference_mode():
        color_logits, shape_logits = model(images)
    return color_logits.argmax(1), shape_logits.argmax(1)


def load_split(
    dataset_uri: str, vocab: dict[str, list[str]], heldout: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Load one split of a captions Parquet file as tensors.

    Args:
        dataset_uri: Parquet with at least ``image_id``, ``image_uri`` and ``caption`` columns.
        vocab: the label vocabulary the captions are parsed with.
        heldout: True for the held-out (evaluation) images, False for the training ones.

    Returns:
        (images (N, 3, 32, 32), colour labels (N,), shape labels (N,)) on the CPU; rows whose
        caption names no known colour and shape are left out.
    """
    import pandas as pd  # only train and evaluate need pandas; serve does not

    frame = pd.read_parquet(io.BytesIO(read_bytes(dataset_uri)), columns=["image_id", "image_uri", "caption"])
    rows = []
    for row in frame.itertuples(index=False):
        if is_heldout(str(row.image_id)) != heldout:
            continue
        try:
            rows.append((str(row.image_uri), *parse_caption(str(row.caption), vocab)))
        except ValueError:
            continue
    if not rows:
        return (
            torch.empty(0, 3, IMAGE_SIZE, IMAGE_SIZE),
            torch.empty(0, dtype=torch.long),
            torch.empty(0, dtype=torch.long),
        )
    # Images are fetched in parallel: on S3 each read is a round trip, not a disk seek.
    with ThreadPoolExecutor(max_workers=16) as pool:
        pngs = list(pool.map(read_bytes, [uri for uri, _, _ in rows]))
    images = torch.stack([image_to_input(png) for png in pngs])
    colors = torch.tensor([c for _, c, _ in rows], dtype=torch.long)
    shapes = torch.tensor([s for _, _, s in rows], dtype=torch.long)
    return images, colors, shapes
