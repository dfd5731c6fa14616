"""Routing: which pool a job goes to. Pure functions, no SkyPilot, no Dagster."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from gpudoor_pipelines.launch.errors import LaunchConfigError
from gpudoor_pipelines.launch.fleet import Fleet, Pool
from gpudoor_pipelines.launch.specs import TaskSpec


@dataclasses.dataclass(frozen=True)
class Route:
    """Where a job goes and why.

    Attributes:
        pool: the chosen pool.
        infra: the SkyPilot infra string the job is launched with.
        accelerator: the GPU type chosen among the spec's candidates.
        gpus_per_node: GPUs per node of that type.
        reason: the rule that decided, in words (shown by ``gpudoor where`` and in metadata).
        skipped: pools passed over, with why.
    """

    pool: Pool
    infra: str
    accelerator: str
    gpus_per_node: int
    reason: str
    skipped: tuple[str, ...] = ()

    @property
    def accelerators(self) -> str:
        """SkyPilot's ``TYPE:COUNT`` form."""
        return f"{self.accelerator}:{self.gpus_per_node}"


def _pick_gpu(spec: TaskSpec, pool: Pool) -> tuple[str, int] | None:
    # The pool lists its GPUs in order of preference; the spec's candidates are a set.
    wanted = {g.lower(): (g, n) for g, n in spec.accelerators.items()}
    return next((wanted[g.lower()] for g in pool.gpus if g.lower() in wanted), None)


def route(
    spec: TaskSpec,
    fleet: Fleet,
    *,
    step: str | None = None,
    pool: str | None = None,
    infra: str | None = None,
    gpus_in_use: Mapping[str, int] | None = None,
) -> Route:
    """Chooses the pool for a spec.

    Order of rules: an explicit ``infra`` override, then an explicit ``pool`` override, then the
    route of the step kind (the first pool that offers one of the spec's GPUs and has room under its
    cap), then the pool the requested accelerator belongs to.

    Args:
        spec: the task spec.
        fleet: the fleet.
        step: the step kind; defaults to ``spec.kind``.
        pool: explicit pool override (run config or the ``gpudoor/pool`` run tag).
        infra: explicit SkyPilot infra override (must belong to a pool of the fleet).
        gpus_in_use: GPUs currently held per pool, to skip pools at their cap.

    Raises:
        LaunchConfigError: unknown pool or infra, or no pool offers the GPUs the spec asks for.
    """
    step = step or spec.kind
    in_use = dict(gpus_in_use or {})
    wanted = ", ".join(f"{g}:{n}" for g, n in spec.accelerators.items())
    offered = {g.lower() for g in fleet.all_gpus}
    if not any(g.lower() in offered for g in spec.accelerators):
        raise LaunchConfigError(
            spec.path,
            "resources.accelerators",
            f"no pool of the fleet offers {wanted}",
            f"ask for one of {sorted(fleet.all_gpus)}, or add a pool that has it to {fleet.source}",
        )

    def fits(p: Pool) -> tuple[str, int]:
        picked = _pick_gpu(spec, p)
        if picked is None:
            raise LaunchConfigError(
                spec.path,
                "resources.accelerators",
                f"pool '{p.name}' offers {list(p.gpus)}, not {wanted}",
                f"ask for one of {list(p.gpus)} or route to a pool that has {wanted}",
            )
        if spec.num_nodes > 1 and not p.multi_node:
            raise LaunchConfigError(
                spec.path,
                "num_nodes",
                f"{spec.num_nodes} nodes on pool '{p.name}', which has no multi-node interconnect",
                "use num_nodes: 1 or a multi-node pool",
            )
        return picked

    if infra:
        p = fleet.pool_for_infra(infra)
        if p is None:
            raise LaunchConfigError(
                "launch override",
                "infra",
                f"'{infra}' belongs to no pool of {fleet.source}",
                f"use one of {[q.infra for q in fleet.pools.values()]} (a partition may follow, e.g. slurm/onprem/debug)",
            )
        gpu, count = fits(p)
        return Route(p, infra, gpu, count, f"infra override '{infra}'")
    if pool:
        p = fleet.pool(pool, field="pool override")
        gpu, count = fits(p)
        return Route(p, p.infra, gpu, count, f"pool override '{pool}'")

    skipped: list[str] = []
    candidates = fleet.routes.get(step)
    if candidates:
        for name in candidates:
            p = fleet.pools[name]
            picked = _pick_gpu(spec, p)
            if picked is None:
                skipped.append(f"{name}: offers none of {wanted}")
                continue
            if spec.num_nodes > 1 and not p.multi_node:
                skipped.append(f"{name}: no multi-node interconnect")
                continue
            need = picked[1] * spec.num_nodes
            if in_use.get(name, 0) + need > p.gpu_cap:
                skipped.append(
                    f"{name}: at its cap ({in_use.get(name, 0)}/{p.gpu_cap} GPUs in use, {need} asked)"
                )
                continue
            reason = f"route for step '{step}'" + (
                f" (passed over {', '.join(s.split(':')[0] for s in skipped)})" if skipped else ""
            )
            return Route(p, p.infra, picked[0], picked[1], reason, tuple(skipped))
        raise LaunchConfigError(
            spec.path,
            "resources.accelerators",
            f"no pool on the '{step}' route {list(candidates)} can take {wanted} x{spec.num_nodes} node(s): {'; '.join(skipped)}",
            "ask for a GPU one of these pools offers, wait for capacity, or override the pool",
        )

    for gpu, count in spec.accelerators.items():
        target = next((v for k, v in fleet.accelerator_routes.items() if k.lower() == gpu.lower()), None)
        if target:
            p = fleet.pools[target]
            return Route(p, p.infra, gpu, count, f"accelerator route {gpu} → {target}")
    raise LaunchConfigError(
        spec.path,
        "resources.accelerators",
        f"step '{step}' has no route and no accelerator route covers {wanted}",
        f"add a route for '{step}' or an accelerator route in {fleet.source}",
    )
