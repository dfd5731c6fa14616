"""The fleet's SkyPilot admin policy: one policy that makes every cluster look the same.

Enable it on the API server (and on clients) with one line of SkyPilot config::

    admin_policy: gpudoor_pipelines.launch.policy.GpuDoorPolicy

Every task launched through the server, by the Dagster pipeline, a person or an agent, is rewritten
by :func:`gpudoor_pipelines.launch.rules.apply_fleet_rules` — the same rules the local backend
applies on the client: per-pool env (cache dir, checkpoints dir, bucket prefix), transit
credentials as secrets, labels (cost owner, Dagster run, asset, partition), the low priority
class on production Kubernetes pools, autostop for interactive clusters, and the GPU caps. It
refuses, with a message that says what to change: a missing or unknown cost owner, a GPU type the
pool does not have, a request over a cap, a production pool without its low priority.

The policy runs wherever ``sky`` runs (the API server), so this module imports ``sky`` at import
time; nothing else in the package imports it.
"""

from __future__ import annotations

import os
from typing import Any

from gpudoor_pipelines.launch import sky_env

sky_env.prepare()
import sky  # noqa: E402

from gpudoor_pipelines.launch.errors import LaunchConfigError  # noqa: E402
from gpudoor_pipelines.launch.fleet import Fleet, load_fleet  # noqa: E402
from gpudoor_pipelines.launch.routing import route  # noqa: E402
from gpudoor_pipelines.launch.rules import (  # noqa: E402
    LABEL_ASSET,
    LABEL_COST_OWNER,
    LABEL_PARTITION,
    LABEL_RUN_ID,
    LABEL_STEP,
    LaunchContext,
    apply_fleet_rules,
)
from gpudoor_pipelines.launch.specs import TaskSpec  # noqa: E402

#: Cluster-name prefixes of interactive clusters (demos, dev sessions): autostop applies.
INTERACTIVE_PREFIXES = ("lab-", "dev-")
#: Environment of the API server holding credentials injected into every job as secrets.
SECRET_ENV_VARS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")
#: Non-secret transit settings copied from the API server's environment into every job.
TRANSIT_ENV_VARS = ("AWS_ENDPOINT_URL", "AWS_REGION", "AWS_DEFAULT_REGION")
_POLICY_ENV_PREFIX = "GPUDOOR_POLICY_"


def _server_values(names: tuple[str, ...]) -> dict[str, str]:
    """``GPUDOOR_POLICY_<NAME>`` from the policy's environment, as ``<NAME>``."""
    out = {}
    for name in names:
        value = os.environ.get(_POLICY_ENV_PREFIX + name)
        if value:
            out[name] = value
    return out


def _infra_of(resources: dict[str, Any]) -> str | None:
    if resources.get("infra"):
        return str(resources["infra"])
    cloud = resources.get("cloud")
    if cloud:
        return "/".join(str(x) for x in (cloud, resources.get("region"), resources.get("zone")) if x)
    return None


def _single_resources(config: dict[str, Any], source: str) -> dict[str, Any]:
    """Folds SkyPilot's ``any_of`` candidates that differ only by GPU back into one accelerator set.

    ``accelerators: {L4: 1, H100: 1}`` serializes as ``any_of``; routing picks one of them.
    """
    resources = dict(config.get("resources") or {})
    if "ordered" in resources:
        raise LaunchConfigError(source, "resources.ordered", "ordered candidates are not routed", "list the GPUs under accelerators instead")
    candidates = resources.pop("any_of", None)
    if candidates:
        accelerators: dict[str, Any] = {}
        rest: list[dict[str, Any]] = []
        for cand in candidates:
            cand = dict(cand)
            accel = cand.pop("accelerators", None)
            if isinstance(accel, dict):
                accelerators.update(accel)
            elif accel:
                name, _, count = str(accel).partition(":")
                accelerators[name] = int(count or 1)
            rest.append(cand)
        if any(r != rest[0] for r in rest):
            raise LaunchConfigError(
                source, "resources.any_of", "candidates differ in more than their GPU", "ask for one resource set; list GPU alternatives under accelerators"
            )
        resources.update(rest[0])
        resources["accelerators"] = accelerators
    config["resources"] = resources
    return resources


def mutate_config(
    config: dict[str, Any],
    fleet: Fleet,
    *,
    request_name: str,
    user: str | None,
    cluster_name: str | None = None,
    source: str = "(request)",
) -> dict[str, Any]:
    """Applies the fleet rules to a task's YAML mapping, as the admin policy does.

    Pure apart from reading the policy's credentials from the environment; used by the policy and
    by tests.

    Raises:
        LaunchConfigError: a rule refuses the request (the policy turns it into a rejection).
    """
    resources = _single_resources(config, source)
    labels = {str(k): str(v) for k, v in (resources.get("labels") or {}).items()}
    infra = _infra_of(resources)
    if infra:
        pool = fleet.pool_for_infra(infra)
        if pool is None:
            raise LaunchConfigError(
                source, "resources.infra", f"'{infra}' is not a pool of the fleet", f"use one of {[p.infra for p in fleet.pools.values()]}"
            )
        accelerators = None
    else:
        spec = TaskSpec(path=source, kind=labels.get(LABEL_STEP) or str(config.get("name") or ""), config=config)
        chosen = route(spec, fleet, step=labels.get(LABEL_STEP))
        pool, infra, accelerators = chosen.pool, chosen.infra, chosen.accelerators
    interactive = request_name in ("sky.launch", "cluster launch") or bool(
        cluster_name and cluster_name.startswith(INTERACTIVE_PREFIXES)
    )
    ctx = LaunchContext(
        cost_owner=labels.get(LABEL_COST_OWNER),
        user=user or labels.get("gpudoor-user") or "unknown",
        run_id=labels.get(LABEL_RUN_ID),
        asset=labels.get(LABEL_ASSET),
        partition=labels.get(LABEL_PARTITION),
        interactive=interactive,
        step=labels.get(LABEL_STEP),
    )
    decision = apply_fleet_rules(
        config,
        pool,
        fleet,
        ctx,
        infra=infra,
        accelerators=accelerators,
        secrets=_server_values(SECRET_ENV_VARS),
        extra_env={k: v for k, v in _server_values(TRANSIT_ENV_VARS).items() if k not in (config.get("envs") or {})},
        source=source,
    )
    return decision.config


class GpuDoorPolicy(sky.AdminPolicy):
    """The fleet rules as a SkyPilot admin policy (see the module docstring).

    The fleet file is ``$GPUDOOR_FLEET_FILE`` or the package's ``task_specs/fleet.yaml``.
    """

    @classmethod
    def validate_and_mutate(cls, user_request: sky.UserRequest) -> sky.MutatedUserRequest:
        """Rewrites the task with the fleet rules, or rejects it saying what to change."""
        request_name = str(getattr(user_request.request_name, "value", user_request.request_name))
        # Requests SkyPilot makes for its own controllers are not user jobs.
        if request_name.endswith("launch_controller"):
            return sky.MutatedUserRequest(user_request.task, user_request.skypilot_config)
        task = user_request.task
        config = task.to_yaml_config()
        options = user_request.request_options
        user = getattr(user_request.user, "name", None) if user_request.user else None
        try:
            fleet = load_fleet(os.environ.get("GPUDOOR_FLEET_FILE"))
            mutated = mutate_config(
                config,
                fleet,
                request_name=request_name,
                user=user,
                cluster_name=getattr(options, "cluster_name", None) if options else None,
                source=f"task '{task.name}'",
            )
        except LaunchConfigError as e:
            raise sky.exceptions.UserRequestRejectedByPolicy(str(e)) from None
        new_task = sky.Task.from_yaml_config(mutated)
        new_task.workdir = task.workdir
        return sky.MutatedUserRequest(task=new_task, skypilot_config=user_request.skypilot_config)
