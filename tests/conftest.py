"""Shared fixtures: every test gets its own GPUDOOR_HOME and DAGSTER_HOME, and SkyPilot stays offline."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import boto3
import pytest

PROJECT_ROOT = Path(__file__).resolve().parents[1]
SPECS_DIR = PROJECT_ROOT / "task_specs"


def python_json(code: str, env: dict[str, str], *, drop: tuple[str, ...] = ()) -> dict:
    """Runs ``code`` in a fresh interpreter (SkyPilot's state and config stay out of this process), with this
    process's environment less the variables starting with one of ``drop``, plus ``env``; returns its last
    stdout line, JSON."""
    import json
    import textwrap

    base = {k: v for k, v in os.environ.items() if not (drop and k.startswith(drop))}
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env={**base, "SKYPILOT_DISABLE_USAGE_COLLECTION": "1", **env},
        cwd=PROJECT_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def given_inputs(spec) -> dict[str, str]:
    """Values for a task spec's required inputs (``envs: {NAME: null}``), as a launch gives them."""
    return {name: f"s3://team/inputs/{name.lower()}" for name in spec.required}


os.environ["SKYPILOT_DISABLE_USAGE_COLLECTION"] = "1"
# A SkyPilot client that has no endpoint must fail, never start a private API server of its own.
os.environ["SKYPILOT_DISABLE_LOCAL_API_SERVER"] = "1"

# Started from a background shell (CI, nohup), pytest inherits SIGINT ignored; each Dagster run then copies
# SIGINT's disposition to SIGTERM, and every program a test starts afterwards would ignore SIGTERM too (a
# job that cannot be stopped the way SkyPilot and the local runner stop it). Tests start from the defaults.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
if signal.getsignal(signal.SIGTERM) is signal.SIG_IGN:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


@pytest.fixture(autouse=True)
def _isolated_homes(tmp_path_factory, monkeypatch):
    home = tmp_path_factory.mktemp("gpudoor_home")
    monkeypatch.setenv("GPUDOOR_HOME", str(home))
    dagster_home = tmp_path_factory.mktemp("dagster_home")
    (dagster_home / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
    monkeypatch.setenv("DAGSTER_HOME", str(dagster_home))
    for var in ("GPUDOOR_BACKEND", "GPUDOOR_TRANSIT", "SKYPILOT_API_SERVER_ENDPOINT"):
        monkeypatch.delenv(var, raising=False)
    _forget_process_state()  # each test's fake API server is new: no job states or usage from the last one
    yield home


def _forget_process_state() -> None:
    from gpudoor_pipelines import outage
    from gpudoor_pipelines.launch import watch
    from gpudoor_pipelines.launch.backends import skypilot as skypilot_backend
    from gpudoor_pipelines.launch.backends import step_clusters

    watch._HUBS.clear()
    step_clusters._STEPS.clear()
    skypilot_backend._USAGE_CACHE.clear()
    skypilot_backend._USAGE_STALE.clear()
    outage._SERVICES.clear()  # which services answered, and since when one has not


@pytest.fixture
def fake_sky(monkeypatch):
    """The SkyPilot backend talking to the fake SDK of tests/launch/fake_sky.py (no API server)."""
    from tests.launch.fake_sky import FakeSky, install

    return install(monkeypatch, FakeSky("http://127.0.0.1:1"))


@pytest.fixture(scope="session")
def s3_server() -> Iterator[str]:
    """Endpoint URL (http://127.0.0.1:PORT) of an S3-compatible server.

    ``GPUDOOR_TEST_S3_ENDPOINT`` if set; otherwise a ``moto.server.ThreadedMotoServer`` on a free
    127.0.0.1 port, run in a child process (``s3_test_server.py``) so that server and client do not
    share one GIL, and stopped at the end of the session.
    """
    endpoint = os.environ.get("GPUDOOR_TEST_S3_ENDPOINT")
    if endpoint:
        yield endpoint.rstrip("/")
        return
    proc = subprocess.Popen(
        [
            sys.executable,
            str(Path(__file__).parent / "transit" / "s3_test_server.py"),
            "-H",
            "127.0.0.1",
            "-p",
            "0",
            "--exit-on-stdin-eof",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline().strip()
        if not line.isdigit():
            raise RuntimeError(f"the moto S3 test server did not start (printed {line!r})")
        endpoint = f"http://127.0.0.1:{int(line)}"
        _wait_until_up(endpoint)
        yield endpoint
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _wait_until_up(endpoint: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            boto3.client(
                "s3",
                endpoint_url=endpoint,
                region_name="us-east-1",
                aws_access_key_id="test",
                aws_secret_access_key="test",
            ).list_buckets()
            return
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


# ---------------------------------------------------------------- what each test did, as it happens
# tests/lanes.py names a file per lane (GPUDOOR_LANE_EVENTS): each test's outcome and seconds are appended
# the moment they are known, and a failure's report too, so a lane cut off by its bound still says which
# tests failed and why (pytest's own summary comes only at the end).
_EVENTS = os.environ.get("GPUDOOR_LANE_EVENTS")


def pytest_runtest_logstart(nodeid, location):
    if _EVENTS:
        with open(_EVENTS, "a") as out:
            out.write(f"started\tsetup\t0\t{nodeid}\n")


def pytest_runtest_logreport(report):
    if not _EVENTS:
        return
    failed = report.failed or (report.when == "call" and report.outcome == "rerun")
    # A setup that takes a while (a shared scenario run once for several tests) counts toward its test's time.
    if report.when != "call" and not failed and not (report.when == "setup" and report.duration >= 1.0):
        return
    outcome = "rerun" if report.outcome == "rerun" else ("failed" if report.failed else report.outcome)
    why = ""
    if failed:
        text = report.longreprtext.splitlines()
        why = next((line[1:].strip() for line in text if line.startswith("E ")), text[-1] if text else "")[:200]
    with open(_EVENTS, "a") as out:
        out.write(f"{outcome}\t{report.when}\t{report.duration:.2f}\t{report.nodeid}\t{why}\n")
    if failed:
        captured = "".join(
            f"\n----- {title}\n{text[-4000:]}" for title, text in report.sections if "log" in title or "std" in title
        )
        with open(_EVENTS + ".failures", "a") as out:
            out.write(
                f"\n===== {outcome.upper()} {report.nodeid} ({report.when})\n{report.longreprtext[-6000:]}{captured}\n"
            )
