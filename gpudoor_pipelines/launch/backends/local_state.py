"""The files and processes of the embedded default: where each job's and warm pool's state lives, written
atomically, and how their processes are looked at and stopped. Shared by the local backend and the
processes it starts (:mod:`.local_runner`)."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import secrets
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

from gpudoor_pipelines.transit.bucket import gpudoor_home

LOG_FILE = "run.log"
STATE_FILE = "state.json"
TASK_FILE = "task.json"
RUNNER_FILE = "runner.json"
# A warm pool's folder (under <home>/worker_pools/<name>/): its spec, its supervisor, queued jobs.
POOL_FILE = "pool.json"
SUPERVISOR_FILE = "supervisor.json"
QUEUE_DIR = "queue"
RELEASED_FILE = "released"
_QUEUE_LOCK = "queue.lock"
#: A local job's id, as the backend issues it: when it was submitted and six random hex digits.
_JOB_ID = re.compile(r"[0-9]{8}-[0-9]{6}-[0-9a-f]{6}")


def new_job_id() -> str:
    """A fresh job id (it names the job's folder under the jobs root)."""
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"


def is_job_id(job_id: object) -> bool:
    """Whether ``job_id`` is an id this backend could have issued: only those ever become a path."""
    return isinstance(job_id, str) and _JOB_ID.fullmatch(job_id) is not None


def pool_dirs(home: Path) -> list[Path]:
    """Every warm pool's folder under ``home`` (a stray file there is not a pool)."""
    root = home / "worker_pools"
    return sorted(d for d in root.iterdir() if d.is_dir()) if root.is_dir() else []


def job_dirs(jobs_root: Path) -> list[Path]:
    """Every job's folder under ``jobs_root``, oldest first (anything else there is not a job)."""
    if not jobs_root.is_dir():
        return []
    return sorted(d for d in jobs_root.iterdir() if is_job_id(d.name) and d.is_dir())


def default_home() -> Path:
    """``$GPUDOOR_HOME`` or ``~/.gpudoor``: where the embedded default keeps its state."""
    return gpudoor_home()


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def read_state(job_dir: Path) -> dict:
    """The job's state file (empty before the runner writes it)."""
    try:
        return json.loads((job_dir / STATE_FILE).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def write_state(job_dir: Path, **fields: object) -> dict:
    """Updates the job's state file atomically."""
    state = read_state(job_dir)
    state.update(fields)
    tmp = job_dir / f".{STATE_FILE}.{os.getpid()}"
    tmp.write_text(json.dumps(state))
    os.replace(tmp, job_dir / STATE_FILE)
    return state


def write_json(path: Path, **fields: object) -> None:
    """Replaces a small JSON file atomically."""
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(fields))
    os.replace(tmp, path)


@contextlib.contextmanager
def queue_lock(pool_dir: Path) -> Iterator[None]:
    """Serializes queueing jobs with a pool deciding to stop (so no job is queued on a pool that is leaving)."""
    with open(pool_dir / _QUEUE_LOCK, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def claim_next(pool_dir: Path) -> Path | None:
    """Takes the oldest queued job of a pool off its queue; returns its folder (None if the queue is empty).

    One pool process claims for all its slots (callers hold its lock); a job released meanwhile is
    simply gone from the queue.
    """
    for entry in sorted((pool_dir / QUEUE_DIR).iterdir()):
        try:
            target = Path(entry.read_text())
            entry.unlink()
        except FileNotFoundError:
            continue
        return target
    return None


def alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # A zombie child of ours counts as gone.
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return True


def kill_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def group_alive(pgid: int) -> bool:
    for pid_dir in Path("/proc").iterdir():
        if not pid_dir.name.isdigit():
            continue
        try:
            with open(pid_dir / "stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False
