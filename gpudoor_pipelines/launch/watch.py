"""Watching jobs without flooding the API server.

Every running step watches its job until it ends. Asked naively (one status request per job every
half second), 200 steps make about 400 requests a second to one SkyPilot API server. Two things keep
that down, and neither delays noticing the end of a job:

- :class:`Backoff`: a job is asked about at ``first`` seconds, then less and less often while
  nothing changes, up to ``most`` seconds (tens of seconds on SkyPilot). Its log stream ending is the
  cue to ask again at once: a job's log ends when the job does.
- :class:`StatusHub`: one per process and backend. Whoever's turn it is asks about every job the
  process watches in one request (``Backend.statuses``); the others take the answer when it is
  fresh enough. Fifty steps of one run (threads of one process) make one request, not fifty.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Sequence

from gpudoor_pipelines.launch.backends.base import Backend
from gpudoor_pipelines.launch.job import JobInfo


class Backoff:
    """The wait before the next status request: ``first`` at the start and after every change, then
    doubling while nothing changes, up to ``most``."""

    def __init__(self, first: float, most: float) -> None:
        self.first, self.most = first, max(first, most)
        self.current = first

    def after(self, changed: bool) -> float:
        """The wait after a status request that found a change (or not)."""
        self.current = self.first if changed else min(self.most, self.current * 2)
        return self.current

    def reset(self) -> None:
        """Ask again soon (something happened that the status may show)."""
        self.current = self.first


class StatusHub:
    """The states of the jobs this process watches on one backend, refreshed by one request for all.

    ``get(job_id, max_age_s)`` answers from a request made at most ``max_age_s`` seconds before the
    call; otherwise the caller makes one request for every watched job (or waits for the one in
    flight) and everyone shares its answer.
    """

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self._cond = threading.Condition()
        self._watched: collections.Counter[str] = collections.Counter()
        self._known: dict[str, tuple[float, JobInfo]] = {}  # job id -> (when its request started, info)
        self._inflight = False
        self.requests = 0  # status requests made (for tests and benchmarks)

    def watch(self, job_ids: Sequence[str]) -> None:
        with self._cond:
            self._watched.update(job_ids)

    def unwatch(self, job_ids: Sequence[str]) -> None:
        with self._cond:
            self._watched.subtract(job_ids)
            for job_id in job_ids:
                if self._watched[job_id] <= 0:
                    del self._watched[job_id]
                    self._known.pop(job_id, None)

    def get(self, job_ids: Sequence[str], max_age_s: float = 0.0) -> dict[str, JobInfo]:
        """The states of ``job_ids`` as of at most ``max_age_s`` ago (jobs the backend has no record of are left out)."""
        asked = time.monotonic()
        while True:
            with self._cond:
                while True:
                    fresh = {j: self._known.get(j) for j in job_ids}
                    if all(e is not None and e[0] >= asked - max_age_s for e in fresh.values()):
                        return {j: e[1] for j, e in fresh.items() if e is not None and e[1] is not None}
                    if not self._inflight:
                        self._inflight = True
                        ids = sorted(set(self._watched) | set(job_ids))
                        break
                    self._cond.wait()
            started = time.monotonic()
            try:
                self.requests += 1
                infos = self.backend.statuses(ids)
            except BaseException:
                with self._cond:
                    self._inflight = False
                    self._cond.notify_all()
                raise
            with self._cond:
                for job_id in ids:
                    # A job missing from the answer is recorded as unknown (None): the caller sees it missing.
                    self._known[job_id] = (started, infos.get(job_id))
                self._inflight = False
                self._cond.notify_all()


_HUBS: dict[tuple, StatusHub] = {}
_HUBS_LOCK = threading.Lock()


def status_hub(backend: Backend) -> StatusHub:
    """The process's hub for this backend's API server (or state folder)."""
    key = backend.watch_key()
    with _HUBS_LOCK:
        hub = _HUBS.get(key)
        if hub is None:
            hub = _HUBS[key] = StatusHub(backend)
        return hub
