#!/usr/bin/env python
"""The agent door's speed: seconds per ``gpudoor status | logs | cancel | where --json`` call.

    python benchmarks/agent_door.py [--calls 7]

Agents call these commands in loops, each a new process. Two measures, each against a baseline run in the
same process, on the same machine:

* the embedded default (a fresh ``GPUDOOR_HOME``, one short job launched first): each command, ``--calls``
  times, median seconds a call, against the bare interpreter (``python -c pass``). The figure to meet is
  0.5 s a call on a 2-core machine. ``where`` is timed with what SkyPilot read of the task file kept (as on
  every call but an agent's first with a new file) and, once, with nothing kept.
* SkyPilot, when ``SKYPILOT_API_SERVER_ENDPOINT`` is set (on the test bed:
  ``set -a; . testbed/.state/env; set +a``): ``gpudoor status JOB --json`` and ``gpudoor logs JOB --json``
  against a bare Python script making the same SDK call (``sky.jobs.queue_v2`` of that job,
  ``sky.jobs.tail_logs`` of it), taking turns. The figure to meet is within 1.1x of the script.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GPUDOOR = str(Path(sys.executable).parent / "gpudoor")
SPEC = {"name": "bench-door", "resources": {"accelerators": "L4:1"}, "run": "echo door-line; sleep 1"}


def _seconds(argv: list[str], env: dict[str, str]) -> tuple[float, subprocess.CompletedProcess]:
    started = time.perf_counter()
    out = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    return time.perf_counter() - started, out


def _median(argv: list[str], env: dict[str, str], calls: int, ok=(0,)) -> float:
    times = []
    for _ in range(calls):
        seconds, out = _seconds(argv, env)
        if out.returncode not in ok:
            raise SystemExit(f"{' '.join(argv)} exited {out.returncode}: {out.stderr[-2000:]}")
        times.append(seconds)
    return statistics.median(times)


def embedded(calls: int) -> None:
    home = Path(tempfile.mkdtemp(prefix="gpudoor-bench-door-"))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SKYPILOT_", "GPUDOOR_", "AWS_", "DAGSTER_"))}
    env.update(GPUDOOR_HOME=str(home), SKYPILOT_DISABLE_USAGE_COLLECTION="1")
    spec = home / "bench-door.yaml"
    spec.write_text(json.dumps(SPEC))
    _, out = _seconds([GPUDOOR, "launch", str(spec), "--follow", "--json"], env)
    job_id = json.loads(out.stdout.splitlines()[0])["job_id"]
    bare = _median([sys.executable, "-c", "pass"], env, calls)
    cold, _ = _seconds([GPUDOOR, "where", str(spec), "--json"], {**env, "GPUDOOR_HOME": str(home / "cold")})
    rows = [
        ("status JOB", _median([GPUDOOR, "status", job_id, "--json"], env, calls)),
        ("status (my jobs)", _median([GPUDOOR, "status", "--json"], env, calls)),
        ("logs JOB", _median([GPUDOOR, "logs", job_id, "--json"], env, calls)),
        ("cancel JOB (ended)", _median([GPUDOOR, "cancel", job_id, "--json"], env, calls, ok=(0, 3))),
        ("where SPEC", _median([GPUDOOR, "where", str(spec), "--json"], env, calls)),
        ("where SPEC, first read", cold),
    ]
    print(f"embedded default: median of {calls} calls, against `python -c pass` ({bare:.3f} s)")
    for name, seconds in rows:
        verdict = "meets 0.5 s" if seconds <= 0.5 else "over 0.5 s"
        print(f"  {name:24s} {seconds:6.3f} s  {seconds / bare:5.1f}x bare  {verdict}")


BARE_STATUS = """
import sys, sky
records, *_ = sky.get(sky.jobs.queue_v2(refresh=False, all_users=True, job_ids=[int(sys.argv[1])],
                                         fields=["job_id", "job_name", "status", "infra"]))
print(records[0].status)
"""
BARE_LOGS = """
import io, sys, sky
buf = io.StringIO()
sky.jobs.tail_logs(job_id=int(sys.argv[1]), follow=False, tail=100, output_stream=buf)
print(buf.getvalue()[-200:])
"""


def skypilot(calls: int) -> None:
    env = {**os.environ, "GPUDOOR_BACKEND": "skypilot", "SKYPILOT_DISABLE_USAGE_COLLECTION": "1"}
    _, out = _seconds([GPUDOOR, "status", "--json"], env)
    jobs = json.loads(out.stdout)["jobs"]
    ended = [int(j["job_id"]) for j in jobs if j["state"] == "SUCCEEDED" and str(j["job_id"]).isdigit()]
    if not ended:
        raise SystemExit("no job of yours that succeeded on the API server to time: launch one first")
    job_id = str(max(ended))
    pairs = [
        ("status JOB", [GPUDOOR, "status", job_id, "--json"], [sys.executable, "-c", BARE_STATUS, job_id]),
        ("logs JOB", [GPUDOOR, "logs", job_id, "--json"], [sys.executable, "-c", BARE_LOGS, job_id]),
    ]
    print(f"SkyPilot ({os.environ['SKYPILOT_API_SERVER_ENDPOINT']}): median of {calls} calls, turns taken")
    for name, door, bare in pairs:
        door_s, bare_s = [], []
        for _ in range(calls):
            door_s.append(_seconds(door, env)[0])
            bare_s.append(_seconds(bare, env)[0])
        d, b = statistics.median(door_s), statistics.median(bare_s)
        verdict = "meets 1.1x" if d <= 1.1 * b else "over 1.1x"
        print(f"  {name:12s} door {d:6.3f} s  bare SDK script {b:6.3f} s  {d / b:5.2f}x  {verdict}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=7)
    args = parser.parse_args()
    embedded(args.calls)
    if os.environ.get("SKYPILOT_API_SERVER_ENDPOINT"):
        skypilot(args.calls)


if __name__ == "__main__":
    main()
