"""What the launcher weighs before a launch besides what is held: the week's figures (what each cost owner
spent, for budgets; how long each pool made its jobs wait, for start soonest) and the GPUs free now on each
pool's cluster.

The figures come from the same job history the weekly usage asset reads (:meth:`Backend.job_history`), counted
the same way (:meth:`JobUsage.gpu_hours`, :meth:`Fleet.usd_per_gpu_hour`). Reading a week of history is a
request of a second or more on a busy API server, so a read is kept: in the process, and on the machine under
``$GPUDOOR_HOME/cache`` (each Dagster step is a process of its own), fresh for ``FRESH_S``; an older read, up to
``STALE_S``, still serves while a new one is made in the background. On a backend whose history is local files
(the embedded default) every launch reads it anew: it costs a file read.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import datetime as dt
import hashlib
import json
import statistics
import threading
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from gpudoor_pipelines.launch.backends.base import Backend
from gpudoor_pipelines.launch.job import JobUsage
from gpudoor_pipelines.launch.resolve.fleet import Fleet
from gpudoor_pipelines.launch.resolve.routing import Route
from gpudoor_pipelines.launch.resolve.sharing import Spent
from gpudoor_pipelines.launch.resolve.usage import Outlook

#: A read of the week's figures serves this long as it is...
FRESH_S = 300.0
#: ... and this long while a new one is made in the background.
STALE_S = 3600.0
#: Queue waits are the median over the jobs that started in this last stretch.
WAITS_OVER_S = 24 * 3600.0
#: A GPU this process submitted to counts as taken this long (the cluster may not show the job yet).
TAKEN_S = 30.0

_LOCK = threading.Lock()
_FIGURES: dict[str, Figures] = {}
_REFRESHING: set[str] = set()
_REFRESH = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="gpudoor-ledger")
_TAKEN: list[tuple[float, str, int]] = []


def week_start(now: float) -> float:
    """Monday 00:00 UTC of the week holding ``now``: budgets are weekly, as the usage asset's partitions."""
    day = dt.datetime.fromtimestamp(now, dt.UTC).date()
    monday = day - dt.timedelta(days=day.weekday())
    return dt.datetime(monday.year, monday.month, monday.day, tzinfo=dt.UTC).timestamp()


@dataclasses.dataclass(frozen=True)
class Figures:
    """The week's figures: spent per cost owner, median queue wait per pool, and when they were read."""

    read_at: float
    spent: Mapping[str, Spent]
    waits: Mapping[str, float]

    @classmethod
    def of(cls, jobs: Iterable[JobUsage], fleet: Fleet, now: float) -> Figures:
        """Counts a week of job history (jobs started since Monday, and the last day's for waits)."""
        since = week_start(now)
        hours: dict[str, float] = {}
        usd: dict[str, float] = {}
        waited: dict[str, list[float]] = {}
        for job in jobs:
            held = job.gpu_hours(since, now)
            if held > 0:
                hours[job.cost_owner] = hours.get(job.cost_owner, 0.0) + held
                rate = fleet.usd_per_gpu_hour(job.pool)
                usd[job.cost_owner] = usd.get(job.cost_owner, 0.0) + (0.0 if rate != rate else held * rate)
            if job.submitted_at and job.started_at and job.started_at >= now - WAITS_OVER_S:
                waited.setdefault(job.pool, []).append(max(0.0, job.started_at - job.submitted_at))
        spent = {o: Spent(hours[o], usd.get(o, 0.0)) for o in hours}
        return cls(now, spent, {p: statistics.median(w) for p, w in waited.items()})

    def to_json(self) -> dict[str, Any]:
        return {
            "read_at": self.read_at,
            "spent": {o: [s.gpu_hours, s.usd] for o, s in self.spent.items()},
            "waits": dict(self.waits),
        }

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> Figures:
        spent = {o: Spent(float(h), float(u)) for o, (h, u) in raw["spent"].items()}
        return cls(float(raw["read_at"]), spent, {p: float(w) for p, w in raw["waits"].items()})


class Ledger:
    """The week's figures and the GPUs free now, for one backend and fleet (see the module docstring)."""

    def __init__(self, backend: Backend, fleet: Fleet, cache_dir: Path | None = None) -> None:
        self.backend, self.fleet = backend, fleet
        self.cache_dir = cache_dir
        self.key = hashlib.sha256(repr(backend.watch_key()).encode()).hexdigest()[:16]

    @property
    def wanted(self) -> bool:
        """Whether a launch weighs the figures: budgets are set, or a route has pools to choose among."""
        return bool(self.fleet.sharing.budgets) or any(len(r) > 1 for r in self.fleet.routes.values())

    # ----------------------------------------------------------------- the week's figures
    def figures(self) -> Figures | None:
        """The week's figures (cached, see the module docstring); None when the history cannot be read."""
        if not self.backend.remote_status:
            return self._read()
        now = time.time()
        with _LOCK:
            kept = _FIGURES.get(self.key)
        if kept is None:
            kept = self._from_file()
        if kept is not None and now - kept.read_at < FRESH_S:
            return kept
        if kept is not None and now - kept.read_at < STALE_S:
            self._refresh_in_background()
            return kept
        return self._read()

    def _read(self) -> Figures | None:
        now = time.time()
        try:
            jobs = self.backend.job_history(min(week_start(now), now - WAITS_OVER_S), now)
        except Exception:  # noqa: BLE001 - the figures are advice: a launch goes on without them
            return None
        figures = Figures.of(jobs, self.fleet, now)
        if self.backend.remote_status:
            with _LOCK:
                _FIGURES[self.key] = figures
            self._to_file(figures)
        return figures

    def _refresh_in_background(self) -> None:
        with _LOCK:
            if self.key in _REFRESHING:
                return
            _REFRESHING.add(self.key)

        def refresh() -> None:
            try:
                self._read()
            finally:
                with _LOCK:
                    _REFRESHING.discard(self.key)

        _REFRESH.submit(refresh)

    def _file(self) -> Path | None:
        return self.cache_dir / f"ledger-{self.key}.json" if self.cache_dir else None

    def _from_file(self) -> Figures | None:
        path = self._file()
        try:
            return Figures.from_json(json.loads(path.read_text())) if path else None
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def _to_file(self, figures: Figures) -> None:
        path = self._file()
        if path is None:
            return
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{threading.get_ident()}.tmp")
            tmp.write_text(json.dumps(figures.to_json()))
            tmp.replace(path)
        except OSError:
            pass  # a machine without room for the cache reads the history again next time

    # ----------------------------------------------------------------- GPUs free now
    def free(self, route: Route) -> int | None:
        """The GPUs of the route's type free now on its pool's cluster, less what this process submitted there
        in the last ``TAKEN_S`` (the cluster may not show those jobs yet); None where the cluster cannot say."""
        if not route.accelerator:
            return None
        counts = self.backend.free_gpus_at(route.infra)
        if counts is None:
            return None
        now = time.time()
        with _LOCK:
            _TAKEN[:] = [t for t in _TAKEN if now - t[0] < TAKEN_S]
            taken = sum(g for _, infra, g in _TAKEN if infra == route.infra)
        return max(0, counts.get(route.accelerator.lower(), 0) - taken)

    def took(self, route: Route) -> None:
        """A job was just submitted on ``route``: its GPUs count as taken there for a while."""
        if route.accelerator:
            with _LOCK:
                _TAKEN.append((time.time(), route.infra, route.total_gpus))

    def outlook(self, figures: Figures | None) -> Outlook:
        """Start soonest's view: free GPUs now, and the pools' recent queue waits."""
        return Outlook(free=self.free, waits=dict(figures.waits) if figures else {})
