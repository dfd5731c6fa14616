"""The one interface every backend fills: submit, watch, read logs, cancel, serve."""

from __future__ import annotations

import abc
import dataclasses
import enum
from collections.abc import Mapping, Sequence
from typing import Any

from gpudoor_pipelines.launch.routing import Route, Usage
from gpudoor_pipelines.launch.rules import LABEL_COST_OWNER, LABEL_POOL, LABEL_STEP, LABEL_USER


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
class ResolvedJob:
    """A job ready to launch: the task after routing and fleet rules.

    Attributes:
        name: job name (derived from the Dagster run, asset and partition).
        config: the SkyPilot task YAML mapping, with ``envs``, ``secrets``, ``resources.infra``.
        workdir: the folder the job runs in (holds ``workloads/``).
        pool: the pool's name.
        pool_env: the env the pool injected (cluster paths), so a local run can map them.
        cluster_name: for services (demos): the cluster to launch on.
        route: where routing sent the job and why.
        labels: the job's labels.
        notes: what the fleet rules did, in words.
        secret_names: names of the secrets the job gets (values are in ``config``).
        spec_path: the task spec it came from.
        launch_as: ``managed`` (a managed job) or ``cluster`` (a cluster of its own, torn down when the job
            ends), from the fleet's ``launch_as``; backends without the distinction ignore it.
    """

    name: str
    config: dict[str, Any]
    workdir: str
    pool: str
    pool_env: dict[str, str] = dataclasses.field(default_factory=dict)
    cluster_name: str | None = None
    route: Route | None = None
    labels: dict[str, str] = dataclasses.field(default_factory=dict)
    notes: tuple[str, ...] = ()
    secret_names: tuple[str, ...] = ()
    spec_path: str = ""
    launch_as: str = "managed"

    @property
    def secrets(self) -> dict[str, str]:
        """Credentials for the job (never logged)."""
        s = self.config.get("secrets") or {}
        return {k: str(v) for k, v in s.items()} if isinstance(s, dict) else {}

    @property
    def num_nodes(self) -> int:
        """Nodes the job spans."""
        return int(self.config.get("num_nodes") or 1)


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


class LogFollower(abc.ABC):
    """Incremental reader of a job's log; lines come out once each, in order."""

    @abc.abstractmethod
    def poll(self) -> list[str]:
        """Lines written since the last call."""

    @property
    def ended(self) -> bool:
        """The log stream has ended (the job has, or the connection dropped); False where it cannot tell."""
        return False

    def close(self) -> None:  # noqa: B027 - optional hook
        """Stops following."""


class Service(abc.ABC):
    """A long-running job on a cluster of its own (a demo): it answers on a port until stopped."""

    cluster_name: str
    job_id: str

    @abc.abstractmethod
    def status(self) -> JobInfo:
        """The service job's current state."""

    @abc.abstractmethod
    def follow_logs(self) -> LogFollower:
        """A follower of the service's log from the start."""

    @abc.abstractmethod
    def log_tail(self, lines: int = 30) -> list[str]:
        """The last lines of the service's log."""

    @abc.abstractmethod
    def url(self, port: int) -> str | None:
        """The URL the service answers on, once it does."""


class Backend(abc.ABC):
    """Runs resolved jobs somewhere. Implementations know nothing of Dagster."""

    name: str = "backend"
    #: Status requests cost a round trip to a shared server: watchers back off while nothing changes.
    remote_status: bool = False

    def watch_key(self) -> tuple:
        """What the jobs of this backend are watched under: one status hub per key and process."""
        return (type(self).__name__, id(self))

    @abc.abstractmethod
    def submit(self, job: ResolvedJob) -> str:
        """Launches the job as a managed job; returns its id."""

    @abc.abstractmethod
    def status(self, job_id: str) -> JobInfo:
        """The job's current state (``KeyError`` when the backend has no such job)."""

    @abc.abstractmethod
    def follow_logs(self, job_id: str) -> LogFollower:
        """A follower of the job's log from the start."""

    @abc.abstractmethod
    def log_tail(self, job_id: str, lines: int = 30) -> list[str]:
        """The last lines of the job's log."""

    def holding_of(self, job_id: str) -> Holding:
        """What a job of this backend holds, to release and check (its job; a backend may say its cluster)."""
        return Holding("job", job_id)

    def finish(self, job_id: str) -> str | None:
        """Called once a job has ended and its log tail was read: gives back what the job's end does not
        (a step cluster); returns what it did, in words, or None."""
        return None

    @abc.abstractmethod
    def cancel(self, job_id: str) -> None:
        """Asks for the job to be cancelled (returns at once)."""

    def statuses(self, job_ids: Sequence[str]) -> dict[str, JobInfo]:
        """The states of many jobs, in one request where the backend can (jobs it has no record of are left out)."""
        out = {}
        for job_id in job_ids:
            try:
                out[job_id] = self.status(job_id)
            except KeyError:
                continue
        return out

    @abc.abstractmethod
    def submit_batch(self, job: ResolvedJob, num_jobs: int, *, pool_name: str, workers: int) -> list[str]:
        """Launches ``num_jobs`` ranks of ``job`` on the warm pool ``pool_name`` of ``workers`` workers.

        The pool is created, or grown, as needed; each worker runs the job's setup once. Every rank is
        told ``SKYPILOT_JOB_RANK`` and ``SKYPILOT_NUM_JOBS``; at most ``workers`` run at once. Returns
        the job ids in rank order.
        """

    def pool_workers(self, pool_name: str) -> int:
        """How many workers the pool ``pool_name`` has now (0 when there is no such pool)."""
        return 0

    @abc.abstractmethod
    def release_pool(self, pool_name: str) -> None:
        """Gives a pool's workers back (their GPUs stop being held); its queued jobs are cancelled."""

    @abc.abstractmethod
    def usage(self) -> Usage:
        """GPUs (and CPU-only jobs' vCPUs) held by jobs that have not ended, per pool and per user."""

    def free_gpus(self, route: Route) -> int | None:
        """GPUs of the route's type the route's cluster reports free right now; None where it cannot tell."""
        return None

    @abc.abstractmethod
    def start_service(self, job: ResolvedJob) -> Service:
        """Launches a long-running service on ``job.cluster_name``."""

    @abc.abstractmethod
    def stop_service(self, cluster_name: str) -> bool:
        """Tears a service's cluster down; True if one was running."""

    def job_history(self, since: float, until: float, *, submitted_after: float | None = None) -> list[JobUsage]:
        """Every job of the team's pools that held GPUs at some point between ``since`` and ``until`` (UNIX
        seconds), whoever launched it and however (Dagster runs, demos, ad-hoc launches).

        With ``submitted_after`` (a listing of recent jobs rather than usage): only the jobs submitted
        after it, asked of the backend as such, and those that have not started yet too.
        """
        raise NotImplementedError(f"the {self.name} backend keeps no job history")

    def check(self) -> None:  # noqa: B027 - optional hook
        """Raises a clear error when the backend cannot be reached (before anything is submitted)."""
    # ----------------------------------------------------------------- what is held, and its release
    def holdings(self) -> list[Holding]:
        """Every unfinished job, warm pool and interactive cluster the backend can see, with its labels
        (the orphan reconciler's view: one listing per kind, whatever their number)."""
        raise NotImplementedError(f"the {self.name} backend cannot list what it holds")

    def release(self, holding: Holding) -> None:
        """Asks for a holding to be given back: a job cancelled, a pool's workers released, a cluster torn
        down (returns once asked; :meth:`check_released` says when it is done)."""
        if holding.kind == "job":
            self.cancel(holding.id)
        elif holding.kind == "pool":
            self.release_pool(holding.id)
        elif holding.kind == "cluster":
            self.stop_service(holding.id)
        else:
            raise ValueError(f"unknown holding kind '{holding.kind}'")

    def release_all(self, holdings: Sequence[Holding]) -> dict[str, str]:
        """Asks for every holding to be released (:meth:`release`); returns the errors by holding key. A
        backend whose server takes many at once asks in one request."""
        errors = {}
        for h in holdings:
            try:
                self.release(h)
            except Exception as e:  # noqa: BLE001 - recorded with the release; the look afterwards decides
                errors[h.key] = f"{type(e).__name__}: {e}"
        return errors

    def check_released_all(self, holdings: Sequence[Holding]) -> dict[str, ReleaseCheck]:
        """:meth:`check_released` of every holding, by key (one look at each; a backend whose server answers
        for many at once asks in one request)."""
        out = {}
        for h in holdings:
            try:
                out[h.key] = self.check_released(h)
            except Exception as e:  # noqa: BLE001 - an unreadable state is not a confirmation
                out[h.key] = ReleaseCheck(False, (f"could not look: {type(e).__name__}: {e}",))
        return out

    def check_released(self, holding: Holding) -> ReleaseCheck:
        """Whether the holding still holds anything, looked at once (see the backends for what each sees)."""
        if holding.kind == "job":
            try:
                state = self.status(holding.id).state
            except KeyError:
                return ReleaseCheck(True, (f"job {holding.id}: unknown to the {self.name} backend",))
            return ReleaseCheck(state.is_terminal, (f"job {holding.id}: {state.value}",))
        if holding.kind == "pool":
            workers = self.pool_workers(holding.id)
            return ReleaseCheck(workers == 0, (f"pool {holding.id}: {workers} workers",))
        raise NotImplementedError(f"the {self.name} backend cannot check a {holding.kind}")

