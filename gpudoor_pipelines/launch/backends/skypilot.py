"""The production backend: the team's SkyPilot API server, through the Python SDK.

Each job runs by a strategy (:mod:`.strategies`): a managed job, a step on a cluster of its own, or a rank
on a warm pool; the backend picks it once and hands every call about the job to it. What is held and what
was (:mod:`.sky_inventory`), the records' meaning (:mod:`.sky_records`) and the SDK itself
(:mod:`.sky_sdk`) are modules of their own.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Sequence
from typing import Any

from gpudoor_pipelines.launch.backends import sky_inventory, sky_records, sky_sdk, step_clusters, strategies
from gpudoor_pipelines.launch.backends.base import Backend, LogFollower, Service
from gpudoor_pipelines.launch.errors import LaunchConfigError
from gpudoor_pipelines.launch.job import Holding, JobInfo, JobState, JobUsage, ReleaseCheck
from gpudoor_pipelines.launch.labels import STEP_CLUSTER_PREFIX
from gpudoor_pipelines.launch.resolve.fleet import normalize_infra
from gpudoor_pipelines.launch.resolve.request import ResolvedJob
from gpudoor_pipelines.launch.resolve.usage import Usage

_USAGE_LOCK = threading.Lock()
#: Reads sent side by side with another one (the warm pools while the queue is read).
_SIDE_READS = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="gpudoor-sky-read")
_USAGE_CACHE: dict[str, tuple[float, Usage]] = {}  # endpoint -> (when the read started, usage)
_USAGE_STALE: dict[str, float] = {}  # endpoint -> when this process last changed what is held
#: A cluster's nodes (GPU type, partitions, free GPUs) are read at most this often per process.
NODES_TTL_S = 5.0
_NODES: dict[tuple[str, str, str], tuple[float, list[tuple[str, tuple[str, ...], int]] | None]] = {}


class SkyPilotBackend(Backend):
    """Launches resolved jobs on the team's API server (managed jobs, step clusters, warm pools, services).

    The SDK takes its API server and token from the process's own SkyPilot settings
    (``SKYPILOT_API_SERVER_ENDPOINT`` / ``SKYPILOT_SERVICE_ACCOUNT_TOKEN``, or ``~/.sky/config.yaml``);
    this backend never rewrites them. :meth:`check` confirms they name the server it was given.

    Args:
        endpoint: the API server URL; required (a missing one never starts a local server).
        token: a service-account token, if the server needs one (for the reachability check).
    """

    name = "skypilot"
    remote_status = True
    #: SkyPilot's jobs controller looks at a starting job every 5 s and at a running one every 15 s
    #: (``sky.jobs.utils``), so a state cannot change faster; and each look at the queue costs the API
    #: server a Python process (about 1.5 CPU-s in consolidation mode; 0.15 with the server's plugin,
    #: ``launch/server/plugin.py``). Looks at 0.5 s, 1 s, 2 s after a change would only repeat the last answer.
    status_granularity_s = 5.0
    #: How long a read of what the team's jobs hold (``usage``) is reused by this process: the full
    #: queue is the heaviest request a launch makes. This process's own submits and cancels drop it.
    usage_ttl_s = 2.0

    def __init__(self, endpoint: str | None, token: str | None = None) -> None:
        if not endpoint:
            raise LaunchConfigError(
                "resource skypilot",
                "api_server_endpoint",
                "the skypilot backend needs an API server",
                "set SKYPILOT_API_SERVER_ENDPOINT (or GPUDOOR_BACKEND=local for the embedded default)",
            )
        self.endpoint = endpoint.rstrip("/")
        self._token = token
        self._strategies = strategies.strategies(self)
        self._pools = strategies.WarmPools(self)

    def watch_key(self) -> tuple:
        """One status hub per API server and process."""
        return ("skypilot", self.endpoint)

    def check(self) -> None:
        """Fails fast, before anything is submitted, when the API server does not answer, or the SDK of
        this process talks to another one."""
        sky_sdk.health(self.endpoint, self._token)
        sdk_endpoint = sky_sdk.sky().server.common.get_server_url()
        if sdk_endpoint != self.endpoint:
            raise LaunchConfigError(
                "resource skypilot",
                "api_server_endpoint",
                f"the SkyPilot SDK of this process talks to {sdk_endpoint}, not {self.endpoint}",
                f"set SKYPILOT_API_SERVER_ENDPOINT={self.endpoint} in the environment of the code location",
            )

    def service_account(self) -> str | None:
        """The name the API server gives this backend's token (its ``/api/health`` answer), if any."""
        if not self._token:
            return None
        try:
            user = sky_sdk.health(self.endpoint, self._token).get("user") or {}
        except LaunchConfigError:
            return None
        return str(user.get("name") or "") or None if isinstance(user, dict) else None

    def build_task(self, job: ResolvedJob) -> Any:
        """The ``sky.Task`` for a resolved job: envs, secrets, resources with infra and labels, workdir."""
        return sky_sdk.build_task(job)

    # ----------------------------------------------------------------- jobs, by their strategy
    def _owner(self, job_id: str) -> strategies.JobStrategy:
        return strategies.owner_of(self._strategies, job_id)

    def submit(self, job: ResolvedJob) -> str:
        """Launches the job the way the fleet's ``launch_as`` says (a managed job unless it says otherwise)."""
        job_id = strategies.for_launch(self._strategies, job).submit(job)
        self._forget_usage()
        return job_id

    def status(self, job_id: str) -> JobInfo:
        info = self.statuses([job_id]).get(job_id)
        if info is None:
            raise KeyError(f"no job {job_id} on {self.endpoint}")
        return info

    def statuses(self, job_ids: Sequence[str]) -> dict[str, JobInfo]:
        """The jobs' states, one request per strategy (every managed job in one ``sky.jobs.queue_v2``)."""
        by_owner: dict[int, tuple[strategies.JobStrategy, list[str]]] = {}
        for job_id in job_ids:
            try:
                owner = self._owner(job_id)
            except KeyError:
                continue
            by_owner.setdefault(id(owner), (owner, []))[1].append(job_id)
        out: dict[str, JobInfo] = {}
        for owner, ids in by_owner.values():
            out.update(owner.infos(ids))
        return out

    def follow_logs(self, job_id: str) -> LogFollower:
        return self._owner(job_id).follow(job_id)

    def log_tail(self, job_id: str, lines: int = 30) -> list[str]:
        return self._owner(job_id).tail(job_id, lines)

    def cancel(self, job_id: str) -> None:
        self._owner(job_id).cancel([job_id])
        self._forget_usage()

    def holding_of(self, job_id: str) -> Holding:
        return self._owner(job_id).holding(job_id)

    def finish(self, job_id: str) -> str | None:
        said = self._owner(job_id).finish(job_id)
        if said:
            self._forget_usage()
        return said

    # ----------------------------------------------------------------- warm pools
    def submit_batch(self, job: ResolvedJob, num_jobs: int, *, pool_name: str, workers: int) -> list[str]:
        job_ids = self._pools.submit(job, num_jobs, pool_name=pool_name, workers=workers)
        self._forget_usage()
        return job_ids

    def pool_workers(self, pool_name: str) -> int:
        return self._pools.workers(pool_name)

    def release_pool(self, pool_name: str) -> None:
        self._pools.release(pool_name)
        self._forget_usage()

    # ----------------------------------------------------------------- what is held
    def free_gpus_at(self, infra: str) -> dict[str, int] | None:
        """GPUs free now by type (lowercase) on the infra's cluster: a Slurm cluster's nodes of the infra's
        partition (``slurm_node_info``), a Kubernetes context's nodes (``kubernetes_node_info``). One request
        per cluster, kept ``NODES_TTL_S`` in the process; None where the cluster cannot say."""
        parts = normalize_infra(infra).split("/")
        if parts[0] not in ("slurm", "kubernetes") or len(parts) < 2:
            return None
        nodes = self._nodes(parts[0], parts[1])
        if nodes is None:
            return None
        partition = parts[2] if len(parts) > 2 else None
        free: dict[str, int] = {}
        for gpu, partitions, count in nodes:
            if partition is None or partition in partitions:
                free[gpu] = free.get(gpu, 0) + count
        return free

    def _nodes(self, kind: str, cluster: str) -> list[tuple[str, tuple[str, ...], int]] | None:
        """(GPU type, partitions, free GPUs) per node of one cluster, read at most every ``NODES_TTL_S``."""
        key = (self.endpoint, kind, cluster)
        with _USAGE_LOCK:
            kept = _NODES.get(key)
        if kept is not None and time.monotonic() - kept[0] < NODES_TTL_S:
            return kept[1]
        sky = sky_sdk.sky()
        try:
            sdk = sky.client.sdk  # the SDK of the process's `sky` (a test's stand-in has none: nothing to read)
            if kind == "slurm":
                rows = sky.get(sdk.slurm_node_info(slurm_cluster_name=cluster)) or []
                nodes = [
                    (
                        str(r.get("gpu_type") or "").lower(),
                        tuple(p.strip().rstrip("*") for p in str(r.get("partition") or "").split(",")),
                        int(r.get("free_gpus") or 0),
                    )
                    for r in rows
                ]
            else:
                info = sky.get(sdk.kubernetes_node_info(context=cluster))
                nodes = [
                    (str(n.accelerator_type or "").lower(), (), max(0, int(sum(n.free.values()))))
                    for n in info.node_info_dict.values()
                    if n.accelerator_type and n.is_ready
                ]
        except Exception:  # noqa: BLE001 - availability is advice: routing falls back to the caps and waits
            nodes = None
        with _USAGE_LOCK:
            _NODES[key] = (time.monotonic(), nodes)
        return nodes

    def usage(self) -> Usage:
        """GPUs (and CPU-only jobs' vCPUs) held per pool and user label: by unfinished managed jobs, by the
        workers of warm pools (whose jobs the queue shows without labels: the workers hold the GPUs), and by
        the door's step clusters.

        Read at most every ``usage_ttl_s`` per process and API server (fifty steps starting together make
        one full-queue request, not fifty); a submit or cancel from this process reads it again.
        """
        with _USAGE_LOCK:
            cached = _USAGE_CACHE.get(self.endpoint)
            if cached is not None and time.monotonic() - cached[0] < self.usage_ttl_s:
                return cached[1]
        asked = time.monotonic()
        usage = self._read_usage()
        with _USAGE_LOCK:
            if self.endpoint not in _USAGE_STALE or _USAGE_STALE[self.endpoint] < asked:
                _USAGE_CACHE[self.endpoint] = (asked, usage)
        return usage

    def _forget_usage(self) -> None:
        """What this process just submitted or cancelled is not in the cached usage: read it again next time."""
        with _USAGE_LOCK:
            _USAGE_CACHE.pop(self.endpoint, None)
            _USAGE_STALE[self.endpoint] = time.monotonic()

    def _read_usage(self) -> Usage:
        """The queue, the warm pools and the clusters, asked side by side (each is a request of seconds on a
        busy server)."""
        sky = sky_sdk.sky()
        pools = _SIDE_READS.submit(lambda: sky_sdk.read(lambda: sky.jobs.pool_status(None)))
        clusters = _SIDE_READS.submit(lambda: sky_sdk.read(lambda: sky.status(all_users=True)))
        records, *_ = sky_sdk.read(
            lambda: sky.jobs.queue_v2(
                refresh=False, skip_finished=True, all_users=True, fields=sky_records.QUEUE_FIELDS
            )
        )
        held = [row for r in records if (row := sky_records.job_held(r)) is not None]
        held.extend(sky_records.pool_workers_held(pools.result() or ()))
        held.extend(sky_records.clusters_held(clusters.result() or ()))
        return Usage.tally(held)

    def job_history(self, since: float, until: float, *, submitted_after: float | None = None) -> list[JobUsage]:
        """See :func:`.sky_inventory.job_history`."""
        return sky_inventory.job_history(since, until, submitted_after=submitted_after)

    def holdings(self) -> list[Holding]:
        """See :func:`.sky_inventory.holdings`."""
        return sky_inventory.holdings()

    # ----------------------------------------------------------------- releases
    def release_all(self, holdings: Sequence[Holding]) -> dict[str, str]:
        """Every job in one ``sky.jobs.cancel``; pools and clusters one by one (there are few)."""
        jobs = [h for h in holdings if h.kind == "job"]
        errors = super().release_all([h for h in holdings if h.kind != "job"])
        if jobs:
            try:
                strategies.ManagedJobs(self).cancel([h.id for h in jobs])
            except Exception as e:  # noqa: BLE001 - recorded with each release; the look afterwards decides
                errors.update({h.key: f"{type(e).__name__}: {e}" for h in jobs})
            self._forget_usage()
        return errors

    def check_released(self, holding: Holding) -> ReleaseCheck:
        """What the API server shows: a job terminal (SkyPilot's controller tears its cluster down before it
        says CANCELLED) and no cluster of its name in ``sky.status``; a pool gone from ``sky.jobs.pool_status``;
        a cluster gone from ``sky.status``. The SDK has no view of a scheduler's own queue (Slurm's ``squeue``)."""
        if holding.kind == "job":
            return self.check_released_all([holding])[holding.key]
        if holding.kind == "pool":
            record = self._pools.record(holding.id)
            if record is None:
                return ReleaseCheck(True, (f"pool {holding.id}: gone from sky.jobs.pool_status",))
            return ReleaseCheck(False, (f"pool {holding.id}: {sky_records.status_name(record)}",))
        if holding.kind == "cluster":
            left = sky_sdk.clusters([holding.id])
            if holding.id in left:
                return ReleaseCheck(False, (f"sky.status: cluster {holding.id} {left[holding.id]}",))
            return ReleaseCheck(True, (f"sky.status: no cluster {holding.id}",))
        return super().check_released(holding)

    def check_released_all(self, holdings: Sequence[Holding]) -> dict[str, ReleaseCheck]:
        """Every job's state from one ``sky.jobs.queue_v2`` and the ended ones' clusters from one
        ``sky.status``; pools and clusters one by one (there are few)."""
        jobs = [h for h in holdings if h.kind == "job"]
        out = super().check_released_all([h for h in holdings if h.kind != "job"])
        if not jobs:
            return out
        from sky.jobs.utils import generate_managed_job_cluster_name

        infos = self.statuses([h.id for h in jobs])
        clusters = {
            h.key: generate_managed_job_cluster_name(infos[h.id].name or h.name or "job", int(h.id))
            for h in jobs
            if h.id in infos and infos[h.id].state.is_terminal
        }
        listed = sky_sdk.clusters(list(clusters.values())) if clusters else {}
        for h in jobs:
            info = infos.get(h.id)
            if info is None:
                out[h.key] = ReleaseCheck(True, (f"job {h.id}: unknown to the API server",))
            elif not info.state.is_terminal:
                out[h.key] = ReleaseCheck(False, (f"job {h.id}: {info.state.value}",))
            else:
                name = clusters[h.key]
                seen = (
                    f"sky.status: cluster {name} {listed[name]}" if name in listed else f"sky.status: no cluster {name}"
                )
                out[h.key] = ReleaseCheck(name not in listed, (f"job {h.id}: {info.state.value}", seen))
        return out

    # ----------------------------------------------------------------- services (demos)
    def start_service(self, job: ResolvedJob) -> Service:
        """``sky.launch`` on ``job.cluster_name`` (autostop comes from the task's resources)."""
        sky = sky_sdk.sky()
        cluster = job.cluster_name or job.name
        with sky_sdk.refusals(job):
            job_id, _ = sky.get(sky.launch(sky_sdk.build_task(job), cluster_name=cluster, retry_until_up=False))
        return _SkyService(cluster, str(job_id))

    def stop_service(self, cluster_name: str) -> bool:
        """``sky.down`` of the service's cluster (a step cluster's job is then never relaunched)."""
        if cluster_name.startswith(STEP_CLUSTER_PREFIX):
            return step_clusters.release_cluster(cluster_name, wait=True)
        sky = sky_sdk.sky()
        from sky import exceptions

        try:
            sky.get(sky.down(cluster_name))
        except (exceptions.ClusterDoesNotExist, ValueError):
            return False
        return True


class _SkyService(Service):
    """A job on a cluster of its own, launched with ``sky.launch``."""

    def __init__(self, cluster_name: str, job_id: str) -> None:
        self.cluster_name, self.job_id = cluster_name, job_id

    def status(self) -> JobInfo:
        sky = sky_sdk.sky()
        found = sky.get(sky.job_status(self.cluster_name, job_ids=[int(self.job_id)])).get(int(self.job_id))
        state = sky_sdk.cluster_job_state(found)
        if state is JobState.PENDING:  # a service that is set up is running as far as its step is concerned
            state = JobState.RUNNING
        return JobInfo(
            job_id=self.job_id,
            state=state or JobState.FAILED_CONTROLLER,
            name=self.cluster_name,
            infra=self.cluster_name,
        )

    def follow_logs(self) -> LogFollower:
        sky = sky_sdk.sky()
        return sky_sdk.ThreadFollower(
            lambda out: sky.tail_logs(self.cluster_name, int(self.job_id), follow=True, output_stream=out)
        )

    def log_tail(self, lines: int = 30) -> list[str]:
        sky = sky_sdk.sky()
        return sky_sdk.tail(
            lambda out: sky.tail_logs(self.cluster_name, int(self.job_id), follow=False, tail=lines, output_stream=out),
            lines,
        )

    def url(self, port: int) -> str | None:
        """``sky.endpoints`` of the cluster's port."""
        sky = sky_sdk.sky()
        try:
            endpoints = sky.get(sky.endpoints(self.cluster_name, port))
        except Exception:  # Not ready yet: the caller polls until its deadline.
            return None
        url = endpoints.get(port) or endpoints.get(str(port))
        return f"http://{url}" if url and not url.startswith("http") else url
