"""Fixtures for the workload tests: a file:// bucket, a synthetic shard, and the runs over it.

Each program run costs seconds (torch alone takes a few to import), so the fixtures run each
scenario once per session and several tests check different things about the same runs.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator

import pandas as pd
import pytest
from workload_helpers import (
    CHECKPOINT_EVERY,
    MAX_STEPS,
    PATIENCE_S,
    caption_files,
    exists,
    free_port,
    kill_leftovers,
    run_under_pipes,
    run_workload,
    start_workload,
    wait_for,
)

from gpudoor_pipelines.transit import bucket as storage
from workloads.synthetic import generate_image, image_id

NUM_IMAGES = 100


@pytest.fixture(scope="session", autouse=True)
def _no_leftover_processes() -> Iterator[None]:
    """A failed test must not leave a program running behind the session."""
    yield
    kill_leftovers()


@pytest.fixture(scope="session")
def bucket(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A local folder standing in for the transit bucket, as a file:// URI."""
    return "file://" + str(tmp_path_factory.mktemp("bucket"))


@pytest.fixture(scope="session")
def shard(bucket: str) -> tuple[str, dict[str, tuple[str, str]]]:
    """A shard of NUM_IMAGES synthetic images; returns (shard URI, image id -> (colour, shape))."""
    uri = storage.join(bucket, "shard-0000")
    truth = {}
    for index in range(NUM_IMAGES):
        png, color, shape = generate_image(index)
        storage.write_bytes(storage.join(uri, "images", f"{image_id(index)}.png"), png)
        truth[image_id(index)] = (color, shape)
    return uri, truth


@pytest.fixture(scope="session")
def caption_runs(bucket: str, shard: tuple[str, dict], tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The shard captioned across a preemption: a run SIGKILLed midway, then a rerun under Pipes.

    Returns:
        {"output": captions URI, "done_before": captions the killed run left,
        "had_manifest_before": bool, "rerun": the rerun's process, "result": its Dagster result}.
    """
    output = storage.join(bucket, "captions", "shard-0000")
    logs = tmp_path_factory.mktemp("caption")
    env = dict(SHARD_URI=shard[0], OUTPUT_URI=output, REPORT_EVERY="25")
    first = start_workload("caption", logs / "first.log", WORKLOAD_THROTTLE_S="0.03", **env)
    wait_for(lambda: len(caption_files(output)) >= 10, first, "the first captions", logs / "first.log")
    first.send_signal(signal.SIGKILL)  # a preemption: no chance to clean up
    first.wait(timeout=PATIENCE_S)
    done_before = len(caption_files(output))
    had_manifest = exists(storage.join(output, storage.MANIFEST_NAME))
    result, rerun = run_under_pipes("caption", env)
    return {
        "output": output,
        "done_before": done_before,
        "had_manifest_before": had_manifest,
        "rerun": rerun,
        "result": result,
    }


@pytest.fixture(scope="session")
def dataset(bucket: str, caption_runs: dict) -> str:
    """A Parquet data set (image_id, image_uri, caption) built from caption.py's output."""
    assert caption_runs["rerun"].returncode == 0, caption_runs["rerun"].stderr
    rows = [json.loads(storage.read_bytes(uri)) for uri in caption_files(caption_runs["output"])]
    uri = storage.join(bucket, "datasets", "captions.parquet")
    path = uri.removeprefix("file://")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    pd.DataFrame(rows)[["image_id", "image_uri", "caption"]].to_parquet(path)
    return uri


@pytest.fixture(scope="session")
def train_runs(bucket: str, dataset: str, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Training interrupted and recovered, as a managed job would be, plus a smoke run alongside.

    1. One node trains toward MAX_STEPS and is SIGKILLed right after its first checkpoint (a smoke
       run, SMOKE_TEST=1 into its own prefix, runs meanwhile: both are mostly waiting).
    2. The job restarts on two nodes (two processes, SKYPILOT_NUM_NODES=2), which resume together.
    3. It is started once more, with nothing left to do.

    Returns:
        A dict of the prefixes, the processes' logs and exit codes.
    """
    logs = tmp_path_factory.mktemp("train")
    output = storage.join(bucket, "checkpoints", "train")
    smoke_output = storage.join(bucket, "checkpoints", "smoke")
    env = dict(
        DATASET_URI=dataset,
        OUTPUT_URI=output,
        CHECKPOINTS_DIR=str(logs / "scratch"),
        MAX_STEPS=str(MAX_STEPS),
        CHECKPOINT_EVERY=str(CHECKPOINT_EVERY),
        BATCH_SIZE="32",
        LEARNING_RATE="0.01",
    )
    smoke_env = dict(
        env,
        OUTPUT_URI=smoke_output,
        CHECKPOINTS_DIR=str(logs / "smoke-scratch"),
        MAX_STEPS="4",
        CHECKPOINT_EVERY="2",
        BATCH_SIZE="8",
        SMOKE_TEST="1",
    )
    smoke = start_workload("train", logs / "smoke.log", **smoke_env)
    first = start_workload("train", logs / "first.log", **dict(env, WORKLOAD_THROTTLE_S="0.1"))
    first_manifest = storage.join(output, f"step-{CHECKPOINT_EVERY:06d}", storage.MANIFEST_NAME)
    wait_for(lambda: exists(first_manifest), first, "the first checkpoint", logs / "first.log")
    first.send_signal(signal.SIGKILL)
    first.wait(timeout=PATIENCE_S)
    killed_before_end = not exists(storage.join(output, f"step-{MAX_STEPS:06d}", storage.MANIFEST_NAME))
    smoke_rc = smoke.wait(timeout=PATIENCE_S)

    two_node_env = dict(
        env,
        SKYPILOT_NUM_NODES="2",
        SKYPILOT_NODE_IPS="127.0.0.1\n127.0.0.1",
        SKYPILOT_NUM_GPUS_PER_NODE="0",
        MASTER_PORT=str(free_port()),
        DIST_TIMEOUT_S="120",
    )
    ranks = [
        start_workload("train", logs / f"rank{rank}.log", **two_node_env, SKYPILOT_NODE_RANK=str(rank))
        for rank in (0, 1)
    ]
    rank_rcs = [proc.wait(timeout=PATIENCE_S) for proc in ranks]
    again = run_workload("train", **env)
    return {
        "output": output,
        "smoke_output": smoke_output,
        "smoke_scratch": logs / "smoke-scratch",
        "smoke": (smoke_rc, (logs / "smoke.log").read_text()),
        "killed_before_end": killed_before_end,
        "ranks": [(rc, (logs / f"rank{rank}.log").read_text()) for rank, rc in enumerate(rank_rcs)],
        "again": again,
    }


@pytest.fixture(scope="session")
def final_checkpoint(train_runs: dict) -> str:
    """The URI of the last checkpoint of the recovered training run."""
    assert [rc for rc, _ in train_runs["ranks"]] == [0, 0], train_runs["ranks"]
    return storage.join(train_runs["output"], f"step-{MAX_STEPS:06d}")
