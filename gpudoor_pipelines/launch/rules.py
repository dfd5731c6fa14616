"""Fleet rules: what every job gets and what no job may do, on whatever cluster it lands.

Each rule is a short function in the style of SkyPilot's example admin policies: it takes the task
(a SkyPilot task YAML mapping, changed in place), the route and the launch context, and either sets
what the fleet wants or raises :class:`PolicyRejection` saying what to change. The rules never
choose a pool, a GPU or a size — :func:`gpudoor_pipelines.launch.routing.route` did that.

Every rule *sets* values computed from the route and the context, so applying the rules to a task
they already rewrote changes nothing: the client applies them for fast failure and ``gpudoor
where``, the API server's admin policy applies them again as the authority. The launch context
travels between the two in the job's labels, through one encode/decode pair
(:meth:`LaunchContext.labels` / :meth:`LaunchContext.from_labels`).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, NoReturn

from gpudoor_pipelines.launch.errors import PolicyRejection
from gpudoor_pipelines.launch.fleet import Fleet, label_value
from gpudoor_pipelines.launch.routing import Route

LABEL_COST_OWNER = "gpudoor-cost-owner"
LABEL_POOL = "gpudoor-pool"
LABEL_USER = "gpudoor-user"
LABEL_INTERACTIVE = "gpudoor-interactive"
LABEL_STEP = "gpudoor-step"
LABEL_ASSET = "dagster-asset"
LABEL_RUN_ID = "dagster-run-id"
LABEL_PARTITION = "dagster-partition"
POOL_ENV = "GPUDOOR_POOL"
PRIORITY_FIELD = "config.kubernetes.pod_config.spec.priorityClassName"

def _label_key(dagster_key: str) -> str:
    # Dagster's execution info is keyed `dagster/run-id`; labels keep one flat `dagster-run-id` form.
    return dagster_key.replace("/", "-")


@dataclasses.dataclass(frozen=True)
class LaunchContext:
    """Who launches what: the part of a launch the rules read, carried in the job's labels.

    Attributes:
        cost_owner: the team account paying for the job (must be in the fleet's ``cost_owners``).
        user: the person, agent or service account launching.
        step: the step kind (``caption``, ``train``, ...), so a server-side policy can route.
        interactive: a cluster that stays up (demo, dev session): autostop applies.
        dagster: the Dagster run's identity (``dagster/run-id``, ``dagster/job``, ``dagster/partition``,
            ...) and ``dagster/asset``; empty outside Dagster.
    """

    cost_owner: str | None
    user: str = "unknown"
    step: str | None = None
    interactive: bool = False
    dagster: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def labels(self) -> dict[str, str]:
        """The context as job labels, with Kubernetes-valid values."""
        out = {LABEL_COST_OWNER: self.cost_owner or "", LABEL_USER: self.user}
        out.update({_label_key(k): v for k, v in self.dagster.items() if v})
        if self.step:
            out[LABEL_STEP] = self.step
        if self.interactive:
            out[LABEL_INTERACTIVE] = "true"
        return {k: label_value(v) for k, v in out.items()}

    @classmethod
    def from_labels(cls, labels: Mapping[str, str], *, user: str | None = None, interactive: bool = False) -> LaunchContext:
        """Reads back what :meth:`labels` wrote; ``user`` and ``interactive`` from the request win."""
        dagster = {k.replace("dagster-", "dagster/", 1): v for k, v in labels.items() if k.startswith("dagster-")}
        return cls(
            cost_owner=labels.get(LABEL_COST_OWNER) or None,
            user=user or labels.get(LABEL_USER) or "unknown",
            step=labels.get(LABEL_STEP),
            interactive=interactive or labels.get(LABEL_INTERACTIVE) == "true",
            dagster=dagster,
        )


@dataclasses.dataclass(frozen=True)
class Injected:
    """What the launcher (or the server) hands every job besides the fleet's own env.

    Attributes:
        env: inputs and outputs (URIs), Pipes bootstrap, transit settings; a spec's own value wins
            only where the launcher passes none.
        secrets: credentials (transit bucket), passed as SkyPilot secrets so they are redacted.
        fill_only: set env only where the task has no value yet (the server filling in its settings).
    """

    env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    secrets: Mapping[str, str] = dataclasses.field(default_factory=dict, repr=False)
    fill_only: bool = False


@dataclasses.dataclass(frozen=True)
class RuleResult:
    """The task after the rules, and what they did (for ``gpudoor where`` and launch metadata)."""

    config: dict[str, Any]
    injected_env: dict[str, str]
    secret_names: tuple[str, ...]
    labels: dict[str, str]
    notes: tuple[str, ...]


@dataclasses.dataclass
class Draft:
    """A task on its way through the rules: what each rule reads, and the task it rewrites in place."""

    task: dict[str, Any]
    route: Route
    ctx: LaunchContext
    fleet: Fleet
    injected: Injected
    source: str
    notes: list[str] = dataclasses.field(default_factory=list)

    def reject(self, field: str, problem: str, fix: str) -> NoReturn:
        """Refuses the job, naming the file, the field and the fix."""
        raise PolicyRejection(self.source, field, problem, fix)

    @property
    def resources(self) -> dict[str, Any]:
        """The task's ``resources`` mapping (created when missing)."""
        return self.task.setdefault("resources", {})


def cost_owner_rule(d: Draft) -> None:
    """Every GPU hour is paid by someone the finance sheet knows."""
    owners = list(d.fleet.cost_owners)
    if not d.ctx.cost_owner:
        d.reject(f"labels.{LABEL_COST_OWNER}", "no cost owner", f"set the cost owner (one of {owners})")
    if owners and d.ctx.cost_owner not in owners:
        d.reject(f"labels.{LABEL_COST_OWNER}", f"unknown cost owner '{d.ctx.cost_owner}'", f"use one of {owners} or add it to cost_owners in {d.fleet.source}")


def placement_rule(d: Draft) -> None:
    """Pins what routing chose: the infra, and the one GPU out of the spec's candidates."""
    d.resources["infra"] = d.route.infra
    if d.route.accelerators:
        d.resources["accelerators"] = d.route.accelerators


def priority_class_rule(d: Draft) -> None:
    """On production pools research runs at the pool's low priority, so serving can evict it."""
    wanted = d.route.pool.priority_class
    if not wanted:
        return
    pod_spec = d.task.setdefault("config", {}).setdefault("kubernetes", {}).setdefault("pod_config", {}).setdefault("spec", {})
    asked = pod_spec.get("priorityClassName")
    if asked not in (None, wanted):
        d.reject(PRIORITY_FIELD, f"'{asked}' on production pool '{d.route.pool.name}'", f"remove it; research jobs on this pool run at priority class '{wanted}'")
    pod_spec["priorityClassName"] = wanted
    d.notes.append(f"priority class '{wanted}' (production pool)")


def autostop_rule(d: Draft) -> None:
    """Interactive clusters (demos, dev sessions) go down once idle; a task's own autostop is kept."""
    if d.ctx.interactive:
        minutes = d.route.pool.autostop_idle_minutes
        d.resources.setdefault("autostop", {"idle_minutes": minutes, "down": True})
        d.notes.append(f"autostop after {minutes} idle minutes (interactive cluster)")


def labels_rule(d: Draft) -> None:
    """Who pays, who launched, which Dagster run and asset, which pool: on every job."""
    d.resources["labels"] = {**(d.resources.get("labels") or {}), **d.ctx.labels(), LABEL_POOL: label_value(d.route.pool.name)}


def pool_env(route: Route) -> dict[str, str]:
    """What the pool injects into every job on it: its paths, and its own name."""
    return {**route.pool.env, POOL_ENV: route.pool.name}


def env_rule(d: Draft) -> None:
    """The launcher's inputs, then the pool's paths (cache, checkpoints), which always win."""
    envs = {k: "" if v is None else str(v) for k, v in (d.task.get("envs") or {}).items()}
    for key, value in d.injected.env.items():
        if not (d.injected.fill_only and envs.get(key)):
            envs[key] = str(value)
    d.task["envs"] = {**envs, **pool_env(d.route)}


def secrets_rule(d: Draft) -> None:
    """Credentials reach the job as SkyPilot secrets (redacted in logs), never as env."""
    if d.injected.secrets:
        d.task["secrets"] = {**(d.task.get("secrets") or {}), **d.injected.secrets}


RULES: tuple[Callable[[Draft], None], ...] = (
    cost_owner_rule, placement_rule, priority_class_rule, autostop_rule, labels_rule, env_rule, secrets_rule,
)  # fmt: skip


def apply_rules(
    config: Mapping[str, Any],
    route: Route,
    ctx: LaunchContext,
    fleet: Fleet,
    injected: Injected | None = None,
    *,
    source: str = "(task)",
) -> RuleResult:
    """Applies every fleet rule, in order, to a copy of ``config`` bound for ``route``.

    Raises:
        PolicyRejection: a rule refuses the job; the message names ``source``, the field and the fix.
    """
    d = Draft(copy.deepcopy(dict(config)), route, ctx, fleet, injected or Injected(), source)
    for rule in RULES:
        rule(d)
    return RuleResult(
        config=d.task,
        injected_env=pool_env(route),
        secret_names=tuple(sorted(d.injected.secrets)),
        labels=dict(d.resources["labels"]),
        notes=tuple(d.notes),
    )
