"""Dagster concurrency pools that mirror the GPU pools, so Dagster never submits more than the caps.

Each launching asset runs in the Dagster pool of the first GPU pool on its route
(``gpu-<pool>``). The limit of that Dagster pool is how many of the route's largest jobs fit under
the GPU pool's cap; :func:`sync_pool_limits` writes the limits into a Dagster instance (the same as
``dagster instance concurrency set``), and ``gpudoor pools`` does it from the command line.
"""

from __future__ import annotations

from collections.abc import Mapping

from gpudoor_pipelines.launch.resolve.fleet import Fleet, load_fleet
from gpudoor_pipelines.launch.resolve.specs import load_spec

#: The Dagster pool of each step kind's assets (the first GPU pool on its route).
STEP_POOLS = {
    "caption": "gpu-onprem",
    "smoke": "gpu-h200",
    "train": "gpu-h200",
    "eval": "gpu-inference",
    "demo": "gpu-inference",
}


def dagster_pool_for(fleet: Fleet, step: str) -> str:
    """``gpu-<first pool on the step's route>``."""
    return f"gpu-{fleet.routes[step][0]}"


def pool_limits(fleet: Fleet | None = None) -> dict[str, int]:
    """Dagster pool → how many jobs of its largest step fit under the GPU pool's cap (at least 1)."""
    fleet = fleet or load_fleet()
    limits: dict[str, int] = {}
    for step in STEP_POOLS:
        spec = load_spec(step)
        gpus = max(spec.accelerators.values()) * spec.num_nodes
        pool = fleet.pools[fleet.routes[step][0]]
        name = dagster_pool_for(fleet, step)
        limits[name] = min(limits.get(name, pool.gpu_cap), max(1, pool.gpu_cap // gpus))
    return limits


def sync_pool_limits(instance, limits: Mapping[str, int] | None = None) -> dict[str, int]:
    """Writes the pool limits into a Dagster instance; returns them."""
    limits = dict(limits or pool_limits())
    for name, limit in limits.items():
        instance.event_log_storage.set_concurrency_slots(name, limit)
    return limits
