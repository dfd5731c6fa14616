"""The production backend: SkyPilot managed jobs through the Python SDK and an API server.

The only module of the package that imports ``sky`` (lazily, after usage collection is switched
off). Every call goes through the SDK against the configured API server; the ``sky`` command line is
never used. Requests return ids, resolved with ``sky.get``.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import copy
import io
import math
import queue
import re
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from gpudoor_pipelines.launch import sky_env
from gpudoor_pipelines.launch.backends import step_clusters
from gpudoor_pipelines.launch.backends.base import Backend, LogFollower, Service
from gpudoor_pipelines.launch.errors import LaunchConfigError, PoolFull
from gpudoor_pipelines.launch.job import Holding, JobInfo, JobState, JobUsage, ReleaseCheck
from gpudoor_pipelines.launch.labels import LABEL_POOL, LABEL_USER, STEP_CLUSTER_PREFIX
from gpudoor_pipelines.launch.resolve.request import ResolvedJob
from gpudoor_pipelines.launch.resolve.routing import Route, Usage
from gpudoor_pipelines.launch.resolve.specs import gpus_per_node

_QUEUE_FIELDS = [
    "job_id", "job_name", "status", "infra", "cloud", "region", "zone", "recovery_count", "submitted_at", "start_at",
    "end_at", "job_duration", "last_recovered_at", "failure_reason", "details", "labels", "accelerators", "resources",
]  # fmt: skip
# What the reconciler reads of every unfinished job: a pending job has no cluster yet, so its labels
# come from the task it was launched with.
_HOLDING_FIELDS = ["job_id", "job_name", "status", "labels", "submitted_at", "pool", "cluster_name_on_cloud",
                   "task_id", "user_yaml"]  # fmt: skip
# The history also reads the task each job was launched with: once a job's cluster is gone, the queue
# no longer shows its labels nor its GPUs.
_HISTORY_FIELDS = [*_QUEUE_FIELDS, "task_id", "user_yaml"]
_NODES = re.compile(r"^(\d+)x")
_GPUS = re.compile(r"[\[,]\s*([A-Za-z][\w-]*):(\d+(?:\.\d+)?)")  # "2x[H200:8]": H200, 8 (not "CPU:8+")
_CPUS = re.compile(r"CPU:(\d+)")  # queue_v2 shows a CPU-only job as e.g. "1x[CPU:8+]"


def _update_mode():
    from sky.serve import serve_utils

    return serve_utils.DEFAULT_UPDATE_MODE


def _sky():
    sky_env.prepare()
    import sky
    import sky.server.common  # noqa: F401 - makes `sky.server.common` reachable as an attribute

    return sky


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


class _QueueStream(io.TextIOBase):
    """A text stream that hands complete lines (colour codes removed) to a queue."""

    def __init__(self, lines: queue.Queue[str]) -> None:
        self._lines = lines
        self._partial = ""

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        data = self._partial + text
        *complete, self._partial = data.split("\n")
        for line in complete:
            self._lines.put(_ANSI.sub("", line).rstrip("\r"))
        return len(text)

    def flush_partial(self) -> None:
        if self._partial:
            self._lines.put(_ANSI.sub("", self._partial))
            self._partial = ""


_USAGE_LOCK = threading.Lock()
#: Reads sent side by side with another one (the warm pools while the queue is read).
_SIDE_READS = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="gpudoor-sky-read")
_USAGE_CACHE: dict[str, tuple[float, Usage]] = {}  # endpoint -> (when the read started, usage)
_USAGE_STALE: dict[str, float] = {}  # endpoint -> when this process last changed what is held


class _ThreadFollower(LogFollower):
    """Runs a blocking SDK log stream (``follow=True``) in a thread; ``poll`` hands out its lines."""

    def __init__(self, stream_to) -> None:
        self._lines: queue.Queue[str] = queue.Queue()
        self._stream = _QueueStream(self._lines)
        self._thread = threading.Thread(target=self._run, args=(stream_to,), daemon=True)
        self._thread.start()

    def _run(self, stream_to) -> None:
        try:
            stream_to(self._stream)
        except Exception as e:  # The stream ends with the job or the connection; say so in the log.
            self._lines.put(f"[gpudoor] log stream ended: {type(e).__name__}: {e}")
        self._stream.flush_partial()

    @property
    def ended(self) -> bool:
        """The SDK's stream returned: the job ended (or the connection dropped), and every line is handed out."""
        return not self._thread.is_alive() and self._lines.empty()

    def poll(self) -> list[str]:
        out = []
        while True:
            try:
                out.append(self._lines.get_nowait())
            except queue.Empty:
                return out

    def close(self) -> None:
        # The SDK call cannot be interrupted; the daemon thread ends with the job's log.
        self._thread.join(timeout=2)


def _state(status: Any) -> JobState:
    name = getattr(status, "value", status)
    try:
        return JobState(str(name))
    except ValueError:
        # Newer SkyPilot states map onto the closest one we know.
        return JobState.RUNNING if "RUN" in str(name) else JobState.PENDING


class SkyPilotBackend(Backend):
    """Launches resolved jobs as SkyPilot managed jobs on the team's API server.

    The SDK takes its API server and token from the process's own SkyPilot settings
    (``SKYPILOT_API_SERVER_ENDPOINT`` / ``SKYPILOT_SERVICE_ACCOUNT_TOKEN``, or ``~/.sky/config.yaml``);
    this backend never rewrites them. :meth:`check` confirms they name the server it was given.

    Args:
        endpoint: the API server URL; required (a missing one never starts a local server).
        token: a service-account token, if the server needs one (for the reachability check).
    """

    name = "skypilot"
    remote_status = True
    #: How long a read of what the team's jobs hold (``usage``) is reused by this process: the full
    #: queue is the heaviest request a launch makes. This process's own submits and cancels drop it.
    usage_ttl_s = 2.0
    #: How long reads are retried while the API server cannot be reached (see ``_read``).
    read_retry_s = 90.0

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
        self.pool_poll_s = 5.0

    def watch_key(self) -> tuple:
        """One status hub per API server and process."""
        return ("skypilot", self.endpoint)

    def _read(self, request: Any) -> Any:
        """``sky.get`` of a read-only request (states, the queue, a pool's status), sent again while the
        API server cannot be reached, for up to ``read_retry_s``: a busy or restarting server is not a
        failed step. Launches and cancels are never sent twice."""
        sky = _sky()
        from sky.exceptions import ApiServerConnectionError

        deadline, wait = time.monotonic() + self.read_retry_s, 1.0
        while True:
            try:
                return sky.get(request())
            except ApiServerConnectionError:
                if time.monotonic() + wait > deadline:
                    raise
                time.sleep(wait)
                wait = min(wait * 2, 15.0)

    def check(self) -> None:
        """Fails fast, before anything is submitted, when the API server does not answer.

        One plain request to ``/api/health`` with a short timeout (SkyPilot's own client retries for
        tens of seconds), then a check that the SDK of this process talks to that same server.
        """
        import urllib.error
        import urllib.request

        request = urllib.request.Request(f"{self.endpoint}/api/health")
        if self._token:
            request.add_header("Authorization", f"Bearer {self._token}")
        try:
            with urllib.request.urlopen(request, timeout=5) as response:
                response.read()
        except urllib.error.HTTPError as e:
            if e.code in (401, 403):
                raise LaunchConfigError(
                    "resource skypilot", "service_account_token", f"the API server at {self.endpoint} refused the credentials ({e.code})",
                    "set SKYPILOT_SERVICE_ACCOUNT_TOKEN to a valid service-account token",
                ) from None  # fmt: skip
            raise LaunchConfigError(
                "resource skypilot", "api_server_endpoint", f"{self.endpoint}/api/health answered {e.code}",
                "check that SKYPILOT_API_SERVER_ENDPOINT points at a SkyPilot API server",
            ) from None  # fmt: skip
        except (urllib.error.URLError, OSError) as e:
            raise LaunchConfigError(
                "resource skypilot",
                "api_server_endpoint",
                f"no SkyPilot API server answers at {self.endpoint} ({getattr(e, 'reason', e)})",
                "start the API server or correct SKYPILOT_API_SERVER_ENDPOINT",
            ) from None
        sdk_endpoint = _sky().server.common.get_server_url()
        if sdk_endpoint != self.endpoint:
            raise LaunchConfigError(
                "resource skypilot", "api_server_endpoint",
                f"the SkyPilot SDK of this process talks to {sdk_endpoint}, not {self.endpoint}",
                f"set SKYPILOT_API_SERVER_ENDPOINT={self.endpoint} in the environment of the code location",
            )  # fmt: skip

    def build_task(self, job: ResolvedJob):
        """The ``sky.Task`` for a resolved job: envs, secrets, resources with infra and labels, workdir."""
        sky = _sky()
        config = copy.deepcopy(job.config)
        secrets = config.pop("secrets", None) or {}
        config["name"] = job.name
        task = sky.Task.from_yaml_config(config, secrets_overrides=list(secrets.items()) or None)
        task.workdir = job.workdir
        return task

    def submit(self, job: ResolvedJob) -> str:
        """``sky.jobs.launch`` of the job; returns the managed job id. A job the fleet launches as a cluster
        (``launch_as``) goes to :mod:`step_clusters` instead (its id is ``<cluster>/<id>``)."""
        if job.launch_as == "cluster":
            job_id = step_clusters.launch(self, job)
            self._forget_usage()
            return job_id
        sky = _sky()
        with _refusals(job):
            job_ids, _ = sky.get(sky.jobs.launch(self.build_task(job), name=job.name))
        self._forget_usage()
        if not job_ids:
            raise RuntimeError(f"SkyPilot returned no job id for {job.name}")
        return str(job_ids[0])

    def _record(self, job_id: int):
        sky = _sky()
        records, *_ = self._read(
            lambda: sky.jobs.queue_v2(refresh=False, all_users=True, job_ids=[job_id], fields=_QUEUE_FIELDS)
        )
        for record in records:
            if record.job_id == job_id:
                return record
        raise KeyError(f"no managed job {job_id} on {self.endpoint}")

    def status(self, job_id: str) -> JobInfo:
        """The managed job's record from ``sky.jobs.queue_v2`` (a step cluster's job: see :mod:`step_clusters`)."""
        if step_clusters.is_step_cluster_job(job_id):
            info = step_clusters.infos(self, [job_id]).get(job_id)
            if info is None:
                raise KeyError(f"no step cluster {step_clusters.cluster_of(job_id)} on {self.endpoint}")
            return info
        return _info(self._record(int(job_id)))

    def statuses(self, job_ids: Sequence[str]) -> dict[str, JobInfo]:
        """Many managed jobs' records from one ``sky.jobs.queue_v2`` request (and step clusters' jobs from one
        ``sky.status``)."""
        clustered = [i for i in job_ids if step_clusters.is_step_cluster_job(i)]
        if clustered:
            managed = [i for i in job_ids if not step_clusters.is_step_cluster_job(i)]
            return {**step_clusters.infos(self, clustered), **(self.statuses(managed) if managed else {})}
        if not job_ids:
            return {}
        sky = _sky()
        records, *_ = self._read(
            lambda: sky.jobs.queue_v2(
                refresh=False, all_users=True, job_ids=[int(i) for i in job_ids], fields=_QUEUE_FIELDS
            )
        )
        return {str(r.job_id): _info(r) for r in records}

    # ----------------------------------------------------------------- warm pools
    def submit_batch(self, job: ResolvedJob, num_jobs: int, *, pool_name: str, workers: int) -> list[str]:
        """``sky.jobs.pool_apply`` (setup runs once per worker), then one ``sky.jobs.launch(pool=, num_jobs=)``."""
        sky = _sky()
        config = copy.deepcopy(job.config)
        secrets = config.pop("secrets", None) or {}
        # SkyPilot refuses job_recovery on a pool: the pool recovers a job whose worker is preempted on a
        # replacement worker itself, and the caller relaunches what a failed job had not finished.
        if isinstance(config.get("resources"), dict):
            config["resources"].pop("job_recovery", None)
        current = self._pool(pool_name)
        if current is None or int(current.get("target_num_replicas") or 0) < workers:
            pool_config = {k: v for k, v in config.items() if k != "run"}
            pool_config.update(name=pool_name, pool={"workers": workers})
            pool_task = sky.Task.from_yaml_config(
                pool_config, secrets_overrides=list(secrets.items()) or None
            )
            pool_task.workdir = job.workdir
            with _refusals(job):
                sky.get(sky.jobs.pool_apply(pool_task, pool_name, mode=_update_mode()))
        self._wait_ready(pool_name)
        # The job runs on the pool's workers: they decide where, and they already ran the setup.
        job_config = {k: v for k, v in config.items() if k not in ("setup", "num_nodes")}
        job_config["name"] = job.name
        task = sky.Task.from_yaml_config(job_config, secrets_overrides=list(secrets.items()) or None)
        task.workdir = job.workdir
        with _refusals(job):
            job_ids, _ = sky.get(sky.jobs.launch(task, name=job.name, pool=pool_name, num_jobs=num_jobs))
        self._forget_usage()
        if len(job_ids or ()) != num_jobs:
            raise RuntimeError(
                f"SkyPilot returned {len(job_ids or ())} job ids for {num_jobs} jobs of {job.name}"
            )
        return [str(i) for i in job_ids]

    def _pool(self, pool_name: str) -> dict | None:
        sky = _sky()
        try:
            records = self._read(lambda: sky.jobs.pool_status([pool_name]))
        except Exception as e:  # noqa: BLE001 - SkyPilot raises a plain exception for an unknown pool
            if "not found" in str(e).lower() or "does not exist" in str(e).lower():
                return None
            raise
        return next((r for r in records or () if r.get("name") == pool_name), None)

    def _wait_ready(self, pool_name: str, timeout_s: float = 900.0) -> None:
        deadline = time.time() + timeout_s
        while True:
            record = self._pool(pool_name)
            status = str(getattr(record and record.get("status"), "value", record and record.get("status")))
            if status == "READY":
                return
            if status.startswith("FAILED") or time.time() > deadline:
                raise RuntimeError(
                    f"pool {pool_name} is {status} (not READY after {time.time() - deadline + timeout_s:.0f} s)"
                )
            time.sleep(self.pool_poll_s)

    def pool_workers(self, pool_name: str) -> int:
        """The pool's target number of workers, from ``sky.jobs.pool_status`` (0 when there is no such pool)."""
        record = self._pool(pool_name)
        return int(record.get("target_num_replicas") or 0) if record else 0

    def release_pool(self, pool_name: str) -> None:
        """``sky.jobs.pool_down`` of the pool (nothing if there is none)."""
        sky = _sky()
        if self._pool(pool_name) is None:
            return
        sky.get(sky.jobs.pool_down(pool_name))
        self._forget_usage()

    def free_gpus(self, route: Route) -> int | None:
        """What the route's Slurm cluster reports free of the route's GPU (``realtime_slurm_gpu_availability``)."""
        parts = route.infra.split("/")
        if parts[0] != "slurm" or len(parts) < 2 or not route.accelerator:
            return None
        from sky.client import sdk

        try:
            groups = _sky().get(
                sdk.realtime_slurm_gpu_availability(
                    slurm_cluster_name=parts[1], name_filter=route.accelerator
                )
            )
        except Exception:  # noqa: BLE001 - availability is advice: fall back to the caps
            return None
        free = None
        for _cluster, gpus, _error in groups or ():
            for gpu, _counts, _capacity, available in gpus or ():
                if str(gpu).lower() == route.accelerator.lower():
                    free = (free or 0) + int(available)
        return free

    def follow_logs(self, job_id: str) -> LogFollower:
        """Streams ``sky.jobs.tail_logs(follow=True)`` in a thread (a step cluster's: ``sky.tail_logs``)."""
        if step_clusters.is_step_cluster_job(job_id):
            return step_clusters.follow(self, job_id)
        sky = _sky()
        return _ThreadFollower(
            lambda out: sky.jobs.tail_logs(job_id=int(job_id), follow=True, output_stream=out)
        )

    def log_tail(self, job_id: str, lines: int = 30) -> list[str]:
        """The last lines of the job's log."""
        sky = _sky()
        if step_clusters.is_step_cluster_job(job_id):
            cluster, sky_job_id = step_clusters.cluster_of(job_id), step_clusters.sky_job_of(job_id)
            return _tail(lambda out: sky.tail_logs(cluster, sky_job_id, follow=False, tail=lines, output_stream=out), lines)
        return _tail(
            lambda out: sky.jobs.tail_logs(job_id=int(job_id), follow=False, tail=lines, output_stream=out),
            lines,
        )

    def cancel(self, job_id: str) -> None:
        """``sky.jobs.cancel`` of the job (returns once the request is accepted); a step cluster is torn down."""
        if step_clusters.is_step_cluster_job(job_id):
            step_clusters.release(job_id, wait=True)
            self._forget_usage()
            return
        sky = _sky()
        sky.get(sky.jobs.cancel(job_ids=[int(job_id)]))
        self._forget_usage()

    def holding_of(self, job_id: str) -> Holding:
        """A managed job; a step cluster's job holds its cluster."""
        return step_clusters.holding(job_id) if step_clusters.is_step_cluster_job(job_id) else Holding("job", job_id)

    def finish(self, job_id: str) -> str | None:
        """A step cluster is torn down once its job has ended (a managed job's controller does that itself)."""
        if not step_clusters.is_step_cluster_job(job_id):
            return None
        said = step_clusters.finish(job_id)
        self._forget_usage()
        return said

    def usage(self) -> Usage:
        """GPUs (and CPU-only jobs' vCPUs) held per pool and user label: by unfinished managed jobs, and by
        the workers of warm pools (whose jobs the queue shows without labels: the workers hold the GPUs).

        Read at most every ``usage_ttl_s`` per process and API server (fifty steps starting together
        make one full-queue request, not fifty); a submit or cancel from this process reads it again.
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
        """The queue, the warm pools and the clusters (the door's step clusters), asked side by side (each is
        a request of seconds on a busy server)."""
        sky = _sky()
        pools = _SIDE_READS.submit(lambda: self._read(lambda: sky.jobs.pool_status(None)))
        clusters = _SIDE_READS.submit(lambda: self._read(lambda: sky.status(all_users=True)))
        records, *_ = self._read(
            lambda: sky.jobs.queue_v2(refresh=False, skip_finished=True, all_users=True, fields=_QUEUE_FIELDS)
        )
        held = [row for r in records if (row := job_held(r)) is not None]
        held.extend(pool_workers_held(pools.result() or ()))
        held.extend(step_clusters.clusters_held(clusters.result() or ()))
        return Usage.tally(held)

    def job_history(self, since: float, until: float, *, submitted_after: float | None = None) -> list[JobUsage]:
        """Every managed job with a ``gpudoor-pool`` label that ran between ``since`` and ``until``, whoever
        launched it, from one ``sky.jobs.queue_v2`` request over all users.

        The SDK's ``queue_v2`` has no page argument: without ``limit`` the server answers with every job,
        so a busy week is not cut short; jobs submitted after ``until`` are left out by the server. Labels
        and GPUs come from the job's cluster while it is up, else from the task it was launched with.
        ``ran_s`` is SkyPilot's ``job_duration``: the time the job ran, without the time it spent
        recovering after preemptions. Demos and dev clusters (``lab-…``, ``dev-…``, launched with
        ``sky.launch``) are clusters, not managed jobs: they come from SkyPilot's cluster history
        (``sky.cost_report``), one entry per time the cluster was up.

        With ``submitted_after`` (``gpudoor status``): the server leaves out every job submitted before
        it, so a listing does not read the whole history; jobs not started yet are kept.
        """
        sky = _sky()
        records, *_ = self._read(
            lambda: sky.jobs.queue_v2(refresh=False, skip_finished=False, all_users=True, submitted_before=until,
                                      submitted_after=submitted_after, fields=_HISTORY_FIELDS)
        )  # fmt: skip
        out = []
        for r in records:
            started, ended = r.start_at or None, r.end_at or None
            if submitted_after is not None:
                if (r.submitted_at or 0) <= submitted_after:
                    continue
            elif started is None or started >= until or (ended is not None and ended <= since):
                continue
            # The launched task is parsed only when the queue no longer shows the job's cluster.
            task = _launched_task(r.user_yaml, r.task_id) if not (r.labels and r.accelerators) else {}
            resources = task.get("resources") if isinstance(task.get("resources"), dict) else {}
            labels = dict(r.labels or resources.get("labels") or {})
            if not labels.get(LABEL_POOL):
                continue
            m = _NODES.match(r.resources or "")
            nodes = int(m.group(1)) if m else int(task.get("num_nodes") or 1)
            out.append(
                JobUsage.from_labels(
                    labels, job_id=str(r.job_id), name=r.job_name or "", gpus=_record_gpus(r, resources) * nodes,
                    started_at=started, ended_at=ended, state=_state(r.status), recoveries=int(r.recovery_count or 0),
                    ran_s=float(r.job_duration) if r.job_duration is not None else None,
                )
            )  # fmt: skip
        return out + self._interactive_clusters(since, until)

    def _interactive_clusters(self, since: float, until: float) -> list[JobUsage]:
        """The ``lab-…``/``dev-…`` clusters and the door's step clusters with a ``gpudoor-pool`` label that were up between ``since`` and
        ``until``, from one ``sky.cost_report`` request (its history keeps torn-down clusters and their
        launched resources, labels included). A cluster is never preempted and recovered: it ran all the
        time it was up."""
        sky = _sky()
        from gpudoor_pipelines.launch.labels import INTERACTIVE_PREFIXES
        now = time.time()
        records = self._read(lambda: sky.cost_report(days=max(1, math.ceil((now - since) / 86400.0) + 1)))
        out = []
        for rec in records or ():
            name = str(rec.get("name") or "")
            resources = rec.get("resources")
            labels = {str(k): str(v) for k, v in (getattr(resources, "labels", None) or {}).items()}
            if not name.startswith((*INTERACTIVE_PREFIXES, STEP_CLUSTER_PREFIX)) or not labels.get(LABEL_POOL):
                continue
            gpus = gpus_per_node(getattr(resources, "accelerators", None))
            nodes = int(rec.get("num_nodes") or 1)
            for start, end in rec.get("usage_intervals") or ():
                if start is None or start >= until or (end is not None and end <= since):
                    continue
                out.append(
                    JobUsage.from_labels(
                        labels, job_id=f"{name}@{int(start)}", name=name, gpus=gpus * nodes, started_at=float(start),
                        ended_at=None if end is None else float(end),
                        state=JobState.RUNNING if end is None else JobState.SUCCEEDED,
                        ran_s=(now if end is None else float(end)) - float(start),
                    )
                )  # fmt: skip
        return out

    # ----------------------------------------------------------------- what is held, and its release
    def holdings(self) -> list[Holding]:
        """Three requests whatever the numbers: ``sky.jobs.queue_v2`` of every user's unfinished jobs (a
        pool's jobs are its pool's), ``sky.jobs.pool_status`` of every warm pool, and ``sky.status`` of
        every user's clusters (the ``lab-…``/``dev-…`` ones and the door's step clusters)."""
        import yaml

        from gpudoor_pipelines.launch.labels import INTERACTIVE_PREFIXES
        sky = _sky()
        records, *_ = self._read(
            lambda: sky.jobs.queue_v2(refresh=False, skip_finished=True, all_users=True, fields=_HOLDING_FIELDS)
        )
        out = []
        for r in records:
            if r.pool or _state(r.status).is_terminal:
                continue
            labels = dict(r.labels or {})
            if not labels:  # no cluster yet: the labels it was launched with
                task = _launched_task(r.user_yaml, r.task_id)
                resources = task.get("resources") if isinstance(task.get("resources"), dict) else {}
                labels = {str(k): str(v) for k, v in (resources.get("labels") or {}).items()}
            out.append(Holding("job", str(r.job_id), labels=labels, since=r.submitted_at, state=_state(r.status).value,
                               name=r.job_name or "", scheduler_name=r.cluster_name_on_cloud or ""))  # fmt: skip
        for record in self._read(lambda: sky.jobs.pool_status(None)) or ():
            try:
                resources = (yaml.safe_load(record.get("pool_yaml") or "") or {}).get("resources") or {}
            except yaml.YAMLError:
                resources = {}
            labels = {str(k): str(v) for k, v in (resources.get("labels") or {}).items()}
            status = str(getattr(record.get("status"), "value", record.get("status")))
            out.append(Holding("pool", str(record.get("name")), labels=labels, state=status, name=str(record.get("name"))))
        for record in self._read(lambda: sky.status(all_users=True)) or ():
            name = str(record.get("name") or "")
            if not name.startswith((*INTERACTIVE_PREFIXES, STEP_CLUSTER_PREFIX)):
                continue
            handle = record.get("handle")
            resources = getattr(handle, "launched_resources", None)
            labels = {str(k): str(v) for k, v in (getattr(resources, "labels", None) or {}).items()}
            status = record.get("status")
            out.append(Holding("cluster", name, labels=labels, since=record.get("launched_at"),
                               state=str(getattr(status, "value", status)), name=name,
                               scheduler_name=str(getattr(handle, "cluster_name_on_cloud", "") or "")))  # fmt: skip
        return out

    def check_released(self, holding: Holding) -> ReleaseCheck:
        """What the API server shows: a job terminal (SkyPilot's controller tears its cluster down before it
        says CANCELLED) and no cluster of its name in ``sky.status``; a pool gone from ``sky.jobs.pool_status``;
        a cluster gone from ``sky.status``. The SDK has no view of a scheduler's own queue (Slurm's ``squeue``)."""
        if holding.kind == "job":
            return self.check_released_all([holding])[holding.key]
        if holding.kind == "pool":
            record = self._pool(holding.id)
            if record is None:
                return ReleaseCheck(True, (f"pool {holding.id}: gone from sky.jobs.pool_status",))
            status = str(getattr(record.get("status"), "value", record.get("status")))
            return ReleaseCheck(False, (f"pool {holding.id}: {status}",))
        if holding.kind == "cluster":
            left = self._clusters([holding.id])
            if holding.id in left:
                return ReleaseCheck(False, (f"sky.status: cluster {holding.id} {left[holding.id]}",))
            return ReleaseCheck(True, (f"sky.status: no cluster {holding.id}",))
        return super().check_released(holding)

    def release_all(self, holdings: Sequence[Holding]) -> dict[str, str]:
        """Every job in one ``sky.jobs.cancel``; pools and clusters one by one (there are few)."""
        jobs = [h for h in holdings if h.kind == "job"]
        errors = super().release_all([h for h in holdings if h.kind != "job"])
        if jobs:
            sky = _sky()
            try:
                sky.get(sky.jobs.cancel(job_ids=[int(h.id) for h in jobs]))
            except Exception as e:  # noqa: BLE001 - recorded with each release; the look afterwards decides
                errors.update({h.key: f"{type(e).__name__}: {e}" for h in jobs})
            self._forget_usage()
        return errors

    def check_released_all(self, holdings: Sequence[Holding]) -> dict[str, ReleaseCheck]:
        """Every job's state from one ``sky.jobs.queue_v2`` and the ended ones' clusters from one
        ``sky.status``; pools and clusters one by one (there are few)."""
        jobs = [h for h in holdings if h.kind == "job"]
        out = super().check_released_all([h for h in holdings if h.kind != "job"])
        if not jobs:
            return out
        from sky.jobs.utils import generate_managed_job_cluster_name

        infos = self.statuses([h.id for h in jobs])
        clusters = {h.key: generate_managed_job_cluster_name(infos[h.id].name or h.name or "job", int(h.id))
                    for h in jobs if h.id in infos and infos[h.id].state.is_terminal}  # fmt: skip
        listed = self._clusters(list(clusters.values())) if clusters else {}
        for h in jobs:
            info = infos.get(h.id)
            if info is None:
                out[h.key] = ReleaseCheck(True, (f"job {h.id}: unknown to the API server",))
            elif not info.state.is_terminal:
                out[h.key] = ReleaseCheck(False, (f"job {h.id}: {info.state.value}",))
            else:
                name = clusters[h.key]
                seen = f"sky.status: cluster {name} {listed[name]}" if name in listed else f"sky.status: no cluster {name}"
                out[h.key] = ReleaseCheck(name not in listed, (f"job {h.id}: {info.state.value}", seen))
        return out

    def _clusters(self, names: list[str]) -> dict[str, str]:
        """Those of ``names`` that ``sky.status`` lists (any user's), with their states."""
        sky = _sky()
        records = self._read(lambda: sky.status(cluster_names=names, all_users=True)) or ()
        return {str(r.get("name")): str(getattr(r.get("status"), "value", r.get("status"))) for r in records}

    # ----------------------------------------------------------------- services (demos)
    def start_service(self, job: ResolvedJob) -> Service:
        """``sky.launch`` on ``job.cluster_name`` (autostop comes from the task's resources)."""
        sky = _sky()
        cluster = job.cluster_name or job.name
        with _refusals(job):
            job_id, _ = sky.get(sky.launch(self.build_task(job), cluster_name=cluster, retry_until_up=False))
        return _SkyService(cluster, str(job_id))

    def stop_service(self, cluster_name: str) -> bool:
        """``sky.down`` of the service's cluster (a step cluster's job is then never relaunched)."""
        if cluster_name.startswith(STEP_CLUSTER_PREFIX):
            return step_clusters.release_cluster(cluster_name, wait=True)
        sky = _sky()
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
        sky = _sky()
        status = sky.get(sky.job_status(self.cluster_name, job_ids=[int(self.job_id)])).get(int(self.job_id))
        name = str(getattr(status, "value", status or ""))
        if status is None:
            state = JobState.FAILED_CONTROLLER
        elif name in ("SUCCEEDED", "CANCELLED", "FAILED_SETUP"):
            state = JobState(name)
        else:
            state = JobState.FAILED if "FAIL" in name else JobState.RUNNING
        return JobInfo(job_id=self.job_id, state=state, name=self.cluster_name, infra=self.cluster_name)

    def follow_logs(self) -> LogFollower:
        sky = _sky()
        return _ThreadFollower(
            lambda out: sky.tail_logs(self.cluster_name, int(self.job_id), follow=True, output_stream=out)
        )

    def log_tail(self, lines: int = 30) -> list[str]:
        sky = _sky()
        return _tail(
            lambda out: sky.tail_logs(
                self.cluster_name, int(self.job_id), follow=False, tail=lines, output_stream=out
            ),
            lines,
        )

    def url(self, port: int) -> str | None:
        """``sky.endpoints`` of the cluster's port."""
        sky = _sky()
        try:
            endpoints = sky.get(sky.endpoints(self.cluster_name, port))
        except Exception:  # Not ready yet: the caller polls until its deadline.
            return None
        url = endpoints.get(port) or endpoints.get(str(port))
        return f"http://{url}" if url and not url.startswith("http") else url


def _tail(read, lines: int) -> list[str]:
    out = io.StringIO()
    try:
        read(out)
    except Exception as e:  # The tail is best effort: the failure itself is reported anyway.
        return [f"[gpudoor] could not fetch the log tail: {type(e).__name__}: {e}"]
    return [_ANSI.sub("", line) for line in out.getvalue().splitlines() if line.strip()][-lines:]


@contextlib.contextmanager
def _refusals(job: ResolvedJob):
    """The server's refusals, as the same clear errors the client's own checks raise."""
    from sky import exceptions

    try:
        yield
    except exceptions.UserRequestRejectedByPolicy as e:
        full = PoolFull.from_refusal(str(e), job.spec_path or job.name)
        if full is not None:
            raise full from None
        raise LaunchConfigError(job.spec_path or job.name, "(admin policy)", f"rejected by the API server's policy: {e}",
                                "change what the policy names, then relaunch") from None  # fmt: skip
    except (exceptions.ResourcesUnavailableError, ValueError) as e:
        raise LaunchConfigError(job.name, "resources", f"SkyPilot cannot place the job: {e}",
                                "check the pool's infra and GPUs in task_specs/fleet.yaml") from None  # fmt: skip


def _field(r: Any, name: str) -> Any:
    """A field of a queue record: the SDK's records have attributes, the server's own are dicts."""
    return r.get(name) if isinstance(r, Mapping) else getattr(r, name, None)


def job_held(r: Any, *, launched_task: bool = False) -> tuple[str, str, int, int] | None:
    """(pool label, user label, GPUs, vCPUs) a managed job of the queue holds, over all its nodes; None for a
    job without a ``gpudoor-pool`` label, or on a warm pool (its pool's workers hold the GPUs).

    The labels and GPUs are the job's cluster's. A job without a cluster yet (pending) has none in the
    queue: with ``launched_task`` they come from the task it was launched with (``user_yaml``), else the
    job is not counted.
    """
    if _field(r, "pool"):
        return None
    labels = _field(r, "labels") or {}
    accelerators = _field(r, "accelerators")
    if launched_task and not labels:
        task = _launched_task(_field(r, "user_yaml"), _field(r, "task_id"))
        resources = task.get("resources") if isinstance(task.get("resources"), dict) else {}
        labels = resources.get("labels") or {}
        accelerators = resources.get("accelerators")
        nodes = int(task.get("num_nodes") or 1)
    else:
        nodes = int(m.group(1)) if (m := _NODES.match(_field(r, "resources") or "")) else 1
    if not labels.get(LABEL_POOL):
        return None
    cpus = int(m.group(1)) if (m := _CPUS.search(_field(r, "resources") or "")) else 0
    gpus = gpus_per_node(accelerators)
    return labels[LABEL_POOL], labels.get(LABEL_USER, "unknown"), gpus * nodes, cpus * nodes


def pool_workers_held(records: Iterable[Mapping[str, Any]]) -> list[tuple[str, str, int, int]]:
    """(pool label, user label, GPUs, vCPUs) of every warm pool's workers, from its task's labels
    (records as ``sky.jobs.pool_status`` gives them)."""
    import yaml

    from gpudoor_pipelines.launch.resolve.specs import parse_accelerators

    out = []
    for record in records:
        status = str(getattr(record.get("status"), "value", record.get("status")))
        if status in ("SHUTTING_DOWN", "FAILED_CLEANUP"):
            continue
        try:
            resources = (yaml.safe_load(record.get("pool_yaml") or "") or {}).get("resources") or {}
        except yaml.YAMLError:
            continue
        labels = resources.get("labels") or {}
        if not labels.get(LABEL_POOL):
            continue
        workers = int(record.get("target_num_replicas") or 0)
        gpus = sum(parse_accelerators(resources.get("accelerators")).values())
        out.append((labels[LABEL_POOL], labels.get(LABEL_USER, "unknown"), workers * gpus, 0))
    return out


def _launched_task(user_yaml: str | None, task_id: int | None) -> dict:
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


def _record_gpus(r: Any, resources: dict) -> float:
    """GPUs per node of a queue record: the cluster's, else the task's, else the queue's resources string.

    Several types listed are alternatives: the job got one of them.
    """
    counts = gpus_per_node(r.accelerators) or gpus_per_node(resources.get("accelerators"))
    if not counts:
        counts = max((float(n) for name, n in _GPUS.findall(r.resources or "") if name.upper() != "CPU"), default=0.0)
    return float(counts)


def _info(r: Any) -> JobInfo:
    """A queue_v2 record as a JobInfo."""
    # queue_v2's `infra` leaves the zone out ("Slurm (cluster)"); a Slurm partition is the zone.
    parts = [str(x) for x in (r.cloud, r.region, r.zone) if x]
    infra = "/".join([parts[0].lower(), *parts[1:]]) if parts else (r.infra or "")
    return JobInfo(
        job_id=str(r.job_id),
        state=_state(r.status),
        name=r.job_name or "",
        infra=infra,
        recoveries=int(r.recovery_count or 0),
        submitted_at=r.submitted_at,
        started_at=r.start_at,
        ended_at=r.end_at,
        detail=r.failure_reason or r.details or "",
        ran_s=float(r.job_duration) if r.job_duration is not None and r.start_at else None,
        # SkyPilot sets it at the first start too: it dates a recovery only once there was one.
        recovered_at=float(recovered) if (recovered := getattr(r, "last_recovered_at", None)) and r.recovery_count else None,
    )
