"""A backend whose jobs run for a set time and count every status request: for the watching tests and
the polling benchmark. It stands in for SkyPilot's API server, which cannot run 50 GPU jobs here."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

from gpudoor_pipelines.launch.backends.base import Backend, LogFollower
from gpudoor_pipelines.launch.job import JobInfo, JobState
from gpudoor_pipelines.launch.resolve.usage import Usage


class _TimedFollower(LogFollower):
    """A log that prints a line a second and ends with its job."""

    def __init__(self, backend: TimedBackend, job_id: str) -> None:
        self.backend, self.job_id, self._printed = backend, job_id, 0

    def poll(self) -> list[str]:
        if self.job_id not in self.backend.jobs:
            return []
        start, end = self.backend.jobs[self.job_id]
        due = int(min(time.monotonic(), end) - start)
        lines = [f"{self.job_id}: second {i}" for i in range(self._printed, due)]
        self._printed = max(self._printed, due)
        return lines

    @property
    def ended(self) -> bool:
        return self.job_id in self.backend.jobs and time.monotonic() >= self.backend.jobs[self.job_id][1]


class TimedBackend(Backend):
    """Jobs that run from their submission for ``seconds``; ``requests`` counts status and usage requests."""

    name = "timed"

    def __init__(self, *, remote_status: bool = True) -> None:
        self.remote_status = remote_status
        self.jobs: dict[str, tuple[float, float]] = {}
        self.requests = 0
        self.ended_seen: dict[str, float] = {}
        self._lock = threading.Lock()

    def add(self, job_id: str, seconds: float) -> None:
        now = time.monotonic()
        self.jobs[job_id] = (now, now + seconds)

    def _info(self, job_id: str) -> JobInfo:
        done = time.monotonic() >= self.jobs[job_id][1]
        return JobInfo(job_id=job_id, state=JobState.SUCCEEDED if done else JobState.RUNNING)

    def status(self, job_id: str) -> JobInfo:
        with self._lock:
            self.requests += 1
        return self._info(job_id)

    def statuses(self, job_ids: Sequence[str]) -> dict[str, JobInfo]:
        with self._lock:
            self.requests += 1
        return {j: self._info(j) for j in job_ids if j in self.jobs}

    def usage(self) -> Usage:
        with self._lock:
            self.requests += 1
        return Usage()

    def follow_logs(self, job_id: str) -> LogFollower:
        return _TimedFollower(self, job_id)

    def log_tail(self, job_id: str, lines: int = 30) -> list[str]:
        return []

    def cancel(self, job_id: str) -> None:
        start, _ = self.jobs[job_id]
        self.jobs[job_id] = (start, time.monotonic())

    def submit(self, job):  # the watching tests add jobs directly
        raise NotImplementedError

    def submit_batch(self, job, num_jobs, *, pool_name, workers):
        raise NotImplementedError

    def release_pool(self, pool_name: str) -> None:
        raise NotImplementedError

    def start_service(self, job):
        raise NotImplementedError

    def stop_service(self, cluster_name: str) -> bool:
        raise NotImplementedError
