"""A launch's fingerprint: what decided how the job runs, hashed, so that "why did this run differently from
last week's" has an answer. Same inputs, same fingerprint; a changed task, fleet file or policy code, a new one.

It hashes the task as resolved (routed and ruled: pool, GPU, env, labels), the fleet file, and the code of the
door's routing, rules and server policy. It leaves out what is one launch's own and not its inputs: the
Dagster run's identity and its signature, the Pipes session, who launches, and the secrets' values.
"""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path
from typing import Any

from gpudoor_pipelines.launch.labels import LABEL_FINGERPRINT, LABEL_SIGNATURE, LABEL_USER
from gpudoor_pipelines.launch.resolve.fleet import Fleet

_LAUNCH = Path(__file__).resolve().parents[1]
#: The code whose change changes what a launch becomes.
_POLICY_CODE = ("resolve/*.py", "server/policy.py", "labels.py")
_PER_LAUNCH_ENV = ("DAGSTER_PIPES_",)


@functools.lru_cache(maxsize=1)
def policy_version() -> str:
    """A hash of the policy's code (routing, rules, the server's policy, the labels)."""
    h = hashlib.sha256()
    for pattern in _POLICY_CODE:
        for path in sorted(_LAUNCH.glob(pattern)):
            h.update(path.name.encode())
            h.update(path.read_bytes())
    return h.hexdigest()[:16]


def _fleet_text(fleet: Fleet) -> str:
    return fleet.model_dump_json(exclude={"source"})


def fingerprint(config: dict[str, Any], fleet: Fleet) -> str:
    """16 hex digits over the resolved task (less what is one launch's own), the fleet and the policy's code."""
    task = json.loads(json.dumps(config, default=str))
    resources = task.get("resources") or {}
    labels = resources.get("labels") or {}
    resources["labels"] = {
        k: v
        for k, v in labels.items()
        if not k.startswith("dagster-") and k not in (LABEL_SIGNATURE, LABEL_FINGERPRINT, LABEL_USER)
    }
    task["envs"] = {k: v for k, v in (task.get("envs") or {}).items() if not k.startswith(_PER_LAUNCH_ENV)}
    task["secrets"] = sorted(task.get("secrets") or {})
    text = json.dumps(task, sort_keys=True) + _fleet_text(fleet) + policy_version()
    return hashlib.sha256(text.encode()).hexdigest()[:16]
