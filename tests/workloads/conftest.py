"""Fixtures for the workload tests: a file:// bucket, a synthetic shard, and the runs over it.

Each program run costs seconds (torch alone takes a few to import), so the fixtures run each
scenario once per session and several tests check different things about the same runs.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import pytest
from workload_helpers import (
    CHECKPOINT_EVERY,
    KILL_PART_SIZE,
    MAX_STEPS,
    PATIENCE_S,
    exists,
    free_port,
    kill_leftovers,
    part_uris,
    publish_images,
    publish_shard,
    read_manifest,
    read_parts,
    run_caption_batch_under_pipes,
    run_workload,
    shard_entry,
    start_workload,
    wait_for,
    write_batch,
)

from gpudoor_pipelines.transit import uris as storage
from gpudoor_pipelines.transit.bucket import MANIFEST_NAME

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
def shard(bucket: str) -> tuple[str, dict[str, str]]:
    """A published shard of NUM_IMAGES synthetic images, stored in a folder of their own.

    Returns:
        (shard URI, image URI -> true caption).
    """
    truth = publish_images(storage.join(bucket, "images", "main"), range(NUM_IMAGES))
    return publish_shard(storage.join(bucket, "shards", "shard-0000"), list(truth)), truth


@pytest.fixture(scope="session")
def caption_runs(bucket: str, shard: tuple[str, dict], tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The shard captioned across a preemption: a job SIGKILLed midway, then the next batch under Pipes.

    The second batch has two jobs: rank 0 resumes the shard, rank 1 captions a small shard of its own;
    each reports through its own Pipes channel of one Dagster session.

    Returns:
        {"output": captions URI, "parts_before": part name -> (bytes, mtime) the killed job left,
        "had_manifest_before": bool, "first_log": its log, "other": (shard URI, truth, output URI) of
        rank 1, "result": the Dagster result, "reruns": the jobs by rank, "messages": custom messages}.
    """
    output = storage.join(bucket, "captions", "shard-0000")
    logs = tmp_path_factory.mktemp("caption")
    batch = storage.join(bucket, "batches", "night-1.json")
    write_batch(batch, [[shard_entry(shard[0], output)]])
    first = start_workload(
        "caption",
        logs / "first.log",
        CAPTION_BATCH_URI=batch,
        IMAGES_PER_PART=str(KILL_PART_SIZE),
        WORKLOAD_THROTTLE_S="0.02",
    )
    wait_for(lambda: part_uris(output), first, "the first part", logs / "first.log")
    first.send_signal(signal.SIGKILL)  # a preemption: no chance to clean up
    first.wait(timeout=PATIENCE_S)
    parts_before = {
        uri.rsplit("/", 1)[-1]: (storage.read_bytes(uri), os.stat(uri.removeprefix("file://")).st_mtime_ns)
        for uri in part_uris(output)
    }
    had_manifest = read_manifest(output) is not None

    other_truth = publish_images(storage.join(bucket, "images", "other"), range(NUM_IMAGES, NUM_IMAGES + 5))
    other_shard = publish_shard(storage.join(bucket, "shards", "shard-0001"), list(other_truth))
    other_output = storage.join(bucket, "captions", "shard-0001")
    shards_per_job = [[shard_entry(shard[0], output)], [shard_entry(other_shard, other_output)]]
    batch = storage.join(bucket, "batches", "night-2.json")
    result, reruns, messages = run_caption_batch_under_pipes(batch, shards_per_job, IMAGES_PER_PART=str(KILL_PART_SIZE))
    return {
        "output": output,
        "parts_before": parts_before,
        "had_manifest_before": had_manifest,
        "first_log": (logs / "first.log").read_text(),
        "other": (other_shard, other_truth, other_output),
        "result": result,
        "reruns": reruns,
        "messages": messages,
    }


@pytest.fixture(scope="session")
def dataset(bucket: str, caption_runs: dict) -> str:
    """A Parquet data set (image_id, image_uri, caption) built from the captions of the shard."""
    assert [p.returncode for p in caption_runs["reruns"]] == [0, 0], [p.stderr for p in caption_runs["reruns"]]
    rows = read_parts(caption_runs["output"])
    uri = storage.join(bucket, "datasets", "captions.parquet")
    path = uri.removeprefix("file://")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    rows[["image_id", "image_uri", "caption"]].to_parquet(path)
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
    first_manifest = storage.join(output, f"step-{CHECKPOINT_EVERY:06d}", MANIFEST_NAME)
    wait_for(lambda: exists(first_manifest), first, "the first checkpoint", logs / "first.log")
    first.send_signal(signal.SIGKILL)
    first.wait(timeout=PATIENCE_S)
    killed_before_end = not exists(storage.join(output, f"step-{MAX_STEPS:06d}", MANIFEST_NAME))
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
