"""The fleet's SkyPilot admin policy: the same route and rules as the client, with the server's authority.

Enable it on the API server (and on clients) with one line of SkyPilot config::

    admin_policy: gpudoor_pipelines.launch.server.policy.GpuDoorPolicy

Every task launched through the server, by the Dagster pipeline, a person or an agent, is checked by
:func:`~gpudoor_pipelines.launch.resolve.specs.task_problems`, routed by
:func:`~gpudoor_pipelines.launch.resolve.routing.route` and rewritten by
:func:`~gpudoor_pipelines.launch.resolve.rules.apply_rules`, exactly as the launcher does on the client, with
every problem reported at once:
per-pool env, labels, the production pools' low priority class, autostop for interactive
clusters, and the size checks; a refusal says what to change. Who launches what comes back out of
the task's labels through :meth:`LaunchContext.from_labels`; nothing is rebuilt by hand. What only
the server may do (inject its own transit credentials, trust its own user name) happens only when
the policy does not run ``at_client_side``.

The policy runs wherever ``sky`` runs (the API server), so this module imports ``sky`` at import
time; nothing else in the package imports it that way.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from gpudoor_pipelines.launch import sky_env

sky_env.prepare()
import sky  # noqa: E402
from sky.server.requests.request_names import AdminPolicyRequestName  # noqa: E402

from gpudoor_pipelines.launch.errors import LaunchConfigError, PoolFull  # noqa: E402
from gpudoor_pipelines.launch.labels import (  # noqa: E402
    INTERACTIVE_PREFIXES,
    LABEL_BORROWED,
    LABEL_KEY_ENV,
    LABEL_POOL,
    STEP_CLUSTER_PREFIX,
    TRANSIT_SECRET_NAMES,
)
from gpudoor_pipelines.launch.resolve.fleet import Fleet, load_fleet, normalize_infra  # noqa: E402
from gpudoor_pipelines.launch.resolve.routing import route  # noqa: E402
from gpudoor_pipelines.launch.resolve.rules import (  # noqa: E402
    Injected,
    LaunchContext,
    apply_rules,
    identity_verified,
    without_identity,
)
from gpudoor_pipelines.launch.resolve.specs import TaskSpec, parse_accelerators, task_infra, task_problems  # noqa: E402
from gpudoor_pipelines.launch.resolve.usage import Usage  # noqa: E402

#: Requests SkyPilot makes for its own controllers: not user jobs.
CONTROLLER_REQUESTS = (AdminPolicyRequestName.JOBS_LAUNCH_CONTROLLER, AdminPolicyRequestName.SERVE_LAUNCH_CONTROLLER)
#: Environment of the API server holding credentials injected into every job as secrets.
SECRET_ENV_VARS = TRANSIT_SECRET_NAMES
#: Non-secret transit settings copied from the API server's environment into every job.
TRANSIT_ENV_VARS = ("AWS_ENDPOINT_URL", "AWS_REGION", "AWS_DEFAULT_REGION")
_POLICY_ENV_PREFIX = "GPUDOOR_POLICY_"


#: The deployment's key for the run identity on jobs (``GPUDOOR_POLICY_LABEL_KEY`` on the API server).
LABEL_KEY_NAME = "LABEL_KEY"


def _server_values(names: tuple[str, ...]) -> dict[str, str]:
    """``GPUDOOR_POLICY_<NAME>`` from the policy's environment, as ``<NAME>``."""
    return {name: os.environ[_POLICY_ENV_PREFIX + name] for name in names if os.environ.get(_POLICY_ENV_PREFIX + name)}


def task_config(task: sky.Task, source: str) -> dict[str, Any]:
    """A ``sky.Task`` as the YAML mapping a task file holds (SkyPilot's own serialization).

    A GPU set comes back as ``any_of`` candidates, which routing reads as a set again; a task's
    ``config:`` comes back as ``resources._cluster_config_overrides`` and is folded back, so the
    rules see one shape whether they run on a task file (client) or on a task SkyPilot rebuilt (server).
    """
    config = task.to_yaml_config()
    resources = dict(config.get("resources") or {})
    key = "any_of" if "any_of" in resources else "ordered" if "ordered" in resources else None
    if key:
        # SkyPilot writes every field into every candidate; what they all share goes back to the top.
        entries = [dict(e) for e in resources[key]]
        shared = {k: v for k, v in entries[0].items() if all(k in e and e[k] == v for e in entries[1:])}
        resources.update(shared)
        resources[key] = [{k: v for k, v in e.items() if k not in shared} for e in entries]
        if len(entries) == 1:
            resources.pop(key)
        if not any(resources.get(key) or ()):
            resources.pop(key, None)
    if _only_tpus(resources) and "/" not in str(resources.get("infra", "/")):
        resources.pop("infra")  # SkyPilot names a cloud for a TPU itself; the task did not
    overrides = resources.pop("_cluster_config_overrides", None)
    if overrides:
        config["config"] = {**(config.get("config") or {}), **overrides}
    config["resources"] = resources
    return config


def _only_tpus(resources: dict[str, Any]) -> bool:
    entries = [resources, *(resources.get("any_of") or resources.get("ordered") or ())]
    names = [str(g) for e in entries for g in parse_accelerators(e.get("accelerators"))]
    return bool(names) and all(n.lower().startswith("tpu-") for n in names)


def back_on_its_pool(config: dict[str, Any], fleet: Fleet) -> dict[str, Any]:
    """A managed job's cluster relaunched after a preemption, asked for where its pool is.

    SkyPilot's ``FAILOVER`` recovery first relaunches a job's cluster in the region it ran in: its
    launched cloud and region, the zone dropped (``slurm/<cluster>``, no partition). Where the fleet's
    pools are zones (Slurm partitions), no pool is that whole region: the rules would refuse the launch,
    and SkyPilot would try it again three times, a minute or more apart, before it relaunched as the job
    was first launched. The job's pool (its ``gpudoor-pool`` label, set when the job was admitted) is in
    that region: the relaunch goes back onto that pool's infra, which is what "the same region first"
    means for the fleet. It is done on every pass of the rules (the controller's own client-side pass,
    the server's validation, the launch); a region without such a label is still refused.
    """
    resources = config.get("resources") or {}
    infra = resources.get("infra")
    pool = fleet.pools.get(str((resources.get("labels") or {}).get(LABEL_POOL) or ""))
    if not infra or pool is None or fleet.pool_for_infra(str(infra)) is not None:
        return config
    if not normalize_infra(pool.infra).startswith(normalize_infra(str(infra)) + "/"):
        return config
    return {**config, "resources": {**resources, "infra": pool.infra}}


def mutate_config(
    config: dict[str, Any],
    fleet: Fleet,
    *,
    interactive: bool = False,
    session: bool = False,
    user: str | None = None,
    at_client_side: bool = False,
    source: str = "(request)",
    usage: Usage | None = None,
) -> dict[str, Any]:
    """Checks a task's YAML mapping, routes it and applies the fleet rules, as the admin policy does.

    The same checks as the launcher and ``gpudoor where``, all problems at once. Pure apart from
    reading the server's credentials from the environment (server side only). With ``usage`` (what
    unfinished jobs hold now), the pool's and the user's caps and the cost owners' quotas count it; a pass
    without it (the client's, the jobs controller's launch of the job's own cluster) keeps the verdict of the
    pass that counted: a job labelled borrowed stays borrowed. ``session``: a ``dev-…``/``lab-…`` cluster,
    held to the pool's ``max_interactive_gpus``.

    Raises:
        PoolFull: the job fits its pool, but not with what is held now.
        LaunchConfigError: the request is refused (the policy turns it into a rejection).
    """
    config = back_on_its_pool(config, fleet)
    resources = config.get("resources") or {}
    labels = {str(k): str(v) for k, v in (resources.get("labels") or {}).items()}
    if at_client_side:
        sign_key = os.environ.get(LABEL_KEY_ENV) or None
    else:
        # Who launched comes from the server's authenticated user (``user``); which Dagster run, only from
        # labels signed with the deployment's key. Anything else a task claims is dropped, never kept.
        sign_key = _server_values((LABEL_KEY_NAME,)).get(LABEL_KEY_NAME)
        if not (sign_key and identity_verified(labels, sign_key)):
            labels = without_identity(labels)
    ctx = LaunchContext.from_labels(labels, user=user, interactive=interactive)
    # A task from the door's launcher carries input URIs the launcher filled in; it checked the file itself.
    problems = task_problems(config, source, launcher_inputs=ctx.via in ("launcher", "policy"), from_file=False)
    spec = TaskSpec(path=source, kind=str(config.get("name") or "task"), config=config)
    # What the launcher does for a task file that names no cost owner; the task is now checked by the policy.
    ctx = dataclasses.replace(
        ctx, cost_owner=ctx.cost_owner or fleet.default_cost_owner or None, via=ctx.via or "policy"
    )
    infra = task_infra(resources, source, fleet, problems)
    # Two pools may share one cluster: the pool the client routed to, when it owns the infra, stays.
    pool = fleet.pools.get(labels.get(LABEL_POOL, ""))
    where = dict(
        step=ctx.step,
        infra=infra,
        pool=pool.name if pool and infra and pool.owns_infra(infra) else None,
        user=ctx.user,
        owner=ctx.cost_owner,
        session=session,
        infra_field=(source, "resources.infra"),
    )
    try:
        chosen = route(spec, fleet, usage=usage, **where)
    except LaunchConfigError as e:
        if usage is not None and not problems:
            try:
                fits = route(spec, fleet, **where)
            except LaunchConfigError:
                fits = None
            if fits is not None:  # it fits its pool, only not with what is held now
                raise PoolFull(fits.pool.name, source, "resources.accelerators", e.problem, e.fix) from None
        raise LaunchConfigError.combine([*problems, e]) from None
    if usage is None and labels.get(LABEL_BORROWED) == "true" and not chosen.borrowed:
        chosen = dataclasses.replace(chosen, borrowed=True)
    injected = Injected(sign_key=sign_key)
    if not at_client_side:  # only the server holds these; a client-side pass leaves them to it
        secrets = {**_server_values(SECRET_ENV_VARS), **_server_values(tuple(fleet.secrets))}
        injected = Injected(
            env=_server_values(TRANSIT_ENV_VARS),
            secrets=secrets,
            fill_only=True,
            require_secrets=True,
            sign_key=sign_key,
        )
    try:
        mutated = apply_rules(config, chosen, ctx, fleet, injected, source=source).config
    except LaunchConfigError as e:
        problems.append(e)
    if problems:
        raise LaunchConfigError.combine(problems)
    return mutated


def server_usage() -> Usage | None:
    """What unfinished managed jobs and warm pools hold now, read in the API server's own process.

    With the jobs controller in consolidation mode (it runs inside the API server), its tables are the
    server's: one database read, milliseconds, no request. Pending jobs count too, from the task they
    were launched with: they hold nothing yet, but a burst of launches must not all pass the cap
    before the first one starts. None where the jobs controller runs apart (its tables are on its own
    machine): then only the launcher counts live usage.
    """
    from sky.jobs import utils as managed_job_utils

    from gpudoor_pipelines.launch.backends.sky_records import clusters_held, job_held, pool_workers_held

    if not managed_job_utils.is_consolidation_mode():
        return None
    queue = managed_job_utils.get_managed_job_queue(skip_finished=True, fields=list(_SERVER_QUEUE_FIELDS))
    held = [row for r in queue.get("jobs") or () if (row := job_held(r, launched_task_too=True)) is not None]
    held.extend(pool_workers_held(_warm_pools()))
    held.extend(clusters_held(_step_clusters()))
    return Usage.tally(held)


_SERVER_QUEUE_FIELDS = ("job_id", "status", "labels", "accelerators", "resources", "user_yaml", "task_id", "pool")


def _warm_pools() -> list[dict[str, Any]]:
    """Every warm pool's record, as ``sky.jobs.pool_status`` gives it, read in the server's process."""
    from sky.serve import serve_state, serve_utils

    out = []
    for name in serve_state.get_glob_service_names(None):
        record = serve_utils._get_service_status(name, pool=True, with_replica_info=False)  # noqa: SLF001 - no public in-process form
        if record is not None:
            out.append(record)
    return out


def _step_clusters() -> list[dict[str, Any]]:
    """The door's step clusters (``gpudoor-step-…``), as the server's cluster table has them."""
    from sky import global_user_state

    return [
        r
        for r in global_user_state.get_clusters(exclude_managed_clusters=True)
        if str(r.get("name") or "").startswith(STEP_CLUSTER_PREFIX)
    ]


def _onto_warm_pool() -> bool:
    """Whether the managed-job launch being checked goes onto a warm pool (``sky.jobs.launch(pool=...)``):
    its jobs run on the pool's workers, whose GPUs were counted when the pool was made. The policy is
    not told; the request's own body, in the server's request table, says."""
    from sky.server.requests import requests as api_requests
    from sky.utils import common_utils

    try:
        request = api_requests.get_request(common_utils.get_current_request_id(), fields=["request_body"])
    except Exception:  # noqa: BLE001 - unknown: the launch is held to the caps, which is the safe side
        return False
    return bool(getattr(getattr(request, "request_body", None), "pool", None))


def _held_to_caps(user_request: sky.UserRequest) -> bool:
    """A managed-job launch, or the launch of a door step cluster (a step the fleet launches as a cluster)."""
    if user_request.request_name == AdminPolicyRequestName.JOBS_LAUNCH:
        return True
    return user_request.request_name == AdminPolicyRequestName.CLUSTER_LAUNCH and _cluster_name(
        user_request
    ).startswith(STEP_CLUSTER_PREFIX)


def _cluster_name(user_request: sky.UserRequest) -> str:
    return getattr(user_request.request_options, "cluster_name", None) or ""


def _live_usage(user_request: sky.UserRequest, fleet: Fleet) -> Usage | None:
    """What is held now, for the caps of a managed-job launch checked on the server; None for anything
    else (clusters, pools, a job's own relaunch after a preemption, a check on the client).

    Raises:
        LaunchConfigError: the fleet says the server counts live usage (``live_caps: server``) and it
            cannot (its jobs controller is not in consolidation mode).
    """
    if user_request.at_client_side or not _held_to_caps(user_request):
        return None
    usage = server_usage()
    if usage is not None and _onto_warm_pool():
        return None
    if usage is None and fleet.live_caps == "server":
        raise LaunchConfigError(
            fleet.source,
            "live_caps",
            "the API server cannot count what is held: its jobs controller does not run in consolidation mode",
            "set live_caps: launcher, or run the jobs controller "
            "in consolidation mode (jobs.controller.consolidation_mode: true)",
        )
    return usage


class GpuDoorPolicy(sky.AdminPolicy):
    """The fleet rules as a SkyPilot admin policy (see the module docstring).

    The fleet file is ``$GPUDOOR_FLEET_FILE`` or the package's ``task_specs/fleet.yaml``.
    """

    @classmethod
    def validate_and_mutate(cls, user_request: sky.UserRequest) -> sky.MutatedUserRequest:
        """Rewrites the task with the fleet rules, or rejects it saying what to change."""
        if user_request.request_name in CONTROLLER_REQUESTS:
            return sky.MutatedUserRequest(user_request.task, user_request.skypilot_config)
        task = user_request.task
        cluster_name = _cluster_name(user_request)
        source = f"task '{task.name}'" if task.name else "the unnamed task"
        try:
            fleet = load_fleet(os.environ.get("GPUDOOR_FLEET_FILE"))
            mutated = mutate_config(
                task_config(task, source),
                fleet,
                # A cluster is interactive (autostop, a time to live), unless it is a door step cluster.
                interactive=(
                    user_request.request_name == AdminPolicyRequestName.CLUSTER_LAUNCH
                    and not cluster_name.startswith(STEP_CLUSTER_PREFIX)
                )
                or cluster_name.startswith(INTERACTIVE_PREFIXES),
                session=cluster_name.startswith(INTERACTIVE_PREFIXES),
                user=None if user_request.at_client_side or not user_request.user else user_request.user.name,
                at_client_side=user_request.at_client_side,
                source=source,
                usage=_live_usage(user_request, fleet),
            )
        except PoolFull as e:
            raise sky.exceptions.UserRequestRejectedByPolicy(e.refusal()) from None
        except LaunchConfigError as e:
            raise sky.exceptions.UserRequestRejectedByPolicy(str(e)) from None
        new_task = sky.Task.from_yaml_config(mutated)
        new_task.workdir = task.workdir
        return sky.MutatedUserRequest(task=new_task, skypilot_config=user_request.skypilot_config)
