"""``gpudoor where``: where a task spec would run and what the fleet rules would give it."""

from __future__ import annotations

import contextlib
import json
import sys

from gpudoor_pipelines.launch.config import launching_user, settings_from_env
from gpudoor_pipelines.launch.launcher import Launcher
from gpudoor_pipelines.launch.resolve.request import LaunchRequest
from gpudoor_pipelines.launch.resolve.specs import load_spec
from gpudoor_pipelines.transit import uris


def explain(
    spec: str,
    *,
    step: str | None = None,
    pool: str | None = None,
    infra: str | None = None,
    cost_owner: str | None = None,
    as_json: bool = False,
    fleet_file: str | None = None,
    env: dict[str, str] | None = None,
) -> str:
    """Resolves ``spec`` exactly as a launch would (the same :func:`resolve`), without launching.

    Secret values are never shown, only their names.

    Raises:
        LaunchConfigError: the same errors a launch would raise, before anything runs.
    """
    # The settings a launch reads (``gpudoor launch``, the code location's resources), without Dagster.
    settings = settings_from_env(fleet_file=fleet_file)
    bucket = uris.open_bucket(**uris.settings_from_env())
    # SkyPilot may print while it parses; with --json, stdout carries the JSON answer only.
    with contextlib.redirect_stdout(sys.stderr) if as_json else contextlib.nullcontext():
        request = LaunchRequest(
            spec=load_spec(spec, settings.specs_dir, skypilot=True, strict=False),
            inputs=bucket.job_env(),
            secrets=bucket.job_secrets(),
            env=dict(env or {}),
            pool=pool,
            infra=infra,
            cost_owner=cost_owner,
            default_cost_owner=settings.cost_owner,
            user=launching_user(settings),
            asset="(gpudoor where)",
            step=step,
        )
        # As a launch weighs it (budgets, where it would start soonest), but without what is held: an answer
        # from the file and the cluster's availability, never a refusal for a full pool.
        launcher = Launcher.from_settings(settings)
        job = launcher.resolve(request, launcher.ahead(request, usage=False))
    route = job.route
    assert route is not None
    envs = job.config.get("envs", {})
    ports = job.config.get("resources", {}).get("ports")
    info = {
        "spec": request.spec.path,
        "step": job.labels.get("gpudoor-step"),
        "pool": route.pool.name,
        "infra": route.infra,
        "accelerators": route.accelerators,
        "vcpus": route.vcpus_per_node or None,
        "use_spot": route.use_spot,
        "ports": [str(p) for p in (ports if isinstance(ports, list) else [] if ports is None else [ports])],
        "cost_owner": job.labels.get("gpudoor-cost-owner"),
        "num_nodes": route.num_nodes,
        "decided_by": route.reason,
        "passed_over": list(route.skipped),
        "injected_env": job.pool_env,
        "task_env": {k: v for k, v in envs.items() if k not in job.pool_env},
        "secrets": {name: "****" for name in job.secret_names},
        "labels": job.labels,
        "policy": list(job.notes),
        "usd_per_hour_estimate": round(route.usd_per_hour, 4),
        "fingerprint": job.fingerprint,
        "quota": route.quota or None,
        "borrowed": route.borrowed,
        "budget": None if job.budget is None else job.budget.left(),
        "warning": None if job.budget is None else job.budget.warning,
    }
    if as_json:
        return json.dumps(info, indent=2)
    lines = [
        f"{request.spec.path}",
        f"  pool        : {info['pool']}" + (f"  ({route.pool.description})" if route.pool.description else ""),
        f"  infra       : {info['infra']}",
        f"  {'GPUs' if route.accelerator else 'CPUs'}        : {route.describe()}  ~${info['usd_per_hour_estimate']}/h",
        f"  decided by  : {info['decided_by']}",
    ]
    if info["ports"]:
        lines.append(f"  ports       : {', '.join(info['ports'])}")
    lines.append(f"  cost owner  : {job.labels.get('gpudoor-cost-owner')}")
    if route.quota:
        lines.append(f"  quota       : {route.quota}")
    if job.budget is not None:
        lines.append(f"  budget      : {job.budget.warning or job.budget.left()}")
    lines.append(f"  fingerprint : {job.fingerprint}")
    lines += [f"  passed over : {skipped}" for skipped in route.skipped]
    lines.append("  injected env:")
    lines += [f"    {k}={v}" for k, v in sorted(job.pool_env.items())]
    if info["secrets"]:
        lines.append("  secrets     : " + ", ".join(f"{k}=****" for k in sorted(info["secrets"])))
    lines.append("  labels      : " + ", ".join(f"{k}={v}" for k, v in sorted(job.labels.items())))
    lines += [f"  policy      : {note}" for note in job.notes]
    return "\n".join(lines)
