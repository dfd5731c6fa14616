"""The embedded default: run a task's ``setup`` and ``run`` as local processes.

Each job gets a folder under the jobs root with its task (secrets stripped), its log and its state,
and a runner process in its own session that runs setup then run once per node rank, with the same
environment SkyPilot gives a job (``SKYPILOT_*``), plus the pool's env mapped under a local folder.
Jobs outlive the Dagster step that launched them, like managed jobs; cancelling kills the whole
process tree.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from gpudoor_pipelines.launch.backends.base import Backend, LogFollower, Service
from gpudoor_pipelines.launch.backends.local_pools import LocalWarmPools
from gpudoor_pipelines.launch.backends.local_state import (
    LOG_FILE,
    POOL_FILE,
    RUNNER_FILE,
    SUPERVISOR_FILE,
    TASK_FILE,
    alive,
    default_home,
    free_port,
    group_alive,
    is_job_id,
    job_dirs,
    kill_group,
    new_job_id,
    pool_dirs,
    read_json,
    read_state,
    write_json,
    write_state,
)
from gpudoor_pipelines.launch.job import Holding, JobInfo, JobState, JobUsage, ReleaseCheck
from gpudoor_pipelines.launch.labels import LABEL_POOL, LABEL_USER
from gpudoor_pipelines.launch.resolve.request import ResolvedJob
from gpudoor_pipelines.launch.resolve.specs import gpus_per_node, parse_accelerators, parse_cpus
from gpudoor_pipelines.launch.resolve.usage import Held, Usage


class _FileFollower(LogFollower):
    """Follows a job's ``run.log``; the stream ends when the job's runner exits (it writes the job's verdict
    first). Where the system has process file descriptors (Linux), a wait loop wakes the moment it does."""

    def __init__(self, path: Path, runner_pid: int | None = None) -> None:
        self._path = path
        self._offset = 0
        self._partial = b""
        self._pid = runner_pid
        self._pidfd: int | None = None
        if runner_pid and hasattr(os, "pidfd_open"):
            try:
                self._pidfd = os.pidfd_open(runner_pid)
            except OSError:  # gone already, or not allowed: ``ended`` still tells
                self._pidfd = None

    @property
    def ended(self) -> bool:
        if self._pidfd is not None:
            return bool(select.select([self._pidfd], [], [], 0)[0])
        return self._pid is not None and not alive(self._pid)

    def end_fd(self) -> int | None:
        return self._pidfd

    def close(self, wait: bool = True) -> None:
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None

    def poll(self) -> list[str]:
        try:
            with open(self._path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return []
        self._offset += len(data)
        data = self._partial + data
        *lines, self._partial = data.split(b"\n")
        return [line.decode(errors="replace") for line in lines]


class LocalBackend(LocalWarmPools, Backend):
    """Runs jobs as local processes with SkyPilot's environment contract.

    Args:
        home: state folder (default ``$GPUDOOR_HOME`` or ``~/.gpudoor``); jobs go under ``jobs/``,
            pool paths under ``pools/<pool>/``.
        python: interpreter whose folder is put first on the jobs' PATH (default: this one).
        pool_idle_timeout_s: how long a warm pool with nothing queued waits for more jobs before it stops.
    """

    name = "local"

    def __init__(
        self, home: str | Path | None = None, python: str | None = None, pool_idle_timeout_s: float = 30.0
    ) -> None:
        self.home = Path(home) if home else default_home()
        self.pool_idle_timeout_s = pool_idle_timeout_s
        self.jobs_root = self.home / "jobs"
        self.python = python or sys.executable

    def watch_key(self) -> tuple:
        """One status hub per state folder and process."""
        return ("local", str(self.jobs_root))

    def job_dir(self, job_id: str) -> Path:
        """The folder of one job; KeyError for anything but an id this backend issues (a path, ``..``, a
        stray file's name): no other path is ever built from what a caller passes."""
        if not is_job_id(job_id):
            raise KeyError(f"no local job {job_id!r}: a local job's id looks like 20260101-120000-a1b2c3")
        return self.jobs_root / job_id

    def map_pool_env(self, pool: str, pool_env: dict[str, str]) -> dict[str, str]:
        """Maps the pool's cluster paths under ``<home>/pools/<pool>/`` and creates them."""
        out = {}
        for key, value in pool_env.items():
            if value.startswith("/"):
                local = self.home / "pools" / pool / value.lstrip("/")
                local.mkdir(parents=True, exist_ok=True)
                out[key] = str(local)
            else:
                out[key] = value
        return out

    def _prepare(self, job: ResolvedJob, service: bool, **extra: object) -> tuple[str, Path]:
        """Creates the job's folder: its task (secrets stripped) and its PENDING state."""
        job_id = new_job_id()
        job_dir = self.job_dir(job_id)
        job_dir.mkdir(parents=True)
        config = {k: v for k, v in job.config.items() if k != "secrets"}
        envs = dict(config.get("envs") or {})
        envs.update(self.map_pool_env(job.pool, job.pool_env))
        # Ports: many services share one laptop, so each gets a free port on loopback.
        if service:
            envs["SERVE_HOST"] = "127.0.0.1"
            if "PORT" in envs:
                envs["PORT"] = str(free_port())
        config["envs"] = envs
        (job_dir / TASK_FILE).write_text(
            json.dumps(
                {
                    "name": job.name,
                    "pool": job.pool,
                    "config": config,
                    "workdir": job.workdir,
                    "cluster_name": job.cluster_name,
                    "service": service,
                    **extra,
                }
            )
        )
        write_state(job_dir, state=JobState.PENDING.value, submitted_at=time.time(), name=job.name, pool=job.pool)
        return job_id, job_dir

    def _start(self, args: list[str], job: ResolvedJob, log_path: Path) -> int:
        """Starts a runner in its own session; the job's secrets reach it through its environment only."""
        env = dict(os.environ)
        env.update(job.secrets)
        env["GPUDOOR_SECRET_NAMES"] = ",".join(sorted(job.secrets))
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(
                [self.python, "-m", "gpudoor_pipelines.launch.backends.local_runner", *args],
                env=env,
                cwd=job.workdir,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,
            )
        return proc.pid

    def _spawn(self, job: ResolvedJob, service: bool) -> str:
        job_id, job_dir = self._prepare(job, service)
        pid = self._start([str(job_dir)], job, job_dir / "runner.stderr")
        write_json(job_dir / RUNNER_FILE, pid=pid, pgid=pid)
        return job_id

    def submit(self, job: ResolvedJob) -> str:
        """Starts the job's runner and returns at once."""
        return self._spawn(job, service=False)

    def _runner(self, job_id: str) -> dict:
        try:
            return json.loads((self.job_dir(job_id) / RUNNER_FILE).read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return {}

    def status(self, job_id: str) -> JobInfo:
        """Reads the job's state; a runner that died without a verdict means FAILED_CONTROLLER."""
        job_dir = self.job_dir(job_id)
        if not job_dir.is_dir():
            raise KeyError(f"no local job {job_id} under {self.jobs_root}")
        state = read_state(job_dir)
        current = JobState(state.get("state", JobState.PENDING.value))
        if not current.is_terminal and not alive(self._runner(job_id).get("pid")):
            # Give a runner that just finished a moment to write its verdict.
            time.sleep(0.2)
            state = read_state(job_dir)
            current = JobState(state.get("state", JobState.PENDING.value))
            if not current.is_terminal:
                state = write_state(
                    job_dir,
                    state=JobState.FAILED_CONTROLLER.value,
                    ended_at=time.time(),
                    detail="the local runner died",
                )
                current = JobState.FAILED_CONTROLLER
        return JobInfo(
            job_id=job_id,
            state=current,
            name=state.get("name", ""),
            infra=f"local ({state.get('pool', '?')})",
            recoveries=int(state.get("recoveries", 0)),
            submitted_at=state.get("submitted_at"),
            started_at=state.get("started_at"),
            ended_at=state.get("ended_at"),
            detail=state.get("detail", ""),
        )

    def follow_logs(self, job_id: str) -> LogFollower:
        """Follows ``run.log`` of the job, until its runner exits."""
        return _FileFollower(self.job_dir(job_id) / LOG_FILE, self._runner(job_id).get("pid"))

    def log_tail(self, job_id: str, lines: int = 30) -> list[str]:
        """The last lines of the job's log."""
        try:
            text = (self.job_dir(job_id) / LOG_FILE).read_text(errors="replace")
        except FileNotFoundError:
            return []
        return text.splitlines()[-lines:]

    def cancel(self, job_id: str) -> None:
        """Terminates the job's whole process tree (SIGTERM, then SIGKILL after a grace period)."""
        job_dir = self.job_dir(job_id)
        if JobState(read_state(job_dir).get("state", "PENDING")).is_terminal:
            return
        write_state(job_dir, state=JobState.CANCELLING.value)
        pgid = self._runner(job_id).get("pgid")
        if not pgid:
            write_state(job_dir, state=JobState.CANCELLED.value, ended_at=time.time())
            return
        kill_group(pgid, signal.SIGTERM)
        deadline = time.time() + 10
        while time.time() < deadline and group_alive(pgid):
            time.sleep(0.1)
        if group_alive(pgid):
            kill_group(pgid, signal.SIGKILL)
        state = read_state(job_dir)
        if not JobState(state.get("state", "PENDING")).is_terminal or state.get("state") == JobState.CANCELLING.value:
            write_state(job_dir, state=JobState.CANCELLED.value, ended_at=time.time())

    def usage(self) -> Usage:
        """GPUs (and CPU-only jobs' vCPUs) requested by local jobs that have not ended."""
        return Usage.tally(self._held())

    def _held(self) -> Iterator[Held]:
        for job_dir in job_dirs(self.jobs_root):
            state = read_state(job_dir)
            if not state or JobState(state.get("state", "PENDING")).is_terminal:
                continue
            if not alive(self._runner(job_dir.name).get("pid")):
                continue
            task = read_json(job_dir / TASK_FILE)
            if not task or task.get("worker_pool"):  # a pool's jobs run on its workers, counted below
                continue
            resources = task["config"].get("resources") or {}
            nodes = int(task["config"].get("num_nodes") or 1)
            gpus = sum(parse_accelerators(resources.get("accelerators")).values()) * nodes
            labels = {**(resources.get("labels") or {}), LABEL_POOL: task["pool"]}
            held = Held.of(labels, gpus, parse_cpus(resources.get("cpus")) * nodes)
            assert held is not None
            yield held
        for pool_dir in pool_dirs(self.home):
            if self._supervisor(pool_dir) is None:
                continue
            spec = read_json(pool_dir / POOL_FILE)
            workers = int(spec.get("workers", 0))
            labels = {**(spec.get("labels") or {}), LABEL_POOL: spec["pool"], LABEL_USER: spec.get("user", "unknown")}
            held = Held.of(
                labels, workers * int(spec.get("gpus_per_worker", 0)), workers * int(spec.get("cpus_per_worker", 0))
            )
            assert held is not None
            yield held

    def job_history(self, since: float, until: float, *, submitted_after: float | None = None) -> list[JobUsage]:
        """Every local job that held GPUs between ``since`` and ``until``, read from the job folders: Dagster
        steps, demos and ad-hoc launches alike. Local jobs are never preempted: they ran all the time they held.
        With ``submitted_after``: the jobs submitted after it, started or not."""
        out = []
        for job_dir in job_dirs(self.jobs_root):
            state, task = read_state(job_dir), read_json(job_dir / TASK_FILE)
            started, ended = state.get("started_at"), state.get("ended_at")
            if submitted_after is not None:
                if not task or (state.get("submitted_at") or 0) <= submitted_after:
                    continue
            elif not task or started is None or started >= until or (ended is not None and ended <= since):
                continue
            info = self.status(job_dir.name)  # a runner that died without a verdict gets its end here
            config = task.get("config") or {}
            resources = config.get("resources") or {}
            nodes = int(config.get("num_nodes") or 1)
            now = time.time()
            out.append(
                JobUsage.from_labels(
                    resources.get("labels") or {},
                    pool=task.get("pool", "unknown"),
                    job_id=job_dir.name,
                    name=info.name or task.get("name", ""),
                    gpus=gpus_per_node(resources.get("accelerators")) * nodes,
                    started_at=info.started_at,
                    ended_at=info.ended_at,
                    state=info.state,
                    recoveries=info.recoveries,
                    ran_s=((info.ended_at or now) - info.started_at) if info.started_at is not None else None,
                    submitted_at=state.get("submitted_at"),
                )
            )
        return out

    # ----------------------------------------------------------------- what is held, and its release
    def holdings(self) -> list[Holding]:
        """Unfinished jobs (a pool's ranks are its pool's), warm pools with a live supervisor, and services."""
        out = []
        services = set(self.clusters().values())
        for job_dir in job_dirs(self.jobs_root):
            task = read_json(job_dir / TASK_FILE)
            if not task or task.get("worker_pool") or job_dir.name in services:
                continue
            info = self.status(job_dir.name)  # a runner that died without a verdict ends here
            if info.state.is_terminal:
                continue
            labels = (task.get("config", {}).get("resources") or {}).get("labels") or {}
            out.append(
                Holding(
                    "job",
                    job_dir.name,
                    labels=dict(labels),
                    since=info.submitted_at,
                    state=info.state.value,
                    name=info.name,
                )
            )
        for pool_dir in pool_dirs(self.home):
            if self._supervisor(pool_dir) is None:
                continue
            spec = read_json(pool_dir / POOL_FILE)
            out.append(
                Holding(
                    "pool",
                    pool_dir.name,
                    labels=dict(spec.get("labels") or {}),
                    since=spec.get("created_at"),
                    state="READY",
                    name=pool_dir.name,
                )
            )
        for cluster, job_id in sorted(self.clusters().items()):
            state = read_state(self.job_dir(job_id))
            task = read_json(self.job_dir(job_id) / TASK_FILE)
            labels = (task.get("config", {}).get("resources") or {}).get("labels") or {}
            out.append(
                Holding(
                    "cluster",
                    cluster,
                    labels=dict(labels),
                    since=state.get("submitted_at"),
                    state=state.get("state", ""),
                    name=cluster,
                )
            )
        return out

    def release(self, holding: Holding) -> None:
        """As every backend does; a pool's running ranks are cancelled too (an orphan pool has nobody to wait for)."""
        super().release(holding)
        if holding.kind == "pool":
            for job_id in self._pool_jobs(holding.id):
                self.cancel(job_id)

    def check_released(self, holding: Holding) -> ReleaseCheck:
        """Local processes are the scheduler here: a job terminal and its process group gone; a pool's
        supervisor and its ranks' process groups gone; a service's record gone (its job cancelled)."""
        if holding.kind == "job":
            base = super().check_released(holding)
            pgid = self._runner(holding.id).get("pgid")
            running = bool(pgid) and group_alive(int(pgid))
            seen = (
                *base.seen,
                f"process group {pgid}: {'alive' if running else 'gone'}" if pgid else "no process group",
            )
            return ReleaseCheck(base.released and not running, seen)
        if holding.kind == "pool":
            supervisor = read_json(self.pool_dir(holding.id) / SUPERVISOR_FILE).get("pid")
            groups = [self._runner(j).get("pgid") for j in self._pool_jobs(holding.id)]
            running = [g for g in groups if g and group_alive(int(g))]
            up = alive(supervisor)
            seen = (
                f"pool {holding.id}: supervisor {supervisor} {'alive' if up else 'gone'}, {len(running)} ranks running",
            )
            return ReleaseCheck(not up and not running, seen)
        if holding.kind == "cluster":
            job_id = self.clusters().get(holding.id)
            if job_id is None:
                return ReleaseCheck(True, (f"cluster {holding.id}: no service record",))
            return ReleaseCheck(False, (f"cluster {holding.id}: still serving job {job_id}",))
        return super().check_released(holding)

    def start_service(self, job: ResolvedJob) -> Service:
        """Starts a service; any earlier service on the same cluster name is stopped first."""
        cluster = job.cluster_name or job.name
        self.stop_service(cluster)
        job_id = self._spawn(job, service=True)
        self._clusters_dir.mkdir(parents=True, exist_ok=True)
        (self._clusters_dir / f"{cluster}.json").write_text(json.dumps({"job_id": job_id}))
        return _LocalService(self, cluster, job_id)

    @property
    def _clusters_dir(self) -> Path:
        return self.home / "clusters"

    def stop_service(self, cluster_name: str) -> bool:
        """Stops the service running under ``cluster_name``."""
        record = self._clusters_dir / f"{cluster_name}.json"
        if not record.is_file():
            return False
        job_id = json.loads(record.read_text())["job_id"]
        was_running = not self.status(job_id).state.is_terminal
        self.cancel(job_id)
        record.unlink(missing_ok=True)
        return was_running

    def clusters(self) -> dict[str, str]:
        """Running services: cluster name → job id."""
        if not self._clusters_dir.is_dir():
            return {}
        return {p.stem: json.loads(p.read_text())["job_id"] for p in self._clusters_dir.glob("*.json")}


class _LocalService(Service):
    """A service started by the local backend: a local job that listens on a port of 127.0.0.1."""

    def __init__(self, backend: LocalBackend, cluster_name: str, job_id: str) -> None:
        self.backend, self.cluster_name, self.job_id = backend, cluster_name, job_id

    def status(self) -> JobInfo:
        return self.backend.status(self.job_id)

    def follow_logs(self) -> LogFollower:
        return self.backend.follow_logs(self.job_id)

    def log_tail(self, lines: int = 30) -> list[str]:
        return self.backend.log_tail(self.job_id, lines)

    def url(self, port: int) -> str | None:
        """``http://127.0.0.1:<port>`` once the service's port answers (each service got a free port)."""
        try:
            task = json.loads((self.backend.job_dir(self.job_id) / TASK_FILE).read_text())
        except FileNotFoundError:
            return None
        local_port = int(task["config"]["envs"].get("PORT", port))
        with socket.socket() as s:
            s.settimeout(0.5)
            if s.connect_ex(("127.0.0.1", local_port)) != 0:
                return None
        return f"http://127.0.0.1:{local_port}"
