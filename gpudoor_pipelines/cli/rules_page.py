"""The fleet's rules as one Markdown page (``docs/rules.md``), for people and coding agents alike.

``gpudoor rules`` writes it from the fleet file and the package's own checks: the pools, the routes,
what every job gets (env names, never values), priorities, autostop, cost owners, and every refusal
with its fix. The page has no timestamp, so the same fleet always gives the same bytes and a test
can tell when the committed page is stale.
"""

from __future__ import annotations

from pathlib import Path

from gpudoor_pipelines.cli.markdown import cell, codes, display, table, usd, yes
from gpudoor_pipelines.cli.rules_refusals import refusals
from gpudoor_pipelines.cli.rules_sharing import sharing
from gpudoor_pipelines.launch.resolve.fleet import PROJECT_ROOT, Fleet, load_fleet

#: Where ``gpudoor rules`` writes the page.
DEFAULT_RULES_PAGE = PROJECT_ROOT / "docs" / "rules.md"


def _pools(fleet: Fleet) -> list[str]:
    out = ["## Pools", ""]
    out += table(
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
                codes(p.gpus),
                p.gpu_cap or "—",
                p.user_gpu_cap if p.gpus else "—",
                usd(p.usd_per_gpu_hour) if p.gpus else "—",
                (p.vcpu_cap or "no cap") if p.name in fleet.cpu_route else "— (takes no CPU-only jobs)",
                usd(p.usd_per_vcpu_hour) if p.name in fleet.cpu_route else "—",
            )
            for p in fleet.pools.values()
        ],
    )
    out += [f"- `{p.name}`: {cell(p.description) or '(no description)'}" for p in fleet.pools.values()] + [""]
    out += ["### What each pool can run", ""]
    out += table(
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
                yes(p.preemptible),
                " → ".join(f"`{t}`" for t in p.recover_to) or "— (recovered in place)",
                f"`{p.priority_class}`" if p.priority_class else "—",
                yes(p.multi_node),
                codes(p.features),
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
            else "the launcher before every launch (`live_caps: launcher`), and again by the API server's policy "
            "where it can see the jobs (a consolidated jobs controller)."
        ),
        "",
        "### By step",
        "",
        "The step comes from the launcher: the asset's step, `--step`, or the task's own `gpudoor-step` label.",
        "",
    ]
    out += table(
        ["step", "pools, in order"],
        [(f"`{s}`", " → ".join(f"`{p}`" for p in ps)) for s, ps in fleet.routes.items()],
    )
    clustered = [s for s, how in fleet.launch_as.items() if how == "cluster"]
    if clustered:
        out += [
            f"Launched as a cluster of its own (`launch_as`): {', '.join(f'`{s}`' for s in clustered)}. Such a step "
            "gets a",
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
    out += table(["GPU", "its own pool", "pools tried for a job asking only this GPU"], rows)
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
        LABEL_BORROWED,
        LABEL_COST_OWNER,
        LABEL_FINGERPRINT,
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
    out += table(["pool", "env"], [(f"`{p.name}`", codes([*p.env, POOL_ENV])) for p in fleet.pools.values()])
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
    out += table(["name", "as", "given to", "on the API server, from"], rows)
    out += ["### Labels", ""]
    out += table(
        ["label", "value"],
        [
            (f"`{LABEL_COST_OWNER}`", "who pays (see [Cost owners](#cost-owners))"),
            (
                f"`{LABEL_USER}`",
                "who launched: `GPUDOOR_USER`, else the service account, else the OS user; on the API server, the "
                "authenticated user",
            ),
            (f"`{LABEL_POOL}`", "the pool the job runs on"),
            (f"`{LABEL_STEP}`", "the step, when the launcher names one"),
            (f"`{LABEL_INTERACTIVE}`", "`true` on interactive clusters"),
            (f"`{LABEL_VIA}`", "who checked the task file (`launcher`, `policy`)"),
            (
                f"`{LABEL_BORROWED}`",
                "on pools with quotas: `true` when the job runs beyond its cost owner's quota, on borrowed GPUs",
            ),
            (f"`{LABEL_FINGERPRINT}`", "a hash of the resolved task, the fleet file and the policy's code"),
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
        out += table(
            ["pool", "priority class", "interactive sessions", "on borrowed GPUs", "preemptible"],
            [
                (
                    f"`{p.name}`",
                    f"`{p.priority_class}`",
                    f"`{p.interactive_priority_class or p.priority_class}`",
                    f"`{p.borrowed_priority_class or p.priority_class}`",
                    yes(p.preemptible),
                )
                for p in forced
            ],
        )
        out += [
            "A task that asks for another priority class on such a pool is refused. Other pools leave it as the task "
            "says.",
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
        f"label), at most {r.max_interactive_ttl_hours:g} hours; asking for more is refused. A managed job or warm "
        "pool",
        f"whose Dagster run has ended, or that names a run Dagster does not know, is released {r.grace_minutes:g} "
        "minutes",
        "after; jobs launched outside Dagster are their owner's to stop."
        + (" The reconciler is in dry run: it only says what it would release." if r.dry_run else ""),
        "",
    ]
    return out


def _cost_owners(fleet: Fleet) -> list[str]:
    return [
        "## Cost owners",
        "",
        f"Every job carries one of: {codes(fleet.cost_owners)}. Default: `{fleet.default_cost_owner}`."
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


def _housekeeping(fleet: Fleet) -> list[str]:
    h = fleet.housekeeping
    delete = f"deleted {h.delete_after_days:g} days after" if h.delete_after_days else "never deleted"
    return [
        "## What the transit bucket keeps",
        "",
        f"Per training: the best {h.keep_best} checkpoints by `{h.metric}`, the latest {h.keep_latest}, the current",
        "best checkpoint, the one the demo serves, those of a run in progress, those pinned by the",
        "`gpudoor/keep-checkpoint` run tag"
        + (f", and {codes(h.keep)}" if h.keep else "")
        + ". The others move to cheaper storage",
        f"(`{h.storage_class}`) {h.cold_after_days:g} days after they were written and are {delete}.",
        f"Smoke outputs untouched for {h.smoke_days:g} days, Pipes sessions for {h.pipes_days:g}, caption parts of an",
        f"old caption model once merged, and writes left unfinished for {h.leftovers_days:g} day(s) are deleted.",
        "The weekly `housekeeping_job` plans it (`gpudoor housekeeping --plan` shows the same plan)"
        + (" and applies the plan." if h.apply else "; applying is off (`housekeeping.apply`)."),
        "",
    ]


def render(fleet: Fleet) -> str:
    """The rules page for ``fleet``, as Markdown (the same fleet always gives the same text)."""
    source = display(fleet.source)
    out = [
        "# Fleet rules",
        "",
        f"<!-- Generated by `gpudoor rules` from {source}. Do not edit: change the fleet file, then run `gpudoor "
        "rules`. -->",
        "",
        f"What every job launched through the door gets, where it may run and what it is refused, from `{source}`",
        "and the package's own checks. `gpudoor where TASK` shows what one task file would get.",
        "",
    ]
    out += _pools(fleet) + _routes(fleet) + _injected(fleet) + _priorities_autostop(fleet) + _cost_owners(fleet)
    out += sharing(fleet) + _housekeeping(fleet)
    out += refusals(fleet, source)
    return "\n".join(out).rstrip("\n") + "\n"


def render_file(fleet_file: str | Path | None = None) -> str:
    """The rules page for a fleet file (default: the project's ``task_specs/fleet.yaml``)."""
    return render(load_fleet(fleet_file))
