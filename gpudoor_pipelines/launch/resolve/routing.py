"""Routing: the one place that decides where a job runs — pool, infra, GPU — and whether it fits.

:func:`route` has no Dagster and no I/O; it reads the task's candidates with SkyPilot's parser and
the pools' features from SkyPilot's table. Every check that can send a job elsewhere or refuse it
lives here: the GPU the pool offers, what SkyPilot can do on the pool's infra (ports, spot, images,
multi-node), the multi-node interconnect, the pool's cap, the per-user cap, vCPU caps for CPU-only
jobs, and what is held right now. The choice is deterministic: pools in route order, and within a
pool the pool's GPU preference (a task's GPU set has no order of its own). The fleet rules
(``rules.py``) take the route as given and never choose again.
"""

from __future__ import annotations

import dataclasses

from gpudoor_pipelines.launch.errors import LaunchConfigError
from gpudoor_pipelines.launch.resolve.fleet import Fleet, Pool, did_you_mean, label_value
from gpudoor_pipelines.launch.resolve.sharing import quota_verdict
from gpudoor_pipelines.launch.resolve.sky_parse import Candidate
from gpudoor_pipelines.launch.resolve.specs import TaskSpec
from gpudoor_pipelines.launch.resolve.usage import Outlook, Usage


@dataclasses.dataclass(frozen=True)
class Route:
    """Where a job goes and why.

    Attributes:
        pool: the chosen pool.
        infra: the SkyPilot infra string the job is launched with.
        accelerator: the GPU type chosen among the spec's candidates (None: a CPU-only job).
        gpus_per_node: GPUs per node of that type (0 for a CPU-only job).
        num_nodes: nodes the job spans.
        vcpus_per_node: vCPUs per node of a CPU-only job (0 for a GPU job: its GPUs are what counts).
        reason: the rule that decided, in words (shown by ``gpudoor where`` and in metadata).
        skipped: pools passed over, with why.
        borrowed: the job runs beyond its cost owner's quota, on the pool's idle GPUs.
        session: an interactive session (a ``dev-…``/``lab-…`` cluster, a demo).
        quota: what the pool's quotas said, in words (empty where the pool has none).
    """

    pool: Pool
    infra: str
    accelerator: str | None
    gpus_per_node: int
    num_nodes: int
    reason: str
    skipped: tuple[str, ...] = ()
    vcpus_per_node: int = 0
    candidate: Candidate | None = None
    borrowed: bool = False
    session: bool = False
    quota: str = ""

    @property
    def use_spot(self) -> bool:
        """The chosen candidate runs on spot capacity."""
        return bool(self.candidate and self.candidate.use_spot)

    @property
    def accelerators(self) -> str | None:
        """SkyPilot's ``TYPE:COUNT`` form, or None for a CPU-only job."""
        return f"{self.accelerator}:{self.gpus_per_node}" if self.accelerator else None

    @property
    def total_gpus(self) -> int:
        """GPUs over all nodes."""
        return self.gpus_per_node * self.num_nodes

    @property
    def usd_per_hour(self) -> float:
        """What the job costs per hour on its pool (GPU-hours, or vCPU-hours for CPU-only jobs)."""
        if self.accelerator:
            return self.total_gpus * self.pool.usd_per_gpu_hour
        return self.vcpus_per_node * self.num_nodes * self.pool.usd_per_vcpu_hour

    def describe(self) -> str:
        """``L4:1 x2 node(s)`` or ``8 vCPUs x1 node(s)``."""
        what = self.accelerators or f"{self.vcpus_per_node} vCPUs"
        return f"{what} x{self.num_nodes} node(s)" + (" on spot" if self.use_spot else "")


@dataclasses.dataclass(frozen=True)
class _Misfit:
    field: str
    problem: str
    fix: str


@dataclasses.dataclass(frozen=True)
class Who:
    """Who launches: the user (per-user caps), the cost owner (quotas), and whether it is an interactive session."""

    user: str = "unknown"
    owner: str | None = None
    session: bool = False


@dataclasses.dataclass(frozen=True)
class _Fit:
    gpu: str | None
    count: int
    borrowed: bool = False
    quota: str = ""


def _fit(spec: TaskSpec, cand: Candidate, pool: Pool, fleet: Fleet, who: Who, usage: Usage) -> _Fit | _Misfit:
    """The GPU (or None for CPU-only) and per-node count ``cand`` gets on ``pool``, or why it does not fit."""
    from gpudoor_pipelines.launch.resolve.features import MULTI_NODE, unsupported

    nodes = spec.num_nodes
    multi_node = _Misfit(
        "num_nodes",
        f"{nodes} nodes on pool '{pool.name}', which has no multi-node interconnect",
        "use num_nodes: 1 or a multi-node pool",
    )
    needed = cand.features | ({MULTI_NODE} if nodes > 1 else set())
    missing = unsupported(pool, frozenset(needed))
    if cand.accelerator is None:
        if pool.name not in fleet.cpu_route:
            return _Misfit(
                "resources.accelerators",
                f"pool '{pool.name}' does not take CPU-only jobs",
                f"ask for a GPU or use one of cpu_route {list(fleet.cpu_route)}",
            )
        if nodes > 1 and not pool.multi_node:
            return multi_node
        if missing:
            return _feature_misfit(pool, missing)
        need, held, cap = spec.vcpus * nodes, usage.vcpus.get(pool.name, 0), pool.vcpu_cap
        if cap is not None and need > cap:
            return _Misfit(
                "resources.cpus",
                f"{need} vCPUs is over pool '{pool.name}' vCPU cap of {cap}",
                f"ask for at most {cap} vCPUs",
            )
        if cap is not None and held + need > cap:
            return _Misfit(
                "resources.cpus",
                f"at its vCPU cap ({held}/{cap} vCPUs in use, {need} asked)",
                "wait for jobs to finish or ask for fewer vCPUs",
            )
        return _Fit(None, spec.vcpus)
    gpu = pool.gpu_named(cand.accelerator)
    if gpu is None:
        return _Misfit(
            "resources.accelerators",
            f"pool '{pool.name}' has no {cand.accelerator} (it offers {list(pool.gpus)})",
            f"ask for one of {list(pool.gpus)}",
        )
    if nodes > 1 and not pool.multi_node:
        return multi_node
    if missing:
        return _feature_misfit(pool, missing)
    per_node = int(cand.count)
    total = per_node * nodes
    # Usage is read back from job labels, where the user name is in its label form.
    user = who.user
    held, mine = usage.gpus.get(pool.name, 0), usage.user_gpus.get((label_value(user), pool.name), 0)
    if total > pool.gpu_cap:
        return _Misfit(
            "resources.accelerators",
            f"{total} GPUs is over pool '{pool.name}' cap of {pool.gpu_cap}",
            f"ask for at most {pool.gpu_cap} GPUs",
        )
    if total > pool.user_gpu_cap:
        return _Misfit(
            "resources.accelerators",
            f"{total} GPUs is over pool '{pool.name}' per-user cap of {pool.user_gpu_cap}",
            f"ask for at most {pool.user_gpu_cap} GPUs",
        )
    if who.session and total > pool.max_interactive_gpus:
        return _Misfit(
            "resources.accelerators",
            f"{total} GPUs for an interactive session (a dev-/lab- cluster or a demo) is over pool '{pool.name}' "
            f"limit of {pool.max_interactive_gpus} per session (max_interactive_gpus)",
            f"ask for at most {pool.max_interactive_gpus} GPUs, or run the work as a job (gpudoor launch, a "
            "managed job)",
        )
    verdict = quota_verdict(fleet, pool.name, who.owner and label_value(who.owner), total, usage)
    if verdict is None and held + total > pool.gpu_cap:
        return _Misfit(
            "resources.accelerators",
            f"at its cap ({held}/{pool.gpu_cap} GPUs in use, {total} asked)",
            "wait for jobs to finish, ask for fewer GPUs, or route to another pool",
        )
    if verdict is not None and verdict.problem:
        return _Misfit("resources.accelerators", verdict.problem, verdict.fix)
    if mine + total > pool.user_gpu_cap:
        return _Misfit(
            "resources.accelerators",
            f"user '{user}' holds {mine} GPUs on '{pool.name}'; with {total} more that is over the per-user cap of "
            f"{pool.user_gpu_cap}",
            "wait for your jobs to finish or ask for fewer GPUs",
        )
    if verdict is None:
        return _Fit(gpu, per_node)
    return _Fit(gpu, per_node, verdict.borrowed, verdict.said)


def _feature_misfit(pool: Pool, missing: dict[str, str]) -> _Misfit:
    reasons = " ".join(why.rstrip(".") + "." for why in missing.values())
    return _Misfit(
        "resources",
        f"pool '{pool.name}' ({pool.infra}) cannot provide {', '.join(missing)}: {reasons}",
        f"drop {', '.join(missing)} or route to a pool that has it",
    )


def _route_to(
    spec: TaskSpec, pool: Pool, infra: str, reason: str, picked: _Fit, cand: Candidate, who: Who, skipped=()
) -> Route:
    if picked.gpu is None:
        return Route(
            pool, infra, None, 0, spec.num_nodes, reason, tuple(skipped), vcpus_per_node=picked.count, candidate=cand
        )
    return Route(
        pool,
        infra,
        picked.gpu,
        picked.count,
        spec.num_nodes,
        reason,
        tuple(skipped),
        candidate=cand,
        borrowed=picked.borrowed,
        session=who.session,
        quota=picked.quota,
    )


def _attempts(spec: TaskSpec, pools: list[Pool]) -> list[tuple[Pool, Candidate]]:
    """(pool, candidate) pairs in the order they are tried.

    A set: pools in route order, and on each pool its own GPU preference, then fewer GPUs, spot
    first. ``ordered``: the task's first candidate on every pool, then its second, and so on.
    """
    cands = spec.candidates
    if spec.ordered:
        return [(p, c) for c in cands for p in pools]

    def on_pool(p: Pool, c: Candidate) -> tuple:
        gpus = [g.lower() for g in p.gpus]
        rank = gpus.index(c.accelerator.lower()) if c.accelerator and c.accelerator.lower() in gpus else len(gpus)
        return (rank, c.count, not c.use_spot)

    return [(p, c) for p in pools for c in sorted(cands, key=lambda c: on_pool(p, c))]


def _preferred(pools: list[Pool], fleet: Fleet, step: str | None, gpus: list[str]) -> list[Pool]:
    """Pools that share one infra, in the order the job would meet them without the override: the step's
    route, else the pools for its GPUs (or the CPU-only route); the rest in the fleet file's order."""
    if step and step in fleet.routes:
        order = list(fleet.routes[step])
    elif gpus:
        order = [p.name for p in fleet.pools_for_gpus(gpus)]
    else:
        order = list(fleet.cpu_route)
    return sorted(pools, key=lambda p: order.index(p.name) if p.name in order else len(order))


def route(
    spec: TaskSpec,
    fleet: Fleet,
    *,
    step: str | None = None,
    pool: str | None = None,
    infra: str | None = None,
    user: str = "unknown",
    owner: str | None = None,
    session: bool = False,
    usage: Usage | None = None,
    outlook: Outlook | None = None,
    infra_field: tuple[str, str] = ("launch override", "infra"),
) -> Route:
    """Chooses the pool, infra and GPU for a spec, and checks that the job can run and fits there.

    Order of rules: an explicit ``infra`` override (with ``pool`` too, the pool must own it: two
    pools may share one cluster), then an explicit ``pool`` override, then the route of the step
    kind (the launcher's: the asset, or ``--step``), then, for a CPU-only job, the fleet's
    ``cpu_route``, and for a GPU job every pool that offers one of its GPUs: the GPU's own pool
    (``accelerator_routes``) first, then the cheapest. The first pool that can run the job wins.

    Args:
        spec: the task spec.
        fleet: the fleet.
        step: the step kind, from the launcher; None routes by what the job needs.
        pool: explicit pool override (run config or the ``gpudoor/pool`` run tag).
        infra: explicit SkyPilot infra override (must belong to a pool of the fleet).
        user: who launches, for per-user caps.
        owner: the cost owner, for its quotas.
        session: an interactive session (a ``dev-…``/``lab-…`` cluster, a demo): the pool's
            ``max_interactive_gpus`` holds.
        usage: what is held right now; no live cap or quota check without it.
        outlook: how soon each pool would start the job: when several pools of the route can take it,
            the first that would not queue wins (start soonest); without it, the first that can.
        infra_field: where ``infra`` came from (file and field), for messages.

    Raises:
        LaunchConfigError: unknown pool, infra or step, no pool offers what the spec asks, or none
            of the pools tried can run it (each one named with why).
    """
    usage = usage or Usage()
    who = Who(user, owner, session)
    gpus = [c.accelerator for c in spec.candidates if c.accelerator]
    wanted = ", ".join(dict.fromkeys(c.describe() for c in spec.candidates))
    if gpus and not any(fleet.pools[p].gpu_named(g) for p in fleet.pools for g in gpus):
        raise LaunchConfigError(
            spec.path,
            "resources.accelerators",
            f"no pool of the fleet offers {wanted}",
            f"ask for one of {sorted(fleet.all_gpus)}, or add a pool that has it to {fleet.source}",
        )

    def explicit(pools: list[Pool], where: str, reason: str) -> Route:
        """The first of ``pools`` that can run the job (several when they share the infra named)."""
        misfits: list[tuple[Pool, _Misfit]] = []
        for p, cand in _attempts(spec, pools):
            picked = _fit(spec, cand, p, fleet, who, usage)
            if not isinstance(picked, _Misfit):
                why = reason if len(pools) == 1 else f"{reason}, pool '{p.name}' of {[q.name for q in pools]}"
                return _route_to(spec, p, where, why, picked, cand, who)
            misfits.append((p, picked))
        first = misfits[0][1]
        problems = (f"{p.name}: {m.problem}" if len(pools) > 1 else m.problem for p, m in misfits)
        raise LaunchConfigError(spec.path, first.field, "; ".join(dict.fromkeys(problems)), first.fix)

    if infra:
        if pool:
            p = fleet.pools.get(pool)
            if p is None or not p.owns_infra(infra):
                raise LaunchConfigError(
                    *infra_field,
                    f"'{infra}' does not belong to pool '{pool}'",
                    f"drop one of the two overrides, or use pool '{pool}''s infra {p.infra if p else '(unknown pool)'}",
                )
            return explicit([p], infra, f"infra override '{infra}'")
        owners = [q for q in fleet.pools.values() if q.owns_infra(infra)]
        if not owners:
            raise LaunchConfigError(
                *infra_field,
                f"'{infra}' is not a pool of the fleet ({fleet.source})",
                f"use one of {list(dict.fromkeys(q.infra for q in fleet.pools.values()))} (a partition may "
                "follow, e.g. slurm/onprem/debug)",
            )
        return explicit(_preferred(owners, fleet, step, gpus), infra, f"infra override '{infra}'")
    if pool:
        p = fleet.pool(pool, field="pool override")
        return explicit([p], p.infra, f"pool override '{pool}'")

    if step:
        if step not in fleet.routes:
            raise LaunchConfigError(
                spec.path,
                "step",
                f"the fleet has no route for step '{step}'",
                f"use one of {sorted(fleet.routes)}{did_you_mean(step, fleet.routes)}, or launch without a step to "
                "route by GPU",
            )
        candidates, why = [fleet.pools[n] for n in fleet.routes[step]], f"route for step '{step}'"
    elif spec.is_cpu_only:
        candidates, why = [fleet.pools[n] for n in fleet.cpu_route], "CPU-only route"
        if not candidates:
            raise LaunchConfigError(
                spec.path,
                "resources.accelerators",
                f"the job asks for no GPU and no pool of {fleet.source} takes CPU-only jobs",
                f"ask for a GPU, or list the pools that take CPU jobs under cpu_route in {fleet.source}",
            )
    else:
        candidates, why = fleet.pools_for_gpus(gpus), f"pools offering {wanted}"

    skipped: list[str] = []
    misfits: list[_Misfit] = []
    fits: list[Route] = []
    for p, cand in _attempts(spec, candidates):
        if any(r.pool.name == p.name for r in fits):
            continue  # a pool's own preference among the candidates decided already
        picked = _fit(spec, cand, p, fleet, who, usage)
        if isinstance(picked, _Misfit):
            if cand.accelerator is None or p.gpu_named(cand.accelerator):  # a pool without the GPU is no news
                skipped.append(f"{p.name}: {cand.describe()}: {picked.problem}")
                misfits.append(picked)
            continue
        passed = f" (passed over {', '.join(dict.fromkeys(s.split(':')[0] for s in skipped))})" if skipped else ""
        fits.append(_route_to(spec, p, p.infra, why + passed, picked, cand, who, skipped))
        if outlook is None:
            break
    if fits:
        return _soonest(fits, outlook)
    names = [p.name for p in candidates]
    if not skipped:
        raise LaunchConfigError(
            spec.path,
            "resources.accelerators",
            f"no pool on the {why} {names} offers {wanted}",
            f"ask for one of the GPUs of {names}, or launch without a step to route by GPU",
        )
    field = "resources.accelerators"
    if all(m.field == "num_nodes" for m in misfits):
        multi = sorted({g for q in fleet.pools.values() if q.multi_node for g in q.gpus})
        fix = f"use num_nodes: 1, or ask for a GPU of a multi-node pool ({', '.join(multi) or 'none in the fleet'})"
        field = "num_nodes"
    else:
        fix = "change what the reasons name, ask for a GPU another pool offers, or wait for capacity"
    raise LaunchConfigError(spec.path, field, f"no pool on the {why} {names} can run it: {'; '.join(skipped)}", fix)


def _soonest(fits: list[Route], outlook: Outlook | None) -> Route:
    """Of the routes that can take the job, in route order, the first whose pool would not queue it (start
    soonest); the first when each would, or none can say. The reason gives the numbers it weighed."""
    if outlook is None or len(fits) == 1:
        return fits[0]
    said: list[str] = []
    for r in fits:
        queues, why = outlook.judge(r)
        said += [why] if why else []
        if not queues:
            break
    else:
        r = fits[0]
    if not any(said):
        return r
    return dataclasses.replace(r, reason=f"{r.reason}; start soonest: {', '.join(said)}")
