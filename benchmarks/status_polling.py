#!/usr/bin/env python
"""Status polling: API requests per job-minute with 50 concurrent steps, before and after the status hub.

    python benchmarks/status_polling.py [--steps 50] [--job-seconds 60] [--stagger 10]

Each step, as in a run, reads what the team's jobs hold (the launch's cap check), then watches its
job until it ends: its log streams from ``sky.jobs.tail_logs(follow=True)`` and its state comes from
``sky.jobs.queue_v2``. The SDK is a counting stand-in whose jobs run ``--job-seconds`` from
submission (starts spread over ``--stagger`` seconds) and whose log stream ends with the job:
SkyPilot's API server cannot run 50 jobs on these machines. The same ``SkyPilotBackend`` serves both
cases, in the same process:

* before: what each step did until now: a full ``queue_v2`` for the caps, then one ``queue_v2`` for
  its own job every 0.5 s;
* after: the package's code: the caps read cached for 2 s, the job watched through the process's
  status hub (one request covers every watched job), backing off to 20 s, and asked at once when
  its log stream ends;
* after, one step per process: the same code with one step alone (Dagster's default executor runs
  each step in a process of its own, where no other step shares the hub), scaled to 50 steps.

Prints requests per job-minute for each, the ratio against before, and how long after its log stream
ended each step noticed its job's end (median, max).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
import types
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("SKYPILOT_DISABLE_USAGE_COLLECTION", "1")


class TimedSky:
    """The SDK calls the steps make, answered from jobs that run for a set time; every request counted."""

    def __init__(self, job_seconds: float) -> None:
        self.job_seconds = job_seconds
        self.ends: dict[int, float] = {}
        self.stream_ended: dict[int, float] = {}
        self.requests = {"queue_v2 (one job or some)": 0, "queue_v2 (every job, for caps)": 0, "tail_logs": 0}
        self._lock = threading.Lock()
        self.jobs = types.SimpleNamespace(
            queue_v2=self._queue_v2, tail_logs=self._tail_logs, pool_status=lambda names: []
        )

    def get(self, request):
        return request

    def add(self, job_id: int, start: float) -> None:
        self.ends[job_id] = start + self.job_seconds

    def _record(self, job_id: int):
        done = time.monotonic() >= self.ends[job_id]
        return types.SimpleNamespace(
            job_id=job_id,
            job_name=f"step-{job_id}",
            status=types.SimpleNamespace(value="SUCCEEDED" if done else "RUNNING"),
            cloud="slurm",
            region="bed",
            zone=None,
            infra="",
            recovery_count=0,
            submitted_at=None,
            start_at=None,
            end_at=None,
            failure_reason=None,
            details=None,
            labels={"gpudoor-pool": "onprem", "gpudoor-user": "ana"},
            accelerators={"L4": 1},
            resources="1x[L4:1]",
        )

    def _queue_v2(self, refresh=False, skip_finished=False, all_users=True, job_ids=None, fields=None, **_):
        with self._lock:
            kind = "queue_v2 (every job, for caps)" if job_ids is None else "queue_v2 (one job or some)"
            self.requests[kind] += 1
            ids = job_ids if job_ids is not None else list(self.ends)
        records = [self._record(j) for j in ids if j in self.ends]
        if skip_finished:
            records = [r for r in records if r.status.value != "SUCCEEDED"]
        return records, len(records), {}, len(records)

    def _tail_logs(self, job_id: int, follow: bool = True, tail: int = 0, output_stream=None) -> int:
        with self._lock:
            self.requests["tail_logs"] += 1
        while follow and time.monotonic() < self.ends[job_id]:
            output_stream.write(f"step {job_id} working\n")
            time.sleep(min(1.0, max(0.0, self.ends[job_id] - time.monotonic())))
        self.stream_ended[job_id] = time.monotonic()
        return 0


def _run(case: str, steps: int, job_seconds: float, stagger: float) -> dict:
    from gpudoor_pipelines.launch import watch
    from gpudoor_pipelines.launch.backends import sky_sdk
    from gpudoor_pipelines.launch.backends import skypilot as skypilot_backend
    from gpudoor_pipelines.launch.config import LaunchSettings
    from gpudoor_pipelines.launch.job import JobState
    from gpudoor_pipelines.launch.launcher import Launcher
    from gpudoor_pipelines.launch.resolve.fleet import load_fleet

    fake = TimedSky(job_seconds)
    sky_sdk.sky = lambda: fake
    skypilot_backend._USAGE_CACHE.clear()
    watch._HUBS.clear()
    settings = LaunchSettings(backend="skypilot", api_server_endpoint="http://127.0.0.1:1")
    noticed: dict[int, float] = {}
    t0 = time.monotonic()

    def step(job_id: int) -> None:
        time.sleep(stagger * job_id / max(1, steps - 1))
        backend = skypilot_backend.SkyPilotBackend("http://127.0.0.1:1")  # a step's own, as in a run
        if case == "before":
            backend._read_usage()
        else:
            backend.usage()
        fake.add(job_id, time.monotonic())
        if case == "before":  # the step's loop until now: its own job's state every 0.5 s
            follower = backend.follow_logs(str(job_id))
            while backend.status(str(job_id)).state is not JobState.SUCCEEDED:
                follower.poll()
                time.sleep(0.5)
            follower.close()
        else:
            Launcher(backend, load_fleet(), settings).wait([str(job_id)])
        noticed[job_id] = time.monotonic()

    threads = [threading.Thread(target=step, args=(i,)) for i in range(steps)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - t0
    status = sum(v for k, v in fake.requests.items() if k.startswith("queue_v2"))
    delays = [noticed[j] - fake.stream_ended[j] for j in noticed]
    return {
        "case": case,
        "steps": steps,
        "wall_s": wall,
        "requests": dict(fake.requests),
        "status_requests": status,
        "per_job_minute": status / (steps * job_seconds / 60.0),
        "delay_median": statistics.median(delays),
        "delay_max": max(delays),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--job-seconds", type=float, default=60.0)
    parser.add_argument("--stagger", type=float, default=10.0)
    args = parser.parse_args()
    before = _run("before", args.steps, args.job_seconds, args.stagger)
    after = _run("after", args.steps, args.job_seconds, args.stagger)
    alone = _run("after, one step per process", 1, args.job_seconds, 0.0)
    for r in (before, after, alone):
        print(
            f"{r['case']:>30}: {r['steps']} steps of {args.job_seconds:.0f} s, {r['status_requests']} API requests "
            f"({r['requests']}), {r['per_job_minute']:.1f} per job-minute; end noticed "
            f"{r['delay_median']:.2f} s (median) / {r['delay_max']:.2f} s (max) after the log stream ended"
        )
    print(
        f"requests per job-minute, after vs before: {after['per_job_minute'] / before['per_job_minute']:.3f}x "
        f"({before['per_job_minute'] / after['per_job_minute']:.0f}x fewer)"
    )
    print(
        "requests per job-minute, one step per process vs before: "
        f"{alone['per_job_minute'] / before['per_job_minute']:.3f}x "
        f"({before['per_job_minute'] / alone['per_job_minute']:.0f}x fewer)"
    )


if __name__ == "__main__":
    main()
