"""A launch request, and :func:`resolve`: the pure step from a request to the task that runs.

The request is built once per launch (by the Dagster client from the asset's context, or by
``gpudoor where`` from its arguments); :func:`resolve` routes it and applies the fleet rules. Both
the launcher and ``gpudoor where`` call the same function, so what ``where`` shows is what runs.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gpudoor_pipelines.launch.errors import LaunchConfigError
from gpudoor_pipelines.launch.labels import LABEL_BORROWED, LABEL_COST_OWNER, LABEL_FINGERPRINT, LABEL_KEY_ENV
from gpudoor_pipelines.launch.resolve.fingerprint import fingerprint
from gpudoor_pipelines.launch.resolve.fleet import PROJECT_ROOT, Fleet
from gpudoor_pipelines.launch.resolve.routing import Route, route
from gpudoor_pipelines.launch.resolve.rules import Injected, LaunchContext, apply_rules, deployment_name
from gpudoor_pipelines.launch.resolve.sharing import BudgetVerdict
from gpudoor_pipelines.launch.resolve.specs import TaskSpec, task_infra
from gpudoor_pipelines.launch.resolve.usage import Outlook, Usage


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
        budget: the cost owner's week against its budget, where the launcher weighed it.
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
    budget: BudgetVerdict | None = None

    @property
    def cost_owner(self) -> str:
        """Who pays (its label)."""
        return self.labels.get(LABEL_COST_OWNER, "")

    @property
    def fingerprint(self) -> str:
        """The launch's fingerprint (its label)."""
        return self.labels.get(LABEL_FINGERPRINT, "")

    def sharing_metadata(self) -> dict[str, str | float]:
        """Who pays, what it has left, whether on borrowed GPUs, and the fingerprint: for a materialization."""
        md: dict[str, str | float] = {"cost_owner": self.cost_owner, "fingerprint": self.fingerprint}
        if self.route is not None and self.route.quota:
            md["quota"] = self.route.quota
        if self.labels.get(LABEL_BORROWED) == "true":
            md["borrowed_quota"] = "true"
        if self.budget is not None:
            md.update(self.budget.metadata())
        return md

    @property
    def secrets(self) -> dict[str, str]:
        """Credentials for the job (never logged)."""
        s = self.config.get("secrets") or {}
        return {k: str(v) for k, v in s.items()} if isinstance(s, dict) else {}

    @property
    def num_nodes(self) -> int:
        """Nodes the job spans."""
        return int(self.config.get("num_nodes") or 1)


def slug(text: str, limit: int = 40) -> str:
    """A lowercase name SkyPilot accepts in job and cluster names."""
    return re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")[:limit].strip("-") or "x"


@dataclasses.dataclass(frozen=True)
class LaunchRequest:
    """Everything one launch needs, read once.

    Attributes:
        spec: the task spec (loaded and checked once, cached by path and modification time).
        inputs: env the launcher passes (input and output URIs, Pipes bootstrap, transit settings).
        env: values for envs the spec declares (the launchpad's ``env``).
        secrets: credentials for the job (transit bucket), passed as SkyPilot secrets; never shown.
        pool: explicit pool override.
        infra: explicit SkyPilot infra override.
        cost_owner: who pays, set for this launch (the ``gpudoor/cost-owner`` run tag, ``--cost-owner``);
            it wins over the task's own ``gpudoor-cost-owner`` label.
        default_cost_owner: who pays when neither the launch nor the task says (the launcher's
            setting); None means the fleet's default.
        user: who launches (labels, per-user caps).
        asset: the asset being materialized.
        partition: its partition key.
        dagster: the Dagster run's identity for the job's labels (``dagster/run-id``, ``dagster/job``, ...).
        interactive: a cluster that stays up (a demo): autostop applies.
        cluster_name: the cluster a service is launched on.
        step: the step kind, set by the launcher (the asset's step, ``--step``); None routes by
            what the task needs (or by the task's own ``gpudoor-step`` label).
        ttl_hours: an interactive cluster's own time to live (else the task's ``gpudoor-ttl-hours``
            label, else the fleet's); the orphan reconciler tears it down after it.
        batch_input: the input naming a batch file whose entries give each job of a batch its own inputs
            (a packed run): the task's required envs are then the batch's to give, not one value for all.
    """

    spec: TaskSpec
    inputs: Mapping[str, str] = dataclasses.field(default_factory=dict)
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    secrets: Mapping[str, str] = dataclasses.field(default_factory=dict, repr=False)
    pool: str | None = None
    infra: str | None = None
    cost_owner: str | None = None
    default_cost_owner: str | None = None
    user: str = "unknown"
    asset: str | None = None
    partition: str | None = None
    dagster: Mapping[str, str] = dataclasses.field(default_factory=dict)
    interactive: bool = False
    cluster_name: str | None = None
    step: str | None = None
    ttl_hours: float | None = None
    batch_input: str | None = None

    @property
    def run_id(self) -> str | None:
        """The Dagster run launching the job."""
        return self.dagster.get("dagster/run-id")

    @property
    def job_name(self) -> str:
        """``<asset>-<partition>-<run id prefix>``, or the cluster's name for a service."""
        if self.cluster_name:
            return self.cluster_name
        asset, partition = slug(self.asset or self.spec.name, 30), slug(self.partition or "all", 24)
        return f"{asset}-{partition}-{(self.run_id or 'adhoc')[:8]}"

    def env_value(self, name: str) -> str:
        """The value the job gets for a declared env: the launchpad's, else the spec's default."""
        return self.env.get(name) or self.spec.envs.get(name, "")

    def with_inputs(self, **inputs: str) -> LaunchRequest:
        """The same request with more launcher env."""
        return dataclasses.replace(self, inputs={**self.inputs, **inputs})


def resolve(
    request: LaunchRequest, fleet: Fleet, *, usage: Usage | None = None, outlook: Outlook | None = None
) -> ResolvedJob:
    """Routes a request and applies the fleet rules: the task that would run, without running it.

    Who pays: the launch's own setting, then the task's ``gpudoor-cost-owner`` label, then the
    launcher's default, then the fleet's. Secrets the task asks for by name (and the fleet allows)
    take their values from the launcher's environment.

    Args:
        request: the launch request.
        fleet: the fleet.
        usage: what is held right now, for live cap and quota checks.
        outlook: how soon each pool would start the job (start soonest); None: the route's order.

    Raises:
        LaunchConfigError: everything wrong with the spec, an override or a rule, at once; nothing
            was launched.
    """
    spec = request.spec
    problems: list[LaunchConfigError] = list(spec.problems)
    for name in request.env:
        if name not in spec.envs:
            problems.append(
                LaunchConfigError(
                    "run config",
                    f"env.{name}",
                    f"{spec.path} declares no env '{name}'",
                    f"use one of {sorted(spec.envs)} or declare it under envs in {spec.path}",
                )
            )
    problems += missing_inputs(request)
    own = LaunchContext.from_labels(
        {str(k): str(v) for k, v in ((spec.config.get("resources") or {}).get("labels") or {}).items()}
    )
    step = request.step or own.step
    infra, infra_field = request.infra, ("launch override", "infra")
    if not infra:
        infra, infra_field = (
            task_infra(spec.config.get("resources") or {}, spec.path, fleet, problems),
            (spec.path, "resources.infra"),
        )
    cost_owner = request.cost_owner or own.cost_owner or request.default_cost_owner or fleet.default_cost_owner
    try:
        chosen = route(
            spec,
            fleet,
            step=step,
            pool=request.pool,
            infra=infra,
            user=request.user,
            owner=cost_owner,
            session=request.interactive,
            usage=usage,
            outlook=outlook,
            infra_field=infra_field,
        )
    except LaunchConfigError as e:
        raise LaunchConfigError.combine([*problems, e]) from None
    ours = {"dagster/asset": request.asset, "dagster/partition": request.partition}
    identity = {**request.dagster, **{k: v for k, v in ours.items() if v}}
    if identity.get("dagster/run-id"):
        identity["dagster/deployment"] = deployment_name()
    ttl = request.ttl_hours if request.ttl_hours is not None else own.ttl_hours
    ctx = LaunchContext(
        cost_owner=cost_owner,
        user=request.user,
        step=step,
        interactive=request.interactive,
        dagster=identity,
        via="launcher",
        ttl_hours=ttl,
    )
    asked = spec.config.get("secrets") or {}
    own_secrets = {n: os.environ[n] for n in asked if n in fleet.secrets and os.environ.get(n)}
    injected = Injected(
        env={**request.inputs, **request.env},
        secrets={**own_secrets, **request.secrets},
        require_secrets=True,
        sign_key=os.environ.get(LABEL_KEY_ENV) or None,
    )
    try:
        ruled = apply_rules(spec.config, chosen, ctx, fleet, injected, source=spec.path)
    except LaunchConfigError as e:
        problems.append(e)
    if problems:
        raise LaunchConfigError.combine(problems)
    printed = fingerprint(ruled.config, fleet)
    ruled.config["resources"]["labels"][LABEL_FINGERPRINT] = printed
    return ResolvedJob(
        name=request.job_name,
        config=ruled.config,
        workdir=_workdir(spec),
        pool=chosen.pool.name,
        pool_env=ruled.injected_env,
        cluster_name=request.cluster_name,
        route=chosen,
        labels={**ruled.labels, LABEL_FINGERPRINT: printed},
        notes=ruled.notes,
        secret_names=ruled.secret_names,
        spec_path=spec.path,
        launch_as=_launch_as(request, fleet, step, identity),
    )


def missing_inputs(request: LaunchRequest) -> list[LaunchConfigError]:
    """The task's required envs (``envs: {NAME: null}``) this launch gives no value for (an empty one counts)."""
    if request.batch_input:  # a packed run: each job's entries of the batch file are its inputs
        return []
    given = {**request.inputs, **request.env}
    return [
        LaunchConfigError(
            request.spec.path,
            f"envs.{name}",
            f"the task needs {name} (declared with no value) and this launch gives none",
            f"give it: `--env {name}=VALUE` (gpudoor launch, gpudoor where), or `env: {{{name}: VALUE}}` in the "
            "launch's run config",
        )
        for name in request.spec.required
        if name not in given
    ]


def _launch_as(request: LaunchRequest, fleet: Fleet, step: str | None, identity: dict[str, str]) -> str:
    """The fleet's ``launch_as`` for the step, for steps of a Dagster run only: a step cluster needs the step
    to tear it down when its job ends, and the orphan reconciler to find its run if the step dies. A launch
    outside a run (a person, an agent) and a service (a demo) are never step clusters."""
    if request.cluster_name or not identity.get("dagster/run-id"):
        return "managed"
    return fleet.launch_as.get(step or "", "managed")


def _workdir(spec: TaskSpec) -> str:
    """The task's own ``workdir`` (relative to its file), else the project (which holds ``workloads/``)."""
    own = spec.config.get("workdir")
    if isinstance(own, str) and own:
        return str((Path(spec.path).parent / own).resolve())
    return str(PROJECT_ROOT)
