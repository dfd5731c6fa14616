"""What every backend fills, as four small interfaces: jobs, warm pools, services and inventory.

:class:`Backend` is all four; the launcher, the reconciler and the assets use only the part they need.
Implementations (:mod:`.local`, :mod:`.skypilot`) know nothing of Dagster.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence

from gpudoor_pipelines.launch.job import Holding, JobInfo, JobUsage, ReleaseCheck
from gpudoor_pipelines.launch.resolve.request import ResolvedJob
from gpudoor_pipelines.launch.resolve.usage import Usage


class LogFollower(abc.ABC):
    """Incremental reader of a job's log; lines come out once each, in order."""

    @abc.abstractmethod
    def poll(self) -> list[str]:
        """Lines written since the last call."""

    @property
    def ended(self) -> bool:
        """The log stream has ended (the job has, or the connection dropped); False where it cannot tell."""
        return False

    def end_fd(self) -> int | None:
        """A file descriptor that becomes readable when the stream ends, for a wait loop to wake on at once
        (``select``); None where there is none (the loop then looks at :attr:`ended` at its own pace)."""
        return None

    def close(self, wait: bool = True) -> None:  # noqa: B027 - optional hook
        """Stops following; ``wait``: first give a stream whose job ended a moment to hand out its last lines."""


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


class Jobs(abc.ABC):
    """Submits jobs and watches them: their states, their logs, their cancel."""

    name: str = "backend"
    #: Status requests cost a round trip to a shared server: watchers back off while nothing changes.
    remote_status: bool = False
    #: The shortest time in which a job's state can change as the backend reports it: a watcher does not
    #: look again sooner, whatever its poll interval (which still paces the hand-over of log lines).
    status_granularity_s: float = 0.0

    def watch_key(self) -> tuple:
        """What the jobs of this backend are watched under: one status hub per key and process."""
        return (type(self).__name__, id(self))

    @abc.abstractmethod
    def submit(self, job: ResolvedJob) -> str:
        """Launches the job (a managed job, or what the fleet's ``launch_as`` says); returns its id."""

    @abc.abstractmethod
    def status(self, job_id: str) -> JobInfo:
        """The job's current state (``KeyError`` when the backend has no such job)."""

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
    def follow_logs(self, job_id: str) -> LogFollower:
        """A follower of the job's log from the start."""

    @abc.abstractmethod
    def log_tail(self, job_id: str, lines: int = 30) -> list[str]:
        """The last lines of the job's log."""

    @abc.abstractmethod
    def cancel(self, job_id: str) -> None:
        """Asks for the job to be cancelled (returns at once)."""

    def holding_of(self, job_id: str) -> Holding:
        """What a job of this backend holds, to release and check (its job; a backend may say its cluster)."""
        return Holding("job", job_id)

    def finish(self, job_id: str) -> str | None:
        """Called once a job has ended and its log tail was read: gives back what the job's end does not
        (a step cluster); returns what it did, in words, or None."""
        return None


class WarmPools(abc.ABC):
    """Runs the ranks of a batch on a pool of warm workers (setup once per worker)."""

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


class Services(abc.ABC):
    """Long-running services (demos) on clusters of their own."""

    @abc.abstractmethod
    def start_service(self, job: ResolvedJob) -> Service:
        """Launches a long-running service on ``job.cluster_name``."""

    @abc.abstractmethod
    def stop_service(self, cluster_name: str) -> bool:
        """Tears a service's cluster down; True if one was running."""


class Inventory(abc.ABC):
    """What is held and what was: for caps, the weekly usage and the orphan reconciler; and its release."""

    def check(self) -> None:  # noqa: B027 - optional hook
        """Raises a clear error when the backend cannot be reached (before anything is submitted)."""

    @abc.abstractmethod
    def usage(self) -> Usage:
        """GPUs (and CPU-only jobs' vCPUs) held by jobs that have not ended, per pool and per user."""

    def free_gpus_at(self, infra: str) -> dict[str, int] | None:
        """GPUs free right now by type (lowercase) on the infra's cluster (its partition, where it names one);
        None where the cluster cannot tell."""
        return None

    def job_history(self, since: float, until: float, *, submitted_after: float | None = None) -> list[JobUsage]:
        """Every job of the team's pools that held GPUs at some point between ``since`` and ``until`` (UNIX
        seconds), whoever launched it and however (Dagster runs, demos, ad-hoc launches).

        With ``submitted_after`` (a listing of recent jobs rather than usage): only the jobs submitted
        after it, asked of the backend as such, and those that have not started yet too.
        """
        raise NotImplementedError(f"the {getattr(self, 'name', 'backend')} backend keeps no job history")

    def holdings(self) -> list[Holding]:
        """Every unfinished job, warm pool and interactive cluster the backend can see, with its labels
        (the orphan reconciler's view: one listing per kind, whatever their number)."""
        raise NotImplementedError(f"the {getattr(self, 'name', 'backend')} backend cannot list what it holds")

    @abc.abstractmethod
    def release_all(self, holdings: Sequence[Holding]) -> dict[str, str]:
        """Asks for every holding to be released (a job cancelled, a pool's workers released, a cluster torn
        down); returns the errors by holding key. Returns once asked: :meth:`check_released_all` says when
        it is done."""

    @abc.abstractmethod
    def check_released_all(self, holdings: Sequence[Holding]) -> dict[str, ReleaseCheck]:
        """One look at whether each holding still holds anything, by key (an unreadable state is not a
        confirmation)."""


class Backend(Jobs, WarmPools, Services, Inventory):
    """Jobs, warm pools, services and inventory of one place jobs run (this machine, or the team's SkyPilot
    API server). Implementations know nothing of Dagster."""

    def release(self, holding: Holding) -> None:
        """Asks for one holding to be given back (see :meth:`release_all`)."""
        if holding.kind == "job":
            self.cancel(holding.id)
        elif holding.kind == "pool":
            self.release_pool(holding.id)
        elif holding.kind == "cluster":
            self.stop_service(holding.id)
        else:
            raise ValueError(f"unknown holding kind '{holding.kind}'")

    def release_all(self, holdings: Sequence[Holding]) -> dict[str, str]:
        """Releases the holdings one by one (:meth:`release`); a backend whose server takes many at once
        asks in one request."""
        errors = {}
        for h in holdings:
            try:
                self.release(h)
            except Exception as e:  # noqa: BLE001 - recorded with the release; the look afterwards decides
                errors[h.key] = f"{type(e).__name__}: {e}"
        return errors

    def check_released_all(self, holdings: Sequence[Holding]) -> dict[str, ReleaseCheck]:
        """:meth:`check_released` of every holding (a backend whose server answers for many at once asks in
        one request)."""
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
