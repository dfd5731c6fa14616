"""Routing: the one place that decides where a job runs — pool, infra, GPU — and whether it fits.

:func:`route` is pure (no SkyPilot, no Dagster). Every check that can send a job elsewhere or
refuse it for its size lives here: the GPU the pool offers, multi-node interconnect, the pool's
cap, the per-user cap, vCPU caps for CPU-only jobs, and what is held right now. The fleet rules
(``rules.py``) take the route as given and never choose again.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping

from gpudoor_pipelines.launch.errors import LaunchConfigError
from gpudoor_pipelines.launch.fleet import Fleet, Pool, did_you_mean, label_value
from gpudoor_pipelines.launch.specs import TaskSpec


@dataclasses.dataclass(frozen=True)
class Usage:
    """What jobs that have not ended hold right now, for cap checks.

    Attributes:
        gpus: GPUs per pool.
        vcpus: vCPUs of CPU-only jobs per pool.
        user_gpus: GPUs per (user, pool).
    """

    gpus: Mapping[str, int] = dataclasses.field(default_factory=dict)
    vcpus: Mapping[str, int] = dataclasses.field(default_factory=dict)
    user_gpus: Mapping[tuple[str, str], int] = dataclasses.field(default_factory=dict)

    @classmethod
    def tally(cls, jobs: Iterable[tuple[str, str, int, int]]) -> Usage:
        """Sums ``(pool, user, GPUs, vCPUs)`` of unfinished jobs; a job with GPUs counts by its GPUs only."""
        gpus: dict[str, int] = {}
        vcpus: dict[str, int] = {}
        user_gpus: dict[tuple[str, str], int] = {}
        for pool, user, job_gpus, job_vcpus in jobs:
            if job_gpus:
                gpus[pool] = gpus.get(pool, 0) + job_gpus
                user_gpus[(user, pool)] = user_gpus.get((user, pool), 0) + job_gpus
            else:
                vcpus[pool] = vcpus.get(pool, 0) + job_vcpus
        return cls(gpus=gpus, vcpus=vcpus, user_gpus=user_gpus)


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
    """

    pool: Pool
    infra: str
    accelerator: str | None
    gpus_per_node: int
    num_nodes: int
    reason: str
    skipped: tuple[str, ...] = ()
    vcpus_per_node: int = 0

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
        return f"{what} x{self.num_nodes} node(s)"


@dataclasses.dataclass(frozen=True)
class _Misfit:
    field: str
    problem: str
    fix: str


def _fit(spec: TaskSpec, pool: Pool, fleet: Fleet, user: str, usage: Usage) -> tuple[str | None, int] | _Misfit:
    """The GPU (or None for CPU-only) and per-node count ``spec`` gets on ``pool``, or why it does not fit."""
    nodes = spec.num_nodes
    multi_node = _Misfit("num_nodes", f"{nodes} nodes on pool '{pool.name}', which has no multi-node interconnect", "use num_nodes: 1 or a multi-node pool")
    if spec.is_cpu_only:
        if pool.name not in fleet.cpu_route:
            return _Misfit("resources.accelerators", f"pool '{pool.name}' does not take CPU-only jobs", f"ask for a GPU or use one of cpu_route {list(fleet.cpu_route)}")
        if nodes > 1 and not pool.multi_node:
            return multi_node
        need, held, cap = spec.vcpus * nodes, usage.vcpus.get(pool.name, 0), pool.vcpu_cap
        if cap is not None and need > cap:
            return _Misfit("resources.cpus", f"{need} vCPUs is over pool '{pool.name}' vCPU cap of {cap}", f"ask for at most {cap} vCPUs")
        if cap is not None and held + need > cap:
            return _Misfit("resources.cpus", f"at its vCPU cap ({held}/{cap} vCPUs in use, {need} asked)", "wait for jobs to finish or ask for fewer vCPUs")
        return None, spec.vcpus
    wanted = ", ".join(f"{g}:{n}" for g, n in spec.accelerators.items())
    # The pool lists its GPUs in order of preference; the spec's candidates are a set.
    gpu = next((g for g in pool.gpus if any(g.lower() == w.lower() for w in spec.accelerators)), None)
    if gpu is None:
        return _Misfit("resources.accelerators", f"pool '{pool.name}' has no {wanted} (it offers {list(pool.gpus)})", f"ask for one of {list(pool.gpus)} or route to a pool that has {wanted}")
    if nodes > 1 and not pool.multi_node:
        return multi_node
    per_node = next(n for g, n in spec.accelerators.items() if g.lower() == gpu.lower())
    total = per_node * nodes
    # Usage is read back from job labels, where the user name is in its label form.
    held, mine = usage.gpus.get(pool.name, 0), usage.user_gpus.get((label_value(user), pool.name), 0)
    if total > pool.gpu_cap:
        return _Misfit("resources.accelerators", f"{total} GPUs is over pool '{pool.name}' cap of {pool.gpu_cap}", f"ask for at most {pool.gpu_cap} GPUs")
    if total > pool.user_gpu_cap:
        return _Misfit("resources.accelerators", f"{total} GPUs is over pool '{pool.name}' per-user cap of {pool.user_gpu_cap}", f"ask for at most {pool.user_gpu_cap} GPUs")
    if held + total > pool.gpu_cap:
        return _Misfit("resources.accelerators", f"at its cap ({held}/{pool.gpu_cap} GPUs in use, {total} asked)", "wait for jobs to finish, ask for fewer GPUs, or route to another pool")
    if mine + total > pool.user_gpu_cap:
        return _Misfit("resources.accelerators", f"user '{user}' holds {mine} GPUs on '{pool.name}'; with {total} more that is over the per-user cap of {pool.user_gpu_cap}", "wait for your jobs to finish or ask for fewer GPUs")
    return gpu, per_node


def _route_to(spec: TaskSpec, pool: Pool, infra: str, reason: str, picked: tuple[str | None, int], skipped=()) -> Route:
    gpu, count = picked
    if gpu is None:
        return Route(pool, infra, None, 0, spec.num_nodes, reason, tuple(skipped), vcpus_per_node=count)
    return Route(pool, infra, gpu, count, spec.num_nodes, reason, tuple(skipped))


def route(
    spec: TaskSpec,
    fleet: Fleet,
    *,
    step: str | None = None,
    pool: str | None = None,
    infra: str | None = None,
    user: str = "unknown",
    usage: Usage | None = None,
) -> Route:
    """Chooses the pool, infra and GPU for a spec, and checks that the job fits there.

    Order of rules: an explicit ``infra`` override (with ``pool`` too, the pool must own it: two
    pools may share one cluster), then an explicit ``pool`` override, then the
    route of the step kind (the first pool where the job fits), then, for a CPU-only job, the fleet's
    ``cpu_route``, and for a GPU job the pool its GPU belongs to (``accelerator_routes``).

    Args:
        spec: the task spec.
        fleet: the fleet.
        step: the step kind; defaults to ``spec.kind``.
        pool: explicit pool override (run config or the ``gpudoor/pool`` run tag).
        infra: explicit SkyPilot infra override (must belong to a pool of the fleet).
        user: who launches, for per-user caps.
        usage: what is held right now; no live cap check without it.

    Raises:
        LaunchConfigError: unknown pool or infra, no pool offers what the spec asks, or it does not fit.
    """
    step = step or spec.kind
    usage = usage or Usage()
    if not spec.is_cpu_only and not any(fleet.pools[p].gpu_named(g) for p in fleet.pools for g in spec.accelerators):
        wanted = ", ".join(f"{g}:{n}" for g, n in spec.accelerators.items())
        raise LaunchConfigError(spec.path, "resources.accelerators", f"no pool of the fleet offers {wanted}",
                                f"ask for one of {sorted(fleet.all_gpus)}, or add a pool that has it to {fleet.source}")  # fmt: skip

    def explicit(p: Pool, where: str, reason: str) -> Route:
        picked = _fit(spec, p, fleet, user, usage)
        if isinstance(picked, _Misfit):
            raise LaunchConfigError(spec.path, picked.field, picked.problem, picked.fix)
        return _route_to(spec, p, where, reason, picked)

    if infra:
        p = fleet.pools.get(pool or "") if pool else fleet.pool_for_infra(infra)
        if pool and (p is None or not p.owns_infra(infra)):
            raise LaunchConfigError("launch override", "infra", f"'{infra}' does not belong to pool '{pool}'",
                                    f"drop one of the two overrides, or use pool '{pool}''s infra {p.infra if p else '(unknown pool)'}")  # fmt: skip
        if p is None:
            raise LaunchConfigError("launch override", "infra", f"'{infra}' is not a pool of the fleet ({fleet.source})",
                                    f"use one of {[q.infra for q in fleet.pools.values()]} (a partition may follow, e.g. slurm/onprem/debug)")  # fmt: skip
        return explicit(p, infra, f"infra override '{infra}'")
    if pool:
        p = fleet.pool(pool, field="pool override")
        return explicit(p, p.infra, f"pool override '{pool}'")

    if step in fleet.routes:
        candidates, why = fleet.routes[step], f"route for step '{step}'"
    elif spec.is_cpu_only:
        candidates, why = fleet.cpu_route, "CPU-only route"
        if not candidates:
            raise LaunchConfigError(spec.path, "resources.accelerators", f"the job asks for no GPU and no pool of {fleet.source} takes CPU-only jobs",
                                    f"ask for a GPU, or list the pools that take CPU jobs under cpu_route in {fleet.source}")  # fmt: skip
    else:
        gpu_route = next(((g, fleet.accelerator_routes[k]) for g in spec.accelerators for k in fleet.accelerator_routes if k.lower() == g.lower()), None)
        if gpu_route is None:
            wanted = ", ".join(spec.accelerators)
            raise LaunchConfigError(spec.path, "resources.accelerators", f"step '{step}' has no route and no accelerator route covers {wanted}",
                                    f"add a route for '{step}' or an accelerator route in {fleet.source}{did_you_mean(step, fleet.routes)}")  # fmt: skip
        candidates, why = (gpu_route[1],), f"accelerator route {gpu_route[0]} → {gpu_route[1]}"

    skipped: list[str] = []
    for name in candidates:
        p = fleet.pools[name]
        picked = _fit(spec, p, fleet, user, usage)
        if isinstance(picked, _Misfit):
            skipped.append(f"{name}: {picked.problem}")
            continue
        if skipped:
            why += f" (passed over {', '.join(s.split(':')[0] for s in skipped)})"
        return _route_to(spec, p, p.infra, why, picked, skipped)
    raise LaunchConfigError(spec.path, "resources.accelerators",
                            f"no pool on the {why} {list(candidates)} can take it: {'; '.join(skipped)}",
                            "ask for what one of these pools offers, wait for capacity, or override the pool")  # fmt: skip
