"""Helpers for the workload tests: run the programs as real subprocesses, as on a GPU node."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from gpudoor_pipelines.transit import bucket as storage

ROOT = Path(__file__).resolve().parents[2]
# Upper bound for any one wait: generous, because a loaded CI runner can be many times slower.
PATIENCE_S = 180
# The training scenario of conftest.train_runs.
MAX_STEPS = 60
CHECKPOINT_EVERY = 20


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


_started: list[subprocess.Popen[bytes]] = []


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


def caption_files(output_uri: str) -> list[str]:
    """The per-image caption URIs (not the manifest) under ``output_uri``."""
    return [u for u in storage.list_uris(output_uri) if not u.endswith(storage.MANIFEST_NAME)]


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
