"""What the API server's records say, read one way: managed jobs of ``sky.jobs.queue_v2``, warm pools of
``sky.jobs.pool_status``, clusters of ``sky.status``.

Pure functions over the records (the SDK's objects, or the server's own dicts when the admin policy reads
its tables in process): the backend, the strategies and the policy on the API server share them.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

from gpudoor_pipelines.launch.backends.sky_sdk import state
from gpudoor_pipelines.launch.job import JobInfo
from gpudoor_pipelines.launch.labels import STEP_CLUSTER_PREFIX
from gpudoor_pipelines.launch.resolve.specs import gpus_per_node, parse_accelerators
from gpudoor_pipelines.launch.resolve.usage import Held

QUEUE_FIELDS = [
    "job_id",
    "job_name",
    "status",
    "infra",
    "cloud",
    "region",
    "zone",
    "recovery_count",
    "submitted_at",
    "start_at",
    "end_at",
    "job_duration",
    "last_recovered_at",
    "failure_reason",
    "details",
    "labels",
    "accelerators",
    "resources",
]
#: What the reconciler reads of every unfinished job: a pending job has no cluster yet, so its labels come
#: from the task it was launched with.
HOLDING_FIELDS = [
    "job_id",
    "job_name",
    "status",
    "labels",
    "submitted_at",
    "pool",
    "cluster_name_on_cloud",
    "task_id",
    "user_yaml",
]
#: The history also reads the task each job was launched with: once a job's cluster is gone, the queue no
#: longer shows its labels nor its GPUs.
HISTORY_FIELDS = [*QUEUE_FIELDS, "task_id", "user_yaml"]
_NODES = re.compile(r"^(\d+)x")
_GPUS = re.compile(r"[\[,]\s*([A-Za-z][\w-]*):(\d+(?:\.\d+)?)")  # "2x[H200:8]": H200, 8 (not "CPU:8+")
_CPUS = re.compile(r"CPU:(\d+)")  # queue_v2 shows a CPU-only job as e.g. "1x[CPU:8+]"


def field(r: Any, name: str) -> Any:
    """A field of a record: the SDK's records have attributes, the server's own are dicts."""
    return r.get(name) if isinstance(r, Mapping) else getattr(r, name, None)


def status_name(record: Mapping[str, Any]) -> str:
    """A pool's or a cluster's status, as its name."""
    status = record.get("status")
    return str(getattr(status, "value", status))


def job_info(r: Any) -> JobInfo:
    """A ``queue_v2`` record as a :class:`JobInfo`."""
    # queue_v2's `infra` leaves the zone out ("Slurm (cluster)"); a Slurm partition is the zone.
    parts = [str(x) for x in (r.cloud, r.region, r.zone) if x]
    infra = "/".join([parts[0].lower(), *parts[1:]]) if parts else (r.infra or "")
    recovered = getattr(r, "last_recovered_at", None)
    return JobInfo(
        job_id=str(r.job_id),
        state=state(r.status),
        name=r.job_name or "",
        infra=infra,
        recoveries=int(r.recovery_count or 0),
        submitted_at=r.submitted_at,
        started_at=r.start_at,
        ended_at=r.end_at,
        detail=r.failure_reason or r.details or "",
        ran_s=float(r.job_duration) if r.job_duration is not None and r.start_at else None,
        # SkyPilot sets it at the first start too: it dates a recovery only once there was one.
        recovered_at=float(recovered) if recovered and r.recovery_count else None,
    )


def launched_task(user_yaml: str | None, task_id: int | None) -> dict:
    """The task a job was launched with, from the queue's ``user_yaml`` (a name document, then one per task)."""
    import yaml

    try:
        # libyaml's loader where PyYAML has it: a busy week's history parses thousands of these.
        loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
        docs = [d for d in yaml.load_all(user_yaml or "", Loader=loader) if isinstance(d, dict)]
    except yaml.YAMLError:
        return {}
    tasks = docs[1:] if len(docs) > 1 else docs
    index = int(task_id or 0)
    return tasks[index] if 0 <= index < len(tasks) else (tasks[0] if tasks else {})


def launched_labels(r: Any) -> dict[str, str]:
    """A job's labels: its cluster's, else (no cluster yet, or gone) the task's it was launched with."""
    labels = field(r, "labels") or {}
    if not labels:
        task = launched_task(field(r, "user_yaml"), field(r, "task_id"))
        resources = task.get("resources") if isinstance(task.get("resources"), dict) else {}
        labels = resources.get("labels") or {}
    return {str(k): str(v) for k, v in labels.items()}


def job_held(r: Any, *, launched_task_too: bool = False) -> Held | None:
    """What a managed job of the queue holds (pool, user, GPUs, vCPUs, cost owner, borrowed), over all its
    nodes; None for a job without a ``gpudoor-pool`` label, or on a warm pool (its pool's workers hold the GPUs).

    The labels and GPUs are the job's cluster's. A job without a cluster yet (pending) has none in the
    queue: with ``launched_task_too`` they come from the task it was launched with (``user_yaml``), else
    the job is not counted.
    """
    if field(r, "pool"):
        return None
    labels = field(r, "labels") or {}
    accelerators = field(r, "accelerators")
    if launched_task_too and not labels:
        task = launched_task(field(r, "user_yaml"), field(r, "task_id"))
        resources = task.get("resources") if isinstance(task.get("resources"), dict) else {}
        labels = resources.get("labels") or {}
        accelerators = resources.get("accelerators")
        nodes = int(task.get("num_nodes") or 1)
    else:
        nodes = int(m.group(1)) if (m := _NODES.match(field(r, "resources") or "")) else 1
    cpus = int(m.group(1)) if (m := _CPUS.search(field(r, "resources") or "")) else 0
    return Held.of(labels, gpus_per_node(accelerators) * nodes, cpus * nodes)


def pool_labels(record: Mapping[str, Any]) -> dict[str, Any]:
    """A warm pool's task resources (its labels and GPUs), from its ``pool_yaml``."""
    import yaml

    try:
        return (yaml.safe_load(record.get("pool_yaml") or "") or {}).get("resources") or {}
    except yaml.YAMLError:
        return {}


def pool_workers_held(records: Iterable[Mapping[str, Any]]) -> list[Held]:
    """What the workers of every warm pool's workers, from its task's labels
    (records as ``sky.jobs.pool_status`` gives them)."""
    out = []
    for record in records:
        if status_name(record) in ("SHUTTING_DOWN", "FAILED_CLEANUP"):
            continue
        resources = pool_labels(record)
        workers = int(record.get("target_num_replicas") or 0)
        gpus = sum(parse_accelerators(resources.get("accelerators")).values())
        if (held := Held.of(resources.get("labels") or {}, int(workers * gpus))) is not None:
            out.append(held)
    return out


def cluster_labels(record: Mapping[str, Any]) -> dict[str, str]:
    """A cluster's labels, from its handle's launched resources (records as ``sky.status`` gives them)."""
    resources = getattr(record.get("handle"), "launched_resources", None)
    return {str(k): str(v) for k, v in (getattr(resources, "labels", None) or {}).items()}


def clusters_held(records: Iterable[Mapping[str, Any]]) -> list[Held]:
    """What every door step cluster that is up or starting (records as
    ``sky.status`` or the server's cluster table give them)."""
    out = []
    for record in records:
        name = str(record.get("name") or "")
        if not name.startswith(STEP_CLUSTER_PREFIX) or status_name(record) not in ("UP", "INIT"):
            continue
        handle = record.get("handle")
        resources = getattr(handle, "launched_resources", None)
        nodes = int(getattr(handle, "launched_nodes", None) or 1)
        gpus = gpus_per_node(getattr(resources, "accelerators", None))
        if (held := Held.of(getattr(resources, "labels", None) or {}, gpus * nodes)) is not None:
            out.append(held)
    return out


def record_gpus(r: Any, resources: dict) -> float:
    """GPUs per node of a queue record: the cluster's, else the task's, else the queue's resources string.

    Several types listed are alternatives: the job got one of them.
    """
    counts = gpus_per_node(r.accelerators) or gpus_per_node(resources.get("accelerators"))
    if not counts:
        counts = max((float(n) for name, n in _GPUS.findall(r.resources or "") if name.upper() != "CPU"), default=0.0)
    return float(counts)


def record_nodes(r: Any, task: Mapping[str, Any]) -> int:
    """Nodes of a queue record: from its resources string (``2x[H200:8]``), else its launched task."""
    m = _NODES.match(r.resources or "")
    return int(m.group(1)) if m else int(task.get("num_nodes") or 1)
