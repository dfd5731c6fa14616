"""The admin policy's earlier path, ``gpudoor_pipelines.launch.policy.GpuDoorPolicy``, kept for API servers
whose SkyPilot config still names it; the policy itself is :mod:`gpudoor_pipelines.launch.server.policy`."""

from gpudoor_pipelines.launch.server.policy import GpuDoorPolicy

__all__ = ["GpuDoorPolicy"]
