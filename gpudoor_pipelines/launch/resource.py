"""The Dagster-facing launcher: resolve a task spec, launch it, stream it, record it.

Every GPU step of the flow goes through :meth:`SkyPilotResource.launch`: the spec is loaded and
checked (by this project and by SkyPilot's own parser), routed to a pool, rewritten by the fleet
rules, and run by a backend as a managed job, while its log lines stream into the Dagster run and
Dagster Pipes carries the job's own metrics back through the transit bucket. Terminating the run
cancels the job. The job id goes into the run's tags, so a retried step re-attaches to a job that is
still running instead of launching a second one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import getpass
import re
import time
from collections.abc import Iterator, Mapping
from typing import Any

import dagster as dg
from pydantic import Field

from gpudoor_pipelines.launch.backends.base import FAILURE_MEANING, Backend, JobInfo, JobState, ResolvedJob
from gpudoor_pipelines.launch.errors import JobFailed, LaunchConfigError
from gpudoor_pipelines.launch.fleet import PROJECT_ROOT, Fleet, load_fleet
from gpudoor_pipelines.launch.routing import Route, route
from gpudoor_pipelines.launch.rules import LaunchContext, RuleDecision, Usage, apply_fleet_rules
from gpudoor_pipelines.launch.specs import TaskSpec, load_spec, validate_with_skypilot
from gpudoor_pipelines.transit.resource import TransitBucketResource

TAG_POOL = "gpudoor/pool"
TAG_INFRA = "gpudoor/infra"
TAG_COST_OWNER = "gpudoor/cost-owner"
_TAG_JOB_PREFIX = "gpudoor/job-"


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


@dataclasses.dataclass
class LaunchResult:
    """What a finished launch reports back to the asset.

    Attributes:
        job_id: the backend's job id.
        route: where the job went and why.
        info: the job's final state and times.
        metadata: launch metadata merged with what the job reported through Pipes.
        check_results: asset check results the job reported through Pipes.
    """

    job_id: str
    route: Route
    info: JobInfo
    metadata: dict[str, Any]
    check_results: list[dg.AssetCheckResult]


@dataclasses.dataclass
class ServiceResult:
    """A running service (demo)."""

    job_id: str
    cluster_name: str
    url: str
    route: Route
    metadata: dict[str, Any]


def _slug(text: str, limit: int = 40) -> str:
    return re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")[:limit].strip("-") or "x"


class _Redactor:
    def __init__(self, secrets: Mapping[str, str]) -> None:
        self._values = sorted({v for v in secrets.values() if v and len(v) >= 4}, key=len, reverse=True)

    def __call__(self, line: str) -> str:
        for value in self._values:
            line = line.replace(value, "****")
        return line


@contextlib.contextmanager
def _refused_before_launch() -> Iterator[None]:
    """Turns a configuration error into a clean step failure that says nothing was launched."""
    try:
        yield
    except LaunchConfigError as e:
        raise dg.Failure(description=f"Nothing was launched. {e}", metadata={"file": e.source, "field": e.field}) from None


class SkyPilotResource(dg.ConfigurableResource):
    """Launches task specs as SkyPilot managed jobs (or local processes on the embedded default).

    With no configuration it runs every job on this machine (``backend="local"``); pointed at a
    SkyPilot API server (``backend="skypilot"``, ``api_server_endpoint``) it launches managed jobs
    on the team's clusters with the same task files.

    Attributes:
        backend: ``local`` (embedded default) or ``skypilot``.
        api_server_endpoint: SkyPilot API server URL (``skypilot`` backend).
        service_account_token: SkyPilot service-account token, bound with ``dg.EnvVar``; never logged.
        specs_dir: folder of task specs (default: the project's ``task_specs/``).
        fleet_file: the fleet file (default: ``task_specs/fleet.yaml``).
        local_home: state folder of the local backend (default ``$GPUDOOR_HOME`` or ``~/.gpudoor``).
        cost_owner: who pays for the jobs (default: the fleet's default); a ``gpudoor/cost-owner`` run tag wins.
        user: who launches (for per-user caps and labels; default: the OS user).
        poll_interval_s: seconds between status polls.
        cancel_timeout_s: how long to wait for a cancelled job to reach CANCELLED.
        validate_with_skypilot: also parse every spec with ``sky.Task`` before launching.
        transit: the transit bucket jobs read inputs from and write outputs to.
    """

    backend: str = Field(default="local", description="'local' (embedded default) or 'skypilot'.")
    api_server_endpoint: str | None = Field(default=None, description="SkyPilot API server URL.")
    service_account_token: str | None = Field(default=None, description="SkyPilot service-account token.")
    specs_dir: str | None = Field(default=None, description="Folder of task specs.")
    fleet_file: str | None = Field(default=None, description="Fleet file.")
    local_home: str | None = Field(default=None, description="State folder of the local backend.")
    cost_owner: str | None = Field(default=None, description="Cost owner label for every job.")
    user: str | None = Field(default=None, description="Who launches (labels, per-user caps).")
    poll_interval_s: float = Field(default=0.5, description="Seconds between status polls.")
    cancel_timeout_s: float = Field(default=180.0, description="Bound on waiting for CANCELLED.")
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
        """The fleet file, validated."""
        return load_fleet(self.fleet_file)

    def get_spec(self, name: str) -> TaskSpec:
        """A task spec by name (``caption``) or path, checked."""
        spec = load_spec(name, self.specs_dir)
        if self.validate_with_skypilot:
            validate_with_skypilot(spec.config, spec.path)
        return spec

    def _user(self) -> str:
        if self.user:
            return self.user
        try:
            return getpass.getuser()
        except (KeyError, OSError):
            return "unknown"

    def resolve(
        self,
        spec_name: str,
        *,
        inputs: Mapping[str, str] | None = None,
        launch_config: LaunchConfig | None = None,
        tags: Mapping[str, str] | None = None,
        run_id: str | None = None,
        asset: str | None = None,
        partition: str | None = None,
        interactive: bool = False,
        extra_env: Mapping[str, str] | None = None,
        backend: Backend | None = None,
        step: str | None = None,
    ) -> tuple[TaskSpec, Route, RuleDecision]:
        """Resolves a spec into the task that would run, without launching anything.

        Raises:
            LaunchConfigError: anything wrong with the spec, the fleet, an override or a rule.
        """
        launch_config = launch_config or LaunchConfig()
        tags = tags or {}
        spec = self.get_spec(spec_name)
        fleet = self.get_fleet()
        for name in launch_config.env:
            if name not in spec.envs:
                raise LaunchConfigError(
                    "run config",
                    f"env.{name}",
                    f"{spec.path} declares no env '{name}'",
                    f"use one of {sorted(spec.envs)} or declare it under envs in {spec.path}",
                )
        in_use = (backend.gpus_in_use() if backend else {}) or {}
        chosen = route(
            spec,
            fleet,
            step=step,
            pool=launch_config.pool or tags.get(TAG_POOL),
            infra=launch_config.infra or tags.get(TAG_INFRA),
            gpus_in_use=in_use,
        )
        ctx = LaunchContext(
            cost_owner=tags.get(TAG_COST_OWNER) or self.cost_owner or fleet.default_cost_owner,
            user=self._user(),
            run_id=run_id,
            asset=asset,
            partition=partition,
            interactive=interactive,
            step=step or spec.kind,
        )
        bucket = self.transit.get_bucket()
        env = dict(extra_env or {})
        env.update(bucket.job_env())
        env.update(inputs or {})
        env.update(launch_config.env)
        decision = apply_fleet_rules(
            spec.config,
            chosen.pool,
            fleet,
            ctx,
            infra=chosen.infra,
            accelerators=chosen.accelerators,
            secrets=bucket.job_secrets(),
            extra_env=env,
            usage=Usage(by_pool=in_use),
            source=spec.path,
        )
        return spec, chosen, decision

    # ----------------------------------------------------------------- launch
    def launch(
        self,
        context: dg.AssetExecutionContext,
        spec_name: str,
        *,
        inputs: Mapping[str, str] | None = None,
        launch_config: LaunchConfig | None = None,
        extras: Mapping[str, Any] | None = None,
    ) -> LaunchResult:
        """Launches a spec as a managed job for the current asset and waits for it to end.

        Args:
            context: the asset's execution context.
            spec_name: the task spec (``caption``, ``train``, ...).
            inputs: input/output URIs and other launcher-provided env for the job.
            launch_config: the asset's run config (pool/infra overrides, spec env values).
            extras: Pipes extras passed to the job.

        Returns:
            The launch result with metadata ready for the materialization.

        Raises:
            dagster.Failure: the job failed or was cancelled; the description has its last log lines.
        """
        run = context.run
        partition = context.partition_key if context.has_partition_key else None
        asset = context.asset_key.to_user_string() if context.has_assets_def else context.op.name
        with _refused_before_launch():
            backend = self.get_backend()
            backend.check()
        bucket = self.transit.get_bucket()
        tag_key = f"{_TAG_JOB_PREFIX}{_slug(asset, 60)}" + (f"-{_slug(partition, 60)}" if partition else "")
        with dg.open_pipes_session(
            context=context,
            context_injector=bucket.pipes_context_injector(),
            message_reader=bucket.pipes_message_reader(),
            extras=dict(extras or {}),
        ) as session:
            with _refused_before_launch():
                spec, chosen, decision = self.resolve(
                    spec_name,
                    inputs=inputs,
                    launch_config=launch_config,
                    tags=run.tags,
                    run_id=run.run_id,
                    asset=asset,
                    partition=partition,
                    extra_env=session.get_bootstrap_env_vars(),
                    backend=backend,
                )
            job = ResolvedJob(
                name=f"{_slug(asset, 30)}-{_slug(partition or 'all', 24)}-{run.run_id[:8]}",
                config=decision.config,
                workdir=str(PROJECT_ROOT),
                pool=chosen.pool.name,
                pool_env=decision.injected_env,
            )
            job_id = self._reattach_or_submit(context, backend, job, tag_key, chosen)
            info = self._watch(context, backend, job_id, _Redactor(job.secrets))
        reported = session.get_results()
        metadata = self._metadata(spec, chosen, decision, info, backend)
        checks: list[dg.AssetCheckResult] = []
        for result in reported:
            if isinstance(result, dg.AssetCheckResult):
                checks.append(result)
            elif result.metadata:
                metadata.update(result.metadata)
        return LaunchResult(job_id=job_id, route=chosen, info=info, metadata=metadata, check_results=checks)

    def _reattach_or_submit(
        self,
        context: dg.AssetExecutionContext,
        backend: Backend,
        job: ResolvedJob,
        tag_key: str,
        chosen: Route,
    ) -> str:
        previous = context.run.tags.get(tag_key)
        if previous and previous.startswith(f"{backend.name}:"):
            old_id = previous.split(":", 1)[1]
            try:
                state = backend.status(old_id).state
            except KeyError:
                state = None
            if state is not None and not state.is_terminal:
                context.log.info(
                    f"Re-attaching to job {old_id}, still {state.value}, instead of launching a second one."
                )
                return old_id
        context.log.info(
            f"Launching {job.name} on pool '{chosen.pool.name}' ({chosen.infra}, {chosen.accelerators}"
            f" x{int(job.config.get('num_nodes') or 1)} node(s)) through the {backend.name} backend: {chosen.reason}."
        )
        job_id = backend.submit(job)
        context.instance.add_run_tags(context.run.run_id, {tag_key: f"{backend.name}:{job_id}"})
        context.log.info(f"Submitted job {job_id}.")
        return job_id

    def _watch(
        self, context: dg.AssetExecutionContext, backend: Backend, job_id: str, redact: _Redactor
    ) -> JobInfo:
        follower = backend.follow_logs(job_id)
        last_state: JobState | None = None
        try:
            while True:
                info = backend.status(job_id)
                for line in follower.poll():
                    context.log.info(redact(line))
                if info.state != last_state:
                    context.log.debug(f"Job {job_id}: {info.state.value}")
                    last_state = info.state
                if info.state.is_terminal:
                    for line in follower.poll():
                        context.log.info(redact(line))
                    break
                time.sleep(self.poll_interval_s)
        except (dg.DagsterExecutionInterruptedError, KeyboardInterrupt):
            context.log.warning(f"Run terminated: cancelling job {job_id}.")
            self._cancel_and_wait(context, backend, job_id)
            raise
        finally:
            follower.close()
        if info.state.is_failure:
            tail = [redact(line) for line in backend.log_tail(job_id, 30)]
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

    def _cancel_and_wait(self, context: dg.AssetExecutionContext, backend: Backend, job_id: str) -> None:
        backend.cancel(job_id)
        deadline = time.time() + self.cancel_timeout_s
        state = backend.status(job_id).state
        while not state.is_terminal and time.time() < deadline:
            time.sleep(self.poll_interval_s)
            state = backend.status(job_id).state
        if state.is_terminal:
            context.log.warning(f"Job {job_id} is {state.value}.")
        else:
            context.log.error(
                f"Job {job_id} still {state.value} after {self.cancel_timeout_s:.0f} s; check it by hand."
            )

    def _metadata(
        self, spec: TaskSpec, chosen: Route, decision: RuleDecision, info: JobInfo, backend: Backend
    ) -> dict[str, Any]:
        queued = (info.started_at - info.submitted_at) if info.started_at and info.submitted_at else None
        running = (info.ended_at - info.started_at) if info.ended_at and info.started_at else 0.0
        gpus = chosen.gpus_per_node * spec.num_nodes
        gpu_hours = gpus * running / 3600.0
        md: dict[str, Any] = {
            "job_id": info.job_id,
            "job_name": info.name,
            "backend": backend.name,
            "pool": chosen.pool.name,
            "infra": info.infra or chosen.infra,
            "accelerators": chosen.accelerators,
            "num_nodes": spec.num_nodes,
            "route": chosen.reason,
            "status": info.state.value,
            "recoveries": info.recoveries,
            "running_s": round(running, 2),
            "gpu_hours": round(gpu_hours, 6),
            "cost_usd_estimate": round(gpu_hours * chosen.pool.usd_per_gpu_hour, 6),
            "task_spec": dg.MetadataValue.path(spec.path),
        }
        if queued is not None:
            md["queued_s"] = round(queued, 2)
        if decision.notes:
            md["policy"] = "; ".join(decision.notes)
        return md

    # ----------------------------------------------------------------- services
    def serve(
        self,
        context: dg.AssetExecutionContext,
        spec_name: str,
        *,
        cluster_name: str,
        inputs: Mapping[str, str] | None = None,
        launch_config: LaunchConfig | None = None,
        ready_timeout_s: float = 120.0,
    ) -> ServiceResult:
        """Launches a long-running service (a demo) on ``cluster_name`` and waits for its URL."""
        asset = context.asset_key.to_user_string()
        with _refused_before_launch():
            backend = self.get_backend()
            backend.check()
            spec, chosen, decision = self.resolve(
                spec_name,
                inputs=inputs,
                launch_config=launch_config,
                tags=context.run.tags,
                run_id=context.run.run_id,
                asset=asset,
                interactive=True,
                backend=backend,
            )
        job = ResolvedJob(
            name=cluster_name,
            config=decision.config,
            workdir=str(PROJECT_ROOT),
            pool=chosen.pool.name,
            pool_env=decision.injected_env,
            cluster_name=cluster_name,
        )
        context.log.info(
            f"Starting service {cluster_name} on pool '{chosen.pool.name}' ({chosen.infra}): {chosen.reason}."
        )
        job_id = backend.start_service(job)
        follower = backend.follow_logs(job_id)
        redact = _Redactor(job.secrets)
        port = (spec.ports or [8000])[0]
        deadline = time.time() + ready_timeout_s
        url = None
        try:
            while time.time() < deadline:
                for line in follower.poll():
                    context.log.info(redact(line))
                info = backend.status(job_id)
                if info.state.is_terminal:
                    tail = backend.log_tail(job_id, 30)
                    raise dg.Failure(
                        description=str(
                            JobFailed(
                                job_id, info.state.value, "the service stopped before it answered", tail
                            )
                        )
                    )
                url = backend.service_url(job, job_id, port)
                if url:
                    break
                time.sleep(self.poll_interval_s)
        except (dg.DagsterExecutionInterruptedError, KeyboardInterrupt):
            backend.stop_service(cluster_name)
            raise
        finally:
            follower.close()
        if not url:
            backend.stop_service(cluster_name)
            raise dg.Failure(
                description=f"Service {cluster_name} did not answer within {ready_timeout_s:.0f} s; it was stopped."
            )
        context.log.info(f"Service {cluster_name} is up at {url}")
        md = {
            "url": dg.MetadataValue.url(url),
            "cluster_name": cluster_name,
            "job_id": job_id,
            "backend": backend.name,
            "pool": chosen.pool.name,
            "infra": chosen.infra,
            "accelerators": chosen.accelerators,
            "usd_per_hour_estimate": round(chosen.gpus_per_node * chosen.pool.usd_per_gpu_hour, 4),
        }
        if decision.notes:
            md["policy"] = "; ".join(decision.notes)
        return ServiceResult(job_id=job_id, cluster_name=cluster_name, url=url, route=chosen, metadata=md)

    def stop_service(self, cluster_name: str) -> bool:
        """Tears down the service on ``cluster_name``; True if it was running."""
        return self.get_backend().stop_service(cluster_name)
