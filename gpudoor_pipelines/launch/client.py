"""The Dagster-facing launcher: a Pipes client for SkyPilot, in the shape of Dagster's own.

Like ``PipesECSClient`` and ``PipesK8sClient``, :meth:`PipesSkyPilotClient.run` opens a Pipes session,
launches the job with the session's bootstrap env, waits for it, forwards a run's termination to the job
(``forward_termination``) and returns a :class:`dagster.PipesClientCompletedInvocation` whose results carry
the launch record next to what the job reported itself. Launching, waiting and releasing are the
launcher's (:mod:`.launcher`, free of Dagster); this module turns what the launcher does into Dagster:
events in the run's log, run tags (a retried step re-attaches to the job an earlier attempt launched),
metadata and failures.

An asset calls it in one line::

    return skypilot.run(context=context, request=skypilot.request(context, "eval", inputs=...)).get_materialize_result()
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import dagster as dg
from pydantic import Field

from gpudoor_pipelines.launch.backends.base import Backend
from gpudoor_pipelines.launch.config import LaunchSettings, launching_user, make_backend
from gpudoor_pipelines.launch.errors import JobFailed
from gpudoor_pipelines.launch.events import (
    job_failure,
    job_tag_key,
    nothing_launched,
    results_are_reported_by_the_caller,
    step_hooks,
    summarize,
)
from gpudoor_pipelines.launch.job import Holding, JobInfo
from gpudoor_pipelines.launch.labels import (
    TAG_COST_OWNER,
    TAG_INFRA,
    TAG_POOL,
)
from gpudoor_pipelines.launch.launcher import Launcher, Redactor
from gpudoor_pipelines.launch.record.goodput import preemption_cost, saved_times
from gpudoor_pipelines.launch.record.process import run_process_tags
from gpudoor_pipelines.launch.record.records import BatchPlan, BatchResult, LaunchRecord, ServiceRecord
from gpudoor_pipelines.launch.resolve.fleet import Fleet, load_fleet
from gpudoor_pipelines.launch.resolve.request import LaunchRequest, ResolvedJob, resolve
from gpudoor_pipelines.launch.resolve.specs import TaskSpec, load_spec
from gpudoor_pipelines.transit.bucket import TransitBucket
from gpudoor_pipelines.transit.resource import TransitBucketResource

_UNSET: Any = object()
#: What a terminated run raises in its step: the launcher cancels the job and verifies the release.
_INTERRUPTS = (dg.DagsterExecutionInterruptedError, KeyboardInterrupt)


class LaunchConfig(dg.Config):
    """Run config every launching asset accepts (the launchpad's "where and how").

    Attributes:
        pool: send the job to this pool of the fleet instead of the routed one.
        infra: send the job to this SkyPilot infra string (must belong to a pool).
        env: values for the spec's declared ``envs`` (only names the spec declares).
    """

    pool: str | None = Field(default=None, description="Pool of task_specs/fleet.yaml to use instead of the route.")
    infra: str | None = Field(default=None, description="SkyPilot infra string to use instead of the route.")
    env: dict[str, str] = Field(default_factory=dict, description="Values for envs the task spec declares.")


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
        return dg.MaterializeResult(
            metadata={**(result.metadata or {}), **(metadata or {})},
            check_results=checks,
            data_version=result.data_version,
            **extra,
        )


class PipesSkyPilotClient(dg.ConfigurableResource, dg.PipesClient):
    """Launches task specs as SkyPilot managed jobs (or local processes on the embedded default).

    With no configuration it runs every job on this machine (``backend="local"``); pointed at a SkyPilot
    API server (``backend="skypilot"``, ``api_server_endpoint``) it launches managed jobs on the team's
    clusters with the same task files. Dagster Pipes runs through the transit bucket. The fields are the
    launcher's settings (:class:`~gpudoor_pipelines.launch.launcher.LaunchSettings`, which says what each
    means), plus:

    Attributes:
        forward_termination: cancel the job when the Dagster run is terminated.
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
    poll_interval_s: float = Field(
        default=0.5, description="Seconds to a job's first status poll and after it enters recovery."
    )
    max_poll_interval_s: float = Field(
        default=20.0, description="Longest wait between status polls of a job on SkyPilot (a log's end: at once)."
    )
    cancel_timeout_s: float = Field(default=180.0, description="Bound on waiting for a release to be confirmed.")
    forward_termination: bool = Field(default=True, description="Cancel the job when the run is terminated.")
    max_log_streams: int = Field(
        default=4, description="Logs of at most this many jobs of a batch stream into the run at once."
    )
    validate_with_skypilot: bool = Field(default=True, description="Parse specs with sky.Task before launching.")
    transit: TransitBucketResource

    # ----------------------------------------------------------------- pieces
    def settings(self) -> LaunchSettings:
        """The launcher's settings, from this resource's fields."""
        names = {f.name for f in dataclasses.fields(LaunchSettings)}
        return LaunchSettings(**{name: getattr(self, name) for name in names})

    def launcher(self) -> Launcher:
        """A launcher on the configured backend and fleet."""
        return Launcher(self.get_backend(), self.get_fleet(), self.settings())

    def get_backend(self) -> Backend:
        """The backend named by ``backend``."""
        return make_backend(self.settings())

    def get_fleet(self) -> Fleet:
        """The fleet file, validated (cached until it changes)."""
        return load_fleet(self.fleet_file)

    def get_spec(self, name: str) -> TaskSpec:
        """A task spec by name (``caption``) or path, checked (cached until the file changes)."""
        return load_spec(name, self.specs_dir, skypilot=self.validate_with_skypilot, strict=False)

    @staticmethod
    def _record_run_process(context: dg.AssetExecutionContext) -> None:
        """Names the process the run executes in, where its steps run in it (:mod:`.record.process`): the orphan
        reconciler marks the run failed once that process is gone, and releases what it launched."""
        tags = run_process_tags()
        if tags and any(context.run.tags.get(k) != v for k, v in tags.items()):
            context.instance.add_run_tags(context.run.run_id, tags)

    def launching_user(self) -> str:
        """Who launches (see :meth:`Launcher.user`)."""
        return launching_user(self.settings())

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

        The step kind that routes the job is ``step``, else the spec's name (the assets name their spec by
        their step: ``caption``, ``train``, ...).

        Raises:
            dagster.Failure: the spec is missing or invalid ("Nothing was launched").
        """
        config = config or LaunchConfig()
        tags = context.run.tags
        with nothing_launched():
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
        request: LaunchRequest, bucket: TransitBucket, bootstrap: Mapping[str, str], dagster: Mapping[str, str]
    ) -> LaunchRequest:
        """The request with what the launch adds: how to reach the bucket, Pipes' bootstrap env, the run's identity."""
        inputs = {**bucket.job_env(), **request.inputs, **bootstrap}
        return dataclasses.replace(request, inputs=inputs, secrets=bucket.job_secrets(), dagster=dict(dagster))

    # ----------------------------------------------------------------- run
    def run(
        self, *, context: dg.AssetExecutionContext, request: LaunchRequest, extras: Mapping[str, Any] | None = None
    ) -> SkyPilotInvocation:
        """Launches the request as a managed job and waits for it to end.

        Returns:
            The completed invocation: ``get_materialize_result()`` / ``get_results()`` give what the job
            reported through Pipes together with the launch record.

        Raises:
            dagster.Failure: nothing could be launched, or the job failed or was cancelled (the description
                has its last log lines).
        """
        from gpudoor_pipelines.transit.pipes import pipes_context_injector, pipes_message_reader

        with nothing_launched():
            launcher = self.launcher()
            # What a launch weighs is read side by side with the health check and the Pipes session's setup.
            ahead = launcher.ahead(request)
            launcher.backend.check()
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
            with nothing_launched():
                job = launcher.resolve(request, ahead)
            if job.budget is not None and job.budget.warning:
                context.log.warning(f"Budget of cost owner '{job.cost_owner}': {job.budget.warning}.")
            self._record_run_process(context)
            job_id, job = self._reattach_or_submit(context, launcher, job, request)
            redact = Redactor(job.secrets)
            tag_key = job_tag_key(request)

            def moved(old: str, new: str, new_job: ResolvedJob) -> None:
                context.instance.add_run_tags(context.run.run_id, {tag_key: f"{launcher.backend.name}:{new}"})

            def state(job_id: str, info: JobInfo) -> None:
                context.log.debug(f"Job {job_id}: {info.state.value}")

            hooks = step_hooks(context, moved=moved, state=state)
            watched = launcher.wait(
                [job_id],
                hooks,
                redact=redact,
                interrupts=_INTERRUPTS,
                forward_termination=self.forward_termination,
                movable=(job, request),
            )
            (job_id,) = watched.job_ids
            info = watched.infos[job_id]
            job = watched.moved[-1] if watched.moved else job
            failure, said = launcher.ended(job_id, info, redact)
            if said:  # a step cluster, torn down once its log tail is read
                context.log.info(said)
            if failure is not None:
                raise job_failure(failure)
        # Read once the session is closed: by then every message the job sent has been read. A job that moved
        # to another pool: the time held is what the step saw (the last job's own count leaves out the first).
        assert job.route is not None
        cost = preemption_cost(
            watched.timelines[job_id],
            saved_times(session.get_custom_messages()),
            gpus=job.route.total_gpus,
            ended_at=time.time(),
            ran_s=None if watched.moved else info.ran_s,
        )
        if cost.recoveries:
            context.log.warning(cost.summary(job_id))
        launched_as = launcher.backend.holding_of(job_id).kind
        return SkyPilotInvocation(
            session, LaunchRecord.of(job, info, launcher.backend.name, cost, launched_as=launched_as)
        )

    def _reattach_or_submit(
        self, context: dg.AssetExecutionContext, launcher: Launcher, job: ResolvedJob, request: LaunchRequest
    ) -> tuple[str, ResolvedJob]:
        """Re-attaches to the job an earlier attempt of this step launched, if it still runs; else submits
        ``job`` (routed around pools the API server says are full). Returns the job id and the job."""
        tag_key = job_tag_key(request)
        backend = launcher.backend
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
        with nothing_launched():
            job_id, job = launcher.submit(job, request, context.log.info)
        context.instance.add_run_tags(context.run.run_id, {tag_key: f"{backend.name}:{job_id}"})
        context.log.info(f"Submitted job {job_id}.")
        return job_id, job

    # ----------------------------------------------------------------- batches on warm pools
    def plan_batch(self, request: LaunchRequest, *, pool_name: str, max_workers: int | None = None) -> BatchPlan:
        """Where a batch of ``request`` would run on the warm pool ``pool_name``, and how many workers fit
        (see :meth:`Launcher.plan_batch`).

        Raises:
            dagster.Failure: the request cannot run on any pool ("Nothing was launched").
        """
        with nothing_launched():
            return self.launcher().plan_batch(request, pool_name=pool_name, max_workers=max_workers)

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
        ``PipesCompositeMessageReader``): ``prepare`` gets the per-rank Pipes env, writes what the ranks need
        (a batch file) and returns the launcher inputs that point at it. Every custom message a rank reports
        is handed to ``on_message`` as it arrives; ``on_submitted`` gets the resolved job and the rank job ids
        once they exist; ``on_preempted`` gets a rank, its state and when the step saw it, once per
        preemption SkyPilot recovers it from. The logs of up to ``max_log_streams`` running ranks stream into
        the run. A run termination cancels every rank and releases the pool. A failed rank does not raise:
        the caller decides what to retry (:attr:`BatchResult.failed_ranks`, with their last log lines).
        """
        from gpudoor_pipelines.transit.pipes import pipes_context_injector, pipes_message_reader

        with nothing_launched():
            launcher = self.launcher()
        self._record_run_process(context)
        backend = launcher.backend
        bucket = self.transit.get_bucket()
        reader = dg.PipesCompositeMessageReader([pipes_message_reader(bucket) for _ in range(num_jobs)])
        seen = 0

        def deliver() -> None:
            nonlocal seen
            messages = session.get_custom_messages()
            for message in messages[seen:]:
                on_message(message)
            seen = len(messages)

        last_summary = [""]

        def polled(infos: Mapping[str, JobInfo]) -> None:
            summary = summarize(infos)
            if summary != last_summary[0]:
                context.log.info(f"{pool_name}: {summary}")
                last_summary[0] = summary

        with dg.open_pipes_session(
            context=context, context_injector=pipes_context_injector(bucket), message_reader=reader
        ) as session:
            inputs = prepare(session.get_per_writer_bootstrap_env_vars())
            request = self._with_transit(
                request.with_inputs(**inputs), bucket, {}, session.default_remote_invocation_info
            )
            with nothing_launched():
                # A warm pool that is up already holds its GPUs: its jobs are not checked against them again.
                live = backend.usage() if not backend.pool_workers(pool_name) else None
                job = launcher.weigh_budget(resolve(request, launcher.fleet, usage=live), request)
            if job.budget is not None and job.budget.warning:
                context.log.warning(f"Budget of cost owner '{job.cost_owner}': {job.budget.warning}.")
            assert job.route is not None
            context.log.info(
                f"Launching {num_jobs} jobs of {job.name} on pool '{pool_name}' of {workers} workers "
                f"({job.pool}, {job.route.infra}, {job.route.describe()} each) through the {backend.name} backend."
            )
            with nothing_launched():
                job_ids = launcher.submit_batch(job, num_jobs, pool_name=pool_name, workers=workers)
            context.log.info(
                f"Submitted jobs {job_ids[0]}…{job_ids[-1]}." if num_jobs > 1 else f"Submitted job {job_ids[0]}."
            )
            if on_submitted:
                on_submitted(job, job_ids)
            redact = Redactor(job.secrets)
            hooks = step_hooks(context, tick=deliver, polled=polled, preempted=on_preempted)
            watched = launcher.wait(
                job_ids,
                hooks,
                redact=redact,
                interrupts=_INTERRUPTS,
                forward_termination=self.forward_termination,
                also_release=[Holding("pool", pool_name)],
            )
        deliver()  # what arrived while the session closed
        results_are_reported_by_the_caller(context)
        ranks = [watched.infos[i] for i in job_ids]
        tails = {
            r: [redact(line) for line in backend.log_tail(info.job_id, 30)]
            for r, info in enumerate(ranks)
            if info.state.is_failure
        }
        return BatchResult(job=job, job_ids=job_ids, infos=ranks, backend=backend.name, tails=tails)

    def release_pool(self, pool_name: str) -> None:
        """Gives a warm pool's workers back."""
        self.get_backend().release_pool(pool_name)

    # ----------------------------------------------------------------- services
    def serve(
        self, *, context: dg.AssetExecutionContext, request: LaunchRequest, ready_timeout_s: float = 120.0
    ) -> ServiceRecord:
        """Launches a long-running service (a demo) on ``request.cluster_name`` and waits for its URL."""
        with nothing_launched():
            launcher = self.launcher()
            launcher.backend.check()
            # No Pipes session for a service: the run's identity straight from the run (what a session would give).
            request = self._with_transit(request, self.transit.get_bucket(), {}, context.run.dagster_execution_info)
            job = resolve(request, launcher.fleet, usage=launcher.backend.usage())
        assert job.route is not None and job.cluster_name
        self._record_run_process(context)
        context.log.info(
            f"Starting service {job.cluster_name} on pool '{job.pool}' ({job.route.infra}): {job.route.reason}."
        )
        redact = Redactor(job.secrets)
        try:
            service, url = launcher.serve(
                job,
                port=(request.spec.ports or [8000])[0],
                ready_timeout_s=ready_timeout_s,
                hooks=step_hooks(context),
                redact=redact,
                interrupts=_INTERRUPTS,
            )
        except JobFailed as e:
            raise dg.Failure(description=str(e)) from None
        except TimeoutError as e:
            raise dg.Failure(description=str(e)) from None
        context.log.info(f"Service {job.cluster_name} is up at {url}")
        return ServiceRecord(
            url=url, cluster_name=job.cluster_name, job_id=service.job_id, backend=launcher.backend.name, job=job
        )

    def stop_service(self, cluster_name: str) -> bool:
        """Tears down the service on ``cluster_name``; True if it was running."""
        return self.get_backend().stop_service(cluster_name)
