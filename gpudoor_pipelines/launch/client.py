"""The Dagster-facing launcher: a Pipes client for SkyPilot, in the shape of Dagster's own.

Like ``PipesECSClient`` and ``PipesK8sClient``, :meth:`PipesSkyPilotClient.run` opens a Pipes
session, launches the job with the session's bootstrap env, waits for it in one place
(:meth:`~PipesSkyPilotClient._wait_for_completion`), forwards a run's termination to the job
(``forward_termination``), and returns a :class:`dagster.PipesClientCompletedInvocation` whose
results carry the launch record (job id, pool, infra, route, policy notes, queued and running
seconds, GPU-hours, cost) next to what the job reported itself. The three moves are three places:
:func:`~gpudoor_pipelines.launch.resolve.request.resolve` (pure), the backend (launch), :class:`LaunchRecord`
(record). The job id goes into the run's tags, so a retried step re-attaches to a job that is still
running instead of launching a second one.

An asset calls it in one line::

    return skypilot.run(context=context, request=skypilot.request(context, "eval", inputs=...)).get_materialize_result()
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import getpass
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import dagster as dg
from pydantic import Field

from gpudoor_pipelines.launch.backends.base import Backend
from gpudoor_pipelines.launch.errors import JobFailed, LaunchConfigError, PoolFull
from gpudoor_pipelines.launch.job import FAILURE_MEANING, Holding, JobInfo, JobState
from gpudoor_pipelines.launch.labels import (
    TAG_COST_OWNER,
    TAG_INFRA,
    TAG_JOB_PREFIX,
    TAG_POOL,
    TAG_RELEASED_PREFIX,
)
from gpudoor_pipelines.launch.record.goodput import PreemptionCost, Timeline, preemption_cost, saved_times
from gpudoor_pipelines.launch.record.release import ReleaseOutcome
from gpudoor_pipelines.launch.resolve.fleet import Fleet, load_fleet
from gpudoor_pipelines.launch.resolve.request import LaunchRequest, ResolvedJob, resolve, slug
from gpudoor_pipelines.launch.resolve.routing import Usage
from gpudoor_pipelines.launch.resolve.specs import TaskSpec, load_spec
from gpudoor_pipelines.launch.watch import Backoff, StatusHub, status_hub
from gpudoor_pipelines.transit.bucket import TransitBucket
from gpudoor_pipelines.transit.resource import TransitBucketResource

_UNSET: Any = object()


class LaunchConfig(dg.Config):
    """Run config every launching asset accepts (the launchpad's "where and how").

    Attributes:
        pool: send the job to this pool of the fleet instead of the routed one.
        infra: send the job to this SkyPilot infra string (must belong to a pool).
        env: values for the spec's declared ``envs`` (only names the spec declares).
    """

    pool: str | None = Field(
        default=None, description="Pool of task_specs/fleet.yaml to use instead of the route."
    )
    infra: str | None = Field(default=None, description="SkyPilot infra string to use instead of the route.")
    env: dict[str, str] = Field(default_factory=dict, description="Values for envs the task spec declares.")


@dataclasses.dataclass(frozen=True)
class LaunchRecord:
    """What one launch cost and where it ran: turned into Dagster metadata in one place."""

    job_id: str
    job_name: str
    backend: str
    pool: str
    infra: str
    accelerators: str | None
    num_nodes: int
    route: str
    status: str
    recoveries: int
    queued_s: float | None
    running_s: float
    gpu_hours: float
    cost_usd: float
    policy: tuple[str, ...]
    task_spec: str
    preemptions: PreemptionCost | None = None
    launched_as: str = "job"

    @classmethod
    def of(cls, job: ResolvedJob, info: JobInfo, backend: str, preemptions: PreemptionCost | None = None,
           launched_as: str = "job") -> LaunchRecord:
        """The record of a finished job (with what its preemptions cost, when the step watched it);
        ``launched_as``: ``job``, or ``cluster`` for a step the fleet launches as a cluster of its own."""
        assert job.route is not None
        queued = info.started_at - info.submitted_at if info.started_at and info.submitted_at else None
        running = info.ended_at - info.started_at if info.ended_at and info.started_at else 0.0
        return cls(
            job_id=info.job_id, job_name=info.name or job.name, backend=backend, pool=job.pool,
            infra=info.infra or job.route.infra, accelerators=job.route.accelerators, num_nodes=job.num_nodes,
            route=job.route.reason, status=info.state.value, recoveries=info.recoveries, queued_s=queued,
            running_s=running, gpu_hours=job.route.total_gpus * running / 3600.0,
            cost_usd=job.route.usd_per_hour * running / 3600.0, policy=job.notes, task_spec=job.spec_path,
            preemptions=preemptions, launched_as=launched_as,
        )  # fmt: skip

    def to_metadata(self) -> dict[str, Any]:
        """The record as materialization metadata (names the UI and ``gpu_usage`` read)."""
        md: dict[str, Any] = {
            "job_id": self.job_id,
            "job_name": self.job_name,
            "backend": self.backend,
            "launched_as": self.launched_as,
            "pool": self.pool,
            "infra": self.infra,
            "accelerators": self.accelerators or "none (CPU-only)",
            "num_nodes": self.num_nodes,
            "route": self.route,
            "status": self.status,
            "recoveries": self.recoveries,
            "running_s": round(self.running_s, 2),
            "gpu_hours": round(self.gpu_hours, 6),
            "cost_usd_estimate": round(self.cost_usd, 6),
            "task_spec": dg.MetadataValue.path(self.task_spec),
        }
        if self.queued_s is not None:
            md["queued_s"] = round(self.queued_s, 2)
        if self.policy:
            md["policy"] = "; ".join(self.policy)
        if self.preemptions is not None:
            md.update(self.preemptions.to_metadata())
        return md


@dataclasses.dataclass(frozen=True)
class BatchPlan:
    """Where a batch would run and how many workers fit: see :meth:`PipesSkyPilotClient.plan_batch`."""

    job: ResolvedJob
    workers: int
    free_gpus: int
    reason: str


@dataclasses.dataclass(frozen=True)
class BatchResult:
    """A finished batch: every rank's final state, and what the batch cost."""

    job: ResolvedJob
    job_ids: list[str]
    infos: list[JobInfo]
    backend: str
    tails: dict[int, list[str]] = dataclasses.field(default_factory=dict)

    def failure(self, rank: int) -> JobFailed:
        """What a failed rank's job did: its end state and last log lines."""
        info = self.infos[rank]
        return JobFailed(info.job_id, info.state.value, info.detail or FAILURE_MEANING.get(info.state, ""), self.tails.get(rank, []))

    @property
    def failed_ranks(self) -> list[int]:
        """Ranks that did not succeed."""
        return [rank for rank, info in enumerate(self.infos) if info.state.is_failure]

    def records(self) -> list[LaunchRecord]:
        """One launch record per rank."""
        return [LaunchRecord.of(self.job, info, self.backend) for info in self.infos]

    def to_metadata(self) -> dict[str, Any]:
        """Totals over the ranks, as materialization metadata."""
        records = self.records()
        assert self.job.route is not None
        return {
            "jobs": len(records),
            "jobs_failed": len(self.failed_ranks),
            "pool": self.job.pool,
            "infra": self.job.route.infra,
            "accelerators": self.job.route.accelerators or "none (CPU-only)",
            "backend": self.backend,
            "gpu_hours": round(sum(r.gpu_hours for r in records), 6),
            "cost_usd_estimate": round(sum(r.cost_usd for r in records), 6),
            "running_s": round(sum(r.running_s for r in records), 2),
        }


class _LogStreams:
    """Streams the logs of up to ``limit`` running jobs of a batch (a person watching sees the jobs work;
    hundreds of streams would load the API server for nothing)."""

    def __init__(self, backend: Backend, job_ids: list[str], limit: int, emit: Callable[[str], None]) -> None:
        self.backend, self.job_ids, self.limit, self.emit = backend, job_ids, limit, emit
        self.prefix = len(job_ids) > 1
        self.open: dict[str, Any] = {}
        self.done: set[str] = set()
        self.cued: set[str] = set()

    def newly_ended(self) -> bool:
        """Whether a followed job's log stream has ended since the last call (its job has, most likely)."""
        ended = {job_id for job_id, follower in self.open.items() if follower.ended} - self.cued
        self.cued |= ended
        return bool(ended)

    def poll(self, infos: Mapping[str, JobInfo]) -> None:
        for job_id in self.job_ids:
            info = infos.get(job_id)
            if info is None or job_id in self.done or job_id in self.open or len(self.open) >= self.limit:
                continue
            if info.state.value in ("STARTING", "RUNNING", "RECOVERING"):
                self.open[job_id] = self.backend.follow_logs(job_id)
        for job_id, follower in list(self.open.items()):
            for line in follower.poll():
                self.emit(f"[job {job_id}] {line}" if self.prefix else line)
            info = infos.get(job_id)
            if info is not None and info.state.is_terminal:
                follower.close()
                del self.open[job_id]
                self.done.add(job_id)

    def close(self) -> None:
        for follower in self.open.values():
            follower.close()


def _results_are_reported_by_the_caller(context: dg.AssetExecutionContext) -> None:
    """Lifts the check Pipes sets on an asset that the session's results are returned.

    A batch reports through custom messages, and its caller logs one materialization per partition as
    each finishes: a range run may end with some partitions done and others left for later, which
    one returned result cannot say. Dagster 1.13 has no public way to lift the check.
    """
    context.op_execution_context._step_execution_context._requires_typed_event_stream = False  # noqa: SLF001


#: The launches' reads of what is held, each started with its step's health check and Pipes session.
_USAGE_READS = concurrent.futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="gpudoor-usage-read")


def submit_routed(
    backend: Backend, job: ResolvedJob, request: LaunchRequest, fleet: Fleet, log: Callable[[str], None]
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
        log(f"Launching {job.name} on pool '{job.pool}' ({job.route.infra}, {job.route.describe()}) "
            f"through the {backend.name} backend: {job.route.reason}.")  # fmt: skip
        try:
            return backend.submit(job), job
        except PoolFull as e:
            full.add(e.pool)
            log(f"The API server says pool '{e.pool}' is full ({e.problem}): routing again.")
            job = resolve(request, fleet, usage=_full(backend.usage(), fleet, full))


def _report_preemptions(job_ids: Sequence[str], before: Mapping[str, JobInfo], now: Mapping[str, JobInfo],
                        reported: dict[str, int], report: Callable[[int, JobInfo, float], None]) -> None:  # fmt: skip
    """Calls ``report`` once per preemption of each rank since the last poll: a rank seen entering RECOVERING,
    or whose recovery count rose past what was reported.

    A job waiting for a new worker goes back and forth between RECOVERING and PENDING: only its first entry
    into RECOVERING after it last ran counts (``reported`` keeps, under ``<job id>/ran``, whether it ran since).
    """
    at = time.time()
    for rank, job_id in enumerate(job_ids):
        info = now.get(job_id)
        if info is None:
            continue
        old = before.get(job_id)
        done = reported.get(job_id, 0)
        ran_key = f"{job_id}/ran"
        fresh = done == 0 or reported.get(ran_key, 0) == 1
        entered = info.state is JobState.RECOVERING and (old is None or old.state is not JobState.RECOVERING) and fresh
        events = max(done + (1 if entered else 0), info.recoveries)
        for _ in range(events - done):
            report(rank, info, at)
        if events > done:
            reported[ran_key] = 0
        if info.state is JobState.RUNNING:
            reported[ran_key] = 1
        reported[job_id] = events


def _job_tag_key(request: LaunchRequest) -> str:
    """The run tag under which a step records the job it launched (a retried step re-attaches to it)."""
    key = f"{TAG_JOB_PREFIX}{slug(request.asset or '', 60)}" + (f"-{slug(request.partition, 60)}" if request.partition else "")
    return key + f"-{slug(request.step or request.spec.kind, 20)}"


def _full(usage: Usage, fleet: Fleet, pools: set[str]) -> Usage:
    """``usage`` with ``pools`` held to their caps: the API server said they are full, whatever was read."""
    gpus = {**usage.gpus, **{p: fleet.pools[p].gpu_cap for p in pools if p in fleet.pools}}
    vcpus = {**usage.vcpus, **{p: fleet.pools[p].vcpu_cap or 0 for p in pools if p in fleet.pools}}
    return dataclasses.replace(usage, gpus=gpus, vcpus=vcpus)


def _preemption_summary(job_id: str, cost: PreemptionCost) -> str:
    lines = [f"Job {job_id} was preempted {len(cost.preemptions)} time(s) and recovered: "
             f"{cost.gpu_hours_lost:.3f} of {cost.gpu_hours_held:.3f} GPU-hours held were lost (goodput {cost.goodput:.1%})."]  # fmt: skip
    for p in cost.preemptions:
        saved = "nothing saved before it" if p.last_saved_at is None else f"last save {p.seen_at - p.last_saved_at:.0f} s before"
        lines.append(f"- preempted (seen) at {time.strftime('%H:%M:%S', time.localtime(p.seen_at))}, {saved}: {p.lost_s:.0f} s of work lost")
    return "\n".join(lines)


def _summarize(infos: Iterable[JobInfo]) -> str:
    counts: dict[str, int] = {}
    for info in infos:
        counts[info.state.value] = counts.get(info.state.value, 0) + 1
    return ", ".join(f"{n} {state.lower()}" for state, n in sorted(counts.items()))


class SkyPilotInvocation(dg.PipesClientCompletedInvocation):
    """A finished launch: the Pipes session's results plus the :class:`LaunchRecord`."""

    def __init__(self, session: dg.PipesSession, record: LaunchRecord) -> None:
        super().__init__(session, metadata=record.to_metadata())
        self.record = record

    def get_materialize_result(
        self,
        *,
        implicit_materialization: bool = True,
        value: Any = _UNSET,
        metadata: Mapping[str, Any] | None = None,
        check_results: list[dg.AssetCheckResult] | None = None,
    ) -> dg.MaterializeResult:
        """Dagster's materialize result of the invocation; optionally with the asset's value (for its IO
        manager), more metadata, and check results the job did not report itself."""
        result = super().get_materialize_result(implicit_materialization=implicit_materialization)
        if value is _UNSET and not metadata and not check_results:
            return result
        extra = {} if value is _UNSET else {"value": value}
        checks = [*(result.check_results or ()), *(check_results or ())]
        return dg.MaterializeResult(metadata={**(result.metadata or {}), **(metadata or {})},
                                    check_results=checks, data_version=result.data_version, **extra)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class ServiceRecord:
    """A running service (a demo) and where it answers."""

    url: str
    cluster_name: str
    job_id: str
    backend: str
    job: ResolvedJob

    def to_metadata(self) -> dict[str, Any]:
        """The service as materialization metadata."""
        route = self.job.route
        assert route is not None
        md: dict[str, Any] = {
            "url": dg.MetadataValue.url(self.url), "cluster_name": self.cluster_name, "job_id": self.job_id,
            "backend": self.backend, "pool": route.pool.name, "infra": route.infra,
            "accelerators": route.accelerators or "none (CPU-only)", "usd_per_hour_estimate": round(route.usd_per_hour, 4),
        }  # fmt: skip
        if self.job.notes:
            md["policy"] = "; ".join(self.job.notes)
        return md


class _Redactor:
    def __init__(self, secrets: Mapping[str, str]) -> None:
        self._values = sorted({v for v in secrets.values() if v and len(v) >= 4}, key=len, reverse=True)

    def __call__(self, line: str) -> str:
        for value in self._values:
            line = line.replace(value, "****")
        return line


@contextlib.contextmanager
def _nothing_launched() -> Iterator[None]:
    """Turns a configuration error into a clean step failure that says nothing was launched."""
    try:
        yield
    except LaunchConfigError as e:
        raise dg.Failure(
            description=f"Nothing was launched. {e}", metadata={"file": e.source, "field": e.field}
        ) from None


def report_unconfirmed(
    instance: dg.DagsterInstance, run: dg.DagsterRun, outcome: ReleaseOutcome, step_key: str | None = None
) -> None:
    """An error event on ``run`` naming a holding whose release was not confirmed (the UI shows it in red)."""
    from dagster._core.events import EngineEventData
    from dagster._utils.error import SerializableErrorInfo

    message = f"GPUs may still be held: {outcome.summary()}"
    instance.report_engine_event(
        message, run,
        EngineEventData(metadata={"kind": outcome.holding.kind, "id": outcome.holding.id, "seen": "; ".join(outcome.seen)},
                        error=SerializableErrorInfo(message, [], "ReleaseNotConfirmed")),
        step_key=step_key,
    )  # fmt: skip


@functools.lru_cache(maxsize=8)
def _service_account_name(endpoint: str | None, token: str) -> str | None:
    """The name the API server gives the token's service account (its ``/api/health`` answer), if any."""
    import json
    import urllib.request

    if not endpoint:
        return None
    request = urllib.request.Request(f"{endpoint.rstrip('/')}/api/health", headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            user = (json.loads(response.read() or b"{}") or {}).get("user") or {}
    except (OSError, ValueError):
        return None
    return str(user.get("name") or "") or None


class PipesSkyPilotClient(dg.ConfigurableResource, dg.PipesClient):
    """Launches task specs as SkyPilot managed jobs (or local processes on the embedded default).

    With no configuration it runs every job on this machine (``backend="local"``); pointed at a
    SkyPilot API server (``backend="skypilot"``, ``api_server_endpoint``) it launches managed jobs
    on the team's clusters with the same task files. Dagster Pipes runs through the transit bucket.

    Attributes:
        backend: ``local`` (embedded default) or ``skypilot``.
        api_server_endpoint: SkyPilot API server URL (``skypilot`` backend).
        service_account_token: SkyPilot service-account token, bound with ``dg.EnvVar``; never logged.
        specs_dir: folder of task specs (default: the project's ``task_specs/``).
        fleet_file: the fleet file (default: ``task_specs/fleet.yaml``).
        local_home: state folder of the local backend (default ``$GPUDOOR_HOME`` or ``~/.gpudoor``).
        cost_owner: who pays for jobs whose task file names no cost owner (default: the fleet's
            default); a ``gpudoor/cost-owner`` run tag wins over both.
        user: who launches (for per-user caps and labels; ``GPUDOOR_USER``; default: the service
            account of ``service_account_token``, else the OS user).
        poll_interval_s: seconds to the first status poll of a job, and after each change of state;
            also how often new log lines are handed to the run.
        max_poll_interval_s: on a backend whose status requests go to a server (SkyPilot), polls of a
            job whose state does not change back off, doubling, up to this. The job's log stream
            ending triggers a poll at once, so the end of a job is not noticed later.
        cancel_timeout_s: how long to wait for a cancelled job to reach CANCELLED.
        forward_termination: cancel the job when the Dagster run is terminated.
        max_log_streams: how many jobs of a batch stream their logs into the run at once.
        validate_with_skypilot: also parse every spec with ``sky.Task`` (once per file version).
        transit: the transit bucket jobs read inputs from and write outputs to, and Pipes runs through.
    """

    backend: str = Field(default="local", description="'local' (embedded default) or 'skypilot'.")
    api_server_endpoint: str | None = Field(default=None, description="SkyPilot API server URL.")
    service_account_token: str | None = Field(default=None, description="SkyPilot service-account token.")
    specs_dir: str | None = Field(default=None, description="Folder of task specs.")
    fleet_file: str | None = Field(default=None, description="Fleet file.")
    local_home: str | None = Field(default=None, description="State folder of the local backend.")
    cost_owner: str | None = Field(default=None, description="Cost owner label for every job.")
    user: str | None = Field(default=None, description="Who launches (labels, per-user caps).")
    poll_interval_s: float = Field(default=0.5, description="Seconds to a job's first status poll and after each change.")
    max_poll_interval_s: float = Field(
        default=20.0, description="Longest wait between status polls of an unchanged job on SkyPilot."
    )
    cancel_timeout_s: float = Field(default=180.0, description="Bound on waiting for CANCELLED.")
    forward_termination: bool = Field(default=True, description="Cancel the job when the run is terminated.")
    max_log_streams: int = Field(default=4, description="Logs of at most this many jobs of a batch stream into the run at once.")
    validate_with_skypilot: bool = Field(
        default=True, description="Parse specs with sky.Task before launching."
    )
    transit: TransitBucketResource

    # ----------------------------------------------------------------- pieces
    def get_backend(self) -> Backend:
        """The backend named by ``backend``."""
        if self.backend == "local":
            from gpudoor_pipelines.launch.backends.local import LocalBackend

            return LocalBackend(home=self.local_home)
        if self.backend == "skypilot":
            from gpudoor_pipelines.launch.backends.skypilot import SkyPilotBackend

            return SkyPilotBackend(endpoint=self.api_server_endpoint, token=self.service_account_token)
        raise LaunchConfigError(
            "resource skypilot",
            "backend",
            f"unknown backend '{self.backend}'",
            "use 'local' or 'skypilot' (GPUDOOR_BACKEND)",
        )

    def get_fleet(self) -> Fleet:
        """The fleet file, validated (cached until it changes)."""
        return load_fleet(self.fleet_file)

    def get_spec(self, name: str) -> TaskSpec:
        """A task spec by name (``caption``) or path, checked (cached until the file changes)."""
        return load_spec(name, self.specs_dir, skypilot=self.validate_with_skypilot, strict=False)

    def launching_user(self) -> str:
        """Who launches: ``user`` (``GPUDOOR_USER``), else the service account the API server knows the
        token as, else the OS user. The API server's policy names the user itself in any case."""
        if self.user:
            return self.user
        if self.backend == "skypilot" and self.service_account_token:
            name = _service_account_name(self.api_server_endpoint, self.service_account_token)
            if name:
                return name
        try:
            return getpass.getuser()
        except (KeyError, OSError):
            return "unknown"

    def request(
        self,
        context: dg.AssetExecutionContext,
        spec: str,
        *,
        inputs: Mapping[str, str] | None = None,
        config: LaunchConfig | None = None,
        cluster_name: str | None = None,
        step: str | None = None,
    ) -> LaunchRequest:
        """The launch request for the current asset: spec, inputs, overrides, asset, partition, run.

        The step kind that routes the job is ``step``, else the spec's name (the assets name their
        spec by their step: ``caption``, ``train``, ...).

        Raises:
            dagster.Failure: the spec is missing or invalid ("Nothing was launched").
        """
        config = config or LaunchConfig()
        tags = context.run.tags
        with _nothing_launched():
            loaded = self.get_spec(spec)
        return LaunchRequest(
            spec=loaded,
            inputs=dict(inputs or {}),
            env=dict(config.env),
            pool=config.pool or tags.get(TAG_POOL),
            infra=config.infra or tags.get(TAG_INFRA),
            cost_owner=tags.get(TAG_COST_OWNER),
            default_cost_owner=self.cost_owner,
            user=self.launching_user(),
            asset=context.asset_key.to_user_string() if context.has_assets_def else context.op.name,
            partition=context.partition_key if context.has_partition_key else None,
            interactive=cluster_name is not None,
            cluster_name=cluster_name,
            step=step or loaded.kind,
        )

    @staticmethod
    def _with_transit(
        request: LaunchRequest,
        bucket: TransitBucket,
        bootstrap: Mapping[str, str],
        dagster: Mapping[str, str],
    ) -> LaunchRequest:
        """The request with what the launch adds: how to reach the bucket, Pipes' bootstrap env, the run's identity."""
        inputs = {**bucket.job_env(), **request.inputs, **bootstrap}
        return dataclasses.replace(
            request, inputs=inputs, secrets=bucket.job_secrets(), dagster=dict(dagster)
        )

    # ----------------------------------------------------------------- run
    def run(
        self,
        *,
        context: dg.AssetExecutionContext,
        request: LaunchRequest,
        extras: Mapping[str, Any] | None = None,
    ) -> SkyPilotInvocation:
        """Launches the request as a managed job and waits for it to end.

        Returns:
            The completed invocation: ``get_materialize_result()`` / ``get_results()`` give what the
            job reported through Pipes together with the launch record.

        Raises:
            dagster.Failure: nothing could be launched, or the job failed or was cancelled (the
                description has its last log lines).
        """
        from gpudoor_pipelines.transit.pipes import pipes_context_injector, pipes_message_reader

        with _nothing_launched():
            backend = self.get_backend()
            fleet = self.get_fleet()
            # What is held is read side by side with the health check and the Pipes session's setup; not at
            # all when the API server counts it (``live_caps: server``).
            usage = None if fleet.live_caps == "server" else _USAGE_READS.submit(backend.usage)
            backend.check()
        bucket = self.transit.get_bucket()
        with dg.open_pipes_session(
            context=context,
            context_injector=pipes_context_injector(bucket),
            message_reader=pipes_message_reader(bucket),
            extras=dict(extras or {}),
        ) as session:
            # The run's identity (run id, job, partition, user) goes into the job's labels.
            request = self._with_transit(
                request, bucket, session.get_bootstrap_env_vars(), session.default_remote_invocation_info
            )
            with _nothing_launched():
                job = resolve(request, fleet, usage=usage.result() if usage is not None else None)
            job_id, job = self._reattach_or_submit(context, backend, job, request, fleet)
            timeline = Timeline()
            moved: list[ResolvedJob] = []  # the job as launched on each pool it moved to after an eviction

            def move(old_id: str) -> str | None:
                current = moved[-1] if moved else job
                new = self._move_after_eviction(context, backend, current, old_id, request, fleet)
                if new is None:
                    return None
                moved.append(new[1])
                return new[0]

            info = self._wait_for_completion(context, backend, job_id, _Redactor(job.secrets), timeline,
                                             on_eviction=move if any(p.recover_to for p in fleet.pools.values()) else None)  # fmt: skip
            job, job_id = moved[-1] if moved else job, info.job_id
        # Read once the session is closed: by then every message the job sent has been read. A job that moved
        # to another pool: the time held is what the step saw (the last job's own count leaves out the first).
        cost = preemption_cost(timeline, saved_times(session.get_custom_messages()), gpus=job.route.total_gpus,
                               ended_at=time.time(), ran_s=None if moved else info.ran_s)  # fmt: skip
        if cost.preemptions:
            context.log.warning(_preemption_summary(job_id, cost))
        launched_as = backend.holding_of(job_id).kind
        return SkyPilotInvocation(session, LaunchRecord.of(job, info, backend.name, cost, launched_as=launched_as))

    def _reattach_or_submit(
        self, context: dg.AssetExecutionContext, backend: Backend, job: ResolvedJob, request: LaunchRequest, fleet: Fleet
    ) -> tuple[str, ResolvedJob]:
        """Re-attaches to the job an earlier attempt of this step launched, if it still runs; else submits
        ``job``. A pool the API server says is full is routed around: the next pool of the route, with
        what is held read then. Returns the job id and the job as submitted."""
        tag_key = _job_tag_key(request)
        previous = context.run.tags.get(tag_key, "")
        if previous.startswith(f"{backend.name}:"):
            old_id = previous.split(":", 1)[1]
            try:
                state = backend.status(old_id).state
            except KeyError:
                state = None
            if state is not None and not state.is_terminal:
                context.log.info(
                    f"Re-attaching to job {old_id}, still {state.value}, instead of launching a second one."
                )
                return old_id, job
        with _nothing_launched():
            job_id, job = submit_routed(backend, job, request, fleet, context.log.info)
        context.instance.add_run_tags(context.run.run_id, {tag_key: f"{backend.name}:{job_id}"})
        context.log.info(f"Submitted job {job_id}.")
        return job_id, job

    def _move_after_eviction(
        self, context: dg.AssetExecutionContext, backend: Backend, job: ResolvedJob, job_id: str,
        request: LaunchRequest, fleet: Fleet,
    ) -> tuple[str, ResolvedJob] | None:
        """A job RECOVERING on a pool whose ``recover_to`` names others: launched on the first of them that
        can take it now (routed and ruled for that pool, its caps counted), then the recovering one is
        cancelled and its release verified. Returns the new job id and job; None when no pool can take it
        (SkyPilot goes on recovering it where it was)."""
        if job.launch_as != "managed" or not fleet.pools[job.pool].recover_to:
            return None  # a step cluster is launched again by the step itself, on its own pool
        refused = []
        for target in fleet.pools[job.pool].recover_to:
            moved_request = dataclasses.replace(request, pool=target, infra=None)
            try:
                usage = None if fleet.live_caps == "server" else backend.usage()
                new_job = resolve(moved_request, fleet, usage=usage)
                new_id = backend.submit(new_job)
            except LaunchConfigError as e:  # PoolFull included: the next pool, or none
                refused.append(f"{target}: {e.problem}")
                continue
            context.instance.add_run_tags(context.run.run_id, {_job_tag_key(request): f"{backend.name}:{new_id}"})
            context.log.warning(
                f"Job {job_id} was evicted from pool '{job.pool}': launched again on pool '{target}' as job {new_id} "
                f"(recover_to of '{job.pool}' in {fleet.source}); it resumes from what it saved. Cancelling job {job_id}."
            )
            self._release_verified(context, backend, [backend.holding_of(job_id)])
            return new_id, new_job
        context.log.warning(f"Job {job_id} was evicted from pool '{job.pool}' and no pool of its recover_to can take it "
                            f"now ({'; '.join(refused)}): SkyPilot recovers it on '{job.pool}'.")  # fmt: skip
        return None

    def _wait_for_completion(
        self, context: dg.AssetExecutionContext, backend: Backend, job_id: str, redact: _Redactor,
        timeline: Timeline | None = None, on_eviction: Callable[[str], str | None] | None = None,
    ) -> JobInfo:
        """Streams the job's log into the run until the job ends; forwards a termination to the job.

        Log lines are handed over every ``poll_interval_s``; the job's state is asked through the
        process's status hub (one request for every job the process watches), backing off while it
        does not change, and at once when the log stream ends. When the job starts RECOVERING and
        ``on_eviction`` gives the id of a job launched in its place (on another pool), that job is
        followed instead.
        """
        follower = backend.follow_logs(job_id)
        hub = status_hub(backend)
        hub.watch([job_id])
        backoff = Backoff(self.poll_interval_s, self._max_poll_interval(backend))
        # The first poll comes a poll interval after submission (a job just submitted is pending): steps
        # that start together are then asked about in one request.
        last_state, next_poll, stream_seen_ended = None, time.monotonic() + self.poll_interval_s, False
        try:
            while True:
                for line in follower.poll():
                    context.log.info(redact(line))
                ended = follower.ended and not stream_seen_ended
                if ended or time.monotonic() >= next_poll:
                    stream_seen_ended = stream_seen_ended or ended
                    info = self._hub_status(hub, job_id)
                    if timeline is not None:
                        timeline.see(time.time(), info)
                    changed = info.state != last_state
                    if changed:
                        context.log.debug(f"Job {job_id}: {info.state.value}")
                        last_state = info.state
                        if info.state is JobState.RECOVERING and on_eviction is not None:
                            new_id = on_eviction(job_id)
                            if new_id is not None:
                                for line in follower.poll():
                                    context.log.info(redact(line))
                                hub.unwatch([job_id])
                                follower.close()
                                job_id, follower, stream_seen_ended = new_id, backend.follow_logs(new_id), False
                                hub.watch([job_id])
                                backoff.reset()
                    if info.state.is_terminal:
                        for line in follower.poll():
                            context.log.info(redact(line))
                        break
                    next_poll = time.monotonic() + backoff.after(changed or ended)
                time.sleep(max(0.0, min(self.poll_interval_s, next_poll - time.monotonic())))
        except (dg.DagsterExecutionInterruptedError, KeyboardInterrupt):
            if self.forward_termination:
                context.log.warning(f"Run terminated: cancelling job {job_id}.")
                self._cancel_and_wait(context, backend, job_id)
            raise
        finally:
            hub.unwatch([job_id])
            follower.close()
        tail = [redact(line) for line in backend.log_tail(job_id, 30)] if info.state.is_failure else []
        if said := backend.finish(job_id):  # a step cluster, torn down once its log tail is read
            context.log.info(said)
        if info.state.is_failure:
            err = JobFailed(
                job_id, info.state.value, info.detail or FAILURE_MEANING.get(info.state, ""), tail
            )
            raise dg.Failure(
                description=str(err),
                metadata={
                    "job_id": job_id,
                    "status": info.state.value,
                    "log_tail": dg.MetadataValue.md("```\n" + "\n".join(tail) + "\n```"),
                },
            )
        return info

    def _max_poll_interval(self, backend: Backend) -> float:
        """Local jobs' states are files: nothing to spare by asking less often."""
        return self.max_poll_interval_s if backend.remote_status else self.poll_interval_s

    def _hub_status(self, hub: StatusHub, job_id: str) -> JobInfo:
        """The job's state from the hub: shared with the other steps of this process when it is at most a
        poll interval old (a state read just before the job ended is asked again a poll interval later)."""
        info = hub.get([job_id], max_age_s=self.poll_interval_s).get(job_id)
        if info is None:
            raise KeyError(f"the {hub.backend.name} backend has no job {job_id}")
        return info

    def _cancel_and_wait(self, context: dg.AssetExecutionContext, backend: Backend, job_id: str) -> None:
        """Cancels the job and verifies the release (see :meth:`_release_verified`)."""
        self._release_verified(context, backend, [backend.holding_of(job_id)])

    def _release_verified(self, context: dg.AssetExecutionContext, backend: Backend, holdings: list[Holding]) -> None:
        """Releases jobs (or a warm pool) and looks until nothing is held (the job terminal, its cluster gone,
        its processes gone): each verdict goes into the run's tags; a release not confirmed within
        ``cancel_timeout_s`` is an error event naming it (the orphan reconciler tries again once the run has ended)."""
        from gpudoor_pipelines.launch.record.release import release_and_verify

        outcomes = release_and_verify(backend, holdings, timeout_s=self.cancel_timeout_s, poll_s=max(self.poll_interval_s, 1.0))
        context.instance.add_run_tags(context.run.run_id, {
            f"{TAG_RELEASED_PREFIX}{o.holding.kind}-{o.holding.id}"[:255]: f"{'confirmed' if o.confirmed else 'NOT confirmed'} in {o.seconds:.0f} s"
            for o in outcomes
        })  # fmt: skip
        step_key = context.get_step_execution_context().step.key
        for outcome in outcomes:
            if outcome.confirmed:
                context.log.warning(outcome.summary())
            else:
                report_unconfirmed(context.instance, context.run, outcome, step_key=step_key)

    # ----------------------------------------------------------------- batches on warm pools
    def plan_batch(self, request: LaunchRequest, *, pool_name: str, max_workers: int | None = None) -> BatchPlan:
        """Where a batch of ``request`` would run on the warm pool ``pool_name``, and how many workers fit.

        Free GPUs are the routed pool's cap minus what jobs hold now (:meth:`Backend.usage`), the
        per-user cap, and, where SkyPilot reports it (Slurm), what the cluster has free; the GPUs the
        warm pool's own workers hold already count as its own. ``workers`` is 0 when nothing is free.

        Raises:
            dagster.Failure: the request cannot run on any pool ("Nothing was launched").
        """
        with _nothing_launched():
            backend = self.get_backend()
            backend.check()
            fleet = self.get_fleet()
            usage = backend.usage()
            own = backend.pool_workers(pool_name)
            job = resolve(request, fleet)  # fails here when no pool could ever take the job
        if not own:  # a new pool goes where there is room now (the route spills over full pools)
            try:
                job = resolve(request, fleet, usage=usage)
            except LaunchConfigError as e:  # every pool of the route is full right now
                return BatchPlan(job=job, workers=0, free_gpus=0, reason=e.problem)
        assert job.route is not None
        pool = fleet.pools[job.pool]
        per_job = max(1, job.route.total_gpus)
        mine = own * per_job  # usage() counts the warm pool's own workers: they are this batch's to reuse
        free = min(
            pool.gpu_cap - usage.gpus.get(job.pool, 0) + mine,
            pool.user_gpu_cap - usage.user_gpus.get((request.user, job.pool), 0) + mine,
        )
        reason = f"pool '{job.pool}' cap {pool.gpu_cap}, {usage.gpus.get(job.pool, 0)} GPUs held"
        reported = backend.free_gpus(job.route) if job.route.accelerator else None
        if reported is not None:
            free = min(free, reported + own * per_job)  # the cluster counts the pool's own workers as busy
            reason += f", {reported} {job.route.accelerator} free on {job.route.infra}"
        workers = max(0, free // per_job)
        if max_workers is not None:
            workers = min(workers, max_workers)
        return BatchPlan(job=job, workers=workers, free_gpus=max(0, free), reason=reason)

    def run_batch(
        self,
        *,
        context: dg.AssetExecutionContext,
        request: LaunchRequest,
        num_jobs: int,
        workers: int,
        pool_name: str,
        prepare: Callable[[Sequence[Mapping[str, str]]], Mapping[str, str]],
        on_message: Callable[[Any], None],
        on_submitted: Callable[[ResolvedJob, list[str]], None] | None = None,
        on_preempted: Callable[[int, JobInfo, float], None] | None = None,
    ) -> BatchResult:
        """Launches ``num_jobs`` ranks of a request on the warm pool ``pool_name`` and waits for all of them.

        One Pipes session covers the batch, with one message channel per rank (Dagster's
        ``PipesCompositeMessageReader``): ``prepare`` gets the per-rank Pipes env, writes what the
        ranks need (a batch file) and returns the launcher inputs that point at it. Every custom
        message a rank reports is handed to ``on_message`` as it arrives; ``on_submitted`` gets the
        resolved job and the rank job ids once they exist; ``on_preempted`` gets a rank, its state and when
        the step saw it, once per preemption SkyPilot recovers it from (it shows RECOVERING, or its
        recovery count rose between two polls). All ranks' states come from one status
        request per poll; the logs of up to ``max_log_streams`` running ranks stream into the run. A
        run termination cancels every rank and releases the pool. A failed rank does not raise: the
        caller decides what to retry (:attr:`BatchResult.failed_ranks`, with their last log lines).
        """
        from gpudoor_pipelines.transit.pipes import pipes_context_injector, pipes_message_reader

        with _nothing_launched():
            backend = self.get_backend()
        bucket = self.transit.get_bucket()
        reader = dg.PipesCompositeMessageReader([pipes_message_reader(bucket) for _ in range(num_jobs)])
        seen = 0

        def deliver() -> None:
            nonlocal seen
            messages = session.get_custom_messages()
            for message in messages[seen:]:
                on_message(message)
            seen = len(messages)

        with dg.open_pipes_session(
            context=context, context_injector=pipes_context_injector(bucket), message_reader=reader
        ) as session:
            inputs = prepare(session.get_per_writer_bootstrap_env_vars())
            request = self._with_transit(request.with_inputs(**inputs), bucket, {}, session.default_remote_invocation_info)
            with _nothing_launched():
                # A warm pool that is up already holds its GPUs: its jobs are not checked against them again.
                live = backend.usage() if not backend.pool_workers(pool_name) else None
                job = resolve(request, self.get_fleet(), usage=live)
            assert job.route is not None
            context.log.info(
                f"Launching {num_jobs} jobs of {job.name} on pool '{pool_name}' of {workers} workers "
                f"({job.pool}, {job.route.infra}, {job.route.describe()} each) through the {backend.name} backend."
            )
            with _nothing_launched():
                job_ids = backend.submit_batch(job, num_jobs, pool_name=pool_name, workers=workers)
            context.log.info(f"Submitted jobs {job_ids[0]}…{job_ids[-1]}." if num_jobs > 1 else f"Submitted job {job_ids[0]}.")
            if on_submitted:
                on_submitted(job, job_ids)
            redact = _Redactor(job.secrets)
            logs = _LogStreams(backend, job_ids, self.max_log_streams, lambda line: context.log.info(redact(line)))
            infos: dict[str, JobInfo] = {}
            preempted: dict[str, int] = {}  # job id -> preemptions reported
            # One status request for every rank per poll; polls back off while nothing changes, and come
            # at once when a followed rank's log stream ends. Ranks report their work through Pipes
            # (delivered every loop), so a later poll delays no materialization.
            backoff = Backoff(self.poll_interval_s, self._max_poll_interval(backend))
            next_poll, cue = 0.0, False
            try:
                last_summary = ""
                while True:
                    if cue or time.monotonic() >= next_poll:
                        previous = dict(infos)
                        infos.update(backend.statuses([i for i in job_ids if i not in infos or not infos[i].state.is_terminal]))
                        if on_preempted is not None:
                            _report_preemptions(job_ids, previous, infos, preempted, on_preempted)
                        summary = _summarize(infos.values())
                        changed = summary != last_summary or cue
                        if summary != last_summary:
                            context.log.info(f"{pool_name}: {summary}")
                            last_summary = summary
                        if len(infos) == len(job_ids) and all(i.state.is_terminal for i in infos.values()):
                            logs.poll(infos)
                            deliver()
                            break
                        next_poll = time.monotonic() + backoff.after(changed)
                    logs.poll(infos)
                    deliver()
                    cue = logs.newly_ended()
                    if not cue:
                        time.sleep(max(0.0, min(self.poll_interval_s, next_poll - time.monotonic())))
            except (dg.DagsterExecutionInterruptedError, KeyboardInterrupt):
                if self.forward_termination:
                    context.log.warning(f"Run terminated: cancelling the {len(job_ids)} jobs on pool {pool_name}.")
                    live = [Holding("job", i) for i in job_ids if i not in infos or not infos[i].state.is_terminal]
                    self._release_verified(context, backend, [*live, Holding("pool", pool_name)])
                raise
            finally:
                logs.close()
        deliver()  # what arrived while the session closed
        _results_are_reported_by_the_caller(context)
        ranks = [infos[i] for i in job_ids]
        tails = {r: [redact(line) for line in backend.log_tail(info.job_id, 30)]
                 for r, info in enumerate(ranks) if info.state.is_failure}  # fmt: skip
        return BatchResult(job=job, job_ids=job_ids, infos=ranks, backend=backend.name, tails=tails)

    def release_pool(self, pool_name: str) -> None:
        """Gives a warm pool's workers back."""
        self.get_backend().release_pool(pool_name)

    # ----------------------------------------------------------------- services
    def serve(
        self, *, context: dg.AssetExecutionContext, request: LaunchRequest, ready_timeout_s: float = 120.0
    ) -> ServiceRecord:
        """Launches a long-running service (a demo) on ``request.cluster_name`` and waits for its URL."""
        with _nothing_launched():
            backend = self.get_backend()
            backend.check()
            # No Pipes session for a service: the run's identity straight from the run (what a session would give).
            request = self._with_transit(
                request, self.transit.get_bucket(), {}, context.run.dagster_execution_info
            )
            job = resolve(request, self.get_fleet(), usage=backend.usage())
        assert job.route is not None and job.cluster_name
        context.log.info(
            f"Starting service {job.cluster_name} on pool '{job.pool}' ({job.route.infra}): {job.route.reason}."
        )
        service = backend.start_service(job)
        follower = service.follow_logs()
        redact = _Redactor(job.secrets)
        port = (request.spec.ports or [8000])[0]
        deadline = time.time() + ready_timeout_s
        url = None
        try:
            while time.time() < deadline and not url:
                for line in follower.poll():
                    context.log.info(redact(line))
                info = service.status()
                if info.state.is_terminal:
                    tail = [redact(line) for line in service.log_tail(30)]
                    raise dg.Failure(
                        description=str(
                            JobFailed(
                                service.job_id,
                                info.state.value,
                                "the service stopped before it answered",
                                tail,
                            )
                        )
                    )
                url = service.url(port)
                if not url:
                    time.sleep(self.poll_interval_s)
        except (dg.DagsterExecutionInterruptedError, KeyboardInterrupt):
            backend.stop_service(job.cluster_name)
            raise
        finally:
            follower.close()
        if not url:
            backend.stop_service(job.cluster_name)
            raise dg.Failure(
                description=f"Service {job.cluster_name} did not answer within {ready_timeout_s:.0f} s; it was stopped."
            )
        context.log.info(f"Service {job.cluster_name} is up at {url}")
        return ServiceRecord(
            url=url, cluster_name=job.cluster_name, job_id=service.job_id, backend=backend.name, job=job
        )

    def stop_service(self, cluster_name: str) -> bool:
        """Tears down the service on ``cluster_name``; True if it was running."""
        return self.get_backend().stop_service(cluster_name)
