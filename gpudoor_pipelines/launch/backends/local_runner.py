"""The processes that run local jobs: one job (setup then run, once per node rank), or a warm pool.

Started by :class:`~gpudoor_pipelines.launch.backends.local.LocalBackend` in its own session, so
killing its process group stops every rank. Writes the job's log and state into the job folder.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from gpudoor_pipelines.launch.backends.local_state import (
    LOG_FILE,
    POOL_FILE,
    QUEUE_DIR,
    RELEASED_FILE,
    RUNNER_FILE,
    SUPERVISOR_FILE,
    TASK_FILE,
    claim_next,
    free_port,
    queue_lock,
    read_state,
    write_json,
    write_state,
)
from gpudoor_pipelines.launch.job import JobState
from gpudoor_pipelines.launch.resolve.specs import parse_accelerators


def _pump(stream, log, lock: threading.Lock, prefix: str) -> None:
    for raw in iter(stream.readline, b""):
        with lock:
            log.write(prefix.encode() + raw if prefix else raw)
            log.flush()


def _setup_failed(job_dir: Path, codes: list[int], what: str) -> None:
    exit_code = max(codes)
    write_state(
        job_dir,
        state=JobState.FAILED_SETUP.value,
        ended_at=time.time(),
        exit_code=exit_code,
        detail=f"{what} exited with {exit_code}",
    )


def _run_phase(command: str, envs: list[dict[str, str]], cwd: str, log, lock: threading.Lock) -> list[int]:
    procs = []
    pumps = []
    multi = len(envs) > 1
    for rank, env in enumerate(envs):
        proc = subprocess.Popen(
            ["bash", "-c", command],
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        t = threading.Thread(
            target=_pump, args=(proc.stdout, log, lock, f"(rank {rank}) " if multi else ""), daemon=True
        )
        t.start()
        procs.append(proc)
        pumps.append(t)
    codes = [p.wait() for p in procs]
    for t in pumps:
        t.join(timeout=5)
    return codes


def job_env(task: dict, job_dir: Path) -> dict[str, str]:
    """The environment SkyPilot gives every node of the job (``SKYPILOT_*``), over this process's own."""
    config = task["config"]
    num_nodes = int(config.get("num_nodes") or 1)
    accel = parse_accelerators(config.get("resources", {}).get("accelerators"))
    gpus_per_node = next(iter(accel.values()), 0)
    job_id = job_dir.name
    submitted = read_state(job_dir).get("submitted_at", time.time())
    task_id = f"sky-{time.strftime('%Y-%m-%d-%H-%M-%S', time.localtime(submitted))}_{task['name']}_{job_id}"
    base = dict(os.environ)
    base.pop("GPUDOOR_SECRET_NAMES", None)
    base["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{base.get('PATH', '')}"
    base["PYTHONUNBUFFERED"] = "1"
    base.update({k: str(v) for k, v in (config.get("envs") or {}).items()})
    base.update(
        {
            "SKYPILOT_TASK_ID": task_id,
            "SKYPILOT_NUM_NODES": str(num_nodes),
            "SKYPILOT_NODE_IPS": "\n".join(["127.0.0.1"] * num_nodes),
            "SKYPILOT_NUM_GPUS_PER_NODE": str(gpus_per_node),
            "SKYPILOT_SETUP_NUM_GPUS_PER_NODE": str(gpus_per_node),
            "SKYPILOT_CLUSTER_INFO": json.dumps(
                {
                    "cluster_name": task.get("cluster_name") or task["name"],
                    "cloud": "local",
                    "pool": task["pool"],
                }
            ),
            "SKYPILOT_INTERNAL_JOB_ID": job_id,
        }
    )
    if "rank" in task:  # one job of a batch on a pool (sky.jobs.launch(..., pool=, num_jobs=))
        base["SKYPILOT_JOB_RANK"] = str(task["rank"])
        base["SKYPILOT_NUM_JOBS"] = str(task["num_jobs"])
    if num_nodes > 1:
        # Ranks share one host here, so they need a port nobody else is using, and a share of its
        # cores each: n ranks with a full thread pool apiece run slower than one.
        base.setdefault("MASTER_PORT", str(free_port()))
        base.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // num_nodes)))
    return base


def main(job_dir_arg: str) -> int:
    """Runs the job in ``job_dir_arg``; returns the exit code of the runner."""
    job_dir = Path(job_dir_arg)
    task = json.loads((job_dir / TASK_FILE).read_text())
    config = task["config"]
    num_nodes = int(config.get("num_nodes") or 1)
    ips = "\n".join(["127.0.0.1"] * num_nodes)

    cancelled = threading.Event()

    def on_term(signum, frame):  # noqa: ARG001 - signal handler signature
        cancelled.set()
        write_state(job_dir, state=JobState.CANCELLED.value, ended_at=time.time(), detail="cancelled")
        # Our own group: the ranks and everything they started.
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.killpg(os.getpgid(0), signal.SIGTERM)

    signal.signal(signal.SIGTERM, on_term)
    base = job_env(task, job_dir)

    def rank_env(rank: int, phase: str) -> dict[str, str]:
        env = dict(base)
        env["SKYPILOT_NODE_RANK"] = str(rank)
        if phase == "setup":
            env["SKYPILOT_SETUP_NODE_RANK"] = str(rank)
            env["SKYPILOT_SETUP_NODE_IPS"] = ips
        return env

    lock = threading.Lock()
    with open(job_dir / LOG_FILE, "ab") as log:
        write_state(job_dir, state=JobState.STARTING.value)
        setup = config.get("setup")
        if setup:
            codes = _run_phase(setup, [rank_env(r, "setup") for r in range(num_nodes)], task["workdir"], log, lock)
            if cancelled.is_set():
                return 0
            if any(codes):
                _setup_failed(job_dir, codes, "setup")
                return 0
        write_state(job_dir, state=JobState.RUNNING.value, started_at=time.time())
        codes = _run_phase(config["run"], [rank_env(r, "run") for r in range(num_nodes)], task["workdir"], log, lock)
        if cancelled.is_set():
            return 0
        failed = [c for c in codes if c]
        if failed:
            write_state(
                job_dir,
                state=JobState.FAILED.value,
                ended_at=time.time(),
                exit_code=failed[0],
                detail=f"run exited with {failed[0]} (exit codes per rank: {codes})",
            )
        else:
            write_state(job_dir, state=JobState.SUCCEEDED.value, ended_at=time.time(), exit_code=0)
    return 0


def pool_main(pool_dir_arg: str) -> int:
    """Runs a warm pool: ``workers`` slots, each runs the pool's setup once, then queued jobs one by one.

    The jobs are the ranks of batches (``SKYPILOT_JOB_RANK`` / ``SKYPILOT_NUM_JOBS``), queued as files
    under ``queue/`` by :meth:`LocalBackend.submit_batch`; each runs in its own process group so one
    can be cancelled without the others. The pool stops when released, or when it has been idle for
    ``idle_timeout_s`` (under the queue lock, so a batch queued meanwhile starts a new pool).
    """
    pool_dir = Path(pool_dir_arg)
    stop = threading.Event()
    busy: set[int] = set()
    lock = threading.Lock()

    def on_term(signum, frame):  # noqa: ARG001 - signal handler signature
        stop.set()

    signal.signal(signal.SIGTERM, on_term)

    def slot(index: int) -> None:
        warm = False
        while not stop.is_set():
            with lock:  # claimed and busy at once: the pool never sees an empty queue and idle slots between
                job_dir = claim_next(pool_dir)
                if job_dir is not None:
                    busy.add(index)
            if job_dir is None:
                time.sleep(0.1)
                continue
            try:
                warm = _run_pooled(job_dir, json.loads((pool_dir / POOL_FILE).read_text()), warm, index)
            finally:
                with lock:
                    busy.discard(index)

    threads: list[threading.Thread] = []
    idle_since = time.monotonic()
    while not stop.is_set():
        # A later batch may have grown the pool: start the slots it added.
        spec = json.loads((pool_dir / POOL_FILE).read_text())
        while len(threads) < int(spec["workers"]):
            threads.append(threading.Thread(target=slot, args=(len(threads),), daemon=True))
            threads[-1].start()
        time.sleep(0.2)
        with lock:
            active = bool(busy)
        if active or any((pool_dir / QUEUE_DIR).iterdir()):
            idle_since = time.monotonic()
            continue
        if (pool_dir / RELEASED_FILE).exists() or time.monotonic() - idle_since > float(spec.get("idle_timeout_s", 30)):
            with queue_lock(pool_dir):
                if not any((pool_dir / QUEUE_DIR).iterdir()):
                    write_json(pool_dir / SUPERVISOR_FILE, pid=os.getpid(), exiting=True)
                    stop.set()
    for t in threads:
        t.join(timeout=1)
    return 0


def _run_pooled(job_dir: Path, spec: dict, warm: bool, slot: int) -> bool:
    """Runs one queued job in a pool slot (setup first if the slot is cold); returns whether the slot is warm."""
    if JobState(read_state(job_dir).get("state", "PENDING")).is_terminal:  # cancelled while queued
        return warm
    task = json.loads((job_dir / TASK_FILE).read_text())
    config = task["config"]
    env = job_env(task, job_dir)
    env["SKYPILOT_NODE_RANK"] = "0"
    log_lock = threading.Lock()
    with open(job_dir / LOG_FILE, "ab") as log:
        write_state(job_dir, state=JobState.STARTING.value)
        if not warm and spec.get("setup"):
            log.write(f"(pool worker {slot}) setup\n".encode())
            setup_env = {**env, "SKYPILOT_SETUP_NODE_RANK": "0", "SKYPILOT_SETUP_NODE_IPS": "127.0.0.1"}
            codes = _run_phase(spec["setup"], [setup_env], task["workdir"], log, log_lock)
            if any(codes):
                _setup_failed(job_dir, codes, "the pool's setup")
                return False
        proc = subprocess.Popen(
            ["bash", "-c", config["run"]],
            cwd=task["workdir"],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own group: cancelling this job leaves the pool and its other jobs alone
        )
        write_json(job_dir / RUNNER_FILE, pid=os.getpid(), pgid=proc.pid)
        write_state(job_dir, state=JobState.RUNNING.value, started_at=time.time())
        _pump(proc.stdout, log, log_lock, "")
        code = proc.wait()
    if JobState(read_state(job_dir).get("state", "PENDING")) in (JobState.CANCELLING, JobState.CANCELLED):
        write_state(job_dir, state=JobState.CANCELLED.value, ended_at=time.time())
    elif code:
        write_state(
            job_dir, state=JobState.FAILED.value, ended_at=time.time(), exit_code=code, detail=f"run exited with {code}"
        )
    else:
        write_state(job_dir, state=JobState.SUCCEEDED.value, ended_at=time.time(), exit_code=0)
    return True


if __name__ == "__main__":
    if sys.argv[1] == "--pool":
        sys.exit(pool_main(sys.argv[2]))
    sys.exit(main(sys.argv[1]))
