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
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from gpudoor_pipelines.launch.backends.base import Backend, LogFollower, Service
from gpudoor_pipelines.launch.config import LaunchSettings, launching_user, make_backend
from gpudoor_pipelines.launch.errors import JobFailed, LaunchConfigError, PoolFull
from gpudoor_pipelines.launch.job import FAILURE_MEANING, Holding, JobInfo, JobState
from gpudoor_pipelines.launch.ledger import Figures, Ledger
from gpudoor_pipelines.launch.record.goodput import Timeline, report_preemptions
from gpudoor_pipelines.launch.record.records import BatchPlan
from gpudoor_pipelines.launch.record.release import ReleaseOutcome, release_and_verify
from gpudoor_pipelines.launch.resolve.fleet import Fleet, load_fleet, normalize_infra
from gpudoor_pipelines.launch.resolve.request import LaunchRequest, ResolvedJob, resolve
from gpudoor_pipelines.launch.resolve.sharing import budget_verdict
from gpudoor_pipelines.launch.resolve.usage import Usage
from gpudoor_pipelines.launch.watch import Backoff, Hooks, Streams, Watched, ignore, status_hub
from gpudoor_pipelines.transit.bucket import gpudoor_home

#: Reads of what is held, started beside a step's health check and Pipes session.
_USAGE_READS = concurrent.futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="gpudoor-usage-read")


class Redactor:
    """Replaces a job's secret values in its log lines with ``****``."""

    def __init__(self, secrets: Mapping[str, str]) -> None:
        self._values = sorted({v for v in secrets.values() if v and len(v) >= 4}, key=len, reverse=True)

    def __call__(self, line: str) -> str:
        for value in self._values:
            line = line.replace(value, "****")
        return line


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

    @functools.cached_property
    def ledger(self) -> Ledger:
        """The week's figures (budgets, queue waits) and the GPUs free now, kept on this machine."""
        return Ledger(self.backend, self.fleet, gpudoor_home() / "cache")

    def ahead(self, request: LaunchRequest | None = None, *, usage: bool = True) -> Ahead:
        """Starts, in the background, the reads a launch weighs: what is held (unless the API server counts it:
        ``live_caps: server``), the week's figures (budgets, queue waits), and the GPUs free on the clusters of
        the request's route where it has pools to choose among. A step starts them beside its health check;
        ``usage=False`` leaves out what is held (``gpudoor where``)."""
        held = _USAGE_READS.submit(self.backend.usage) if usage and self.fleet.live_caps != "server" else None
        figures = _USAGE_READS.submit(self.ledger.figures) if self.ledger.wanted else None
        if request is not None:
            # The pools of the route that offer one of the job's GPUs: only among several is there a choice.
            gpus = {c.accelerator.lower() for c in request.spec.candidates if c.accelerator}
            route = [self.fleet.pools[p] for p in self.fleet.routes.get(request.step or "", ())]
            pools = [p for p in route if gpus & {g.lower() for g in p.gpus}]
            if len(pools) > 1:  # one read per cluster: its partitions come in the same answer
                for infra in {"/".join(normalize_infra(p.infra).split("/")[:2]): p.infra for p in pools}.values():
                    _USAGE_READS.submit(self.backend.free_gpus_at, infra)
        return Ahead(held, figures)

    def resolve(
        self, request: LaunchRequest, ahead: Ahead | None = None, *, full: set[str] = frozenset()
    ) -> ResolvedJob:
        """Resolves ``request`` as the launch will run it: its caps and quotas counted (where the launcher counts
        them), the pool that starts it soonest among those its route allows, its cost owner's budget weighed.

        Raises:
            LaunchConfigError: the request is refused (its budget spent included); nothing was launched.
        """
        ahead = ahead or self.ahead(request)
        usage = ahead.usage.result() if ahead.usage is not None else None
        if full:  # the API server said these are full: read what is held, whatever the settings say
            usage = _full(usage or self.backend.usage(), self.fleet, full)
        figures = ahead.figures.result() if ahead.figures is not None else None
        job = resolve(request, self.fleet, usage=usage, outlook=self.ledger.outlook(figures))
        return self._budgeted(job, request, figures)

    def weigh_budget(self, job: ResolvedJob, request: LaunchRequest) -> ResolvedJob:
        """The job with its cost owner's week against its budget, the week's figures read now (a batch's launch).

        Raises:
            LaunchConfigError: as :meth:`_budgeted`.
        """
        return self._budgeted(job, request, self.ledger.figures() if self.fleet.sharing.budgets else None)

    def _budgeted(self, job: ResolvedJob, request: LaunchRequest, figures: Figures | None) -> ResolvedJob:
        """The job with its cost owner's week against its budget (``figures`` None: they could not be read, the
        launch goes on without them).

        Raises:
            LaunchConfigError: the budget is spent and the fleet refuses (``budget_enforce: refuse``); an
                interactive session is never refused.
        """
        if not self.fleet.sharing.budgets or figures is None:
            return job
        verdict = budget_verdict(self.fleet, job.cost_owner, figures.spent)
        if verdict is not None and verdict.refusal and not request.interactive:
            raise LaunchConfigError(
                self.fleet.source,
                f"sharing.budgets.{job.cost_owner}",
                verdict.refusal,
                "wait for next week (it starts Monday 00:00 UTC), launch under a cost owner with budget left "
                "(--cost-owner, the gpudoor/cost-owner run tag), or ask the fleet's admins to raise the budget",
            )
        return dataclasses.replace(job, budget=verdict)

    # ----------------------------------------------------------------- submit
    def submit(
        self, job: ResolvedJob, request: LaunchRequest, log: Callable[[str], None] = ignore
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
            step = f" ({request.step} step)" if request.step else ""
            log(
                f"Launching {job.name}{step} on pool '{job.pool}' ({job.route.infra}, {job.route.describe()}) "
                f"through the {self.backend.name} backend: {job.route.reason}."
            )
            try:
                job_id = self.backend.submit(job)
            except PoolFull as e:
                full.add(e.pool)
                log(f"The API server says pool '{e.pool}' is full ({e.problem}): routing again.")
                try:
                    job = self.resolve(request, full=full)
                except LaunchConfigError:
                    raise e from None  # no other pool can take it: the server's own numbers say why
                continue
            self.ledger.took(job.route)
            return job_id, job

    def _move(
        self, job: ResolvedJob, job_id: str, request: LaunchRequest, hooks: Hooks
    ) -> tuple[str, ResolvedJob] | None:
        """A job RECOVERING on a pool whose ``recover_to`` names others: launched on the first of them that can
        take it now (routed and ruled for that pool, its caps counted). Returns the new job id and job (the
        caller follows it, then releases the recovering one); None when no pool can take it (SkyPilot goes on
        recovering it where it was)."""
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
                f"(recover_to of '{job.pool}' in {self.fleet.source}); it resumes from what it saved. Cancelling job "
                f"{job_id}."
            )
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
        counts = self.backend.free_gpus_at(job.route.infra) if job.route.accelerator else None
        reported = None if counts is None or not job.route.accelerator else counts.get(job.route.accelerator.lower(), 0)
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
        first = self._first_look_s()
        if service is not None:

            def statuses(asked: Sequence[str], fresh: bool) -> dict[str, JobInfo]:
                return {service.job_id: service.status()}

            follow: Callable[[str], LogFollower] = lambda _job_id: service.follow_logs()  # noqa: E731
            most = s.poll_interval_s  # a service's URL shows without a change of state: no backing off
        else:
            # A log that just ended says the job did: an answer older than a poll interval is not enough; a
            # backend whose states are local files is asked again at once (a look costs a file read).
            fresh_age = s.poll_interval_s if self.backend.remote_status else 0.0

            def statuses(asked: Sequence[str], fresh: bool) -> dict[str, JobInfo]:
                return hub.get(asked, max_age_s=fresh_age if fresh else first)

            follow = self.backend.follow_logs
            most = s.max_poll_interval_s if self.backend.remote_status else first
        streams = Streams(follow, s.max_log_streams, lambda line: hooks.line(redact(line)), prefix=len(ids) > 1)
        infos: dict[str, JobInfo] = {}
        timelines = {job_id: Timeline() for job_id in ids}
        reported: dict[str, int] = {}
        moved: list[ResolvedJob] = []
        movable = movable if movable is not None and any(p.recover_to for p in self.fleet.pools.values()) else None
        backoff = Backoff(first, most)
        # The first poll comes a look's interval after submission (a job just submitted is pending): steps that
        # start together are then asked about in one request.
        next_poll = time.monotonic() + first
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
                    answer = statuses(live, fresh=bool(cue))
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
                            # Only a recovery is followed closely (its next states come soon, and a move may be
                            # due): a job launching or running changes next when it ends, which its log's end cues.
                            changed = changed or info.state is JobState.RECOVERING
                            hooks.state(job_id, info)
                            if info.state is JobState.RECOVERING and movable is not None:
                                new = self._move(moved[-1] if moved else movable[0], job_id, movable[1], hooks)
                                if new is not None:
                                    moved.append(new[1])
                                    self._replace(ids, job_id, new[0], infos, timelines, streams, hub)
                                    # The new job's log streams first: a short job may end while the old
                                    # one's release is verified, and a log opened after its end shows nothing.
                                    hooks.released(self.release([self.backend.holding_of(job_id)]))
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
                streams.wait(max(0.0, min(s.poll_interval_s, next_poll - time.monotonic())))
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
        streams: Streams,
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
        return release_and_verify(
            self.backend, holdings, timeout_s=self.settings.cancel_timeout_s, poll_s=max(self._first_look_s(), 1.0)
        )

    def _first_look_s(self) -> float:
        """How soon a job's state is looked at again after a change: the poll interval, but never sooner than
        the backend's states can change (:attr:`~.base.Jobs.status_granularity_s`)."""
        return max(self.settings.poll_interval_s, self.backend.status_granularity_s)

    def cancel(self, job_id: str) -> ReleaseOutcome:
        """Cancels one job and verifies its release (``KeyError`` when the backend has no such job)."""
        self.backend.status(job_id)
        (outcome,) = self.release([self.backend.holding_of(job_id)])
        return outcome


@dataclasses.dataclass(frozen=True)
class Ahead:
    """The reads a launch weighs, under way: what is held (None: the API server counts it), the week's figures
    (None: nothing to weigh them for)."""

    usage: concurrent.futures.Future[Usage] | None = None
    figures: concurrent.futures.Future[Figures | None] | None = None


def _full(usage: Usage, fleet: Fleet, pools: set[str]) -> Usage:
    """``usage`` with ``pools`` held to their caps: the API server said they are full, whatever was read."""
    gpus = {**usage.gpus, **{p: fleet.pools[p].gpu_cap for p in pools if p in fleet.pools}}
    vcpus = {**usage.vcpus, **{p: fleet.pools[p].vcpu_cap or 0 for p in pools if p in fleet.pools}}
    held_on_quota = {**usage.borrowed, **{p: 0 for p in pools}}  # nothing there is anyone's to reclaim either
    return dataclasses.replace(usage, gpus=gpus, vcpus=vcpus, borrowed=held_on_quota)
