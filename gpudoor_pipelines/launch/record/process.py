"""Which process a run executes in, and whether it is still there.

A run whose steps execute in its own process (``gpudoor flow``, ``dg.materialize``, ``execute_in_process``,
the in-process executor of a launched run) has no run worker for Dagster's run monitoring to watch: killed
with ``kill -9`` (or an OOM, a closed laptop lid's shell), it stays STARTED for ever and its jobs keep their
GPUs. Its first launching step records the process (:data:`~.labels.TAG_RUN_PROCESS`: host, pid and the
process's start time, so a pid used again by another process is not taken for it); the orphan reconciler,
on the same host, sees the process gone and marks the run failed.
"""

from __future__ import annotations

import multiprocessing
import os
import socket

from gpudoor_pipelines.launch.labels import TAG_RUN_PROCESS


def _stat(pid: int) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command (Linux); None where /proc does not say."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _start_ticks(fields: list[str] | None) -> str | None:
    """A process's start time since boot, in clock ticks, from its :func:`_stat` fields."""
    return fields[19] if fields and len(fields) > 19 else None


def this_run_process() -> str | None:
    """``<host>:<pid>:<start>`` of this process when it is the run's own (no executor's child process of
    another: Dagster's multiprocess executor starts its steps with ``multiprocessing``); else None."""
    if multiprocessing.parent_process() is not None:
        return None
    pid = os.getpid()
    return f"{socket.gethostname()}:{pid}:{_start_ticks(_stat(pid)) or ''}"


def run_process_tags() -> dict[str, str]:
    """The run tag naming this process, when it is the run's own (see :func:`this_run_process`)."""
    identity = this_run_process()
    return {TAG_RUN_PROCESS: identity} if identity else {}


def run_process_gone(identity: str) -> bool:
    """Whether the process ``identity`` names is gone. Only a process of this host can be told gone: one of
    another host (a pod, another machine) is never (Dagster's run monitoring watches those)."""
    try:
        host, pid_text, start = identity.rsplit(":", 2)
        pid = int(pid_text)
    except ValueError:
        return False
    if host != socket.gethostname() or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass  # another user's process: it is there
    fields = _stat(pid)
    if fields and fields[0] == "Z":
        return True  # killed, not yet reaped by its parent
    now = _start_ticks(fields)
    return bool(start and now and now != start)  # the pid is another process's now
