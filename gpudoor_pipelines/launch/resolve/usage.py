"""What routing weighs besides the task and the fleet: what is held now (:class:`Usage`, for caps and quotas)
and how soon each pool would start a job (:class:`Outlook`, for start soonest). Pure values; the backends
and the API server's policy read them, routing decides.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple

from gpudoor_pipelines.launch.labels import LABEL_BORROWED, LABEL_COST_OWNER, LABEL_POOL, LABEL_USER


class Held(NamedTuple):
    """What one job, warm pool or cluster holds, read from the door's labels on it."""

    pool: str
    user: str
    gpus: int
    vcpus: int
    owner: str = ""
    borrowed: bool = False

    @classmethod
    def of(cls, labels: Mapping[str, Any], gpus: int, vcpus: int = 0) -> Held | None:
        """From a job's labels (None without a ``gpudoor-pool`` label: not the door's)."""
        if not labels.get(LABEL_POOL):
            return None
        return cls(
            str(labels[LABEL_POOL]),
            str(labels.get(LABEL_USER, "unknown")),
            gpus,
            vcpus,
            str(labels.get(LABEL_COST_OWNER) or ""),
            str(labels.get(LABEL_BORROWED, "")).lower() == "true",
        )


@dataclasses.dataclass(frozen=True)
class Usage:
    """What jobs that have not ended hold right now, for cap and quota checks.

    Attributes:
        gpus: GPUs per pool.
        vcpus: vCPUs of CPU-only jobs per pool.
        user_gpus: GPUs per (user, pool).
        owner_gpus: GPUs per (cost owner, pool).
        borrowed: GPUs held on borrowed quota per pool.
        owner_borrowed: GPUs held on borrowed quota per (cost owner, pool).
    """

    gpus: Mapping[str, int] = dataclasses.field(default_factory=dict)
    vcpus: Mapping[str, int] = dataclasses.field(default_factory=dict)
    user_gpus: Mapping[tuple[str, str], int] = dataclasses.field(default_factory=dict)
    owner_gpus: Mapping[tuple[str, str], int] = dataclasses.field(default_factory=dict)
    borrowed: Mapping[str, int] = dataclasses.field(default_factory=dict)
    owner_borrowed: Mapping[tuple[str, str], int] = dataclasses.field(default_factory=dict)

    @classmethod
    def tally(cls, jobs: Iterable[tuple]) -> Usage:
        """Sums what unfinished jobs hold (:class:`Held`, or its first four fields); a job with GPUs counts
        by its GPUs only."""
        gpus: dict[str, int] = {}
        vcpus: dict[str, int] = {}
        user_gpus: dict[tuple[str, str], int] = {}
        owner_gpus: dict[tuple[str, str], int] = {}
        borrowed: dict[str, int] = {}
        owner_borrowed: dict[tuple[str, str], int] = {}
        for row in jobs:
            held = Held(*row)
            pool = held.pool
            if not held.gpus:
                vcpus[pool] = vcpus.get(pool, 0) + held.vcpus
                continue
            gpus[pool] = gpus.get(pool, 0) + held.gpus
            user_gpus[(held.user, pool)] = user_gpus.get((held.user, pool), 0) + held.gpus
            owner_gpus[(held.owner, pool)] = owner_gpus.get((held.owner, pool), 0) + held.gpus
            if held.borrowed:
                borrowed[pool] = borrowed.get(pool, 0) + held.gpus
                owner_borrowed[(held.owner, pool)] = owner_borrowed.get((held.owner, pool), 0) + held.gpus
        return cls(gpus, vcpus, user_gpus, owner_gpus, borrowed, owner_borrowed)


#: A pool whose recent jobs waited longer than this, median, for their start is one where a job would queue.
QUEUE_WAIT_S = 60.0


@dataclasses.dataclass(frozen=True)
class Outlook:
    """How soon each pool would start a job, for start soonest.

    Attributes:
        free: the GPUs of a route's type free now on its pool's cluster (its Slurm partition, its Kubernetes
            context), less what this machine just submitted there; None where the cluster cannot say.
        waits: a pool's median wait, in seconds, from submission to start of its jobs of the last day.
    """

    free: Callable[[Any], int | None] = lambda route: None
    waits: Mapping[str, float] = dataclasses.field(default_factory=dict)

    def judge(self, route: Any) -> tuple[bool, str]:
        """Whether the job would queue on the route's pool, and the numbers that say so."""
        free = self.free(route)
        pool = route.pool.name
        if free is not None:
            queues = free < route.total_gpus
            return queues, f"'{pool}' {'would queue' if queues else 'starts now'} ({free} {route.accelerator} free)"
        wait = self.waits.get(pool)
        if wait is not None:
            queues = wait > QUEUE_WAIT_S
            return queues, f"'{pool}' {'would queue' if queues else 'starts now'} (median wait {wait:.0f} s)"
        return False, ""
