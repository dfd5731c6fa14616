"""The process that runs one local job: setup then run, once per node rank.

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

from gpudoor_pipelines.launch.backends.base import JobState
from gpudoor_pipelines.launch.backends.local import LOG_FILE, TASK_FILE, free_port, read_state, write_state
from gpudoor_pipelines.launch.specs import parse_accelerators


def _pump(stream, log, lock: threading.Lock, prefix: str) -> None:
    for raw in iter(stream.readline, b""):
        with lock:
            log.write(prefix.encode() + raw if prefix else raw)
            log.flush()


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


def main(job_dir_arg: str) -> int:
    """Runs the job in ``job_dir_arg``; returns the exit code of the runner."""
    job_dir = Path(job_dir_arg)
    task = json.loads((job_dir / TASK_FILE).read_text())
    config = task["config"]
    num_nodes = int(config.get("num_nodes") or 1)
    accel = parse_accelerators(config.get("resources", {}).get("accelerators"))
    gpus_per_node = next(iter(accel.values()), 0)
    job_id = job_dir.name
    task_id = f"sky-{time.strftime('%Y-%m-%d-%H-%M-%S', time.localtime(read_state(job_dir).get('submitted_at', time.time())))}_{task['name']}_{job_id}"
    ips = "\n".join(["127.0.0.1"] * num_nodes)

    cancelled = threading.Event()

    def on_term(signum, frame):  # noqa: ARG001 - signal handler signature
        cancelled.set()
        write_state(job_dir, state=JobState.CANCELLED.value, ended_at=time.time(), detail="cancelled")
        # Our own group: the ranks and everything they started.
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.killpg(os.getpgid(0), signal.SIGTERM)

    signal.signal(signal.SIGTERM, on_term)

    base = dict(os.environ)
    base.pop("GPUDOOR_SECRET_NAMES", None)
    base["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{base.get('PATH', '')}"
    base["PYTHONUNBUFFERED"] = "1"
    base.update({k: str(v) for k, v in (config.get("envs") or {}).items()})
    base.update(
        {
            "SKYPILOT_TASK_ID": task_id,
            "SKYPILOT_NUM_NODES": str(num_nodes),
            "SKYPILOT_NODE_IPS": ips,
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
    if num_nodes > 1:
        # Ranks share one host here, so they need a port nobody else is using, and a share of its
        # cores each: n ranks with a full thread pool apiece run slower than one.
        base.setdefault("MASTER_PORT", str(free_port()))
        base.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // num_nodes)))

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
            codes = _run_phase(
                setup, [rank_env(r, "setup") for r in range(num_nodes)], task["workdir"], log, lock
            )
            if cancelled.is_set():
                return 0
            if any(codes):
                write_state(job_dir, state=JobState.FAILED_SETUP.value, ended_at=time.time(), exit_code=max(codes),
                            detail=f"setup exited with {max(codes)}")  # fmt: skip
                return 0
        write_state(job_dir, state=JobState.RUNNING.value, started_at=time.time())
        codes = _run_phase(
            config["run"], [rank_env(r, "run") for r in range(num_nodes)], task["workdir"], log, lock
        )
        if cancelled.is_set():
            return 0
        failed = [c for c in codes if c]
        if failed:
            write_state(job_dir, state=JobState.FAILED.value, ended_at=time.time(), exit_code=failed[0],
                        detail=f"run exited with {failed[0]} (exit codes per rank: {codes})")  # fmt: skip
        else:
            write_state(job_dir, state=JobState.SUCCEEDED.value, ended_at=time.time(), exit_code=0)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
