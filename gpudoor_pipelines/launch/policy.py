"""The fleet's SkyPilot admin policy: the same route and rules as the client, with the server's authority.

Enable it on the API server (and on clients) with one line of SkyPilot config::

    admin_policy: gpudoor_pipelines.launch.policy.GpuDoorPolicy

Every task launched through the server, by the Dagster pipeline, a person or an agent, is routed by
:func:`~gpudoor_pipelines.launch.routing.route` and rewritten by
:func:`~gpudoor_pipelines.launch.rules.apply_rules`, exactly as the launcher does on the client:
per-pool env, labels, the production pools' low priority class, autostop for interactive
clusters, and the size checks; a refusal says what to change. Who launches what comes back out of
the task's labels through :meth:`LaunchContext.from_labels`; nothing is rebuilt by hand. What only
the server may do (inject its own transit credentials, trust its own user name) happens only when
the policy does not run ``at_client_side``.

The policy runs wherever ``sky`` runs (the API server), so this module imports ``sky`` at import
time; nothing else in the package imports it that way.
"""

from __future__ import annotations

import os
from typing import Any

from gpudoor_pipelines.launch import sky_env

sky_env.prepare()
import sky  # noqa: E402
from sky.server.requests.request_names import AdminPolicyRequestName  # noqa: E402

from gpudoor_pipelines.launch.errors import LaunchConfigError  # noqa: E402
from gpudoor_pipelines.launch.fleet import Fleet, load_fleet  # noqa: E402
from gpudoor_pipelines.launch.routing import route  # noqa: E402
from gpudoor_pipelines.launch.rules import LABEL_POOL, Injected, LaunchContext, apply_rules  # noqa: E402
from gpudoor_pipelines.launch.specs import TaskSpec, parse_accelerators  # noqa: E402

#: Cluster-name prefixes of interactive clusters (demos, dev sessions): autostop applies.
INTERACTIVE_PREFIXES = ("lab-", "dev-")
#: Requests SkyPilot makes for its own controllers: not user jobs.
CONTROLLER_REQUESTS = (AdminPolicyRequestName.JOBS_LAUNCH_CONTROLLER, AdminPolicyRequestName.SERVE_LAUNCH_CONTROLLER)
#: Environment of the API server holding credentials injected into every job as secrets.
SECRET_ENV_VARS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")
#: Non-secret transit settings copied from the API server's environment into every job.
TRANSIT_ENV_VARS = ("AWS_ENDPOINT_URL", "AWS_REGION", "AWS_DEFAULT_REGION")
_POLICY_ENV_PREFIX = "GPUDOOR_POLICY_"


def _server_values(names: tuple[str, ...]) -> dict[str, str]:
    """``GPUDOOR_POLICY_<NAME>`` from the policy's environment, as ``<NAME>``."""
    return {name: os.environ[_POLICY_ENV_PREFIX + name] for name in names if os.environ.get(_POLICY_ENV_PREFIX + name)}


def _infra_of(resources: dict[str, Any]) -> str | None:
    if resources.get("infra"):
        return str(resources["infra"])
    cloud = resources.get("cloud")
    return "/".join(str(x) for x in (cloud, resources.get("region"), resources.get("zone")) if x) if cloud else None


def task_config(task: sky.Task, source: str) -> dict[str, Any]:
    """A ``sky.Task`` as the YAML mapping a task file holds: the inverse of SkyPilot's own serialization.

    SkyPilot writes ``accelerators: {L4: 1, H100: 1}`` back as ``any_of`` candidates and a task's
    ``config:`` as ``resources._cluster_config_overrides``; both are folded back, so the rules see
    one shape whether they run on a task file (client) or on a task SkyPilot rebuilt (server).
    """
    config = task.to_yaml_config()
    resources = dict(config.get("resources") or {})
    if "ordered" in resources:
        raise LaunchConfigError(source, "resources.ordered", "ordered candidates are not routed", "list the GPUs under accelerators instead")
    candidates = [dict(c) for c in resources.pop("any_of", None) or ()]
    if candidates:
        accelerators = {g: n for c in candidates for g, n in parse_accelerators(c.pop("accelerators", None), source).items()}
        if any(c != candidates[0] for c in candidates):
            raise LaunchConfigError(source, "resources.any_of", "candidates differ in more than their GPU",
                                    "ask for one resource set; list GPU alternatives under accelerators")  # fmt: skip
        resources.update(candidates[0])
        if accelerators:
            resources["accelerators"] = accelerators
    overrides = resources.pop("_cluster_config_overrides", None)
    if overrides:
        config["config"] = {**(config.get("config") or {}), **overrides}
    config["resources"] = resources
    return config


def mutate_config(
    config: dict[str, Any],
    fleet: Fleet,
    *,
    interactive: bool = False,
    user: str | None = None,
    at_client_side: bool = False,
    source: str = "(request)",
) -> dict[str, Any]:
    """Routes a task's YAML mapping and applies the fleet rules, as the admin policy does.

    Pure apart from reading the server's credentials from the environment (server side only).

    Raises:
        LaunchConfigError: routing or a rule refuses the request (the policy turns it into a rejection).
    """
    resources = config.get("resources") or {}
    labels = {str(k): str(v) for k, v in (resources.get("labels") or {}).items()}
    ctx = LaunchContext.from_labels(labels, user=user, interactive=interactive)
    spec = TaskSpec(path=source, kind=ctx.step or str(config.get("name") or ""), config=config)
    infra = _infra_of(resources)
    # Two pools may share one cluster: the pool the client routed to, when it owns the infra, stays.
    pool = fleet.pools.get(labels.get(LABEL_POOL, ""))
    chosen = route(spec, fleet, step=ctx.step, infra=infra, pool=pool.name if pool and infra and pool.owns_infra(infra) else None, user=ctx.user)
    injected = Injected()
    if not at_client_side:  # only the server holds these; a client-side pass leaves them to it
        injected = Injected(env=_server_values(TRANSIT_ENV_VARS), secrets=_server_values(SECRET_ENV_VARS), fill_only=True)
    return apply_rules(config, chosen, ctx, fleet, injected, source=source).config


class GpuDoorPolicy(sky.AdminPolicy):
    """The fleet rules as a SkyPilot admin policy (see the module docstring).

    The fleet file is ``$GPUDOOR_FLEET_FILE`` or the package's ``task_specs/fleet.yaml``.
    """

    @classmethod
    def validate_and_mutate(cls, user_request: sky.UserRequest) -> sky.MutatedUserRequest:
        """Rewrites the task with the fleet rules, or rejects it saying what to change."""
        if user_request.request_name in CONTROLLER_REQUESTS:
            return sky.MutatedUserRequest(user_request.task, user_request.skypilot_config)
        task, options = user_request.task, user_request.request_options
        cluster_name = getattr(options, "cluster_name", None) or ""
        source = f"task '{task.name}'"
        try:
            mutated = mutate_config(
                task_config(task, source),
                load_fleet(os.environ.get("GPUDOOR_FLEET_FILE")),
                interactive=user_request.request_name == AdminPolicyRequestName.CLUSTER_LAUNCH
                or cluster_name.startswith(INTERACTIVE_PREFIXES),
                user=None if user_request.at_client_side or not user_request.user else user_request.user.name,
                at_client_side=user_request.at_client_side,
                source=source,
            )
        except LaunchConfigError as e:
            raise sky.exceptions.UserRequestRejectedByPolicy(str(e)) from None
        new_task = sky.Task.from_yaml_config(mutated)
        new_task.workdir = task.workdir
        return sky.MutatedUserRequest(task=new_task, skypilot_config=user_request.skypilot_config)
