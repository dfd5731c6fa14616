"""Fleet rules: what every job gets and what no job may do, on whatever cluster it lands.

Each rule is a short function in the style of SkyPilot's example admin policies: it takes the task
(a SkyPilot task YAML mapping, changed in place), the route and the launch context, and either sets
what the fleet wants or raises :class:`PolicyRejection` saying what to change. The rules never
choose a pool, a GPU or a size — :func:`gpudoor_pipelines.launch.resolve.routing.route` did that.

Every rule *sets* values computed from the route and the context, so applying the rules to a task
they already rewrote changes nothing: the client applies them for fast failure and ``gpudoor
where``, the API server's admin policy applies them again as the authority. The launch context
travels between the two in the job's labels, through one encode/decode pair
(:meth:`LaunchContext.labels` / :meth:`LaunchContext.from_labels`).
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import hmac
import os
from collections.abc import Callable, Mapping
from typing import Any

from gpudoor_pipelines.launch.errors import LaunchConfigError, PolicyRejection
from gpudoor_pipelines.launch.labels import (
    LABEL_BORROWED,
    LABEL_COST_OWNER,
    LABEL_FINGERPRINT,
    LABEL_INTERACTIVE,
    LABEL_POOL,
    LABEL_SIGNATURE,
    LABEL_STEP,
    LABEL_TTL,
    LABEL_USER,
    LABEL_VIA,
    POOL_ENV,
    PRIORITY_FIELD,
    TRANSIT_SECRET_NAMES,
)
from gpudoor_pipelines.launch.resolve.fleet import Fleet, label_value
from gpudoor_pipelines.launch.resolve.routing import Route


def _label_key(dagster_key: str) -> str:
    # Dagster's execution info is keyed `dagster/run-id`; labels keep one flat `dagster-run-id` form.
    return dagster_key.replace("/", "-")


def deployment_name() -> str:
    """This Dagster deployment's name: ``GPUDOOR_DEPLOYMENT``, else Dagster+'s ``DAGSTER_CLOUD_DEPLOYMENT_NAME``,
    else ``default``."""
    return os.environ.get("GPUDOOR_DEPLOYMENT") or os.environ.get("DAGSTER_CLOUD_DEPLOYMENT_NAME") or "default"


def identity_signature(labels: Mapping[str, str], key: str) -> str:
    """A keyed digest (HMAC-SHA256, 32 hex digits) of the ``dagster-*`` labels: which Dagster run launched a job.

    The launcher signs with the deployment's key (``GPUDOOR_LABEL_KEY``), the API server's policy checks
    with the same key (``GPUDOOR_POLICY_LABEL_KEY``), and the orphan reconciler trusts a job's run only
    when the digest matches: a task file or a raw ``sky.jobs.launch`` cannot claim a run.
    """
    text = "\n".join(f"{k}={v}" for k, v in sorted(labels.items()) if k.startswith("dagster-"))
    return hmac.new(key.encode(), text.encode(), hashlib.sha256).hexdigest()[:32]


def identity_verified(labels: Mapping[str, str], key: str | None) -> bool:
    """Whether the job's ``dagster-*`` labels carry a valid signature under ``key`` (no key: nothing to check)."""
    if not key or not any(k.startswith("dagster-") for k in labels):
        return True
    return hmac.compare_digest(str(labels.get(LABEL_SIGNATURE, "")), identity_signature(labels, key))


def without_identity(labels: Mapping[str, str]) -> dict[str, str]:
    """The labels less the run identity (``dagster-*``) and its signature."""
    return {k: v for k, v in labels.items() if not k.startswith("dagster-") and k != LABEL_SIGNATURE}


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
        via: who checked the task file (``launcher``), if not the policy.
        ttl_hours: an interactive cluster's own time to live (else the fleet's).
    """

    cost_owner: str | None
    user: str = "unknown"
    step: str | None = None
    interactive: bool = False
    dagster: Mapping[str, str] = dataclasses.field(default_factory=dict)
    via: str | None = None
    ttl_hours: float | None = None

    def labels(self) -> dict[str, str]:
        """The context as job labels, with Kubernetes-valid values."""
        out = {LABEL_COST_OWNER: self.cost_owner or "", LABEL_USER: self.user}
        out.update({_label_key(k): v for k, v in self.dagster.items() if v})
        if self.step:
            out[LABEL_STEP] = self.step
        if self.interactive:
            out[LABEL_INTERACTIVE] = "true"
            if self.ttl_hours is not None:
                out[LABEL_TTL] = f"{self.ttl_hours:g}"
        return {k: label_value(v) for k, v in out.items()}

    @classmethod
    def from_labels(
        cls, labels: Mapping[str, str], *, user: str | None = None, interactive: bool = False
    ) -> LaunchContext:
        """Reads back what :meth:`labels` wrote; ``user`` and ``interactive`` from the request win."""
        dagster = {k.replace("dagster-", "dagster/", 1): v for k, v in labels.items() if k.startswith("dagster-")}
        return cls(
            cost_owner=labels.get(LABEL_COST_OWNER) or None,
            user=user or labels.get(LABEL_USER) or "unknown",
            step=labels.get(LABEL_STEP),
            interactive=interactive or labels.get(LABEL_INTERACTIVE) == "true",
            dagster=dagster,
            via=labels.get(LABEL_VIA),
            ttl_hours=_hours(labels.get(LABEL_TTL)),
        )


def _hours(value: str | None) -> float | None:
    try:
        return float(value) if value not in (None, "") else None
    except ValueError:
        return None


@dataclasses.dataclass(frozen=True)
class Injected:
    """What the launcher (or the server) hands every job besides the fleet's own env.

    Attributes:
        env: inputs and outputs (URIs), Pipes bootstrap, transit settings; a spec's own value wins
            only where the launcher passes none.
        secrets: credentials (transit bucket), passed as SkyPilot secrets so they are redacted.
        fill_only: set env only where the task has no value yet (the server filling in its settings).
        require_secrets: a secret the task asks for must have a value by now (the server, last to fill).
        sign_key: the deployment's key: the run identity labels are signed with it.
    """

    env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    secrets: Mapping[str, str] = dataclasses.field(default_factory=dict, repr=False)
    fill_only: bool = False
    require_secrets: bool = False
    sign_key: str | None = dataclasses.field(default=None, repr=False)


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

    problems: list[LaunchConfigError] = dataclasses.field(default_factory=list)

    def reject(self, field: str, problem: str, fix: str) -> None:
        """Refuses the job, naming the file, the field and the fix (every rule still runs: all problems at once)."""
        self.problems.append(PolicyRejection(self.source, field, problem, fix))

    @property
    def resources(self) -> dict[str, Any]:
        """The task's ``resources`` mapping (created when missing)."""
        return self.task.setdefault("resources", {})


def cost_owner_rule(d: Draft) -> None:
    """Every GPU hour is paid by someone the finance sheet knows."""
    owners = list(d.fleet.cost_owners)
    if not d.ctx.cost_owner:
        d.reject(f"labels.{LABEL_COST_OWNER}", "no cost owner", f"set the cost owner (one of {owners})")
    elif owners and d.ctx.cost_owner not in owners:
        d.reject(
            f"labels.{LABEL_COST_OWNER}",
            f"unknown cost owner '{d.ctx.cost_owner}'",
            f"use one of {owners} or add it to cost_owners in {d.fleet.source}",
        )


def placement_rule(d: Draft) -> None:
    """Pins what routing chose: the infra, and the one candidate (GPU, spot or not) out of the spec's set."""
    for key in ("any_of", "ordered", "accelerators", "use_spot"):
        d.resources.pop(key, None)
    if d.route.candidate is not None:
        d.resources.update(
            {k: copy.deepcopy(v) for k, v in d.route.candidate.fields if k not in ("accelerators", "labels")}
        )
    d.resources["infra"] = d.route.infra
    if d.route.accelerators:
        d.resources["accelerators"] = d.route.accelerators
    if d.route.use_spot:
        d.resources["use_spot"] = True


def priority_class_rule(d: Draft) -> None:
    """On production pools research runs at the pool's low priority, so serving can evict it; an interactive
    session at the pool's interactive class, a job on borrowed GPUs at its borrowed class (evicted first).

    A class the pool itself hands out, set by an earlier pass of the rules, is replaced: the launcher may
    have judged a job within quota that the server, counting what is held, finds borrowing."""
    pool, route = d.route.pool, d.route
    why, wanted = "production pool", pool.priority_class
    if route.session and pool.interactive_priority_class:
        why, wanted = "interactive session", pool.interactive_priority_class
    elif route.borrowed and pool.borrowed_priority_class:
        why, wanted = "borrowed GPUs: evicted first", pool.borrowed_priority_class
    if not wanted:
        return
    pod_spec = (
        d.task.setdefault("config", {}).setdefault("kubernetes", {}).setdefault("pod_config", {}).setdefault("spec", {})
    )
    asked = pod_spec.get("priorityClassName")
    own = {pool.priority_class, pool.interactive_priority_class, pool.borrowed_priority_class} - {None}
    if asked is not None and asked not in own:
        d.reject(
            PRIORITY_FIELD,
            f"'{asked}' on production pool '{pool.name}'",
            f"remove it; research jobs on this pool run at priority class '{wanted}'",
        )
    pod_spec["priorityClassName"] = wanted
    d.notes.append(f"priority class '{wanted}' ({why})")


def autostop_rule(d: Draft) -> None:
    """Interactive clusters (demos, dev sessions) go down once idle; a task's own autostop is kept."""
    if d.ctx.interactive:
        minutes = d.route.pool.autostop_idle_minutes
        d.resources.setdefault("autostop", {"idle_minutes": minutes, "down": True})
        d.notes.append(f"autostop after {minutes} idle minutes (interactive cluster)")


def ttl_rule(d: Draft) -> None:
    """An interactive cluster is torn down by the orphan reconciler once its time to live is over, busy or not."""
    if not d.ctx.interactive:
        return
    policy = d.fleet.reconciler
    asked = d.ctx.ttl_hours
    if asked is not None and not 0 < asked <= policy.max_interactive_ttl_hours:
        d.reject(
            f"labels.{LABEL_TTL}",
            f"a time to live of {asked:g} hours",
            f"ask for more than 0 and at most {policy.max_interactive_ttl_hours:g} hours "
            f"(reconciler.max_interactive_ttl_hours in {d.fleet.source})",
        )
    hours = asked if asked is not None else policy.interactive_ttl_hours
    d.notes.append(f"torn down {hours:g} hours after launch (interactive cluster)")


def labels_rule(d: Draft) -> None:
    """Who pays, who launched, which Dagster run and asset, which pool: on every job.

    The door's own labels (``gpudoor-*``, ``dagster-*``) come from the launch context only; a task's
    own values for them are dropped (its cost owner was read into the context before).
    """
    own = {
        str(k): v
        for k, v in (d.resources.get("labels") or {}).items()
        if not str(k).startswith(("gpudoor-", "dagster-"))
    }
    ours = d.ctx.labels()
    if d.ctx.via:
        ours[LABEL_VIA] = label_value(d.ctx.via)
    if any(k.startswith("dagster-") for k in ours):
        if d.injected.sign_key:
            ours[LABEL_SIGNATURE] = identity_signature(ours, d.injected.sign_key)
        elif (signed := (d.resources.get("labels") or {}).get(LABEL_SIGNATURE)) is not None:
            ours[LABEL_SIGNATURE] = str(signed)  # a pass without the key keeps the launcher's; the server checks it
    given = d.resources.get("labels") or {}
    if given.get(LABEL_FINGERPRINT):  # the launcher's: a later pass (the server's) keeps it
        ours[LABEL_FINGERPRINT] = label_value(str(given[LABEL_FINGERPRINT]))
    if d.route.borrowed or d.fleet.sharing.has_quotas(d.route.pool.name):
        ours[LABEL_BORROWED] = "true" if d.route.borrowed else "false"
    d.resources["labels"] = {**own, **ours, LABEL_POOL: label_value(d.route.pool.name)}
    if d.route.quota:
        d.notes.append(f"quota: {d.route.quota}")


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
    """Credentials reach the job as SkyPilot secrets (redacted in logs), never as env.

    A task may ask by name for the secrets the fleet lists (``secrets: {HF_TOKEN: null}``); the value
    comes from the launcher's environment, or from the API server's (``GPUDOOR_POLICY_<NAME>``).
    """
    asked = {str(k): v for k, v in (d.task.get("secrets") or {}).items()}
    allowed = set(d.fleet.secrets) | set(TRANSIT_SECRET_NAMES)
    for name in asked:
        if name not in allowed:
            d.reject(
                f"secrets.{name}",
                f"'{name}' is not a secret jobs may ask for",
                f"use one of {sorted(d.fleet.secrets)}, or ask the fleet's admins to add it to `secrets` in "
                f"{d.fleet.source}",
            )
    filled = {k: v for k, v in asked.items() if v not in (None, "")}
    for name, value in d.injected.secrets.items():
        if not (d.injected.fill_only and filled.get(name)) and value:
            filled[name] = value
    missing = sorted(k for k in asked if k in allowed and not filled.get(k))
    if missing and d.injected.require_secrets:
        d.reject(
            f"secrets.{missing[0]}",
            f"no value for {', '.join(missing)}",
            "set it in the launcher's environment, or as GPUDOOR_POLICY_<NAME> on the API server",
        )
    if filled or asked:
        d.task["secrets"] = {k: filled.get(k) for k in {**asked, **filled}}


RULES: tuple[Callable[[Draft], None], ...] = (
    cost_owner_rule,
    placement_rule,
    priority_class_rule,
    autostop_rule,
    ttl_rule,
    labels_rule,
    env_rule,
    secrets_rule,
)


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
    if d.problems:
        raise LaunchConfigError.combine(d.problems)
    return RuleResult(
        config=d.task,
        injected_env=pool_env(route),
        secret_names=tuple(sorted(d.task.get("secrets") or {})),
        labels=dict(d.resources["labels"]),
        notes=tuple(d.notes),
    )
