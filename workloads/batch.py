"""The batch file a packed run writes for its jobs: one entry per job, picked by ``SKYPILOT_JOB_RANK``.

Both the caption and the eval jobs of a batch read it the same way, and refuse it the same way when it is
unusable (a :class:`~workloads.config.ConfigError` that says which setting and why).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from gpudoor_pipelines.transit.uris import read_bytes
from workloads.config import ConfigError, env_int, env_str


def require(condition: bool, message: str) -> None:
    """Refuses the job's settings with ``message`` unless ``condition`` holds."""
    if not condition:
        raise ConfigError(message)


def is_str_map(value: Any) -> bool:
    """Whether ``value`` maps names to strings."""
    return isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items())


@dataclass(frozen=True)
class BatchEntry:
    """This job's entry of the batch file.

    Attributes:
        uri: the batch file.
        batch: the whole file (its fields besides ``jobs``, e.g. ``window_end``).
        entry: this job's entry.
        rank: this job's rank (``SKYPILOT_JOB_RANK``).
        num_jobs: how many jobs the batch has.
        pipes_env: this job's Dagster Pipes channel.
        where: ``jobs[<rank>] of <uri>``, for messages.
    """

    uri: str
    batch: dict[str, Any]
    entry: dict[str, Any]
    rank: int
    num_jobs: int
    pipes_env: dict[str, str]
    where: str


def read_batch_entry(env: str) -> BatchEntry:
    """Reads the batch file named by the environment variable ``env`` and this job's entry of it.

    Raises:
        ConfigError: the file is missing or not a batch, the rank is out of range, or the entry unusable.
    """
    rank = env_int("SKYPILOT_JOB_RANK", 0)
    uri = env_str(env)
    try:
        batch = json.loads(read_bytes(uri))
    except FileNotFoundError:
        raise ConfigError(f"{env}={uri!r}: there is no batch file there") from None
    except ValueError as exc:  # an unsupported URI, or not JSON
        raise ConfigError(f"{env}={uri!r}: {exc}") from None
    require(isinstance(batch, dict), f"the batch file {uri} is not a JSON object")
    jobs = batch.get("jobs")
    require(isinstance(jobs, list) and bool(jobs), f"the batch file {uri} has no list of jobs")
    if os.environ.get("SKYPILOT_NUM_JOBS", "").strip():
        num_jobs = env_int("SKYPILOT_NUM_JOBS")
        require(num_jobs == len(jobs), f"SKYPILOT_NUM_JOBS={num_jobs} but the batch file {uri} has {len(jobs)} jobs")
    require(
        0 <= rank < len(jobs),
        f"SKYPILOT_JOB_RANK={rank} is out of range: the batch file {uri} has {len(jobs)} jobs "
        f"(ranks 0 to {len(jobs) - 1})",
    )
    where = f"jobs[{rank}] of {uri}"
    entry = jobs[rank]
    require(isinstance(entry, dict), f"{where} must be an object, got {entry!r}")
    pipes_env = entry.get("pipes_env") or {}
    require(is_str_map(pipes_env), f"{where}: pipes_env must map names to strings")
    return BatchEntry(
        uri=uri, batch=batch, entry=entry, rank=rank, num_jobs=len(jobs), pipes_env=pipes_env, where=where
    )
