"""The path SkyPilot's config names for the fleet's admin policy: ``gpudoor_pipelines.launch.policy.GpuDoorPolicy``.

The policy lives in :mod:`gpudoor_pipelines.launch.server.policy` (what only the API server runs); this
module keeps the one config line every team's API server already has working.
"""

from gpudoor_pipelines.launch.server.policy import GpuDoorPolicy

__all__ = ["GpuDoorPolicy"]
