"""What a job is to every part of the door: its states, what a backend knows of it, what it holds.

Free of Dagster and of any backend: the launcher, the records, the reconciler and the backends all speak
these types.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from typing import Any

from gpudoor_pipelines.launch.labels import LABEL_COST_OWNER, LABEL_POOL, LABEL_STEP, LABEL_USER


class JobState(enum.StrEnum):
    """Managed-job states, named as SkyPilot names them."""

    PENDING = "PENDING"
    STARTING = "STARTING"
    RUNNING = "RUNNING"
    RECOVERING = "RECOVERING"
    CANCELLING = "CANCELLING"
    SUCCEEDED = "SUCCEEDED"
    CANCELLED = "CANCELLED"
    FAILED = "FAILED"
    FAILED_SETUP = "FAILED_SETUP"
    FAILED_PRECHECKS = "FAILED_PRECHECKS"
    FAILED_NO_RESOURCE = "FAILED_NO_RESOURCE"
    FAILED_CONTROLLER = "FAILED_CONTROLLER"

    @property
    def is_terminal(self) -> bool:
        """The job will not change state again."""
        return self in _TERMINAL

    @property
    def is_failure(self) -> bool:
        """A terminal state other than success."""
        return self.is_terminal and self is not JobState.SUCCEEDED


_TERMINAL = {
    JobState.SUCCEEDED,
    JobState.CANCELLED,
    JobState.FAILED,
    JobState.FAILED_SETUP,
    JobState.FAILED_PRECHECKS,
    JobState.FAILED_NO_RESOURCE,
    JobState.FAILED_CONTROLLER,
}

FAILURE_MEANING = {
    JobState.FAILED: "the job's run command exited non-zero",
    JobState.FAILED_SETUP: "the job's setup command failed",
    JobState.FAILED_PRECHECKS: "the job was refused before it started (invalid task or policy)",
    JobState.FAILED_NO_RESOURCE: "no resources were available for the job",
    JobState.FAILED_CONTROLLER: "the managed-jobs controller failed",
    JobState.CANCELLED: "the job was cancelled",
}


@dataclasses.dataclass(frozen=True)
class JobInfo:
    """What a backend knows about one job.

    Times are UNIX seconds (None until they happen).
    """

    job_id: str
    state: JobState
    name: str = ""
    infra: str = ""
    recoveries: int = 0
    submitted_at: float | None = None
    started_at: float | None = None
    ended_at: float | None = None
    detail: str = ""
    #: Seconds the job ran, time spent recovering after preemptions excluded (SkyPilot's
    #: ``job_duration``); None where the backend does not count it.
    ran_s: float | None = None
    #: When the job last ran again after a preemption (SkyPilot's ``last_recovered_at``); None when it
    #: never was, or where the backend does not tell.
    recovered_at: float | None = None


@dataclasses.dataclass(frozen=True)
class JobUsage:
    """One job's hold on GPUs, as the weekly usage figures count it.

    Times are UNIX seconds. A job holds its GPUs from ``started_at`` (when it started running) to
    ``ended_at`` (None while it runs).

    Attributes:
        job_id: the backend's job id.
        name: the job's name.
        pool: the fleet pool it ran on (its ``gpudoor-pool`` label).
        user: who launched it (``gpudoor-user``).
        cost_owner: who pays (``gpudoor-cost-owner``; ``unknown`` when the job carries none).
        step: the step kind (``gpudoor-step``; empty for a job launched without one).
        gpus: GPUs over all its nodes.
        started_at: when it started running (None if it never did).
        ended_at: when it ended (None while it runs).
        state: its state.
        recoveries: how many times it was preempted and recovered.
        ran_s: seconds it actually ran between its start and its end (or now), without the time spent
            recovering after preemptions; None where the backend cannot tell.
        submitted_at: when it was submitted (None where the backend cannot tell): its wait is to ``started_at``.
    """

    job_id: str
    name: str
    pool: str
    user: str
    cost_owner: str
    step: str
    gpus: float
    started_at: float | None
    ended_at: float | None
    state: JobState
    recoveries: int = 0
    ran_s: float | None = None
    submitted_at: float | None = None

    @classmethod
    def from_labels(cls, labels: Mapping[str, Any], *, pool: str = "unknown", **fields: Any) -> JobUsage:
        """A job's usage with where, who and what read from the door's labels on it (``gpudoor-pool``,
        ``gpudoor-user``, ``gpudoor-cost-owner``, ``gpudoor-step``); ``pool`` where it has no pool label."""
        return cls(
            pool=str(labels.get(LABEL_POOL) or pool),
            user=str(labels.get(LABEL_USER) or "unknown"),
            cost_owner=str(labels.get(LABEL_COST_OWNER) or "unknown"),
            step=str(labels.get(LABEL_STEP) or ""),
            **fields,
        )

    def held_s(self, since: float, until: float) -> float:
        """Seconds the job held its GPUs between ``since`` and ``until`` (a running job holds them up to ``until``)."""
        if self.started_at is None:
            return 0.0
        end = until if self.ended_at is None else min(self.ended_at, until)
        return max(0.0, end - max(self.started_at, since))

    def gpu_hours(self, since: float, until: float) -> float:
        """GPU-hours the job held between ``since`` and ``until``: what the weekly figures and budgets count."""
        return self.gpus * self.held_s(since, until) / 3600.0

    def running_share(self, now: float) -> float | None:
        """The share of its life (start to end, or ``now``) the job spent running; None where unknown."""
        if self.ran_s is None or self.started_at is None:
            return None
        life = (self.ended_at if self.ended_at is not None else now) - self.started_at
        return 1.0 if life <= 0 else max(0.0, min(1.0, self.ran_s / life))


@dataclasses.dataclass(frozen=True)
class Holding:
    """Something that holds GPUs (or may): an unfinished job, a warm pool, an interactive cluster.

    Attributes:
        kind: ``job``, ``pool`` (a warm pool's workers) or ``cluster`` (a ``lab-…``/``dev-…`` cluster).
        id: the job id, the pool's name or the cluster's name.
        labels: the door's labels on it (pool, user, cost owner, run identity).
        since: when it was submitted (job), created or launched (UNIX seconds; None if unknown).
        state: its state, as the backend names it.
        name: the job's name (jobs).
        scheduler_name: what the cluster's scheduler calls its allocation (a Slurm job name), if known.
    """

    kind: str
    id: str
    labels: Mapping[str, str] = dataclasses.field(default_factory=dict)
    since: float | None = None
    state: str = ""
    name: str = ""
    scheduler_name: str = ""

    @property
    def key(self) -> str:
        """``<kind>:<id>``: unique across kinds."""
        return f"{self.kind}:{self.id}"

    def describe(self) -> str:
        """``job 42 (train-…)``, ``pool gpudoor-eval-…``, ``cluster lab-demo``."""
        return f"{self.kind} {self.id}" + (f" ({self.name})" if self.name and self.name != self.id else "")


@dataclasses.dataclass(frozen=True)
class ReleaseCheck:
    """One look at whether a holding still holds anything.

    Attributes:
        released: nothing is held any more, as far as the backend can see.
        seen: what was looked at and what it showed, in words (recorded with the release).
    """

    released: bool
    seen: tuple[str, ...] = ()
