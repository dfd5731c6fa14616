"""Fleet rules: what every job gets and what no job may do, whatever cluster it lands on.

One pure function, :func:`apply_fleet_rules`, turns a spec's task config plus its route into the
task that runs: per-pool env, transit credentials as secrets, labels, the production pools' low
priority class, autostop for interactive clusters; and refuses what breaks a rule. The SkyPilot
admin policy runs the same function on the API server; the local backend runs it on the client.
"""

from __future__ import annotations

import copy
import dataclasses
import re
from collections.abc import Mapping
from typing import Any

from gpudoor_pipelines.launch.errors import PolicyRejection
from gpudoor_pipelines.launch.fleet import Fleet, Pool
from gpudoor_pipelines.launch.specs import parse_accelerators

LABEL_COST_OWNER = "gpudoor-cost-owner"
LABEL_POOL = "gpudoor-pool"
LABEL_RUN_ID = "dagster-run-id"
LABEL_ASSET = "dagster-asset"
LABEL_PARTITION = "dagster-partition"
LABEL_USER = "gpudoor-user"
LABEL_INTERACTIVE = "gpudoor-interactive"
LABEL_STEP = "gpudoor-step"
POOL_ENV = "GPUDOOR_POOL"
_LABEL_VALUE = re.compile(r"[^A-Za-z0-9_.-]+")


def label_value(text: str) -> str:
    """Makes a string a valid Kubernetes label value (SkyPilot passes labels on as pod labels)."""
    cleaned = _LABEL_VALUE.sub("-", text).strip("-_.")
    return cleaned[:63].rstrip("-_.") or "none"


@dataclasses.dataclass(frozen=True)
class LaunchContext:
    """Who launches what, for labels and per-user caps.

    Attributes:
        cost_owner: the team account paying for the job (must be in the fleet's ``cost_owners``).
        user: the person, agent or service account launching.
        run_id: the Dagster run id, when launched from Dagster.
        asset: the asset being materialized.
        partition: its partition key.
        step: the step kind (``caption``, ``train``, ...), so a server-side policy can route.
        interactive: a cluster that stays up (demo, dev session): autostop applies.
    """

    cost_owner: str | None
    user: str = "unknown"
    run_id: str | None = None
    asset: str | None = None
    partition: str | None = None
    interactive: bool = False
    step: str | None = None

    def labels(self) -> dict[str, str]:
        """Labels for the job, as Kubernetes-valid values."""
        out = {LABEL_COST_OWNER: self.cost_owner or "", LABEL_USER: self.user}
        if self.run_id:
            out[LABEL_RUN_ID] = self.run_id
        if self.asset:
            out[LABEL_ASSET] = self.asset
        if self.partition:
            out[LABEL_PARTITION] = self.partition
        if self.interactive:
            out[LABEL_INTERACTIVE] = "true"
        if self.step:
            out[LABEL_STEP] = self.step
        return {k: label_value(v) for k, v in out.items()}


@dataclasses.dataclass(frozen=True)
class Usage:
    """GPUs held right now, for cap checks."""

    by_pool: Mapping[str, int] = dataclasses.field(default_factory=dict)
    by_user_pool: Mapping[tuple[str, str], int] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class RuleDecision:
    """What the rules did to a task, for ``gpudoor where`` and launch metadata."""

    config: dict[str, Any]
    pool: Pool
    injected_env: dict[str, str]
    secret_names: tuple[str, ...]
    labels: dict[str, str]
    notes: tuple[str, ...]


def _priority_class_of(config: Mapping[str, Any]) -> str | None:
    # A task file writes it under `config:`; SkyPilot serializes it under resources.
    for overrides in (config.get("config"), (config.get("resources") or {}).get("_cluster_config_overrides")):
        pod = (((overrides or {}).get("kubernetes") or {}).get("pod_config") or {}).get("spec") or {}
        if pod.get("priorityClassName"):
            return pod["priorityClassName"]
    return None


def apply_fleet_rules(
    config: Mapping[str, Any],
    pool: Pool,
    fleet: Fleet,
    ctx: LaunchContext,
    *,
    infra: str | None = None,
    accelerators: str | None = None,
    secrets: Mapping[str, str] | None = None,
    extra_env: Mapping[str, str] | None = None,
    usage: Usage | None = None,
    source: str = "(task)",
) -> RuleDecision:
    """Applies the fleet's rules to one task config bound for ``pool``.

    Args:
        config: the task YAML mapping (not modified).
        pool: the pool the job is going to.
        fleet: the fleet (cost owners).
        ctx: who launches what.
        infra: the infra string to pin (defaults to the pool's).
        accelerators: the ``TYPE:COUNT`` chosen by routing (defaults to the spec's first candidate the pool offers).
        secrets: credentials for the job (transit bucket, logger); passed as SkyPilot secrets.
        extra_env: launcher inputs (input/output URIs, Pipes bootstrap) merged into ``envs``.
        usage: GPUs in use, for caps; no cap check without it.
        source: the spec file, for messages.

    Returns:
        The mutated config and a record of what changed.

    Raises:
        PolicyRejection: a rule refuses the job; the message says what to change.
    """
    out: dict[str, Any] = copy.deepcopy(dict(config))
    notes: list[str] = []

    # Cost owner: every GPU hour is paid by someone the finance sheet knows.
    if not ctx.cost_owner:
        raise PolicyRejection(
            source,
            f"labels.{LABEL_COST_OWNER}",
            "no cost owner",
            f"set the cost owner (one of {list(fleet.cost_owners)})",
        )
    if fleet.cost_owners and ctx.cost_owner not in fleet.cost_owners:
        raise PolicyRejection(
            source,
            f"labels.{LABEL_COST_OWNER}",
            f"unknown cost owner '{ctx.cost_owner}'",
            f"use one of {list(fleet.cost_owners)} or add it to cost_owners in {fleet.source}",
        )

    resources: dict[str, Any] = dict(out.get("resources") or {})
    candidates = parse_accelerators(accelerators or resources.get("accelerators"), source)
    # The pool's own order decides between candidates: SkyPilot keeps them as an unordered set.
    by_name = {g.lower(): (g, n) for g, n in candidates.items()}
    chosen = next((by_name[g.lower()] for g in pool.gpus if g.lower() in by_name), None)
    if chosen is None:
        raise PolicyRejection(
            source,
            "resources.accelerators",
            f"pool '{pool.name}' has no {', '.join(candidates) or 'GPU requested'}",
            f"ask for one of {list(pool.gpus)} or let routing pick another pool",
        )
    gpu, per_node = chosen
    num_nodes = int(out.get("num_nodes") or 1)
    total = per_node * num_nodes
    if num_nodes > 1 and not pool.multi_node:
        raise PolicyRejection(
            source,
            "num_nodes",
            f"pool '{pool.name}' has no multi-node interconnect",
            "use one node or the multi-node pool",
        )
    if total > pool.gpu_cap:
        raise PolicyRejection(
            source,
            "resources.accelerators",
            f"{total} GPUs is over pool '{pool.name}' cap of {pool.gpu_cap}",
            f"ask for at most {pool.gpu_cap} GPUs",
        )
    if total > pool.max_gpus_per_user:
        raise PolicyRejection(
            source,
            "resources.accelerators",
            f"{total} GPUs is over pool '{pool.name}' per-user cap of {pool.max_gpus_per_user}",
            f"ask for at most {pool.max_gpus_per_user} GPUs",
        )
    if usage is not None:
        held = usage.by_pool.get(pool.name, 0)
        if held + total > pool.gpu_cap:
            raise PolicyRejection(
                source,
                "resources.accelerators",
                f"pool '{pool.name}' has {held}/{pool.gpu_cap} GPUs in use and this job asks {total}",
                "wait for jobs to finish, ask for fewer GPUs, or route to another pool",
            )
        mine = usage.by_user_pool.get((ctx.user, pool.name), 0)
        if mine + total > pool.max_gpus_per_user:
            raise PolicyRejection(
                source,
                "resources.accelerators",
                f"user '{ctx.user}' holds {mine} GPUs on '{pool.name}'; with {total} more that is over the per-user cap of {pool.max_gpus_per_user}",
                "wait for your jobs to finish or ask for fewer GPUs",
            )

    # Production pools: research must never evict serving.
    if pool.priority_class:
        asked = _priority_class_of(out)
        if asked not in (None, pool.priority_class):
            raise PolicyRejection(
                source,
                "config.kubernetes.pod_config.spec.priorityClassName",
                f"'{asked}' on production pool '{pool.name}'",
                f"remove it; research jobs on this pool run at priority class '{pool.priority_class}'",
            )
        # Write where the task already keeps its overrides (a re-applied task has them under resources).
        if "_cluster_config_overrides" in resources:
            cfg = resources["_cluster_config_overrides"] = dict(resources["_cluster_config_overrides"] or {})
        else:
            cfg = out.setdefault("config", {})
        pod_spec = cfg.setdefault("kubernetes", {}).setdefault("pod_config", {}).setdefault("spec", {})
        pod_spec["priorityClassName"] = pool.priority_class
        notes.append(f"priority class '{pool.priority_class}' (production pool)")

    resources["infra"] = infra or pool.infra
    resources["accelerators"] = f"{gpu}:{per_node}"
    labels = dict(resources.get("labels") or {})
    labels.update(ctx.labels())
    labels[LABEL_POOL] = label_value(pool.name)
    resources["labels"] = labels
    if ctx.interactive:
        resources.setdefault("autostop", {"idle_minutes": pool.autostop_idle_minutes, "down": True})
        notes.append(f"autostop after {pool.autostop_idle_minutes} idle minutes (interactive cluster)")
    out["resources"] = resources

    injected = dict(pool.env)
    injected[POOL_ENV] = pool.name
    envs = dict(out.get("envs") or {})
    envs.update(extra_env or {})
    envs.update(injected)
    out["envs"] = {k: "" if v is None else str(v) for k, v in envs.items()}

    secret_values = dict(secrets or {})
    if secret_values:
        merged = dict(out.get("secrets") or {}) if isinstance(out.get("secrets"), dict) else {}
        merged.update(secret_values)
        out["secrets"] = merged
    return RuleDecision(
        config=out,
        pool=pool,
        injected_env=injected,
        secret_names=tuple(sorted(secret_values)),
        labels=labels,
        notes=tuple(notes),
    )
