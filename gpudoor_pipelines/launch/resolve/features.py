"""Whether a pool's infra can run what a job needs, by SkyPilot's own feature table (imports ``sky`` lazily).

SkyPilot keeps, per kind of infra, the features it cannot provide there (``Opening ports is not
supported in Slurm``). It refines that table only by asking the cluster itself (Pyxis on a Slurm
cluster, spot nodes on a Kubernetes cluster), which a router must not do on every launch: a pool
declares such features in the fleet file (``features:``) instead.
"""

from __future__ import annotations

import functools

from gpudoor_pipelines.launch.resolve.fleet import Pool, normalize_infra

#: Needed by every job that spans several nodes.
MULTI_NODE = "multi-node"


@functools.lru_cache(maxsize=32)
def _unsupported_by_cloud(cloud_name: str) -> tuple[tuple[str, str], ...]:
    from gpudoor_pipelines.launch import sky_env

    sky_env.prepare()
    from sky.utils import registry

    cloud = registry.CLOUD_REGISTRY.from_str(cloud_name)
    if cloud is None:
        return ()
    # The static table of the cloud class: what SkyPilot never provides there, without asking a cluster.
    table = getattr(type(cloud), "_CLOUD_UNSUPPORTED_FEATURES", {})
    return tuple((feature.value, " ".join(str(why).split())) for feature, why in table.items())


def unsupported(pool: Pool, needed: frozenset[str]) -> dict[str, str]:
    """The features in ``needed`` that ``pool`` cannot provide, with SkyPilot's reason for each."""
    if not needed:
        return {}
    cloud = normalize_infra(pool.infra).split("/", 1)[0]
    table = dict(_unsupported_by_cloud(cloud))
    return {f: table[f] for f in sorted(needed) if f in table and f not in pool.features}
