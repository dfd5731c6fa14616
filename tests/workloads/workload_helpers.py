"""Helpers for the workload tests: run the programs as real subprocesses, as on a GPU node."""

from __future__ import annotations

import io
import json
import os
import socket
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from gpudoor_pipelines.data.synthetic import caption_text, generate_image, image_id
from gpudoor_pipelines.transit import uris as storage
from gpudoor_pipelines.transit.bucket import MANIFEST_NAME

ROOT = Path(__file__).resolve().parents[2]
# Upper bound for any one wait: generous, because a loaded CI runner can be many times slower (seven
# trainings started at once beside the test bed once took over 180 s to write a first checkpoint).
PATIENCE_S = 600
# The training scenario of conftest.train_runs.
MAX_STEPS = 60
CHECKPOINT_EVERY = 20
# Images per part in the caption preemption scenario: several parts, so the kill lands midway.
KILL_PART_SIZE = 16


def base_env(**overrides: str) -> dict[str, str]:
    """This process's environment minus any Pipes/SkyPilot settings, plus ``overrides``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DAGSTER_PIPES_", "SKYPILOT_"))}
    # One thread per process: two ranks on a two-core runner otherwise fight over the cores.
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.update(overrides)
    return env


def run_workload(name: str, timeout: float = PATIENCE_S, **env: str) -> subprocess.CompletedProcess[str]:
    """Run ``python -m workloads.<name>`` to completion with ``env`` added to :func:`base_env`."""
    return subprocess.run(
        [sys.executable, "-m", f"workloads.{name}"],
        cwd=ROOT,
        env=base_env(**env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


_started: list[subprocess.Popen[Any]] = []


def start_workload(name: str, log: Path, **env: str) -> subprocess.Popen[bytes]:
    """Start ``python -m workloads.<name>`` in the background, stdout and stderr into ``log``."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", f"workloads.{name}"], cwd=ROOT, env=base_env(**env), stdout=out, stderr=out
        )
    _started.append(proc)
    return proc


def kill_leftovers() -> None:
    """Kill the background programs this session started that are still running (after a failure)."""
    for proc in _started:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def wait_for(
    condition: Callable[[], bool],
    proc: subprocess.Popen[bytes],
    what: str,
    log: Path,
    timeout: float = PATIENCE_S,
) -> None:
    """Poll ``condition`` until true; fail (killing ``proc``, showing ``log``) on timeout or early exit."""
    deadline = time.monotonic() + timeout
    while not condition():
        if proc.poll() is not None:
            raise AssertionError(f"process exited (rc={proc.returncode}) before {what}:\n{log.read_text()}")
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"timed out waiting for {what}:\n{log.read_text()}")
        time.sleep(0.02)


def free_port() -> int:
    """A TCP port on 127.0.0.1 nobody listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def exists(uri: str) -> bool:
    """Whether an object is stored at ``uri`` (through the workloads' own storage layer)."""
    bucket, key = storage.bucket_for_uri(uri)
    return bucket.exists(key)


def publish_images(folder_uri: str, indices: range) -> dict[str, str]:
    """Store synthetic images ``indices`` under ``folder_uri``; returns image URI -> true caption."""
    truth = {}
    for index in indices:
        png, color, shape = generate_image(index)
        uri = storage.join(folder_uri, f"{image_id(index)}.png")
        storage.write_bytes(uri, png)
        truth[uri] = caption_text(color, shape)
    return truth


def publish_shard(shard_uri: str, images: Sequence[str], ids: Sequence[str] | None = None) -> str:
    """Publish a data set shard listing ``images`` (with their ``ids``, as the orchestrator does; without,
    as it did before ids were recorded); returns ``shard_uri``."""
    name = shard_uri.rstrip("/").rsplit("/", 1)[-1]
    manifest = {"dataset": "synthetic", "shard": name, "count": len(images), "images": list(images)}
    if ids is not None:
        manifest["ids"] = list(ids)
    storage.publish(shard_uri, manifest)
    return shard_uri


def shard_entry(shard_uri: str, output_uri: str) -> dict[str, str]:
    """A shard's entry in a caption batch file."""
    return {
        "shard": shard_uri.rstrip("/").rsplit("/", 1)[-1],
        "shard_uri": shard_uri,
        "output_uri": output_uri,
    }


def write_batch(
    uri: str,
    shards_per_job: Sequence[Sequence[dict[str, str]]],
    window_end: float | None = None,
    pipes_envs: Sequence[Mapping[str, str]] = (),
) -> str:
    """Write a caption batch file: one job per entry of ``shards_per_job``; returns ``uri``."""
    jobs = [
        {"shards": list(shards), "pipes_env": dict(pipes_envs[rank]) if rank < len(pipes_envs) else {}}
        for rank, shards in enumerate(shards_per_job)
    ]
    storage.write_bytes(uri, json.dumps({"window_end": window_end, "jobs": jobs}).encode())
    return uri


def part_uris(output_uri: str) -> list[str]:
    """The Parquet part files under ``output_uri``, in order."""
    return [u for u in storage.list_uris(output_uri) if u.endswith(".parquet")]


def read_parts(output_uri: str) -> pd.DataFrame:
    """Every row of every part under ``output_uri``, with the name of its part in column ``part``."""
    frames = [
        pd.read_parquet(io.BytesIO(storage.read_bytes(uri))).assign(part=uri.rsplit("/", 1)[-1])
        for uri in part_uris(output_uri)
    ]
    if not frames:
        return pd.DataFrame(columns=["image_uri", "image_id", "caption", "model", "error", "part"])
    return pd.concat(frames, ignore_index=True)


def read_manifest(folder_uri: str) -> dict[str, Any] | None:
    """The published manifest of ``folder_uri``, or None."""
    uri = storage.join(folder_uri, MANIFEST_NAME)
    return json.loads(storage.read_bytes(uri)) if exists(uri) else None


def file_pipes_env(messages: Path) -> dict[str, str]:
    """Pipes bootstrap variables that make a program write its Pipes messages, one a line, to ``messages``.

    What a Dagster session with a temp-file message reader passes, minus Dagster: the context goes
    inline, so the job has an asset and a run to report for.
    """
    from dagster_pipes import encode_param

    context = {
        "asset_keys": ["caption"],
        "code_version_by_asset_key": None,
        "provenance_by_asset_key": None,
        "partition_key": None,
        "partition_key_range": None,
        "partition_time_window": None,
        "run_id": "test-run",
        "job_name": None,
        "retry_number": 0,
        "extras": {},
    }
    return {
        "DAGSTER_PIPES_CONTEXT": encode_param({"data": context}),
        "DAGSTER_PIPES_MESSAGES": encode_param({"path": str(messages)}),
    }


def custom_messages(messages: Path) -> list[Any]:
    """The payloads of the custom messages written to a Pipes messages file, in order."""
    if not messages.exists():
        return []
    lines = [json.loads(line) for line in messages.read_text().splitlines() if line.strip()]
    return [m["params"]["payload"] for m in lines if m["method"] == "report_custom_message"]


def run_under_pipes(
    program: str, env: dict[str, str], check_names: Sequence[str] = ()
) -> tuple[Any, subprocess.CompletedProcess[str]]:
    """Materialize an asset (named after ``program``) whose body runs the program under Dagster Pipes.

    The subprocess gets the real bootstrap variables of a ``dagster.open_pipes_session`` with the
    temp-file context injector and message reader, as a Dagster-launched job would.

    Returns:
        (the ``dagster.materialize`` result, the finished program process).
    """
    import dagster as dg  # only the Pipes tests pay for importing dagster

    finished: list[subprocess.CompletedProcess[str]] = []

    @dg.asset(name=program, check_specs=[dg.AssetCheckSpec(name, asset=program) for name in check_names])
    def _asset(context):  # unannotated: dagster rejects the string annotations of this module
        with dg.open_pipes_session(
            context=context,
            context_injector=dg.PipesTempFileContextInjector(),
            message_reader=dg.PipesTempFileMessageReader(),
        ) as session:
            finished.append(
                subprocess.run(
                    [sys.executable, "-m", f"workloads.{program}"],
                    cwd=ROOT,
                    env={**base_env(**env), **session.get_bootstrap_env_vars()},
                    capture_output=True,
                    text=True,
                    timeout=PATIENCE_S,
                )
            )
        yield from session.get_results()

    result = dg.materialize([_asset], instance=dg.DagsterInstance.ephemeral(), raise_on_error=False)
    return result, finished[0]


def run_caption_batch_under_pipes(
    batch_uri: str, shards_per_job: Sequence[Sequence[dict[str, str]]], **env: str
) -> tuple[Any, list[subprocess.CompletedProcess[str]], list[Any]]:
    """Materialize one asset whose body runs a caption batch, every job at once, under one Pipes session.

    As the orchestrator does: a composite message reader with one temp-file reader per job, and each
    job's own bootstrap variables in its entry of the batch file (``pipes_env``).

    Returns:
        (the ``dagster.materialize`` result, the finished jobs by rank, the custom messages received).
    """
    import dagster as dg  # only the Pipes tests pay for importing dagster

    finished: list[subprocess.CompletedProcess[str]] = []
    received: list[Any] = []
    num_jobs = len(shards_per_job)

    @dg.asset(name="caption")
    def _asset(context):  # unannotated: dagster rejects the string annotations of this module
        readers = [dg.PipesTempFileMessageReader() for _ in range(num_jobs)]
        with dg.open_pipes_session(
            context=context,
            context_injector=dg.PipesTempFileContextInjector(),
            message_reader=dg.PipesCompositeMessageReader(readers),
        ) as session:
            write_batch(batch_uri, shards_per_job, pipes_envs=session.get_per_writer_bootstrap_env_vars())
            procs = [
                subprocess.Popen(
                    [sys.executable, "-m", "workloads.caption"],
                    cwd=ROOT,
                    env=base_env(
                        CAPTION_BATCH_URI=batch_uri,
                        SKYPILOT_JOB_RANK=str(rank),
                        SKYPILOT_NUM_JOBS=str(num_jobs),
                        **env,
                    ),
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
                for rank in range(num_jobs)
            ]
            _started.extend(procs)
            for proc in procs:
                stdout, stderr = proc.communicate(timeout=PATIENCE_S)
                finished.append(subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr))
        received.extend(session.get_custom_messages())
        yield from session.get_results()

    with warnings.catch_warnings():  # the composite reader is a preview feature; it is what we use
        warnings.simplefilter("ignore", dg.PreviewWarning)
        result = dg.materialize([_asset], instance=dg.DagsterInstance.ephemeral(), raise_on_error=False)
    return result, finished, received
