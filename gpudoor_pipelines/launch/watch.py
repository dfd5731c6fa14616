"""Watching jobs without flooding the API server.

Every running step watches its job until it ends (the launcher's wait loop, with the :class:`Hooks` a front
end gives it and the :class:`Watched` it returns). Asked naively (one status request per job every
half second), 200 steps make about 400 requests a second to one SkyPilot API server. Two things keep
that down, and neither delays noticing the end of a job:

- :class:`Backoff`: a job is asked about at ``first`` seconds, then less and less often, up to
  ``most`` seconds (tens of seconds on SkyPilot), until it enters recovery (its next states come soon).
  Its log stream ending is the cue to ask again at once: a job's log ends when the job does. A job
  going from pending to launching to running is not followed closer for it: what it does next is end.
- :class:`StatusHub`: one per process and backend. Whoever's turn it is asks about every job the
  process watches in one request (``Backend.statuses``); the others take the answer when it is
  fresh enough. Fifty steps of one run (threads of one process) make one request, not fifty.
"""

from __future__ import annotations

import collections
import dataclasses
import select
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from gpudoor_pipelines.launch.job import JobInfo, JobState

if TYPE_CHECKING:
    from gpudoor_pipelines.launch.backends.base import Backend, LogFollower
    from gpudoor_pipelines.launch.record.goodput import Timeline
    from gpudoor_pipelines.launch.record.release import ReleaseOutcome
    from gpudoor_pipelines.launch.resolve.request import ResolvedJob


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
        """The states of ``job_ids`` as of at most ``max_age_s`` ago (jobs the backend has no record of are left
        out)."""
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


def ignore(*_: Any) -> None:
    return None


@dataclasses.dataclass
class Hooks:
    """What a front end hears from the wait loop (every hook is optional).

    Attributes:
        line: a log line of a job (secrets redacted; prefixed ``[job <id>]`` when several jobs stream).
        state: a job's state changed (its id, its new state).
        polled: after each status poll, every job's last known state.
        tick: every turn of the loop (a front end delivers what arrived meanwhile, e.g. Pipes messages).
        preempted: once per preemption of a job: its rank, its state, when it was seen.
        moved: an evicted job was launched again on another pool: its old id, its new id, the job as launched.
        said: what the launcher did on its own (a move, a cancel after an interruption), in words.
        released: what a release released (after an interruption, or a move), and whether it was confirmed.
    """

    line: Callable[[str], None] = ignore
    state: Callable[[str, JobInfo], None] = ignore
    polled: Callable[[Mapping[str, JobInfo]], None] = ignore
    tick: Callable[[], None] = ignore
    preempted: Callable[[int, JobInfo, float], None] | None = None
    moved: Callable[[str, str, ResolvedJob], None] = ignore
    said: Callable[[str], None] = ignore
    released: Callable[[list[ReleaseOutcome]], None] = ignore


@dataclasses.dataclass
class Watched:
    """What a wait saw: each job's last state and the states it went through, by the job's final id.

    Attributes:
        job_ids: the jobs, in rank order (a job moved after an eviction has the id of its last launch).
        infos: each job's last known state.
        timelines: each job's states as the loop saw them (for what its preemptions cost).
        moved: the jobs launched in place of evicted ones, in order.
    """

    job_ids: list[str]
    infos: dict[str, JobInfo]
    timelines: dict[str, Timeline]
    moved: list[ResolvedJob] = dataclasses.field(default_factory=list)


class Streams:
    """The log streams of the jobs being waited for: at most ``limit`` open at once (a person watching sees
    the jobs work; hundreds of streams would load the API server for nothing)."""

    def __init__(
        self, follow: Callable[[str], LogFollower], limit: int, emit: Callable[[str], None], prefix: bool
    ) -> None:
        self.follow, self.limit, self.emit, self.prefix = follow, max(1, limit), emit, prefix
        self.open: dict[str, LogFollower] = {}
        self.done: set[str] = set()
        self.cued: set[str] = set()

    def start(self, job_ids: Iterable[str], infos: Mapping[str, JobInfo], *, now: bool = False) -> None:
        """Opens streams for jobs that run (or, ``now``, whatever their state) while there is room."""
        for job_id in job_ids:
            if job_id in self.done or job_id in self.open or len(self.open) >= self.limit:
                continue
            info = infos.get(job_id)
            if now or (info is not None and info.state in (JobState.STARTING, JobState.RUNNING, JobState.RECOVERING)):
                self.open[job_id] = self.follow(job_id)

    def drain(self) -> None:
        """Hands out the lines written since the last call."""
        for job_id, follower in list(self.open.items()):
            for line in follower.poll():
                self.emit(f"[job {job_id}] {line}" if self.prefix else line)

    def newly_ended(self) -> bool:
        """Whether a followed job's log stream has ended since the last call (its job has, most likely)."""
        ended = {job_id for job_id, follower in self.open.items() if follower.ended} - self.cued
        self.cued |= ended
        return bool(ended)

    def wait(self, seconds: float) -> None:
        """Sleeps ``seconds``, waking at once when a followed job's stream ends where its follower can say so
        (:meth:`~.backends.base.LogFollower.end_fd`: the local backend's runner exiting)."""
        fds = [fd for job_id, f in self.open.items() if job_id not in self.cued and (fd := f.end_fd()) is not None]
        if fds:
            select.select(fds, [], [], seconds)
        else:
            time.sleep(seconds)

    def stop(self, job_id: str) -> None:
        """Closes a job's stream for good (its job ended, or was replaced)."""
        follower = self.open.pop(job_id, None)
        if follower is not None:
            follower.close()  # first: it may still be handing out the job's last lines
            for line in follower.poll():
                self.emit(f"[job {job_id}] {line}" if self.prefix else line)
        self.done.add(job_id)

    def close(self) -> None:
        """Stops following what is still open (the wait ended, or was interrupted): no waiting for last lines."""
        for follower in self.open.values():
            follower.close(wait=False)
