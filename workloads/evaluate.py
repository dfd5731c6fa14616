"""Score one checkpoint on the held-out images: ``python -m workloads.evaluate``.

Environment:
    CHECKPOINT_URI: a checkpoint folder holding ``model.pt`` (or the ``model.pt`` URI itself).
    DATASET_URI: Parquet with ``image_id``, ``image_uri`` and ``caption`` columns; only the held-out
        images (see ``synthetic.is_heldout``) are scored, against their captions.
    OUTPUT_URI: prefix; ``metrics.json`` is written there = {"accuracy", "color_accuracy",
        "shape_accuracy", "num_examples", "checkpoint_uri", "checkpoint_step", "chance"}.
    EVAL_BATCH_SIZE: images per forward pass (default 64).

Reports the metrics as materialization metadata and the asset check ``accuracy_above_chance``
(exact-match accuracy above 1 / (colours x shapes)).
"""

from __future__ import annotations

import json
import sys

from gpudoor_pipelines.transit.bucket import join, write_bytes
from workloads.config import ConfigError, env_int, env_str, run_main
from workloads.model import load_model, load_split, pick_device, predict
from workloads.reporting import open_reporting

CHECK_NAME = "accuracy_above_chance"


def main() -> int:
    """Evaluate the checkpoint, write metrics.json and report the metrics and the check."""
    checkpoint_uri = env_str("CHECKPOINT_URI")
    dataset_uri = env_str("DATASET_URI")
    output_uri = env_str("OUTPUT_URI")
    batch_size = env_int("EVAL_BATCH_SIZE", 64)
    if batch_size < 1:
        raise ConfigError("EVAL_BATCH_SIZE must be >= 1")

    with open_reporting() as reporter:
        device = pick_device()
        model, state = load_model(checkpoint_uri, device)
        vocab = state["vocab"]
        images, colors, shapes = load_split(dataset_uri, vocab, heldout=True)
        if len(images) == 0:
            print(f"no held-out examples in {dataset_uri}: nothing to evaluate", file=sys.stderr, flush=True)
            return 1
        print(
            f"evaluating step {state['step']} of {checkpoint_uri} on {len(images)} held-out images ({device})",
            flush=True,
        )

        color_hits = shape_hits = both_hits = 0
        for start in range(0, len(images), batch_size):
            batch = slice(start, start + batch_size)
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
        metrics_uri = join(output_uri, "metrics.json")
        write_bytes(metrics_uri, json.dumps(metrics, indent=2).encode())
        summary = (
            f"accuracy {metrics['accuracy']:.3f} (colour {metrics['color_accuracy']:.3f}, "
            f"shape {metrics['shape_accuracy']:.3f}, chance {chance:.3f}); wrote {metrics_uri}"
        )
        print(summary, flush=True)
        reporter.report_asset_materialization(metadata=metrics)
        reporter.report_asset_check(
            check_name=CHECK_NAME,
            passed=bool(metrics["accuracy"] > chance),
            metadata={"accuracy": metrics["accuracy"], "chance": chance},
        )
    return 0


if __name__ == "__main__":
    run_main(main)
