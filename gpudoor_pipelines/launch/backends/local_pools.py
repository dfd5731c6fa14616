"""Warm pools of the embedded default: a supervisor process per pool runs the ranks of a batch on its
workers (setup once per worker), like ``sky.jobs.launch(task, pool=..., num_jobs=...)``."""

from __future__ import annotations

import time
from pathlib import Path

from gpudoor_pipelines.launch.backends.local_state import (
    POOL_FILE,
    QUEUE_DIR,
    RELEASED_FILE,
    RUNNER_FILE,
    SUPERVISOR_FILE,
    TASK_FILE,
    alive,
    job_dirs,
    queue_lock,
    read_json,
    read_state,
    write_json,
    write_state,
)
from gpudoor_pipelines.launch.job import JobState
from gpudoor_pipelines.launch.labels import LABEL_USER
from gpudoor_pipelines.launch.resolve.request import ResolvedJob
from gpudoor_pipelines.launch.resolve.specs import parse_accelerators, parse_cpus


class LocalWarmPools:
    """The warm-pool part of :class:`~.local.LocalBackend` (its job folders, its runner processes)."""

    home: Path
    jobs_root: Path
    pool_idle_timeout_s: float

    def _prepare(self, job: ResolvedJob, service: bool, **extra: object) -> tuple[str, Path]:
        """A new job folder (the backend's)."""
        raise NotImplementedError

    def _start(self, args: list[str], job: ResolvedJob, log_path: Path) -> int:
        """A runner process in its own session (the backend's)."""
        raise NotImplementedError

    def submit_batch(self, job: ResolvedJob, num_jobs: int, *, pool_name: str, workers: int) -> list[str]:
        """Queues ``num_jobs`` ranks of ``job`` on the warm pool ``pool_name`` (started, or grown, to ``workers``).

        Like ``sky.jobs.launch(task, pool=..., num_jobs=...)``: each job is told ``SKYPILOT_JOB_RANK``
        and ``SKYPILOT_NUM_JOBS``; at most ``workers`` run at once; each worker runs the setup once.
        """
        if job.num_nodes > 1:
            raise ValueError(f"{job.name}: a pool runs single-node jobs, not {job.num_nodes} nodes")
        pool_dir = self.pool_dir(pool_name)
        (pool_dir / QUEUE_DIR).mkdir(parents=True, exist_ok=True)
        accelerators = parse_accelerators((job.config.get("resources") or {}).get("accelerators"))
        ids = []
        with queue_lock(pool_dir):
            supervisor = self._supervisor(pool_dir)
            current = read_json(pool_dir / POOL_FILE) if supervisor else {}
            write_json(
                pool_dir / POOL_FILE,
                name=pool_name,
                workers=max(workers, int(current.get("workers", 0))),
                setup=job.config.get("setup"),
                pool=job.pool,
                user=job.labels.get(LABEL_USER, "unknown"),
                labels=dict(job.labels),
                created_at=current.get("created_at") or time.time(),
                gpus_per_worker=sum(accelerators.values()),
                cpus_per_worker=parse_cpus((job.config.get("resources") or {}).get("cpus")),
                idle_timeout_s=self.pool_idle_timeout_s,
            )
            (pool_dir / RELEASED_FILE).unlink(missing_ok=True)
            if supervisor is None:
                supervisor = self._start(["--pool", str(pool_dir)], job, pool_dir / "supervisor.stderr")
                write_json(pool_dir / SUPERVISOR_FILE, pid=supervisor, exiting=False)
            stamp = time.time_ns()
            for rank in range(num_jobs):
                job_id, job_dir = self._prepare(job, False, rank=rank, num_jobs=num_jobs, worker_pool=pool_name)
                write_json(job_dir / RUNNER_FILE, pid=supervisor)
                (pool_dir / QUEUE_DIR / f"{stamp:020d}-{rank:06d}").write_text(str(job_dir))
                ids.append(job_id)
        return ids

    def pool_dir(self, pool_name: str) -> Path:
        """The folder of a warm pool."""
        return self.home / "worker_pools" / pool_name

    def _supervisor(self, pool_dir: Path) -> int | None:
        """The pid of the pool's live supervisor that is not leaving, else None."""
        record = read_json(pool_dir / SUPERVISOR_FILE)
        pid = record.get("pid")
        return pid if alive(pid) and not record.get("exiting") else None

    def pool_workers(self, pool_name: str) -> int:
        """Workers of the pool's live supervisor (0 when it has stopped)."""
        pool_dir = self.pool_dir(pool_name)
        if self._supervisor(pool_dir) is None:
            return 0
        return int(read_json(pool_dir / POOL_FILE).get("workers", 0))

    def release_pool(self, pool_name: str) -> None:
        """Lets the pool stop once its running jobs end; its queued jobs are cancelled."""
        pool_dir = self.pool_dir(pool_name)
        if not pool_dir.is_dir():
            return
        with queue_lock(pool_dir):
            for entry in (pool_dir / QUEUE_DIR).iterdir():
                try:
                    job_dir = Path(entry.read_text())
                    entry.unlink()
                except FileNotFoundError:
                    continue
                write_state(
                    job_dir,
                    state=JobState.CANCELLED.value,
                    ended_at=time.time(),
                    detail="its pool was released",
                )
            (pool_dir / RELEASED_FILE).touch()

    def _pool_jobs(self, pool_name: str) -> list[str]:
        """The pool's ranks that have not ended."""
        out = []
        for job_dir in job_dirs(self.jobs_root):
            if read_json(job_dir / TASK_FILE).get("worker_pool") != pool_name:
                continue
            if not JobState(read_state(job_dir).get("state", "PENDING")).is_terminal:
                out.append(job_dir.name)
        return out
