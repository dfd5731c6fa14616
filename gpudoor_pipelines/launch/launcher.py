"""The launcher: submit, one wait loop, cancel with a verified release; free of Dagster.

Every front end goes through it: the Pipes client of the assets (:mod:`.client`) and the agent door
(``gpudoor launch/status/logs/cancel``). What a front end does with what happens (Dagster events, run
tags, JSON lines) it says through :class:`Hooks`.

- :meth:`Launcher.submit`: a resolved job onto its pool; routed again around pools the API server says
  are full.
- :meth:`Launcher.wait`: **the** wait loop. Log lines stream to a callback; states come from the
  process's status hub (one request for every job the process watches), backing off while nothing
  changes and asked at once when a followed log stream ends; preemptions are counted and dated; a job
  evicted from a pool whose ``recover_to`` names others moves there; an interruption (a run terminated,
  Ctrl-C) cancels what is still held and verifies the release.
- :meth:`Launcher.release`: cancel, give back, then look until nothing is held (``record.release``).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import getpass
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from gpudoor_pipelines.launch.backends.base import Backend, LogFollower, Service
from gpudoor_pipelines.launch.errors import JobFailed, LaunchConfigError, PoolFull
from gpudoor_pipelines.launch.job import FAILURE_MEANING, Holding, JobInfo, JobState
from gpudoor_pipelines.launch.record.goodput import Timeline, report_preemptions
from gpudoor_pipelines.launch.record.records import BatchPlan
from gpudoor_pipelines.launch.record.release import ReleaseOutcome, release_and_verify
from gpudoor_pipelines.launch.resolve.fleet import Fleet, load_fleet
from gpudoor_pipelines.launch.resolve.request import LaunchRequest, ResolvedJob, resolve
from gpudoor_pipelines.launch.resolve.routing import Usage
from gpudoor_pipelines.launch.watch import Backoff, status_hub

#: Reads of what is held, started beside a step's health check and Pipes session.
_USAGE_READS = concurrent.futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="gpudoor-usage-read")


@dataclasses.dataclass(frozen=True)
class LaunchSettings:
    """Where jobs go and how they are watched: the fields of the Pipes client resource, free of Dagster.

    Attributes:
        backend: ``local`` (embedded default) or ``skypilot``.
        api_server_endpoint: SkyPilot API server URL (``skypilot`` backend).
        service_account_token: SkyPilot service-account token; never logged.
        specs_dir: folder of task specs (default: the project's ``task_specs/``).
        fleet_file: the fleet file (default: ``task_specs/fleet.yaml``).
        local_home: state folder of the local backend (default ``$GPUDOOR_HOME`` or ``~/.gpudoor``).
        cost_owner: who pays for jobs whose task file names no cost owner (default: the fleet's).
        user: who launches (labels, per-user caps); default: the service account, else the OS user.
        poll_interval_s: seconds to a job's first status poll and after each change; also how often
            log lines are handed over.
        max_poll_interval_s: where status requests go to a server, polls of an unchanged job back off,
            doubling, up to this.
        cancel_timeout_s: how long a release is looked at before it is reported not confirmed.
        max_log_streams: how many jobs of a batch stream their logs at once.
        validate_with_skypilot: also parse every spec with ``sky.Task`` (once per file version).
    """

    backend: str = "local"
    api_server_endpoint: str | None = None
    service_account_token: str | None = dataclasses.field(default=None, repr=False)
    specs_dir: str | None = None
    fleet_file: str | None = None
    local_home: str | None = None
    cost_owner: str | None = None
    user: str | None = None
    poll_interval_s: float = 0.5
    max_poll_interval_s: float = 20.0
    cancel_timeout_s: float = 180.0
    max_log_streams: int = 4
    validate_with_skypilot: bool = True


#: The settings the environment sets, and from which variables (the Dagster resources bind the same ones).
ENV_SETTINGS = {
    "backend": "GPUDOOR_BACKEND",
    "api_server_endpoint": "SKYPILOT_API_SERVER_ENDPOINT",
    "service_account_token": "SKYPILOT_SERVICE_ACCOUNT_TOKEN",
    "cost_owner": "GPUDOOR_COST_OWNER",
    "local_home": "GPUDOOR_HOME",
    "user": "GPUDOOR_USER",
}


def settings_from_env(**overrides: Any) -> LaunchSettings:
    """The settings the environment describes (see ``gpudoor_pipelines.settings``), with ``overrides``."""
    found = {field: os.environ[var] for field, var in ENV_SETTINGS.items() if os.environ.get(var)}
    return LaunchSettings(**{**found, **{k: v for k, v in overrides.items() if v is not None}})


def make_backend(settings: LaunchSettings) -> Backend:
    """The backend the settings name.

    Raises:
        LaunchConfigError: an unknown backend, or a SkyPilot backend without an API server.
    """
    if settings.backend == "local":
        from gpudoor_pipelines.launch.backends.local import LocalBackend

        return LocalBackend(home=settings.local_home)
    if settings.backend == "skypilot":
        from gpudoor_pipelines.launch.backends.skypilot import SkyPilotBackend

        return SkyPilotBackend(endpoint=settings.api_server_endpoint, token=settings.service_account_token)
    raise LaunchConfigError(
        "resource skypilot",
        "backend",
        f"unknown backend '{settings.backend}'",
        "use 'local' or 'skypilot' (GPUDOOR_BACKEND)",
    )


def launching_user(settings: LaunchSettings) -> str:
    """Who launches: ``user``, else the service account the API server knows the token as, else the OS user.
    The API server's policy names the user itself in any case."""
    if settings.user:
        return settings.user
    if settings.backend == "skypilot" and settings.service_account_token:
        name = _service_account(settings.api_server_endpoint, settings.service_account_token)
        if name:
            return name
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return "unknown"


class Redactor:
    """Replaces a job's secret values in its log lines with ``****``."""

    def __init__(self, secrets: Mapping[str, str]) -> None:
        self._values = sorted({v for v in secrets.values() if v and len(v) >= 4}, key=len, reverse=True)

    def __call__(self, line: str) -> str:
        for value in self._values:
            line = line.replace(value, "****")
        return line


def _ignore(*_: Any) -> None:
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

    line: Callable[[str], None] = _ignore
    state: Callable[[str, JobInfo], None] = _ignore
    polled: Callable[[Mapping[str, JobInfo]], None] = _ignore
    tick: Callable[[], None] = _ignore
    preempted: Callable[[int, JobInfo, float], None] | None = None
    moved: Callable[[str, str, ResolvedJob], None] = _ignore
    said: Callable[[str], None] = _ignore
    released: Callable[[list[ReleaseOutcome]], None] = _ignore


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


class _Streams:
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

    def stop(self, job_id: str) -> None:
        """Closes a job's stream for good (its job ended, or was replaced)."""
        follower = self.open.pop(job_id, None)
        if follower is not None:
            for line in follower.poll():
                self.emit(f"[job {job_id}] {line}" if self.prefix else line)
            follower.close()
        self.done.add(job_id)

    def close(self) -> None:
        for follower in self.open.values():
            follower.close()


class Launcher:
    """Submits, waits for and releases jobs on one backend, for one fleet (see the module docstring)."""

    def __init__(self, backend: Backend, fleet: Fleet, settings: LaunchSettings | None = None) -> None:
        self.backend, self.fleet = backend, fleet
        self.settings = settings or LaunchSettings()

    @classmethod
    def from_settings(cls, settings: LaunchSettings) -> Launcher:
        """The launcher of the settings' backend and fleet file."""
        return cls(make_backend(settings), load_fleet(settings.fleet_file), settings)

    # ----------------------------------------------------------------- who and what is held
    def user(self) -> str:
        """Who launches (:func:`launching_user`)."""
        return launching_user(self.settings)

    def status(self, job_id: str) -> JobInfo:
        """The job's state, through the process's status hub (``KeyError`` when the backend has no such job)."""
        info = status_hub(self.backend).get([job_id]).get(job_id)
        if info is None:
            raise KeyError(f"the {self.backend.name} backend has no job {job_id}")
        return info

    def usage_now(self) -> concurrent.futures.Future[Usage] | None:
        """What is held, read in the background (None when the API server counts it: ``live_caps: server``)."""
        return None if self.fleet.live_caps == "server" else _USAGE_READS.submit(self.backend.usage)

    # ----------------------------------------------------------------- submit
    def submit(
        self, job: ResolvedJob, request: LaunchRequest, log: Callable[[str], None] = _ignore
    ) -> tuple[str, ResolvedJob]:
        """Submits ``job`` (``request`` resolved); when the API server says its pool is full, reads what is
        held, counts the refused pools as full whatever the read says, and submits to the next pool the
        route allows. Returns the job id and the job as submitted.

        Raises:
            LaunchConfigError: the server refused the job for another reason, or no pool has room.
        """
        full: set[str] = set()
        while True:
            assert job.route is not None
            log(
                f"Launching {job.name} on pool '{job.pool}' ({job.route.infra}, {job.route.describe()}) "
                f"through the {self.backend.name} backend: {job.route.reason}."
            )
            try:
                return self.backend.submit(job), job
            except PoolFull as e:
                full.add(e.pool)
                log(f"The API server says pool '{e.pool}' is full ({e.problem}): routing again.")
                job = resolve(request, self.fleet, usage=_full(self.backend.usage(), self.fleet, full))

    def _move(
        self, job: ResolvedJob, job_id: str, request: LaunchRequest, hooks: Hooks
    ) -> tuple[str, ResolvedJob] | None:
        """A job RECOVERING on a pool whose ``recover_to`` names others: launched on the first of them that can
        take it now (routed and ruled for that pool, its caps counted), then the recovering one is cancelled
        and its release verified. Returns the new job id and job; None when no pool can take it (SkyPilot
        goes on recovering it where it was)."""
        if job.launch_as != "managed" or not self.fleet.pools[job.pool].recover_to:
            return None  # a step cluster is launched again by the step itself, on its own pool
        refused = []
        for target in self.fleet.pools[job.pool].recover_to:
            moved_request = dataclasses.replace(request, pool=target, infra=None)
            try:
                usage = None if self.fleet.live_caps == "server" else self.backend.usage()
                new_job = resolve(moved_request, self.fleet, usage=usage)
                new_id = self.backend.submit(new_job)
            except LaunchConfigError as e:  # PoolFull included: the next pool, or none
                refused.append(f"{target}: {e.problem}")
                continue
            hooks.moved(job_id, new_id, new_job)
            hooks.said(
                f"Job {job_id} was evicted from pool '{job.pool}': launched again on pool '{target}' as job {new_id} "
                f"(recover_to of '{job.pool}' in {self.fleet.source}); it resumes from what it saved. Cancelling job {job_id}."
            )
            hooks.released(self.release([self.backend.holding_of(job_id)]))
            return new_id, new_job
        hooks.said(
            f"Job {job_id} was evicted from pool '{job.pool}' and no pool of its recover_to can take it "
            f"now ({'; '.join(refused)}): SkyPilot recovers it on '{job.pool}'."
        )
        return None

    def submit_batch(self, job: ResolvedJob, num_jobs: int, *, pool_name: str, workers: int) -> list[str]:
        """The ranks of a batch on a warm pool (see :meth:`Backend.submit_batch`)."""
        return self.backend.submit_batch(job, num_jobs, pool_name=pool_name, workers=workers)

    def plan_batch(self, request: LaunchRequest, *, pool_name: str, max_workers: int | None = None) -> BatchPlan:
        """Where a batch of ``request`` would run on the warm pool ``pool_name``, and how many workers fit.

        Free GPUs are the routed pool's cap minus what jobs hold now, the per-user cap, and, where SkyPilot
        reports it (Slurm), what the cluster has free; the GPUs the warm pool's own workers hold already
        count as its own. ``workers`` is 0 when nothing is free.

        Raises:
            LaunchConfigError: the request cannot run on any pool.
        """
        self.backend.check()
        usage = self.backend.usage()
        own = self.backend.pool_workers(pool_name)
        job = resolve(request, self.fleet)  # fails here when no pool could ever take the job
        if not own:  # a new pool goes where there is room now (the route spills over full pools)
            try:
                job = resolve(request, self.fleet, usage=usage)
            except LaunchConfigError as e:  # every pool of the route is full right now
                return BatchPlan(job=job, workers=0, free_gpus=0, reason=e.problem)
        assert job.route is not None
        pool = self.fleet.pools[job.pool]
        per_job = max(1, job.route.total_gpus)
        mine = own * per_job  # usage() counts the warm pool's own workers: they are this batch's to reuse
        free = min(
            pool.gpu_cap - usage.gpus.get(job.pool, 0) + mine,
            pool.user_gpu_cap - usage.user_gpus.get((request.user, job.pool), 0) + mine,
        )
        reason = f"pool '{job.pool}' cap {pool.gpu_cap}, {usage.gpus.get(job.pool, 0)} GPUs held"
        reported = self.backend.free_gpus(job.route) if job.route.accelerator else None
        if reported is not None:
            free = min(free, reported + own * per_job)  # the cluster counts the pool's own workers as busy
            reason += f", {reported} {job.route.accelerator} free on {job.route.infra}"
        workers = max(0, free // per_job)
        if max_workers is not None:
            workers = min(workers, max_workers)
        return BatchPlan(job=job, workers=workers, free_gpus=max(0, free), reason=reason)

    # ----------------------------------------------------------------- the wait loop
    def wait(
        self,
        job_ids: Sequence[str],
        hooks: Hooks | None = None,
        *,
        redact: Callable[[str], str] = str,
        interrupts: tuple[type[BaseException], ...] = (KeyboardInterrupt,),
        forward_termination: bool = True,
        also_release: Sequence[Holding] = (),
        service: Service | None = None,
        until: Callable[[], bool] | None = None,
        movable: tuple[ResolvedJob, LaunchRequest] | None = None,
    ) -> Watched:
        """Waits until every job has ended (or ``until`` says so), streaming their logs (see the module
        docstring). ``service``: wait for one service instead of jobs (its state and log are its own).
        ``movable``: the one job waited for and its request, to launch it again elsewhere when it is evicted
        from a pool whose ``recover_to`` names others.

        On one of ``interrupts``, with ``forward_termination``: every job not ended, and ``also_release``
        (a batch's warm pool), are released and the release verified (:attr:`Hooks.released`); then the
        interruption goes on.
        """
        hooks = hooks or Hooks()
        s = self.settings
        ids = list(job_ids)
        hub = status_hub(self.backend)
        if service is not None:

            def statuses(asked: Sequence[str]) -> dict[str, JobInfo]:
                return {service.job_id: service.status()}

            follow: Callable[[str], LogFollower] = lambda _job_id: service.follow_logs()  # noqa: E731
            most = s.poll_interval_s  # a service's URL shows without a change of state: no backing off
        else:

            def statuses(asked: Sequence[str]) -> dict[str, JobInfo]:
                return hub.get(asked, max_age_s=s.poll_interval_s)

            follow = self.backend.follow_logs
            most = s.max_poll_interval_s if self.backend.remote_status else s.poll_interval_s
        streams = _Streams(follow, s.max_log_streams, lambda line: hooks.line(redact(line)), prefix=len(ids) > 1)
        infos: dict[str, JobInfo] = {}
        timelines = {job_id: Timeline() for job_id in ids}
        reported: dict[str, int] = {}
        moved: list[ResolvedJob] = []
        movable = movable if movable is not None and any(p.recover_to for p in self.fleet.pools.values()) else None
        backoff = Backoff(s.poll_interval_s, most)
        # The first poll comes a poll interval after submission (a job just submitted is pending): steps that
        # start together are then asked about in one request.
        next_poll = time.monotonic() + s.poll_interval_s
        hub.watch(ids)
        try:
            streams.start(ids, infos, now=len(ids) <= streams.limit)
            while True:
                streams.drain()
                hooks.tick()
                cue = streams.newly_ended()
                if cue or time.monotonic() >= next_poll:
                    previous = dict(infos)
                    live = [i for i in ids if i not in infos or not infos[i].state.is_terminal]
                    answer = statuses(live)
                    if len(ids) == 1 and ids[0] not in answer:
                        raise KeyError(f"the {self.backend.name} backend has no job {ids[0]}")
                    infos.update(answer)
                    changed = cue
                    for job_id in live:
                        info = infos.get(job_id)
                        if info is None:
                            continue
                        timelines[job_id].see(time.time(), info)
                        if previous.get(job_id) is None or previous[job_id].state is not info.state:
                            changed = True
                            hooks.state(job_id, info)
                            if info.state is JobState.RECOVERING and movable is not None:
                                new = self._move(moved[-1] if moved else movable[0], job_id, movable[1], hooks)
                                if new is not None:
                                    moved.append(new[1])
                                    self._replace(ids, job_id, new[0], infos, timelines, streams, hub)
                                    backoff.reset()
                    if hooks.preempted is not None:
                        report_preemptions(ids, previous, infos, reported, hooks.preempted)
                    for job_id in ids:
                        if job_id in infos and infos[job_id].state.is_terminal and job_id not in streams.done:
                            streams.stop(job_id)
                            hub.unwatch([job_id])  # an ended job is not asked about again
                    hooks.polled(infos)
                    if all(i in infos and infos[i].state.is_terminal for i in ids) or (until is not None and until()):
                        break
                    streams.start(ids, infos)
                    next_poll = time.monotonic() + backoff.after(changed)
                time.sleep(max(0.0, min(s.poll_interval_s, next_poll - time.monotonic())))
            streams.drain()
            hooks.tick()
        except interrupts:
            if forward_termination:
                live = [i for i in ids if i not in infos or not infos[i].state.is_terminal]
                what = (
                    f"job {live[0]}"
                    if len(ids) == 1
                    else f"the {len(live)} jobs" + (f" on pool {also_release[0].id}" if also_release else "")
                )
                hooks.said(f"Run terminated: cancelling {what}.")
                hooks.released(self.release([*(self.backend.holding_of(i) for i in live), *also_release]))
            raise
        finally:
            hub.unwatch([i for i in ids if i not in streams.done])
            streams.close()
        return Watched(
            job_ids=ids,
            infos={i: infos[i] for i in ids if i in infos},
            timelines={i: timelines[i] for i in ids},
            moved=moved,
        )

    @staticmethod
    def _replace(
        ids: list[str],
        old: str,
        new: str,
        infos: dict[str, JobInfo],
        timelines: dict[str, Timeline],
        streams: _Streams,
        hub: Any,
    ) -> None:
        """Follows the job launched in place of an evicted one (its timeline goes on)."""
        streams.stop(old)
        hub.unwatch([old])
        ids[ids.index(old)] = new
        timelines[new] = timelines.pop(old)
        infos.pop(old, None)
        hub.watch([new])
        streams.start([new], infos, now=True)

    def ended(
        self, job_id: str, info: JobInfo, redact: Callable[[str], str] = str
    ) -> tuple[JobFailed | None, str | None]:
        """After a job ended: what its failure was (its last log lines), and what giving back what its end
        does not (a step cluster, once its log tail is read) did."""
        failure = None
        if info.state.is_failure:
            tail = [redact(line) for line in self.backend.log_tail(job_id, 30)]
            failure = JobFailed(job_id, info.state.value, info.detail or FAILURE_MEANING.get(info.state, ""), tail)
        return failure, self.backend.finish(job_id)

    # ----------------------------------------------------------------- services
    def serve(
        self,
        job: ResolvedJob,
        *,
        port: int,
        ready_timeout_s: float,
        hooks: Hooks | None = None,
        redact: Callable[[str], str] = str,
        interrupts: tuple[type[BaseException], ...] = (KeyboardInterrupt,),
    ) -> tuple[Service, str]:
        """Starts a service (a demo) on ``job.cluster_name`` and waits for its URL.

        Raises:
            JobFailed: the service stopped before it answered (its last log lines).
            TimeoutError: it did not answer within ``ready_timeout_s`` (it was stopped).
        """
        assert job.cluster_name
        service = self.backend.start_service(job)
        deadline = time.monotonic() + ready_timeout_s
        url: list[str] = []

        def answered() -> bool:
            found = service.url(port)
            if found:
                url.append(found)
            return bool(found) or time.monotonic() >= deadline

        try:
            watched = self.wait(
                [service.job_id],
                hooks,
                redact=redact,
                interrupts=interrupts,
                service=service,
                until=answered,
                forward_termination=False,
            )
        except interrupts:
            self.backend.stop_service(job.cluster_name)
            raise
        info = watched.infos.get(service.job_id)
        if not url and info is not None and info.state.is_terminal:
            tail = [redact(line) for line in service.log_tail(30)]
            raise JobFailed(service.job_id, info.state.value, "the service stopped before it answered", tail)
        if not url:
            self.backend.stop_service(job.cluster_name)
            raise TimeoutError(
                f"Service {job.cluster_name} did not answer within {ready_timeout_s:.0f} s; it was stopped."
            )
        return service, url[0]

    # ----------------------------------------------------------------- release
    def release(self, holdings: Sequence[Holding]) -> list[ReleaseOutcome]:
        """Releases jobs (or a warm pool, a cluster) and looks until nothing is held: the job terminal, its
        cluster gone, its processes gone. A release not confirmed within ``cancel_timeout_s`` says so in its
        outcome (the orphan reconciler tries again once its run has ended)."""
        s = self.settings
        return release_and_verify(
            self.backend, holdings, timeout_s=s.cancel_timeout_s, poll_s=max(s.poll_interval_s, 1.0)
        )

    def cancel(self, job_id: str) -> ReleaseOutcome:
        """Cancels one job and verifies its release (``KeyError`` when the backend has no such job)."""
        self.backend.status(job_id)
        (outcome,) = self.release([self.backend.holding_of(job_id)])
        return outcome


def _full(usage: Usage, fleet: Fleet, pools: set[str]) -> Usage:
    """``usage`` with ``pools`` held to their caps: the API server said they are full, whatever was read."""
    gpus = {**usage.gpus, **{p: fleet.pools[p].gpu_cap for p in pools if p in fleet.pools}}
    vcpus = {**usage.vcpus, **{p: fleet.pools[p].vcpu_cap or 0 for p in pools if p in fleet.pools}}
    return dataclasses.replace(usage, gpus=gpus, vcpus=vcpus)


@functools.lru_cache(maxsize=8)
def _service_account(endpoint: str | None, token: str) -> str | None:
    """The name the API server gives the token's service account (cached per process)."""
    if not endpoint:
        return None
    from gpudoor_pipelines.launch.backends.skypilot import SkyPilotBackend

    return SkyPilotBackend(endpoint, token).service_account()
