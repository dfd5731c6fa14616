"""Pod sizing for the steps that run inside Dagster's own pods on Kubernetes (dagster-k8s tags).

GPU steps never run in a Dagster pod: SkyPilot runs them, and the step only watches. The CPU steps
(building the dataset's shards, the morning merge, the usage report) do their work in the step's
own pod; these tags size it when the code location runs with dagster-k8s (``K8sRunLauncher``, or
``k8s_job_executor`` for one pod per step). Outside Kubernetes the tags are inert.
"""

from __future__ import annotations

#: The tag dagster-k8s reads a step's (or a run's) Kubernetes config from.
K8S_CONFIG_TAG = "dagster-k8s/config"


def cpu_step_tags(cpu: str, memory: str) -> dict[str, dict]:
    """``op_tags`` that request (and cap at the same size) ``cpu`` cores and ``memory`` for a CPU step's pod."""
    size = {"cpu": cpu, "memory": memory}
    return {K8S_CONFIG_TAG: {"container_config": {"resources": {"requests": dict(size), "limits": dict(size)}}}}
