"""The rules page's refusals: every way the door refuses a launch, the field it names, and the fix."""

from __future__ import annotations

from gpudoor_pipelines.cli.markdown import codes, table
from gpudoor_pipelines.launch.resolve.fleet import Fleet, Pool

#: The needs of a job that not every pool can meet: SkyPilot's feature name, and what in a task asks for it.
NEEDS = (
    ("open_ports", "`ports`"),
    ("spot_instance", "`use_spot: true`"),
    ("multi-node", "`num_nodes` > 1"),
    ("docker_image", "`image_id: docker:…`"),
)


def missing_needs(pool: Pool) -> dict[str, str]:
    """What ``pool`` cannot provide among :data:`NEEDS`, with the reason (SkyPilot's table, the pool's interconnect)."""
    from gpudoor_pipelines.launch.resolve.features import MULTI_NODE, unsupported

    missing = unsupported(pool, frozenset(name for name, _ in NEEDS))
    if not pool.multi_node:
        missing.setdefault(MULTI_NODE, "No multi-node interconnect on this pool (`multi_node: false`).")
    return missing


def refusals(fleet: Fleet, source: str) -> list[str]:
    """The page's last section: every refusal a launch can meet, the field it names, and its fix."""
    from gpudoor_pipelines.launch.labels import LABEL_COST_OWNER, PRIORITY_FIELD, TRANSIT_SECRET_NAMES
    from gpudoor_pipelines.launch.resolve.specs import (
        _FORBIDDEN_TOP,
        CREDENTIAL_NAME_PARTS,
        SKYPILOT_TASK_FIELDS,
    )

    owners = list(fleet.cost_owners)
    may_ask = sorted({*fleet.secrets, *TRANSIT_SECRET_NAMES})
    rows: list[tuple[str, str, str]] = []
    rows += [(f"a `{key}` section", f"`{key}`", f"remove it: {why}") for key, why in _FORBIDDEN_TOP.items()]
    rows += [
        (
            "a git `workdir` (a mapping)",
            "`workdir`",
            "clone the repository in `setup`, or use a local folder as workdir",
        ),
        (
            "a field SkyPilot tasks do not have",
            "the field",
            f"remove it; known fields: {codes(sorted(SKYPILOT_TASK_FIELDS - {'_user_specified_yaml'}))}",
        ),
        (
            f"an env whose name has a credential word as a whole `_` part ({codes(sorted(CREDENTIAL_NAME_PARTS))}; "
            "`HF_TOKEN` yes, `MAX_TOKENS` no)",
            "`envs.<NAME>`",
            "declare it under `secrets:` with no value (`secrets: {NAME: null}`); the value comes from the launcher's "
            "environment",
        ),
        (
            "a path or URI in an env (starts with `/`, `~` or `scheme://`)",
            "`envs.<NAME>`",
            f"remove it: per-cluster paths come from the pool's `env` in `{source}`, data URIs from the launcher",
        ),
        (
            "an input the task declares with no value (`envs: {NAME: null}`) that the launch does not give",
            "`envs.<NAME>`",
            "give it: `--env NAME=VALUE` (`gpudoor launch`, `gpudoor where`), or `env: {NAME: VALUE}` in the launch's "
            "run config",
        ),
        (
            "a secret with a value in the file",
            "`secrets.<NAME>`",
            "write `<NAME>: null`; the value comes from the launcher's environment",
        ),
        (
            "a secret the fleet does not list",
            "`secrets.<NAME>`",
            f"use one of {codes(may_ask)}, or ask the fleet's admins to add it to `secrets` in `{source}`",
        ),
        (
            "a secret asked for with no value anywhere",
            "`secrets.<NAME>`",
            "set it in the launcher's environment, or as `GPUDOOR_POLICY_<NAME>` on the API server",
        ),
        ("no cost owner", f"`labels.{LABEL_COST_OWNER}`", f"set one of {codes(owners)}"),
        (
            "an unknown cost owner",
            f"`labels.{LABEL_COST_OWNER}`",
            f"use one of {codes(owners)} or add it to `cost_owners` in `{source}`",
        ),
        (
            "a GPU no pool offers",
            "`resources.accelerators`",
            f"ask for one of {codes(sorted(fleet.all_gpus, key=str.lower))}, or add a pool that has it to `{source}`",
        ),
        (
            "a GPU count that is not a positive whole number",
            "`resources.accelerators`",
            "use e.g. `H100:1`: pools lend whole GPUs",
        ),
        ("`num_nodes` that is not a positive whole number", "`num_nodes`", "use e.g. `num_nodes: 2`"),
        (
            "a step the fleet has no route for",
            "`step`",
            f"use one of {codes(fleet.routes)}, or launch without a step to route by GPU",
        ),
        (
            "an `infra`/`cloud` that is no pool of the fleet",
            "`resources.infra`",
            f"remove it: the route picks the pool (or name one of {codes(p.infra for p in fleet.pools.values())})",
        ),
        ("candidates naming different infras", "`resources.infra`", "remove infra: the route picks the pool"),
    ]
    for p in fleet.pools.values():
        if p.priority_class:
            rows.append(
                (
                    f"another priority class on production pool `{p.name}`",
                    f"`{PRIORITY_FIELD}`",
                    f"remove it; research jobs on this pool run at priority class `{p.priority_class}`",
                )
            )
    rows += [
        (
            "more GPUs than a pool's cap",
            "`resources.accelerators`",
            "ask for at most the pool's GPU cap (see [Pools](#pools))",
        ),
        (
            "more GPUs than one user may hold on a pool",
            "`resources.accelerators`",
            "ask for at most the pool's per-user GPU cap",
        ),
        (
            "more GPUs than are free on the pool right now (yours or the team's)",
            "`resources.accelerators`",
            "wait for jobs to finish, ask for fewer GPUs, or route to another pool",
        ),
        (
            "an interactive session (a `dev-…`/`lab-…` cluster, a demo) with more GPUs than the pool's "
            "`max_interactive_gpus`",
            "`resources.accelerators`",
            "ask for fewer GPUs, or run the work as a job (see [GPUs per interactive "
            "session](#gpus-per-interactive-session))",
        ),
        (
            "a team beyond its quota on a pool whose GPUs are all in use"
            + ("" if fleet.sharing.borrowing else ", or on any pool (borrowing is off)"),
            "`resources.accelerators`",
            "wait for GPUs to free up, launch on your team's quota elsewhere, or ask for a quota (see "
            "[Quotas](#quotas))",
        ),
        (
            "a new launch of a cost owner whose weekly budget is spent"
            + (" (only a warning: `budget_enforce: warn`)" if fleet.sharing.budget_enforce == "warn" else ""),
            "`sharing.budgets.<owner>`",
            "wait for next week, launch under a cost owner with budget left, or ask for more (see [Weekly "
            "budgets](#weekly-budgets))",
        ),
        (
            "a CPU-only job over a pool's vCPU cap",
            "`resources.cpus`",
            "ask for fewer vCPUs, or wait for jobs to finish",
        ),
        (
            "a CPU-only job on a pool off `cpu_route`",
            "`resources.accelerators`",
            f"ask for a GPU or use one of {codes(fleet.cpu_route)}",
        ),
        (
            "a need no pool on the route can provide",
            "`resources` or `num_nodes`",
            "drop the need or route to a pool that has it (see [Needs a pool cannot "
            "provide](#needs-a-pool-cannot-provide))",
        ),
        (
            "several YAML documents in one file (a pipeline or a job group)",
            "`(documents)`",
            "pipelines and job groups are not supported yet; launch each task on its own",
        ),
    ]
    out = [
        "## Refused, and the fix",
        "",
        "The same checks run in `gpudoor where`, the launcher and the API server's admin policy; a refusal names",
        "the file, the field and the fix, every problem at once.",
        "",
    ]
    out += table(["refused", "field", "fix"], rows)
    out += [
        "### Needs a pool cannot provide",
        "",
        "From SkyPilot's own table of what each kind of infra cannot do, less the pool's declared `features`,",
        "and the pool's multi-node interconnect. A job with such a need goes to the next pool on its route.",
        "",
    ]
    header = ["pool"] + [f"{asked} (`{name}`)" for name, asked in NEEDS]
    rows2 = []
    for p in fleet.pools.values():
        missing = missing_needs(p)
        rows2.append([f"`{p.name}`"] + [f"no: {missing[name]}" if name in missing else "yes" for name, _ in NEEDS])
    out += table(header, rows2)
    return out
