"""``gpudoor where``: where a task spec would run and what the fleet rules would give it."""

from __future__ import annotations

import json

from gpudoor_pipelines.launch.resource import LaunchConfig, SkyPilotResource
from gpudoor_pipelines.transit.resource import bucket_from_env


def explain(
    spec: str,
    *,
    step: str | None = None,
    pool: str | None = None,
    infra: str | None = None,
    cost_owner: str | None = None,
    as_json: bool = False,
) -> str:
    """Resolves ``spec`` as a launch would, without launching, and describes the result.

    Secret values are never shown, only their names.

    Raises:
        LaunchConfigError: the same errors a launch would raise, before anything runs.
    """
    resource = SkyPilotResource(transit=bucket_from_env(), cost_owner=cost_owner)
    tags = {}
    loaded, chosen, decision = resource.resolve(
        spec,
        launch_config=LaunchConfig(pool=pool, infra=infra),
        tags=tags,
        asset="(gpudoor where)",
        step=step,
    )
    envs = decision.config.get("envs", {})
    info = {
        "spec": loaded.path,
        "step": step or loaded.kind,
        "pool": chosen.pool.name,
        "infra": chosen.infra,
        "accelerators": chosen.accelerators,
        "num_nodes": loaded.num_nodes,
        "decided_by": chosen.reason,
        "passed_over": list(chosen.skipped),
        "injected_env": decision.injected_env,
        "task_env": {k: v for k, v in envs.items() if k not in decision.injected_env},
        "secrets": {name: "****" for name in decision.secret_names},
        "labels": decision.labels,
        "policy": list(decision.notes),
        "usd_per_hour_estimate": round(
            chosen.gpus_per_node * loaded.num_nodes * chosen.pool.usd_per_gpu_hour, 4
        ),
    }
    if as_json:
        return json.dumps(info, indent=2)
    lines = [
        f"{loaded.path}",
        f"  pool        : {info['pool']}  ({chosen.pool.description})"
        if chosen.pool.description
        else f"  pool        : {info['pool']}",
        f"  infra       : {info['infra']}",
        f"  GPUs        : {info['accelerators']} x {info['num_nodes']} node(s)  ~${info['usd_per_hour_estimate']}/h",
        f"  decided by  : {info['decided_by']}",
    ]
    for skipped in chosen.skipped:
        lines.append(f"  passed over : {skipped}")
    lines.append("  injected env:")
    lines += [f"    {k}={v}" for k, v in sorted(decision.injected_env.items())]
    if info["secrets"]:
        lines.append("  secrets     : " + ", ".join(f"{k}=****" for k in sorted(info["secrets"])))
    lines.append("  labels      : " + ", ".join(f"{k}={v}" for k, v in sorted(decision.labels.items())))
    for note in decision.notes:
        lines.append(f"  policy      : {note}")
    return "\n".join(lines)
