"""The launcher without Dagster: one wait loop for one job or many, and an interruption that releases.

The backend is the counting stand-in of watch_fakes.py (jobs that run for a set time, a log line a second).
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from gpudoor_pipelines.launch.config import LaunchSettings
from gpudoor_pipelines.launch.launcher import Launcher
from gpudoor_pipelines.launch.resolve.fleet import load_fleet
from gpudoor_pipelines.launch.watch import Hooks
from tests.conftest import PROJECT_ROOT
from tests.launch.watch_fakes import TimedBackend


def _launcher(backend: TimedBackend) -> Launcher:
    return Launcher(backend, load_fleet(), LaunchSettings(poll_interval_s=0.1, cancel_timeout_s=5))


def test_the_one_loop_waits_for_a_batch_and_streams_each_jobs_lines():
    backend = TimedBackend(remote_status=False)
    backend.add("a", 1.2)
    backend.add("b", 2.2)
    lines: list[str] = []
    states: list[tuple[str, str]] = []
    watched = _launcher(backend).wait(
        ["a", "b"], Hooks(line=lines.append, state=lambda j, info: states.append((j, info.state.value)))
    )
    assert {j: info.state.value for j, info in watched.infos.items()} == {"a": "SUCCEEDED", "b": "SUCCEEDED"}
    assert "[job a] a: second 0" in lines and "[job b] b: second 1" in lines  # several jobs: each line says whose
    assert ("a", "SUCCEEDED") in states and ("b", "SUCCEEDED") in states
    assert [s for _, s, _ in watched.timelines["b"].seen][-1].value == "SUCCEEDED"


def test_an_interruption_cancels_what_is_still_running_and_verifies_the_release():
    backend = TimedBackend(remote_status=False)
    backend.add("long", 60.0)
    started = time.monotonic()
    said: list[str] = []
    released: list = []

    def tick() -> None:
        if time.monotonic() - started > 0.5:
            raise KeyboardInterrupt  # what a terminated run raises in its step

    with pytest.raises(KeyboardInterrupt):
        _launcher(backend).wait(["long"], Hooks(tick=tick, said=said.append, released=released.extend))
    assert said == ["Run terminated: cancelling job long."]
    (outcome,) = released
    assert outcome.holding.id == "long" and outcome.confirmed and outcome.seen == ("job long: SUCCEEDED",)
    assert time.monotonic() - started < 5


def test_the_launcher_and_the_agent_door_import_no_dagster():
    script = (
        "import sys, gpudoor_pipelines.launch.launcher, gpudoor_pipelines.cli.agent, "
        "gpudoor_pipelines.launch.backends.local, gpudoor_pipelines.launch.backends.skypilot\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] in ('dagster', 'dagster_aws', 'sky'))\n"
        "assert not loaded, loaded"
    )
    out = subprocess.run([sys.executable, "-c", script], cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
