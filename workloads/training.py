"""The training engine behind ``workloads.train``: data, DDP, the loop and checkpoint writing.

Kept apart from the program so that it (and torch) is only imported once the settings are checked
and the run is known to have work left.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from gpudoor_pipelines.transit.uris import join, publish, read_bytes
from workloads.checkpoints import MODEL_FILE, checkpoint_dir_name, latest_checkpoint
from workloads.model import (
    build_model,
    default_vocab,
    load_checkpoint,
    load_model,
    load_split,
    pick_device,
    save_checkpoint,
)

LOG_EVERY = 10


class TrainingError(RuntimeError):
    """The run cannot go on: no usable data, or a smoke-test check failed."""


@dataclass(frozen=True)
class TrainSettings:
    """Everything a run needs, read from the environment by ``workloads.train``."""

    dataset_uri: str
    output_uri: str
    checkpoints_dir: str
    max_steps: int
    checkpoint_every: int
    batch_size: int
    learning_rate: float
    smoke: bool = False
    throttle_s: float = 0.0
    rank: int = 0
    world: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    dist_timeout_s: int = 60


@dataclass
class TrainResult:
    """What a run did, for the job log and Dagster."""

    final_loss: float
    resumed_from_step: int
    checkpoints: list[int] = field(default_factory=list)


def train(
    settings: TrainSettings,
    resume_uri: str | None,
    log: Callable[[str], None],
    on_checkpoint: Callable[[int], None] | None = None,
) -> TrainResult:
    """Train from ``resume_uri`` (a checkpoint folder, or None for a fresh start) to max_steps.

    ``on_checkpoint(step)`` is called on rank 0 once each checkpoint is complete in storage.

    Raises:
        TrainingError: no usable training data, or a smoke-test check failed.
    """
    s = settings
    device = pick_device()
    if device.type == "cuda":
        torch.cuda.set_device(device.index or 0)
    gpus = os.environ.get("SKYPILOT_NUM_GPUS_PER_NODE", "1" if device.type == "cuda" else "0")
    log(f"node {s.rank + 1}/{s.world} on {device} (one process; node has {gpus} GPU(s))")

    state = load_checkpoint(read_bytes(join(resume_uri, MODEL_FILE)), device) if resume_uri else None
    vocab = state["vocab"] if state else default_vocab()
    images, colors, shapes = load_split(s.dataset_uri, vocab, heldout=False)
    if len(images) == 0:
        raise TrainingError(f"no usable training examples in {s.dataset_uri}")
    images, colors, shapes = images.to(device), colors.to(device), shapes.to(device)
    log(f"loaded {len(images)} training images from {s.dataset_uri}")

    if s.world > 1:
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo",
            init_method=f"tcp://{s.master_addr}:{s.master_port}",
            rank=s.rank,
            world_size=s.world,
            timeout=timedelta(seconds=s.dist_timeout_s),  # a missing peer fails the job, not hangs it
        )
        log(f"joined process group of {s.world} via {s.master_addr}:{s.master_port}")

    torch.manual_seed(0)  # the same initial weights everywhere (DDP broadcasts rank 0's anyway)
    model = build_model(vocab).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=s.learning_rate)
    result = TrainResult(final_loss=float("nan"), resumed_from_step=0)
    if state:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        result.resumed_from_step = int(state["step"])
        log(f"resuming from step {result.resumed_from_step}")
    net: nn.Module = DistributedDataParallel(model) if s.world > 1 else model
    loss_fn = nn.CrossEntropyLoss()

    window_loss, window_steps, window_correct = 0.0, 0, 0
    for step in range(result.resumed_from_step + 1, s.max_steps + 1):
        # The batch depends only on (step, rank): a resumed run sees the batches the lost one would
        # have, and the ranks see different ones.
        generator = torch.Generator().manual_seed(step * s.world + s.rank)
        index = torch.randint(len(images), (s.batch_size,), generator=generator).to(device)
        color_logits, shape_logits = net(images[index])
        loss = loss_fn(color_logits, colors[index]) + loss_fn(shape_logits, shapes[index])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if s.smoke and step == result.resumed_from_step + 1:
            _check_gradients(model, loss)
            log(f"smoke: forward/backward ok (loss {loss.item():.4f})")
        optimizer.step()

        result.final_loss = loss.item()
        window_loss += result.final_loss
        window_steps += 1
        hits = (color_logits.argmax(1) == colors[index]) & (shape_logits.argmax(1) == shapes[index])
        window_correct += int(hits.sum())
        if step % LOG_EVERY == 0 or step in (result.resumed_from_step + 1, s.max_steps):
            log(f"step {step}/{s.max_steps} loss {result.final_loss:.4f}")
        if step % s.checkpoint_every == 0 or step == s.max_steps:
            if s.rank == 0:
                uri = _write_checkpoint(
                    s,
                    model,
                    optimizer,
                    step,
                    vocab,
                    loss=window_loss / window_steps,
                    train_accuracy=window_correct / (window_steps * s.batch_size),
                )
                result.checkpoints.append(step)
                log(f"checkpoint step {step} written to {uri}")
                if on_checkpoint is not None:
                    on_checkpoint(step)
            window_loss, window_steps, window_correct = 0.0, 0, 0
        if s.throttle_s:
            time.sleep(s.throttle_s)

    if s.smoke and s.rank == 0:
        _check_round_trip(s, model, device)
        log("smoke test passed")
    if s.world > 1:
        dist.destroy_process_group()
    return result


def _write_checkpoint(
    s: TrainSettings,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    step: int,
    vocab: dict[str, list[str]],
    loss: float,
    train_accuracy: float,
) -> str:
    """Save locally, then publish the model with its manifest (written last); return the checkpoint's URI."""
    name = checkpoint_dir_name(step)
    local = os.path.join(s.checkpoints_dir, name, MODEL_FILE)
    os.makedirs(os.path.dirname(local), exist_ok=True)
    save_checkpoint(local, model, optimizer, step, vocab)
    uri = join(s.output_uri, name)
    manifest = {
        "step": step,
        "loss": round(loss, 6),
        "train_accuracy": round(train_accuracy, 4),
        "created_at": datetime.now(UTC).isoformat(),
    }
    publish(uri, manifest, files={MODEL_FILE: local})
    return uri


def _check_gradients(model: nn.Module, loss: torch.Tensor) -> None:
    """Smoke check: the first forward/backward gave a finite loss and a finite gradient everywhere."""
    finite = bool(torch.isfinite(loss)) and all(
        p.grad is not None and bool(torch.isfinite(p.grad).all()) for p in model.parameters()
    )
    if not finite:
        raise TrainingError("smoke test failed: forward/backward gave a non-finite loss or gradient")


def _check_round_trip(s: TrainSettings, model: nn.Module, device: torch.device) -> None:
    """Smoke check: the last checkpoint is complete in storage and reads back identical."""
    found = latest_checkpoint(s.output_uri)
    if not found or found[0] != s.max_steps:
        raise TrainingError(f"smoke test failed: no complete checkpoint for step {s.max_steps} in {s.output_uri}")
    reloaded, _ = load_model(found[1], device)
    pairs = zip(model.state_dict().values(), reloaded.state_dict().values(), strict=True)
    if not all(torch.equal(a, b) for a, b in pairs):
        raise TrainingError("smoke test failed: the checkpoint read back differs from the model")
