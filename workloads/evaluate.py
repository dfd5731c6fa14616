"""Score checkpoints on the held-out images: ``python -m workloads.evaluate``.

One checkpoint, or many in one job of a batch (when ``EVAL_BATCH_URI`` is set). Either way a
checkpoint is scored against the captions of the held-out images (see ``synthetic.is_heldout``) of
its data set, and its ``metrics.json`` = {"accuracy", "color_accuracy", "shape_accuracy",
"num_examples", "checkpoint_uri", "checkpoint_step", "chance"} is written to its output prefix.

Environment, single checkpoint:
    CHECKPOINT_URI: a checkpoint folder holding ``model.pt`` (or the ``model.pt`` URI itself).
    DATASET_URI: Parquet with ``image_id``, ``image_uri`` and ``caption`` columns.
    OUTPUT_URI: prefix; ``metrics.json`` is written there.
    EVAL_BATCH_SIZE: images per forward pass (default 64).

    Reports the metrics as materialization metadata and the asset check ``accuracy_above_chance``
    (exact-match accuracy above chance, 1 / (colours x shapes)). Exits 1 when the checkpoint has no
    readable model file or the data set no held-out example.

Environment, batch (many checkpoints, one SkyPilot managed job of a batch):
    EVAL_BATCH_URI: URI of the batch file, JSON ``{"jobs": [...]}``; ``jobs[rank]`` is this job:
        ``{"checkpoints": [{"checkpoint", "checkpoint_uri", "dataset_uri", "output_uri"}, ...],
        "pipes_env": {...}}``, ``checkpoint`` being the checkpoint's partition key and the URIs
        what CHECKPOINT_URI, DATASET_URI and OUTPUT_URI are to a single checkpoint.
    SKYPILOT_JOB_RANK: which entry of ``jobs`` this job is (default 0).
    SKYPILOT_NUM_JOBS: when set, must equal the number of entries in ``jobs``.
    EVAL_BATCH_SIZE: as above.

    The checkpoints are scored in order, each held-out split loaded once per data set. A checkpoint
    whose ``metrics.json`` already exists (and parses) is not scored again. A checkpoint that cannot
    be scored (no model file, no held-out example, any error reading or predicting) fails alone: the
    job goes on with the others and exits 1 at the end.

    Each job reports through its own Pipes channel (its entry's ``pipes_env``), one custom message
    per checkpoint and no materialization nor check (the orchestrator materializes each checkpoint
    from the messages): ``{"checkpoint", "state": "done", "metrics", "seconds"}`` (plus
    ``"reused": true``, and seconds 0.0, when metrics.json was already there) or
    ``{"checkpoint", "state": "failed", "reason"}``.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gpudoor_pipelines.transit.uris import bucket_for_uri, join, read_bytes, write_bytes
from workloads.batch import read_batch_entry, require
from workloads.checkpoints import checkpoint_file_uri
from workloads.config import ConfigError, env_int, env_str, run_main
from workloads.reporting import open_reporting, saved

if TYPE_CHECKING:
    import torch

CHECK_NAME = "accuracy_above_chance"
METRICS_FILE = "metrics.json"
CHECKPOINT_KEYS = ("checkpoint", "checkpoint_uri", "dataset_uri", "output_uri")


class EvalError(Exception):
    """A checkpoint cannot be scored: its model file is missing or unreadable, or nothing is held out."""


def say(message: str) -> None:
    """A line for the job log (the launcher streams the job log into the Dagster run)."""
    print(message, flush=True)


def complain(message: str) -> None:
    """A line for stderr."""
    print(message, file=sys.stderr, flush=True)


def one_line(text: str) -> str:
    """``text`` on one line, for a report."""
    return " ".join(text.split())


@dataclass(frozen=True)
class CheckpointTask:
    """One checkpoint to score: its partition key, where it is, its data set and where its metrics go."""

    checkpoint: str
    checkpoint_uri: str
    dataset_uri: str
    output_uri: str


class Evaluator:
    """Scores checkpoints; loads torch and picks the device on first use, keeps each held-out split."""

    def __init__(self, batch_size: int) -> None:
        self.batch_size = batch_size
        self._device: torch.device | None = None
        self._heldout: dict[tuple[str, str], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    @property
    def device(self) -> torch.device:
        if self._device is None:
            # Imported only now: torch takes seconds to load, and a batch already scored needs none of it.
            from workloads.model import pick_device

            self._device = pick_device()
        return self._device

    def heldout(
        self, dataset_uri: str, vocab: dict[str, list[str]], prefix: str = ""
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The held-out (images, colours, shapes) of a data set, on the CPU; read once per data set."""
        from workloads.model import load_split

        # The labels are indices into the checkpoint's vocabulary: the same for all of a training.
        key = (dataset_uri, json.dumps(vocab, sort_keys=True))
        if key not in self._heldout:
            images, colors, shapes = load_split(dataset_uri, vocab, heldout=True)
            if len(images) == 0:
                raise EvalError(f"no held-out examples in {dataset_uri}: nothing to evaluate")
            say(f"{prefix}loaded {len(images)} held-out images from {dataset_uri}")
            self._heldout[key] = images, colors, shapes
        return self._heldout[key]

    def evaluate(self, checkpoint_uri: str, dataset_uri: str, output_uri: str, prefix: str = "") -> dict[str, Any]:
        """Score a checkpoint and write its metrics.json; ``prefix`` starts each log line.

        Returns:
            The metrics (what metrics.json holds).

        Raises:
            EvalError: no readable model file, or no held-out example. Errors reading the data set or
                writing the metrics are raised as they come.
        """
        from workloads.model import load_model, predict

        device = self.device
        model_uri = checkpoint_file_uri(checkpoint_uri)
        try:
            model, state = load_model(checkpoint_uri, device)
        except FileNotFoundError:
            raise EvalError(f"no model file at {model_uri}") from None
        except Exception as exc:  # torch reports a damaged file with many exception types
            raise EvalError(f"cannot read the model file {model_uri}: {type(exc).__name__}: {exc}") from exc
        vocab = state["vocab"]
        images, colors, shapes = self.heldout(dataset_uri, vocab, prefix)
        say(f"{prefix}evaluating step {state['step']} of {checkpoint_uri} on {len(images)} held-out images ({device})")

        color_hits = shape_hits = both_hits = 0
        for start in range(0, len(images), self.batch_size):
            batch = slice(start, start + self.batch_size)
            color_pred, shape_pred = predict(model, images[batch].to(device))
            color_ok = color_pred.cpu() == colors[batch]
            shape_ok = shape_pred.cpu() == shapes[batch]
            color_hits += int(color_ok.sum())
            shape_hits += int(shape_ok.sum())
            both_hits += int((color_ok & shape_ok).sum())

        total = len(images)
        chance = 1.0 / (len(vocab["colors"]) * len(vocab["shapes"]))
        metrics = {
            "accuracy": both_hits / total,
            "color_accuracy": color_hits / total,
            "shape_accuracy": shape_hits / total,
            "num_examples": total,
            "checkpoint_uri": checkpoint_uri,
            "checkpoint_step": int(state["step"]),
            "chance": chance,
        }
        metrics_uri = join(output_uri, METRICS_FILE)
        write_bytes(metrics_uri, json.dumps(metrics, indent=2).encode())
        say(
            f"{prefix}accuracy {metrics['accuracy']:.3f} (colour {metrics['color_accuracy']:.3f}, "
            f"shape {metrics['shape_accuracy']:.3f}, chance {chance:.3f}); wrote {metrics_uri}"
        )
        return metrics


def main_single() -> int:
    """Evaluate one checkpoint, write metrics.json and report the metrics and the check."""
    checkpoint_uri = env_str("CHECKPOINT_URI")
    dataset_uri = env_str("DATASET_URI")
    output_uri = env_str("OUTPUT_URI")
    batch_size = env_int("EVAL_BATCH_SIZE", 64)
    if batch_size < 1:
        raise ConfigError("EVAL_BATCH_SIZE must be >= 1")

    with open_reporting() as reporter:
        try:
            metrics = Evaluator(batch_size).evaluate(checkpoint_uri, dataset_uri, output_uri)
        except EvalError as exc:
            complain(str(exc))
            return 1
        reporter.report_asset_materialization(metadata=metrics)
        reporter.report_asset_check(
            check_name=CHECK_NAME,
            passed=bool(metrics["accuracy"] > metrics["chance"]),
            metadata={"accuracy": metrics["accuracy"], "chance": metrics["chance"]},
        )
    return 0


@dataclass(frozen=True)
class BatchSettings:
    """This job's settings, from the environment and its entry in the batch file."""

    batch_size: int
    rank: int
    num_jobs: int
    checkpoints: list[CheckpointTask]
    pipes_env: dict[str, str]


def _checkpoint_task(entry: Any, where: str) -> CheckpointTask:
    require(isinstance(entry, dict), f"{where} must be an object with {', '.join(CHECKPOINT_KEYS)}: {entry!r}")
    for key in CHECKPOINT_KEYS:
        require(key in entry, f"{where} has no {key}")
        require(
            isinstance(entry[key], str) and bool(entry[key]),
            f"{where}.{key} must be a non-empty string, got {entry[key]!r}",
        )
    for key in ("checkpoint_uri", "dataset_uri", "output_uri"):
        try:
            bucket_for_uri(entry[key])  # a bad scheme fails the job now, not each checkpoint later
        except ValueError as exc:
            raise ConfigError(f"{where}.{key}: {exc}") from None
    return CheckpointTask(*(entry[key] for key in CHECKPOINT_KEYS))


def load_batch_settings() -> BatchSettings:
    """Read and check this job's settings; fetches the batch file.

    Raises:
        ConfigError: a setting or the batch file is unusable; the message says which and why.
    """
    batch_size = env_int("EVAL_BATCH_SIZE", 64)
    require(batch_size >= 1, "EVAL_BATCH_SIZE must be >= 1")
    read = read_batch_entry("EVAL_BATCH_URI")
    checkpoints = read.entry.get("checkpoints")
    require(isinstance(checkpoints, list), f"{read.where} has no list of checkpoints")
    return BatchSettings(
        batch_size=batch_size,
        rank=read.rank,
        num_jobs=read.num_jobs,
        checkpoints=[_checkpoint_task(c, f"{read.where}: checkpoints[{i}]") for i, c in enumerate(checkpoints)],
        pipes_env=read.pipes_env,
    )


def _existing_metrics(output_uri: str, prefix: str) -> dict[str, Any] | None:
    """The metrics.json already under ``output_uri``, or None when there is none that parses."""
    uri = join(output_uri, METRICS_FILE)
    try:
        metrics = json.loads(read_bytes(uri))
    except FileNotFoundError:
        return None
    except ValueError as exc:
        say(f"{prefix}{uri} is not JSON ({one_line(str(exc))}): evaluating again")
        return None
    if not isinstance(metrics, dict):
        say(f"{prefix}{uri} is not a JSON object: evaluating again")
        return None
    return metrics


def evaluate_task(evaluator: Evaluator, task: CheckpointTask) -> dict[str, Any]:
    """Score one checkpoint of a batch (or reuse its metrics) and return its report; never raises."""
    prefix = f"{task.checkpoint}: "
    started = time.monotonic()
    try:
        metrics = _existing_metrics(task.output_uri, prefix)
        if metrics is not None:
            uri = join(task.output_uri, METRICS_FILE)
            say(f"{prefix}already evaluated: accuracy {metrics.get('accuracy')}; reusing {uri}")
            return {
                "checkpoint": task.checkpoint,
                "state": "done",
                "metrics": metrics,
                "seconds": 0.0,
                "reused": True,
            }
        metrics = evaluator.evaluate(task.checkpoint_uri, task.dataset_uri, task.output_uri, prefix)
    except EvalError as exc:
        reason = one_line(str(exc))
    except Exception as exc:  # one broken checkpoint must not cost the job the others
        traceback.print_exc()
        reason = one_line(
            f"cannot evaluate {task.checkpoint_uri} on {task.dataset_uri} into {task.output_uri}: "
            f"{type(exc).__name__}: {exc}"
        )
    else:
        seconds = round(time.monotonic() - started, 3)
        return {"checkpoint": task.checkpoint, "state": "done", "metrics": metrics, "seconds": seconds}
    complain(f"{prefix}failed: {reason}")
    return {"checkpoint": task.checkpoint, "state": "failed", "reason": reason}


def main_batch() -> int:
    """Evaluate this job's checkpoints in order; report each with a custom message."""
    settings = load_batch_settings()
    # Each job of a batch has its own Pipes channel; open_reporting reads it from the environment.
    os.environ.update(settings.pipes_env)
    with open_reporting() as reporter:
        job = f"job {settings.rank + 1}/{settings.num_jobs}"
        say(f"{job}: {len(settings.checkpoints)} checkpoints")
        evaluator = Evaluator(settings.batch_size)
        states: list[str] = []
        for task in settings.checkpoints:
            report = evaluate_task(evaluator, task)
            # A checkpoint evaluated is saved: its metrics are in the bucket.
            reporter.report_custom_message(saved("metrics", **report) if report["state"] == "done" else report)
            states.append(report["state"])
        say(f"{job}: {states.count('done')} done, {states.count('failed')} failed")
        return 1 if "failed" in states else 0


def main() -> int:
    """A batch of checkpoints when EVAL_BATCH_URI is set, else the one checkpoint CHECKPOINT_URI."""
    return main_batch() if os.environ.get("EVAL_BATCH_URI", "").strip() else main_single()


if __name__ == "__main__":
    run_main(main)
