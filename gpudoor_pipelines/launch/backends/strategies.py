"""How the SkyPilot backend runs a job, as strategies chosen once, in the style of SkyPilot's registered
recovery strategies.

- :class:`ManagedJobs` (``managed``): ``sky.jobs.launch``; SkyPilot's controller watches and recovers it.
  Its id is SkyPilot's managed-job id (a number).
- ``cluster`` (:mod:`.step_clusters`): a cluster of its own for a short step, torn down when it ends. Its
  id is ``<cluster>/<job id on the cluster>``.
- :class:`WarmPools`: the ranks of a batch on a managed-job pool (``sky.jobs.pool_apply``, then one
  ``sky.jobs.launch(pool=, num_jobs=)``); the ranks are managed jobs.

A strategy is picked by the fleet's ``launch_as`` when a job is launched (:func:`for_launch`), and by the
form of its id afterwards (:func:`owner_of`): the one place that looks at an id's form.
"""

from __future__ import annotations

import abc
import re
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, ClassVar

from gpudoor_pipelines.launch.backends import sky_records, sky_sdk
from gpudoor_pipelines.launch.backends.base import LogFollower
from gpudoor_pipelines.launch.job import Holding, JobInfo, JobState
from gpudoor_pipelines.launch.resolve.request import ResolvedJob

if TYPE_CHECKING:
    from gpudoor_pipelines.launch.backends.skypilot import SkyPilotBackend

_REGISTRY: dict[str, type[JobStrategy]] = {}
#: What a look at jobs reads to tell whether a launch arrived.
_LOOK_FIELDS = ["job_id", "job_name", "submitted_at"]
#: The states of a job whose cancel has arrived.
_CANCEL_ARRIVED = {JobState.CANCELLING, *(s for s in JobState if s.is_terminal)}


def register(name: str):
    """Registers a job strategy under the ``launch_as`` name that picks it."""

    def wrap(cls: type[JobStrategy]) -> type[JobStrategy]:
        cls.NAME = name
        _REGISTRY[name] = cls
        return cls

    return wrap


def strategies(backend: SkyPilotBackend) -> list[JobStrategy]:
    """One instance of every registered strategy for ``backend`` (a strategy registers when its module is
    imported: the backend imports them all)."""
    return [cls(backend) for cls in _REGISTRY.values()]


def for_launch(choices: Sequence[JobStrategy], job: ResolvedJob) -> JobStrategy:
    """The strategy the fleet's ``launch_as`` names for ``job`` (a managed job when it names none known)."""
    by_name = {s.NAME: s for s in choices}
    return by_name.get(job.launch_as) or by_name[ManagedJobs.NAME]


def owner_of(choices: Sequence[JobStrategy], job_id: str) -> JobStrategy:
    """The strategy whose ids look like ``job_id``."""
    for strategy in choices:
        if strategy.owns(job_id):
            return strategy
    raise KeyError(f"no job {job_id}: neither a managed job's id nor a step cluster's")


class JobStrategy(abc.ABC):
    """One way of running a job: submit it, read its state and logs, cancel it, say what it holds."""

    NAME: ClassVar[str] = ""

    def __init__(self, backend: SkyPilotBackend) -> None:
        self.backend = backend

    @staticmethod
    @abc.abstractmethod
    def owns(job_id: str) -> bool:
        """Whether ``job_id`` is one of this strategy's ids."""

    @abc.abstractmethod
    def submit(self, job: ResolvedJob) -> str:
        """Launches the job; returns its id."""

    @abc.abstractmethod
    def infos(self, job_ids: Sequence[str]) -> dict[str, JobInfo]:
        """The states of the jobs, in as few requests as the API allows (unknown ones left out)."""

    @abc.abstractmethod
    def follow(self, job_id: str) -> LogFollower:
        """A follower of the job's log from the start."""

    @abc.abstractmethod
    def tail(self, job_id: str, lines: int) -> list[str]:
        """The last lines of the job's log."""

    @abc.abstractmethod
    def cancel(self, job_ids: Sequence[str]) -> None:
        """Asks for the jobs to be cancelled (returns once asked)."""

    def holding(self, job_id: str) -> Holding:
        """What the job holds, to release and check."""
        return Holding("job", job_id)

    def finish(self, job_id: str) -> str | None:
        """Called once the job has ended and its log tail was read; says what it gave back, if anything."""
        return None


@register("managed")
class ManagedJobs(JobStrategy):
    """A SkyPilot managed job: ``sky.jobs.launch``, watched through ``sky.jobs.queue_v2``."""

    @staticmethod
    def owns(job_id: str) -> bool:
        return re.fullmatch(r"[0-9]+", str(job_id)) is not None

    def submit(self, job: ResolvedJob) -> str:
        sky = sky_sdk.sky()
        with sky_sdk.refusals(job):
            task = sky_sdk.build_task(job)
            job_ids = sky_sdk.launch(job.name, lambda: sky.jobs.launch(task, name=job.name), self.named(job.name))
        if not job_ids:
            raise RuntimeError(f"SkyPilot returned no job id for {job.name}")
        return job_ids[0]

    @staticmethod
    def named(name: str) -> Callable[[float], list[str]]:
        """A look for the managed jobs of this name submitted since a time (did a launch arrive?)."""

        def look(since: float) -> list[str]:
            sky = sky_sdk.sky()
            records, *_ = sky.get(
                sky.jobs.queue_v2(
                    refresh=False, all_users=True, name_match=name, submitted_after=since, fields=_LOOK_FIELDS
                )
            )
            found = [r for r in records if r.job_name == name and (r.submitted_at or 0) >= since]
            return [str(r.job_id) for r in sorted(found, key=lambda r: r.job_id)]

        return look

    def infos(self, job_ids: Sequence[str]) -> dict[str, JobInfo]:
        if not job_ids:
            return {}
        sky = sky_sdk.sky()
        ids = [int(i) for i in job_ids]
        records, *_ = sky_sdk.read(
            lambda: sky.jobs.queue_v2(refresh=False, all_users=True, job_ids=ids, fields=sky_records.QUEUE_FIELDS)
        )
        return {str(r.job_id): sky_records.job_info(r) for r in records}

    def follow(self, job_id: str) -> LogFollower:
        sky = sky_sdk.sky()
        return sky_sdk.ThreadFollower(
            lambda out: sky.jobs.tail_logs(job_id=int(job_id), follow=True, output_stream=out),
            catch_up=lambda out: sky.jobs.tail_logs(job_id=int(job_id), follow=False, output_stream=out),
        )

    def tail(self, job_id: str, lines: int) -> list[str]:
        sky = sky_sdk.sky()
        return sky_sdk.tail(
            lambda out: sky.jobs.tail_logs(job_id=int(job_id), follow=False, tail=lines, output_stream=out), lines
        )

    def cancel(self, job_ids: Sequence[str]) -> None:
        if not job_ids:
            return
        sky, ids = sky_sdk.sky(), [int(i) for i in job_ids]

        def done() -> bool:  # did the cancel arrive? every job ended or on its way out
            infos = self.infos(job_ids)
            return all(i not in infos or infos[i].state in _CANCEL_ARRIVED for i in job_ids)

        sky_sdk.cancel(f"jobs {', '.join(job_ids)}", lambda: sky.jobs.cancel(job_ids=ids), done)


class WarmPools:
    """The ranks of a batch on a managed-job pool: setup runs once per worker, the ranks are managed jobs."""

    #: Seconds between looks at a pool that is not ready yet.
    poll_s = 5.0
    #: How long a pool's release waits for the controllers of its last batch's ended jobs to be done.
    cleanup_wait_s = 60.0

    def __init__(self, backend: SkyPilotBackend) -> None:
        self.backend = backend
        self._last_batch: dict[str, list[str]] = {}

    def submit(self, job: ResolvedJob, num_jobs: int, *, pool_name: str, workers: int) -> list[str]:
        """``sky.jobs.pool_apply`` (when the pool is missing or too small), then one ``sky.jobs.launch(pool=, "
        "num_jobs=)``."""
        sky = sky_sdk.sky()
        config = {k: v for k, v in job.config.items()}
        # SkyPilot refuses job_recovery on a pool: the pool recovers a job whose worker is preempted on a
        # replacement worker itself, and the caller relaunches what a failed job had not finished.
        if isinstance(config.get("resources"), dict):
            config["resources"] = {k: v for k, v in config["resources"].items() if k != "job_recovery"}
        current = self.record(pool_name)
        if current is None or int(current.get("target_num_replicas") or 0) < workers:
            pool_config = {k: v for k, v in config.items() if k != "run"}
            pool_config.update(name=pool_name, pool={"workers": workers})
            with sky_sdk.refusals(job):
                sky.get(
                    sky.jobs.pool_apply(sky_sdk.build_task(job, pool_config), pool_name, mode=sky_sdk.update_mode())
                )
        self._wait_ready(pool_name)
        # The job runs on the pool's workers: they decide where, and they already ran the setup.
        job_config = {k: v for k, v in config.items() if k not in ("setup", "num_nodes")}
        job_config["name"] = job.name
        with sky_sdk.refusals(job):
            task = sky_sdk.build_task(job, job_config)
            job_ids = sky_sdk.launch(
                job.name,
                lambda: sky.jobs.launch(task, name=job.name, pool=pool_name, num_jobs=num_jobs),
                ManagedJobs.named(job.name),
            )
        if len(job_ids) != num_jobs:
            raise RuntimeError(f"SkyPilot returned {len(job_ids)} job ids for {num_jobs} jobs of {job.name}")
        self._last_batch[pool_name] = list(job_ids)  # a batch is launched once the one before it has ended
        return job_ids

    def record(self, pool_name: str) -> dict | None:
        """The pool's ``sky.jobs.pool_status`` record (None when there is no such pool)."""
        sky = sky_sdk.sky()
        try:
            records = sky_sdk.read(lambda: sky.jobs.pool_status([pool_name]))
        except Exception as e:  # noqa: BLE001 - SkyPilot raises a plain exception for an unknown pool
            if "not found" in str(e).lower() or "does not exist" in str(e).lower():
                return None
            raise
        return next((r for r in records or () if r.get("name") == pool_name), None)

    def _wait_ready(self, pool_name: str, timeout_s: float = 900.0) -> None:
        deadline = time.time() + timeout_s
        while True:
            record = self.record(pool_name)
            status = sky_records.status_name(record) if record else "None"
            if status == "READY":
                return
            if status.startswith("FAILED") or time.time() > deadline:
                raise RuntimeError(
                    f"pool {pool_name} is {status} (not READY after {time.time() - deadline + timeout_s:.0f} s)"
                )
            time.sleep(self.poll_s)

    def workers(self, pool_name: str) -> int:
        """The pool's target number of workers (0 when there is no such pool)."""
        record = self.record(pool_name)
        return int(record.get("target_num_replicas") or 0) if record else 0

    def release(self, pool_name: str) -> None:
        """``sky.jobs.pool_down`` of the pool (nothing if there is none), once the controllers of its last
        batch's ended jobs are done (:meth:`_controllers_done`)."""
        last = self._last_batch.pop(pool_name, [])
        if self.record(pool_name) is None:
            return
        self._controllers_done(last)
        sky = sky_sdk.sky()
        sky.get(sky.jobs.pool_down(pool_name))

    def _controllers_done(self, job_ids: list[str]) -> None:
        """Waits, at most ``cleanup_wait_s``, until the controller of every ended job of ``job_ids`` is done
        (its ``schedule_state`` DONE). A job that has ended may still have its controller at work on its worker
        (reading the log, cancelling what is left there): the worker taken down under it turns the job
        FAILED_CONTROLLER. Jobs not ended (a run interrupted) are released as they are."""
        if not job_ids:
            return
        sky = sky_sdk.sky()
        ids = [int(j) for j in job_ids]
        fields = ["job_id", "status", "schedule_state"]
        deadline = time.monotonic() + self.cleanup_wait_s
        while time.monotonic() < deadline:
            records, *_ = sky_sdk.read(
                lambda: sky.jobs.queue_v2(
                    refresh=False, skip_finished=False, all_users=True, job_ids=ids, fields=fields
                )
            )
            scheduled = ((sky_records.field(r, "status"), sky_records.field(r, "schedule_state")) for r in records)
            busy = [
                state
                for status, state in scheduled
                if sky_sdk.state(status).is_terminal and str(getattr(state, "value", state) or "DONE") != "DONE"
            ]
            if not busy:
                return
            time.sleep(1.0)
