"""A stand-in for the part of the SkyPilot SDK the backend calls, for tests of the Dagster side.

What it fakes: the API server (managed jobs that move PENDING → RUNNING → SUCCEEDED over a few
status polls, their logs, cancel, the queue). What stays real: ``sky.Task`` (tasks are built and
checked by SkyPilot's own parser) and ``sky.exceptions``. Real managed jobs on a real API server are
exercised on the Slurm test bed (tests/slurm); this fake is for what the bed cannot show quickly:
an interrupt arriving at an exact moment, a job that has run for exactly one hour.
"""

from __future__ import annotations

import dataclasses
import enum
import threading
import time
import types
from typing import Any


class Status(enum.Enum):
    PENDING = "PENDING"
    RUNNING = "RUNNING"
    RECOVERING = "RECOVERING"
    SUCCEEDED = "SUCCEEDED"
    CANCELLED = "CANCELLED"
    FAILED = "FAILED"


@dataclasses.dataclass
class Record:
    """One row of ``sky.jobs.queue_v2``, with the fields the backend reads."""

    job_id: int
    job_name: str
    status: Status
    labels: dict
    accelerators: dict
    resources: str
    cloud: str = "Slurm"
    region: str = "fake-cluster"
    zone: str = "part"
    infra: str = "Slurm (fake-cluster)"
    recovery_count: int = 0
    submitted_at: float | None = None
    start_at: float | None = None
    end_at: float | None = None
    failure_reason: str | None = None
    details: str | None = None
    job_duration: float | None = None
    task_id: int = 0
    user_yaml: str | None = None
    pool: str | None = None
    cluster_name_on_cloud: str | None = None
    schedule_state: str | None = None  # the job's controller: DONE once it has exited


class FakeSky:
    """The fake SDK. ``polls_to_finish`` status polls after submission, a job succeeds.

    Attributes:
        launched: the ``sky.Task`` of every ``jobs.launch``.
        cancelled: job ids passed to ``jobs.cancel``.
        interrupt_after: raise ``interrupt`` from the n-th status poll (simulates a run being terminated).
        preempt_at: the status polls at which a running job is preempted: it shows RECOVERING (its
            recovery count up by one), then RUNNING again at the next poll.
        says: Pipes custom messages a job sends, by status poll (written where the job's Pipes
            bootstrap env says, as a job on a real node would).
    """

    def __init__(self, endpoint: str, polls_to_finish: int = 3, run_seconds: float = 3600.0) -> None:
        import sky

        self.Task = sky.Task
        self.exceptions = sky.exceptions
        self.endpoint = endpoint
        self.polls_to_finish = polls_to_finish
        self.run_seconds = run_seconds
        self.records: dict[int, Record] = {}
        self.polls: dict[int, int] = {}
        self.launched: list[Any] = []
        self.cancelled: list[int] = []
        self.queue_requests: list[dict] = []  # the arguments of every jobs.queue_v2 request
        self.interrupt_after: int | None = None
        self.interrupt: BaseException | None = None
        self.preempt_at: set[int] = set()
        self.preempt_jobs: set[int] | None = None  # the jobs preempt_at applies to (None: every job)
        self.says: dict[int, list[Any]] = {}
        self.full_pools: set[str] = set()  # pools the server's policy says are full (launches there are refused)
        self._lock = threading.Lock()
        self.pools: list[dict] = []  # records as sky.jobs.pool_status returns them
        self.clusters: list[dict] = []  # records as sky.cost_report returns them (clusters, torn down or up)
        self.cost_report = lambda days=None: list(self.clusters)
        self.up: list[dict] = []  # records as sky.status returns them (clusters up now)
        self.requests: dict[str, int] = {}  # every request by name (queue_v2, pool_status, status, ...)
        # Clusters launched with ``sky.launch`` (the door's step clusters): each has its job 1, 2, ...
        self.cluster_launches: list[tuple[str, Any]] = []  # (cluster name, task) of every sky.launch
        self.cluster_exit = 0  # what ``sky.tail_logs`` of a cluster's job returns (0 succeeded, 100 failed)
        self.lose_clusters = 0  # the next n clusters' allocations are lost while their job runs (preempted)
        self.cluster_run_s = 0.0  # how long a cluster's job runs before its last line (when not lost)
        self.relaunch_s = 0.0  # how long a lost cluster takes to come up again
        self.status_interrupt_after: int | None = None  # raise ``interrupt`` from the n-th sky.status of named clusters
        self.stream_drops = 0  # the next n log streams of a cluster's job break off while the job runs on
        self.job_status_errors = 0  # the next n sky.job_status requests fail (the API server does not answer)
        # An outage: every request before this time.monotonic() finds no server (ApiServerConnectionError).
        self.down_until = 0.0
        self.launch_answers_lost = 0  # the next n managed-job launches take effect, but their answer is lost
        self.cancel_answers_lost = 0  # the same for cancels
        self.log_lines = 0  # a managed job's log: this many numbered lines (0: a hello and a done line)
        # (after line n, outage s, how): the stream breaks there, cut ("cut") or ended cleanly by a server restart
        # that killed its request ("restart": SkyPilot returns the signal's negative number)
        self.log_breaks: list[tuple[int, float, str]] = []
        self.jobs = types.SimpleNamespace(
            launch=self._launch,
            queue_v2=self._queue_v2,
            tail_logs=self._tail_logs,
            cancel=self._cancel,
            pool_status=self._pool_status,
            pool_down=self._pool_down,
        )
        self.server = types.SimpleNamespace(common=types.SimpleNamespace(get_server_url=lambda: endpoint))

    def _count(self, name: str) -> None:
        if time.monotonic() < self.down_until:
            self.requests["refused"] = self.requests.get("refused", 0) + 1
            raise self.exceptions.ApiServerConnectionError(self.endpoint)
        self.requests[name] = self.requests.get(name, 0) + 1

    def outage(self, seconds: float) -> None:
        """The API server goes away for ``seconds`` from now."""
        self.down_until = time.monotonic() + seconds

    def _pool_status(self, names: list[str] | None) -> list[dict]:
        self._count("pool_status")
        return [p for p in self.pools if names is None or p["name"] in names]

    def _pool_down(self, name: str) -> None:
        self._count("pool_down")
        self.pools = [p for p in self.pools if p["name"] != name]

    def status(self, cluster_names: list[str] | None = None, all_users: bool = False, **_: Any) -> list[dict]:
        """``sky.status``: the clusters that are up."""
        self._count("status")
        if cluster_names is not None and self.status_interrupt_after is not None:  # a step looking at its cluster
            self.status_interrupt_after -= 1
            if self.status_interrupt_after <= 0:
                self.status_interrupt_after = None
                raise self.interrupt or KeyboardInterrupt()
        return [c for c in self.up if cluster_names is None or c["name"] in cluster_names]

    def down(self, cluster_name: str) -> None:
        """``sky.down``: the cluster goes."""
        self._count("down")
        if not any(c["name"] == cluster_name for c in self.up):
            raise self.exceptions.ClusterDoesNotExist(cluster_name)
        self.up = [c for c in self.up if c["name"] != cluster_name]

    def launch(self, task: Any, cluster_name: str, retry_until_up: bool = False, **_: Any) -> tuple[int, None]:
        """``sky.launch``: the cluster is up, its job submitted (job ids count per cluster, from 1)."""
        if any(name == cluster_name for name, _ in self.cluster_launches):
            time.sleep(self.relaunch_s)
        with self._lock:
            self._count("cluster_launch")
            (resources,) = task.resources
            handle = types.SimpleNamespace(
                launched_nodes=task.num_nodes,
                launched_resources=types.SimpleNamespace(
                    labels=dict(resources.labels or {}), accelerators=dict(resources.accelerators or {})
                ),
            )
            self.up.append({"name": cluster_name, "status": "UP", "handle": handle, "launched_at": 1000.0})
            self.cluster_launches.append((cluster_name, task))
            return sum(1 for name, _ in self.cluster_launches if name == cluster_name), None

    def api_cancel(self, request_ids: Any, silent: bool = False) -> None:
        self._count("api_cancel")

    def tail_logs(self, cluster_name: str, job_id: int, follow: bool = True, tail: int = 0, output_stream=None) -> int:
        """``sky.tail_logs`` of a cluster's job: its lines, then its exit code (a lost cluster's stream breaks)."""
        output_stream.write(f"cluster {cluster_name} job {job_id} says hello\n")
        if follow and self.stream_drops:
            self.stream_drops -= 1
            return 255
        if follow and self.lose_clusters:
            self.lose_clusters -= 1
            seen = self.requests.get("status", 0)
            # It runs until the step has looked at it twice (30 s at most, for a loaded machine); then its
            # allocation is lost.
            deadline = time.monotonic() + 30.0
            while self.requests.get("status", 0) < seen + 2 and time.monotonic() < deadline:
                time.sleep(0.01)
            self.up = [c for c in self.up if c["name"] != cluster_name]  # the allocation is gone
            return 100
        time.sleep(self.cluster_run_s)  # it runs a moment
        output_stream.write(f"cluster {cluster_name} job {job_id} is done\n")
        return self.cluster_exit

    def job_status(self, cluster_name: str, job_ids: list[int]) -> dict[int, Any]:
        self._count("job_status")
        if self.job_status_errors:
            self.job_status_errors -= 1
            raise ConnectionError("the API server did not answer")
        return {i: "FAILED" if self.cluster_exit else "SUCCEEDED" for i in job_ids}

    def get(self, request: Any) -> Any:
        """The SDK's requests return ids resolved by ``sky.get``; here they are the results themselves."""
        return request

    def add_job(self, job_id: int, status: Status, labels: dict | None = None) -> None:
        """A job submitted earlier (by an earlier attempt of a step)."""
        self.records[job_id] = Record(
            job_id, f"earlier-{job_id}", status, labels or {}, {"L4": 1}, "1x[L4:1]", submitted_at=500.0
        )
        self.polls[job_id] = 0

    def _launch(self, task: Any, name: str | None = None) -> tuple[list[int], None]:
        with self._lock:
            self._count("launch")
            job_id = max(self.records, default=0) + 1
            (resources,) = task.resources
            pool = (resources.labels or {}).get("gpudoor-pool")
            if pool in self.full_pools:
                from gpudoor_pipelines.launch.errors import PoolFull

                raise self.exceptions.UserRequestRejectedByPolicy(
                    PoolFull(
                        pool, "task", "resources.accelerators", "at its cap (1/1 GPUs in use, 1 asked)", "wait"
                    ).refusal()
                )
            self.launched.append(task)
            self.records[job_id] = Record(
                job_id,
                name or task.name,
                Status.PENDING,
                dict(resources.labels or {}),
                dict(resources.accelerators or {}),
                f"{task.num_nodes}x[...]",
                submitted_at=1000.0,
            )
            self.polls[job_id] = 0
            if self.launch_answers_lost:  # the job is there; the answer never reaches the client
                self.launch_answers_lost -= 1
                self.records[job_id].submitted_at = time.time()
                self.outage(1.5)
                raise self.exceptions.ApiServerConnectionError(self.endpoint)
        return [job_id], None

    def _queue_v2(
        self,
        refresh=False,
        skip_finished=False,
        all_users=True,
        job_ids=None,
        limit=None,
        fields=None,
        submitted_before=None,
        **filters,
    ):
        with self._lock:
            self._count("queue_v2")
            self.queue_requests.append(
                {
                    "refresh": refresh,
                    "skip_finished": skip_finished,
                    "all_users": all_users,
                    "job_ids": job_ids,
                    "limit": limit,
                    "fields": fields,
                    "submitted_before": submitted_before,
                    **filters,
                }
            )
            rows = [r for r in self.records.values() if job_ids is None or r.job_id in job_ids]
            if submitted_before is not None:
                rows = [r for r in rows if r.submitted_at is None or r.submitted_at <= submitted_before]
            if filters.get("submitted_after") is not None:
                rows = [r for r in rows if r.submitted_at is None or r.submitted_at >= filters["submitted_after"]]
            if limit is not None:  # the server returns the first page only
                rows = rows[:limit]
            for r in rows if job_ids else ():
                self._advance(r)
            if skip_finished:
                rows = [r for r in rows if r.status in (Status.PENDING, Status.RUNNING, Status.RECOVERING)]
        return rows, len(rows), {}, len(rows)

    def _advance(self, r: Record) -> None:
        self.polls[r.job_id] += 1
        n = self.polls[r.job_id]
        if self.interrupt_after is not None and n >= self.interrupt_after and r.status is Status.RUNNING:
            self.interrupt_after = None
            raise self.interrupt or KeyboardInterrupt()
        for payload in self.says.get(n, ()):
            self._send(r.job_id, payload() if callable(payload) else payload)
        if r.status is Status.PENDING and n >= 1 and r.submitted_at is not None:
            r.status, r.start_at = Status.RUNNING, r.submitted_at + 10.0
        elif r.status is Status.RUNNING and n in self.preempt_at and r.job_id in (self.preempt_jobs or {r.job_id}):
            r.status, r.recovery_count = Status.RECOVERING, r.recovery_count + 1
        elif r.status is Status.RECOVERING:
            r.status = Status.RUNNING
        elif r.status is Status.RUNNING and n >= self.polls_to_finish:
            r.status, r.end_at = Status.SUCCEEDED, (r.start_at or 0.0) + self.run_seconds
            if r.recovery_count:  # SkyPilot's job_duration leaves out the time spent recovering
                r.job_duration = self.run_seconds - 600.0 * r.recovery_count

    def _send(self, job_id: int, payload: Any) -> None:
        """The job sends a Pipes custom message (to the file its bootstrap env names)."""
        import json

        from dagster_pipes import PIPES_PROTOCOL_VERSION, PIPES_PROTOCOL_VERSION_FIELD, decode_env_var

        task = self.launched[job_id - 1]
        path = decode_env_var(task.envs["DAGSTER_PIPES_MESSAGES"])["path"]
        message = {
            PIPES_PROTOCOL_VERSION_FIELD: PIPES_PROTOCOL_VERSION,
            "method": "report_custom_message",
            "params": {"payload": payload},
        }
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(message) + "\n")

    def _tail_logs(self, job_id: int, follow: bool = True, tail: int = 0, output_stream=None) -> int:
        self._count("tail_logs")
        if not self.log_lines:
            output_stream.write(f"fake job {job_id} says hello\n")
            output_stream.write(f"fake job {job_id} is done\n")
            return 0
        for n in range(1, self.log_lines + 1):  # from the first line, as SkyPilot streams a whole log
            output_stream.write(f"fake job {job_id} line {n}\n")
            if self.log_breaks and self.log_breaks[0][0] == n:
                _, seconds, how = self.log_breaks.pop(0)
                self.outage(seconds)
                if how == "restart":
                    return -15
                raise ConnectionError("Connection aborted: the API server went away")
        return 0

    def _cancel(self, job_ids: list[int]) -> None:
        with self._lock:
            self._count("cancel")
            for job_id in job_ids:
                self.cancelled.append(job_id)
                self.records[job_id].status = Status.CANCELLED
            if self.cancel_answers_lost:
                self.cancel_answers_lost -= 1
                self.outage(1.5)
                raise self.exceptions.ApiServerConnectionError(self.endpoint)


def install(monkeypatch, fake: FakeSky) -> FakeSky:
    """Makes ``fake`` the SDK the SkyPilot backend calls. Its jobs move a state per status poll, not at the
    pace of SkyPilot's controller, so the backend's floor between looks (``status_granularity_s``) is off."""
    from gpudoor_pipelines.launch.backends import sky_sdk
    from gpudoor_pipelines.launch.backends.skypilot import SkyPilotBackend

    monkeypatch.setattr(sky_sdk, "sky", lambda: fake)
    monkeypatch.setattr(SkyPilotBackend, "status_granularity_s", 0.0)
    return fake
