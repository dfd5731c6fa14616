"""The fleet's rules as one Markdown page (``docs/rules.md``), for people and coding agents alike.

``gpudoor rules`` writes it from the fleet file and the package's own checks: the pools, the routes,
what every job gets (env names, never values), priorities, autostop, cost owners, and every refusal
with its fix. The page has no timestamp, so the same fleet always gives the same bytes and a test
can tell when the committed page is stale.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from gpudoor_pipelines.launch.resolve.fleet import PROJECT_ROOT, Fleet, Pool, load_fleet

#: Where ``gpudoor rules`` writes the page.
DEFAULT_RULES_PAGE = PROJECT_ROOT / "docs" / "rules.md"

#: The needs of a job that not every pool can meet: SkyPilot's feature name, and what in a task asks for it.
NEEDS = (
    ("open_ports", "`ports`"),
    ("spot_instance", "`use_spot: true`"),
    ("multi-node", "`num_nodes` > 1"),
    ("docker_image", "`image_id: docker:…`"),
)


def _display(path: str | Path) -> str:
    """A path as the page names it: relative to the project when inside it, so the page never names a home folder."""
    p = Path(path).resolve()
    try:
        return p.relative_to(PROJECT_ROOT).as_posix()
    except ValueError:
        return p.name


def _cell(value: object) -> str:
    return " ".join(str(value).split()).replace("|", "\\|")


def _table(header: Iterable[str], rows: Iterable[Iterable[object]]) -> list[str]:
    head = [_cell(h) for h in header]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return lines + [""]


def _codes(names: Iterable[str]) -> str:
    names = list(names)
    return ", ".join(f"`{n}`" for n in names) if names else "none"


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def _usd(value: float) -> str:
    return f"{value:.2f}"


def _missing_needs(pool: Pool) -> dict[str, str]:
    """What ``pool`` cannot provide among :data:`NEEDS`, with the reason (SkyPilot's table, the pool's interconnect)."""
    from gpudoor_pipelines.launch.resolve.features import MULTI_NODE, unsupported

    missing = unsupported(pool, frozenset(name for name, _ in NEEDS))
    if not pool.multi_node:
        missing.setdefault(MULTI_NODE, "No multi-node interconnect on this pool (`multi_node: false`).")
    return missing


def _pools(fleet: Fleet) -> list[str]:
    out = ["## Pools", ""]
    out += _table(
        [
            "pool",
            "infra",
            "GPUs",
            "GPU cap",
            "per-user GPU cap",
            "$/GPU-hour",
            "vCPU cap (CPU-only jobs)",
            "$/vCPU-hour",
        ],
        [
            (
                f"`{p.name}`",
                f"`{p.infra}`",
                _codes(p.gpus),
                p.gpu_cap or "—",
                p.user_gpu_cap if p.gpus else "—",
                _usd(p.usd_per_gpu_hour) if p.gpus else "—",
                (p.vcpu_cap or "no cap") if p.name in fleet.cpu_route else "— (takes no CPU-only jobs)",
                _usd(p.usd_per_vcpu_hour) if p.name in fleet.cpu_route else "—",
            )
            for p in fleet.pools.values()
        ],
    )
    out += [f"- `{p.name}`: {_cell(p.description) or '(no description)'}" for p in fleet.pools.values()] + [""]
    out += ["### What each pool can run", ""]
    out += _table(
        [
            "pool",
            "preemptible",
            "an evicted job moves to",
            "priority class",
            "multi-node interconnect",
            "declared SkyPilot features",
            "autostop of interactive clusters",
        ],
        [
            (
                f"`{p.name}`",
                _yes(p.preemptible),
                " → ".join(f"`{t}`" for t in p.recover_to) or "— (recovered in place)",
                f"`{p.priority_class}`" if p.priority_class else "—",
                _yes(p.multi_node),
                _codes(p.features),
                f"{p.autostop_idle_minutes} idle minutes",
            )
            for p in fleet.pools.values()
        ],
    )
    out += [
        "Declared features are those SkyPilot learns only by asking a cluster (spot nodes on Kubernetes, Pyxis on",
        "Slurm); the pool's `features:` in the fleet file says it has them.",
        "",
        "A managed job evicted from a pool with `recover_to` (the step sees it RECOVERING) is launched again on the",
        "first of those pools that can take it now, with that pool's env, rules and caps; the recovering one is",
        "cancelled and its release verified, and the job resumes from what it saved in the transit bucket. When",
        "none can take it, SkyPilot recovers it on its own pool.",
        "",
    ]
    return out


def _routes(fleet: Fleet) -> list[str]:
    out = ["## Routes", ""]
    out += [
        "A pool on a route is skipped when it offers none of the GPUs the task asks for, cannot provide what",
        "the job needs (see [Needs a pool cannot provide](#needs-a-pool-cannot-provide)), or is at its cap; the",
        "first pool that can run the job wins. An explicit pool (`--pool`, the `gpudoor/pool` run tag) or infra",
        "(`--infra`, or the task's own `infra` naming a pool of the fleet) wins over every route.",
        "",
        "What running jobs hold is counted by "
        + (
            "the API server's policy (`live_caps: server`): the launcher routes without reading it, and tries the next "
            "pool when the server says one is full."
            if fleet.live_caps == "server"
            else "the launcher before every launch (`live_caps: launcher`), and again by the API server's policy where it "
            "can see the jobs (a consolidated jobs controller)."
        ),
        "",
        "### By step",
        "",
        "The step comes from the launcher: the asset's step, `--step`, or the task's own `gpudoor-step` label.",
        "",
    ]
    out += _table(
        ["step", "pools, in order"],
        [(f"`{s}`", " → ".join(f"`{p}`" for p in ps)) for s, ps in fleet.routes.items()],
    )
    clustered = [s for s, how in fleet.launch_as.items() if how == "cluster"]
    if clustered:
        out += [
            f"Launched as a cluster of its own (`launch_as`): {', '.join(f'`{s}`' for s in clustered)}. Such a step gets a",
            "cluster (`gpudoor-step-…`) that is torn down when its job ends; the step launches it again after a",
            "preemption, and the orphan reconciler tears it down once its run has ended. A launch outside a Dagster",
            "run (`gpudoor launch`) is a managed job all the same.",
            "",
        ]
    out += [
        "### Without a step: by GPU",
        "",
        "A job launched without a step goes to every pool that offers one of its GPUs: the GPU's own pool",
        "(`accelerator_routes`) first, then the cheapest by $/GPU-hour (ties in the fleet file's order).",
        "",
    ]
    rows = []
    for gpu in sorted(fleet.all_gpus, key=str.lower):
        own = fleet.accelerator_routes.get(gpu)
        order = " → ".join(f"`{p.name}`" for p in fleet.pools_for_gpus([gpu]))
        rows.append((f"`{gpu}`", f"`{own}`" if own else "— (cheapest first)", order))
    out += _table(["GPU", "its own pool", "pools tried for a job asking only this GPU"], rows)
    out += ["### CPU-only jobs", ""]
    if fleet.cpu_route:
        out += [
            "A job that asks for no GPU and names no step goes to the first of these pools with room under its",
            f"vCPU cap: {' → '.join(f'`{p}`' for p in fleet.cpu_route)}. Other pools take no CPU-only jobs.",
            "",
        ]
    else:
        out += ["No pool takes CPU-only jobs (`cpu_route` is empty): every job must ask for a GPU.", ""]
    return out


def _injected(fleet: Fleet) -> list[str]:
    from gpudoor_pipelines.launch.labels import (
        LABEL_ASSET,
        LABEL_COST_OWNER,
        LABEL_INTERACTIVE,
        LABEL_PARTITION,
        LABEL_POOL,
        LABEL_RUN_ID,
        LABEL_STEP,
        LABEL_USER,
        LABEL_VIA,
        POOL_ENV,
    )
    from gpudoor_pipelines.launch.server.policy import SECRET_ENV_VARS, TRANSIT_ENV_VARS

    out = ["## Injected into every job", ""]
    out += [
        "Names only: the values are per-cluster paths and settings; read them in the fleet file, or see what",
        "one task gets with `gpudoor where TASK`. The pool's env always wins over a task's own value.",
        "",
        "### Env, per pool",
        "",
    ]
    out += _table(["pool", "env"], [(f"`{p.name}`", _codes([*p.env, POOL_ENV])) for p in fleet.pools.values()])
    out += [
        f"`{POOL_ENV}` holds the pool's name. Inputs and outputs (transit bucket URIs) are set by the launcher",
        "under the names the task declares in `envs`.",
        "",
        "### Transit settings and secrets",
        "",
        "Secrets travel as SkyPilot secrets (redacted in logs), never as env. On the API server, a value the",
        "job does not have yet comes from the server's environment as `GPUDOOR_POLICY_<NAME>`.",
        "",
    ]
    rows = [
        (f"`{n}`", "env", "every job: how to reach the transit bucket (when set)", f"`GPUDOOR_POLICY_{n}`")
        for n in TRANSIT_ENV_VARS
    ]
    rows += [
        (
            f"`{n}`",
            "secret",
            "every job: the transit bucket's credentials (when set)",
            f"`GPUDOOR_POLICY_{n}`",
        )
        for n in SECRET_ENV_VARS
    ]
    rows += [
        (
            f"`{n}`",
            "secret",
            f"a job that asks for it (`secrets: {{{n}: null}}`); the value comes from the launcher's environment",
            f"`GPUDOOR_POLICY_{n}`",
        )
        for n in fleet.secrets
    ]
    out += _table(["name", "as", "given to", "on the API server, from"], rows)
    out += ["### Labels", ""]
    out += _table(
        ["label", "value"],
        [
            (f"`{LABEL_COST_OWNER}`", "who pays (see [Cost owners](#cost-owners))"),
            (
                f"`{LABEL_USER}`",
                "who launched: `GPUDOOR_USER`, else the service account, else the OS user; on the API server, the authenticated user",
            ),
            (f"`{LABEL_POOL}`", "the pool the job runs on"),
            (f"`{LABEL_STEP}`", "the step, when the launcher names one"),
            (f"`{LABEL_INTERACTIVE}`", "`true` on interactive clusters"),
            (f"`{LABEL_VIA}`", "who checked the task file (`launcher`, `policy`)"),
            (f"`{LABEL_RUN_ID}`, `{LABEL_ASSET}`, `{LABEL_PARTITION}`, `dagster-*`", "the Dagster run's identity"),
        ],
    )
    out += [
        "A task's own values for `gpudoor-*` and `dagster-*` labels are dropped; its other labels are kept.",
        "",
    ]
    return out


def _priorities_autostop(fleet: Fleet) -> list[str]:
    from gpudoor_pipelines.launch.labels import INTERACTIVE_PREFIXES, LABEL_TTL, PRIORITY_FIELD

    out = ["## Priorities", ""]
    forced = [p for p in fleet.pools.values() if p.priority_class]
    if forced:
        out += [
            f"On these pools every job runs under the pool's Kubernetes priority class (`{PRIORITY_FIELD}`),",
            "so serving can evict it:",
            "",
        ]
        out += _table(
            ["pool", "priority class", "preemptible"],
            [(f"`{p.name}`", f"`{p.priority_class}`", _yes(p.preemptible)) for p in forced],
        )
        out += [
            "A task that asks for another priority class on such a pool is refused. Other pools leave it as the task says.",
            "",
        ]
    else:
        out += ["No pool forces a priority class.", ""]
    prefixes = ", ".join(f"`{p}…`" for p in INTERACTIVE_PREFIXES)
    r = fleet.reconciler
    out += [
        "## Autostop and time to live",
        "",
        f"Interactive clusters (cluster names starting with {prefixes}, demos, and any cluster started with",
        "`sky launch`) stop and go down after the pool's idle minutes (see",
        "[What each pool can run](#what-each-pool-can-run)); a task's own `resources.autostop` is kept. Managed",
        "jobs end with their run.",
        "",
        f"Busy or not, the orphan reconciler tears an interactive cluster down {r.interactive_ttl_hours:g} hours after",
        f"its launch, or after the time to live its launch asked for (the demo's `ttl_hours`, a task's `{LABEL_TTL}`",
        f"label), at most {r.max_interactive_ttl_hours:g} hours; asking for more is refused. A managed job or warm pool",
        f"whose Dagster run has ended, or that names a run Dagster does not know, is released {r.grace_minutes:g} minutes",
        "after; jobs launched outside Dagster are their owner's to stop."
        + (" The reconciler is in dry run: it only says what it would release." if r.dry_run else ""),
        "",
    ]
    return out


def _cost_owners(fleet: Fleet) -> list[str]:
    return [
        "## Cost owners",
        "",
        f"Every job carries one of: {_codes(fleet.cost_owners)}. Default: `{fleet.default_cost_owner}`."
        if fleet.cost_owners
        else "The fleet lists no cost owners: any cost owner is accepted.",
        "",
        "Who pays, first that is set:",
        "",
        "1. the launch's own setting: the `gpudoor/cost-owner` run tag, or `--cost-owner`;",
        "2. the task file's `gpudoor-cost-owner` label;",
        "3. the launcher's `cost_owner` setting (`GPUDOOR_COST_OWNER`);",
        f"4. the fleet's default, `{fleet.default_cost_owner or 'none'}`.",
        "",
    ]


def _refusals(fleet: Fleet, source: str) -> list[str]:
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
            f"remove it; known fields: {_codes(sorted(SKYPILOT_TASK_FIELDS - {'_user_specified_yaml'}))}",
        ),
        (
            f"an env whose name has a credential word as a whole `_` part ({_codes(sorted(CREDENTIAL_NAME_PARTS))}; `HF_TOKEN` yes, `MAX_TOKENS` no)",
            "`envs.<NAME>`",
            "declare it under `secrets:` with no value (`secrets: {NAME: null}`); the value comes from the launcher's environment",
        ),
        (
            "a path or URI in an env (starts with `/`, `~` or `scheme://`)",
            "`envs.<NAME>`",
            f"remove it: per-cluster paths come from the pool's `env` in `{source}`, data URIs from the launcher",
        ),
        (
            "a secret with a value in the file",
            "`secrets.<NAME>`",
            "write `<NAME>: null`; the value comes from the launcher's environment",
        ),
        (
            "a secret the fleet does not list",
            "`secrets.<NAME>`",
            f"use one of {_codes(may_ask)}, or ask the fleet's admins to add it to `secrets` in `{source}`",
        ),
        (
            "a secret asked for with no value anywhere",
            "`secrets.<NAME>`",
            "set it in the launcher's environment, or as `GPUDOOR_POLICY_<NAME>` on the API server",
        ),
        ("no cost owner", f"`labels.{LABEL_COST_OWNER}`", f"set one of {_codes(owners)}"),
        (
            "an unknown cost owner",
            f"`labels.{LABEL_COST_OWNER}`",
            f"use one of {_codes(owners)} or add it to `cost_owners` in `{source}`",
        ),
        (
            "a GPU no pool offers",
            "`resources.accelerators`",
            f"ask for one of {_codes(sorted(fleet.all_gpus, key=str.lower))}, or add a pool that has it to `{source}`",
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
            f"use one of {_codes(fleet.routes)}, or launch without a step to route by GPU",
        ),
        (
            "an `infra`/`cloud` that is no pool of the fleet",
            "`resources.infra`",
            f"remove it: the route picks the pool (or name one of {_codes(p.infra for p in fleet.pools.values())})",
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
            "a CPU-only job over a pool's vCPU cap",
            "`resources.cpus`",
            "ask for fewer vCPUs, or wait for jobs to finish",
        ),
        (
            "a CPU-only job on a pool off `cpu_route`",
            "`resources.accelerators`",
            f"ask for a GPU or use one of {_codes(fleet.cpu_route)}",
        ),
        (
            "a need no pool on the route can provide",
            "`resources` or `num_nodes`",
            "drop the need or route to a pool that has it (see [Needs a pool cannot provide](#needs-a-pool-cannot-provide))",
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
    out += _table(["refused", "field", "fix"], rows)
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
        missing = _missing_needs(p)
        rows2.append([f"`{p.name}`"] + [f"no: {missing[name]}" if name in missing else "yes" for name, _ in NEEDS])
    out += _table(header, rows2)
    return out


def render(fleet: Fleet) -> str:
    """The rules page for ``fleet``, as Markdown (the same fleet always gives the same text)."""
    source = _display(fleet.source)
    out = [
        "# Fleet rules",
        "",
        f"<!-- Generated by `gpudoor rules` from {source}. Do not edit: change the fleet file, then run `gpudoor rules`. -->",
        "",
        f"What every job launched through the door gets, where it may run and what it is refused, from `{source}`",
        "and the package's own checks. `gpudoor where TASK` shows what one task file would get.",
        "",
    ]
    out += _pools(fleet) + _routes(fleet) + _injected(fleet) + _priorities_autostop(fleet) + _cost_owners(fleet)
    out += _refusals(fleet, source)
    return "\n".join(out).rstrip("\n") + "\n"


def render_file(fleet_file: str | Path | None = None) -> str:
    """The rules page for a fleet file (default: the project's ``task_specs/fleet.yaml``)."""
    return render(load_fleet(fleet_file))
