"""The rules page's "Quotas and budgets" section: each team's GPU quotas, its weekly budget, and the GPUs one
interactive session may hold, from the fleet file's ``sharing`` section and pools."""

from __future__ import annotations

from gpudoor_pipelines.cli.markdown import codes, table, usd
from gpudoor_pipelines.launch.resolve.fleet import Fleet


def sharing(fleet: Fleet) -> list[str]:
    """The section, as Markdown lines."""
    from gpudoor_pipelines.launch.labels import INTERACTIVE_PREFIXES, LABEL_BORROWED

    s = fleet.sharing
    out = ["## Quotas and budgets", "", "### Quotas", ""]
    if s.quotas:
        out += [
            "A quota is GPUs a cost owner may always hold on a pool, or on a group of pools together. Within it, a",
            "launch is never refused for what another team borrowed. "
            + (
                "Beyond it, or on a pool where the team has none, a job may borrow the pool's idle GPUs: it is "
                f'labelled `{LABEL_BORROWED}: "true"` and runs at the pool\'s borrowed priority class, the first '
                "evicted when the owner needs its GPUs back."
                if s.borrowing
                else "Borrowing is off: beyond its quota, or on a pool where it has none, a team's launch is refused."
            ),
            "",
        ]
        rows = [
            (f"`{owner}`", f"`{scope}`", codes(s.scope_pools(scope)), gpus)
            for owner, quotas in s.quotas.items()
            for scope, gpus in quotas.items()
        ]
        out += table(["cost owner", "on", "pools", "GPUs"], rows)
        shared = [p for p in fleet.pools if s.has_quotas(p)]
        rest = [p for p in fleet.pools if p not in shared]
        if rest:
            out += [f"Pools without quotas ({codes(rest)}) are shared by their caps alone.", ""]
    else:
        out += ["No quotas: the pools are shared by their caps alone.", ""]
    out += ["### Weekly budgets", ""]
    if s.budgets:
        out += [
            "Counted from Monday 00:00 UTC over every job the team ran (the same figures as the weekly usage asset).",
            f"From {s.warn_at:.0%} a launch warns (in the run's log, its materialization and the agent's JSON); at "
            "100% "
            + (
                "the cost owner's new launches are refused, interactive sessions excepted."
                if s.budget_enforce == "refuse"
                else "they still only warn (`budget_enforce: warn`)."
            ),
            "",
        ]
        out += table(
            ["cost owner", "GPU-hours", "dollars"],
            [
                (
                    f"`{owner}`",
                    f"{b.gpu_hours:g}" if b.gpu_hours is not None else "—",
                    usd(b.usd) if b.usd is not None else "—",
                )
                for owner, b in s.budgets.items()
            ],
        )
    else:
        out += ["No budgets.", ""]
    prefixes = ", ".join(f"`{p}…`" for p in INTERACTIVE_PREFIXES)
    out += [
        "### GPUs per interactive session",
        "",
        f"An interactive session ({prefixes} clusters, demos) may hold at most this many GPUs on a pool, at the",
        "pool's interactive priority class where it has one; bigger work runs as a job.",
        "",
    ]
    out += table(
        ["pool", "GPUs per session", "interactive priority class", "borrowed priority class"],
        [
            (
                f"`{p.name}`",
                p.max_interactive_gpus,
                f"`{p.interactive_priority_class}`" if p.interactive_priority_class else "—",
                f"`{p.borrowed_priority_class}`" if p.borrowed_priority_class else "—",
            )
            for p in fleet.pools.values()
            if p.gpus
        ],
    )
    return out
