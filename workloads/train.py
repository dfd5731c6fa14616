"""Train the colour/shape model, on one node or many: ``python -m workloads.train``.

Environment:
    DATASET_URI: Parquet with ``image_id``, ``image_uri`` and ``caption`` columns; trains on the
        images that are not held out (see ``synthetic.is_heldout``).
    OUTPUT_URI: checkpoints prefix (``<root>/checkpoints/<training id>``; given the folder of every training,
        ``<root>/checkpoints/`` with its trailing slash, the training makes its own id, dated from the job's
        SkyPilot task id, so the same on every node and every recovery of the job: ``<UTC submission
        time>-<hash>``); each checkpoint is ``step-XXXXXX/model.pt`` plus
        ``step-XXXXXX/_manifest.json`` (written last) = {"step", "loss", "train_accuracy", "created_at"}
        (loss and accuracy averaged over the steps since the previous checkpoint, on rank 0).
    CHECKPOINTS_DIR: local scratch folder checkpoints are saved to before upload (created;
        default ``<tmp>/gpudoor-checkpoints``).
    MAX_STEPS (default 60), CHECKPOINT_EVERY (default 20), BATCH_SIZE (default 32, per node),
    LEARNING_RATE (default 0.01, Adam).
    SMOKE_TEST: "1" for a validation run: starts fresh (ignores existing checkpoints), checks that
        the data loads, the first forward/backward is finite and the last checkpoint reads back
        identical from OUTPUT_URI, then prints ``smoke test passed``. Checkpoints are written as usual.
    SKYPILOT_NODE_RANK (default 0), SKYPILOT_NUM_NODES (default 1), SKYPILOT_NODE_IPS (newline
        separated; the first is the master; required when there are several nodes),
        SKYPILOT_NUM_GPUS_PER_NODE (logged only: one process per node, on its first GPU),
        MASTER_PORT (default 29500).
    DIST_TIMEOUT_S: seconds to wait for the other nodes before failing (default 60).
    WORKLOAD_THROTTLE_S: seconds to pause after each step (default 0); lets tests and demos
        interrupt a run midway.
    ENDED_MARKER_URI: optional; where rank 0 writes, once the training is over, the JSON
        ``{"state": "succeeded" | "failed", "reason": str or null, "step": the last complete
        checkpoint's step or null, "at": UTC ISO time}``. Succeeded: MAX_STEPS reached (by this run or
        an earlier one). Failed: a configuration error found once the environment is read (exit 2),
        which a restart cannot fix. Not written on a TrainingError or a crash (SkyPilot may restart the
        job on an error, and it resumes; the orchestrator records the failure once the managed job is
        over), nor on a signal (a preempted job is recovered and resumes). Never written in smoke mode.
        A marker that cannot be written is reported on stderr and changes nothing else.

A training launched without the orchestrator (``gpudoor launch``, an agent, SkyPilot itself) is found by the
checkpoint sensor all the same: when ENDED_MARKER_URI is not given and OUTPUT_URI is ``<root>/checkpoints/<training
id>`` (the transit bucket's layout), rank 0 writes this start's journal entry itself, as the orchestrator does
(``<root>/trainings/<day>/<start>-<training id>.json``, :mod:`gpudoor_pipelines.data.checkpoints`), and its ended
marker goes where that entry says. A training id that could not name a training is a configuration error.

Every rank resumes from the newest complete checkpoint in OUTPUT_URI (``resuming from step N``);
when that checkpoint already reaches MAX_STEPS the program exits 0 at once, before loading torch.
Rank 0 alone writes checkpoints and reports to Dagster: ``steps``, ``final_loss``, ``checkpoints``
(steps written by this run) and ``resumed_from_step`` (0 for a fresh start).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from gpudoor_pipelines.data import layout
from gpudoor_pipelines.data.checkpoints import TrainingStart, check_training_id, new_training_id, training_prefix
from gpudoor_pipelines.transit.bucket import MANIFEST_NAME
from gpudoor_pipelines.transit.uris import bucket_for_uri, join, write_bytes
from workloads.checkpoints import latest_checkpoint, read_manifest
from workloads.config import ConfigError, env_flag, env_float, env_int, env_str, node_rank, run_main
from workloads.reporting import open_reporting, saved


@dataclass(frozen=True)
class Ending:
    """How a training ended, for the ended marker: ``state`` succeeded or failed."""

    state: str
    reason: str | None = None
    step: int | None = None  # the last complete checkpoint; None: look it up in storage


def log(message: str) -> None:
    """A line for the job log; the launcher streams it into Dagster and prefixes the rank."""
    print(message, flush=True)


def read_settings() -> tuple[dict[str, Any], str | None]:
    """This node's settings, from the environment (checked in :func:`run`), and ENDED_MARKER_URI.

    Raises:
        ConfigError: a variable is missing or not a number, or the nodes do not add up.
    """
    rank, world = node_rank(), env_int("SKYPILOT_NUM_NODES", 1)
    node_ips = os.environ.get("SKYPILOT_NODE_IPS", "").split()
    if world > 1 and not node_ips:
        raise ConfigError("SKYPILOT_NODE_IPS is required when SKYPILOT_NUM_NODES > 1")
    if not 0 <= rank < world:
        raise ConfigError(f"SKYPILOT_NODE_RANK={rank} is outside 0..{world - 1} (SKYPILOT_NUM_NODES={world})")
    ended_marker_uri = os.environ.get("ENDED_MARKER_URI", "").strip() or None
    if ended_marker_uri:
        try:
            bucket_for_uri(ended_marker_uri)  # a bad scheme is found now, not once the training is over
        except ValueError as exc:
            raise ConfigError(f"ENDED_MARKER_URI: {exc}") from None
    return dict(
        dataset_uri=env_str("DATASET_URI"),
        output_uri=own_training_folder(env_str("OUTPUT_URI")),
        checkpoints_dir=env_str("CHECKPOINTS_DIR", os.path.join(tempfile.gettempdir(), "gpudoor-checkpoints")),
        max_steps=env_int("MAX_STEPS", 60),
        checkpoint_every=env_int("CHECKPOINT_EVERY", 20),
        batch_size=env_int("BATCH_SIZE", 32),
        learning_rate=env_float("LEARNING_RATE", 0.01),
        smoke=env_flag("SMOKE_TEST"),
        throttle_s=env_float("WORKLOAD_THROTTLE_S", 0.0),
        rank=rank,
        world=world,
        master_addr=node_ips[0] if node_ips else "127.0.0.1",
        master_port=env_int("MASTER_PORT", 29500),
        dist_timeout_s=env_int("DIST_TIMEOUT_S", 60),
    ), ended_marker_uri


def own_training_folder(output_uri: str) -> str:
    """OUTPUT_URI as given; given the folder of every training (``<root>/checkpoints/``, the trailing slash
    saying so), a folder of this training's own, named in the id format of :func:`new_training_id` from the
    job's SkyPilot task id (its submission time and a hash of it): every rank, and every recovery of the job,
    gets the same.

    Raises:
        ConfigError: no SkyPilot task id to make it from.
    """
    if not output_uri.endswith(f"/{layout.CHECKPOINTS}/"):
        return output_uri
    task_id = os.environ.get("SKYPILOT_TASK_ID", "")
    submitted = re.search(r"sky-(?:managed-)?(\d{4}(?:-\d\d){5})", task_id)
    if not submitted:
        raise ConfigError(
            f"OUTPUT_URI={output_uri} names the folder of every training, and there is no SkyPilot task id "
            "(SKYPILOT_TASK_ID) to name this training from: give OUTPUT_URI=<that folder>/<training id>"
        )
    started = time.mktime(time.strptime(submitted.group(1), "%Y-%m-%d-%H-%M-%S"))  # SkyPilot's local time
    training_id = new_training_id(hashlib.sha1(task_id.encode()).hexdigest(), now=started)
    return join(output_uri, training_id)


def journal_own_start(output_uri: str) -> str | None:
    """Writes this start's journal entry when OUTPUT_URI is a training's folder in the transit bucket, so the
    checkpoint sensor watches a training nobody else journaled; returns where its ended marker goes (None
    when OUTPUT_URI is elsewhere: nothing watches that).

    Raises:
        ConfigError: the folder's name cannot be a training id.
    """
    root, sep, training_id = output_uri.rstrip("/").rpartition(f"/{layout.CHECKPOINTS}/")
    if not sep or "/" in training_id:
        return None
    try:
        check_training_id(training_id)
    except ValueError as exc:
        raise ConfigError(f"OUTPUT_URI: {exc}") from None
    latest = latest_checkpoint(output_uri)
    after = f"{training_prefix(training_id)}/{latest[1].rsplit('/', 1)[1]}/{MANIFEST_NAME}" if latest else None
    start = TrainingStart(training_id=training_id, started_at=time.time(), after=after)
    write_bytes(join(root, start.journal_key), json.dumps(dataclasses.asdict(start)).encode())
    log(f"training {training_id}: journaled for the checkpoint sensor ({join(root, start.journal_key)})")
    return join(root, start.ended_key)


def one_line(text: str) -> str:
    """``text`` on one line, for the marker."""
    return " ".join(text.split())


def write_ended_marker(uri: str, output_uri: str, ending: Ending) -> None:
    """Write the ended marker; a failure to is reported on stderr, never raised."""
    try:
        step = ending.step
        if step is None:
            try:
                latest = latest_checkpoint(output_uri)
            except Exception as exc:  # the storage may be what failed the training
                print(f"cannot list the checkpoints in {output_uri}: {exc}", file=sys.stderr, flush=True)
                latest = None
            step = latest[0] if latest else None
        marker = {
            "state": ending.state,
            "reason": ending.reason,
            "step": step,
            "at": datetime.now(UTC).isoformat(),
        }
        write_bytes(uri, json.dumps(marker).encode())
        log(f"training {ending.state}: marker written to {uri}")
    except Exception as exc:
        print(f"cannot write the ended marker {uri}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)


def run(settings: dict[str, Any]) -> Ending:
    """Train to MAX_STEPS from the latest complete checkpoint, checkpointing on the way.

    Raises:
        ConfigError: the settings are unusable.
    """
    if min(settings["max_steps"], settings["checkpoint_every"], settings["batch_size"]) < 1:
        raise ConfigError("MAX_STEPS, CHECKPOINT_EVERY and BATCH_SIZE must be >= 1")

    with open_reporting() as reporter:
        # Every rank reads storage before any rank can write to it (rank 0 writes only once all
        # ranks have joined the process group), so all ranks resume from the same step.
        latest = None if settings["smoke"] else latest_checkpoint(settings["output_uri"])
        if latest and latest[0] >= settings["max_steps"]:
            log(f"checkpoint at step {latest[0]} already reaches MAX_STEPS={settings['max_steps']}; nothing to do")
            reporter.report_asset_materialization(
                metadata={
                    "steps": latest[0],
                    "final_loss": read_manifest(latest[1]).get("loss"),
                    "checkpoints": [],
                    "resumed_from_step": latest[0],
                }
            )
            return Ending("succeeded", step=latest[0])

        # Imported only now: torch takes seconds to load, which a finished run should not wait for.
        from workloads.training import TrainingError, TrainSettings, train

        try:
            result = train(
                TrainSettings(**settings),
                latest[1] if latest else None,
                log,
                on_checkpoint=lambda step: reporter.report_custom_message(saved("checkpoint", step=step)),
            )
        except TrainingError as exc:
            print(str(exc), file=sys.stderr, flush=True)
            return Ending("failed", reason=one_line(str(exc)))
        log(f"finished at step {settings['max_steps']}; final loss {result.final_loss:.4f}")
        reporter.report_asset_materialization(
            metadata={
                "steps": settings["max_steps"],
                "final_loss": round(result.final_loss, 6),
                "checkpoints": result.checkpoints,
                "resumed_from_step": result.resumed_from_step,
            }
        )
    return Ending("succeeded", step=settings["max_steps"])


def main() -> int:
    """Train, then (rank 0, when ENDED_MARKER_URI is set, not in smoke mode) mark how it ended."""
    settings, marker_uri = read_settings()
    if settings["rank"] != 0 or settings["smoke"]:
        marker_uri = None  # one marker per training; a smoke test is not the training
    elif marker_uri is None:  # nobody journaled this start: the orchestrator gives the marker with its entry
        marker_uri = journal_own_start(settings["output_uri"])
    try:
        ending = run(settings)
    except ConfigError as exc:  # bad settings: a restart of the job fails the same way
        if marker_uri:
            write_ended_marker(
                marker_uri, settings["output_uri"], Ending("failed", one_line(f"configuration error: {exc}"))
            )
        raise
    # A failed run (a TrainingError, a crash) writes no marker: SkyPilot may restart the job on an
    # error (the task's job_recovery), and it resumes. The orchestrator records the failure once the
    # managed job is over. Neither does a signal (a preempted job is recovered and resumes).
    if marker_uri and ending.state == "succeeded":
        write_ended_marker(marker_uri, settings["output_uri"], ending)
    return 0 if ending.state == "succeeded" else 1


if __name__ == "__main__":
    run_main(main)
