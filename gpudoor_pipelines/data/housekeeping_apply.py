"""Applying a housekeeping plan: only what it names, at most a day after it was made, idempotent and resumable.

The plan is applied a batch of rows at a time, and each batch done is recorded in the bucket
(``<plan>/applied/<pass>-NNNNN.json``): a run killed midway is finished by the next, which skips what is
recorded and repeats the rest (every operation of :mod:`gpudoor_pipelines.transit.tiers` may be repeated).
Deletes go in two passes: first the manifests of the checkpoints to delete, so a checkpoint is never seen
complete with files missing; then the rest. What was protected when the plan was made, and what is protected
now (a checkpoint that became the best since), is left alone.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import time
from collections import defaultdict
from collections.abc import Callable

from gpudoor_pipelines.data import layout
from gpudoor_pipelines.data.checkpoints import checkpoint_key
from gpudoor_pipelines.data.housekeeping import (
    ABORT,
    COLD,
    DAY,
    DELETE,
    KEEP,
    RESTORE,
    Protected,
    _top,
    open_plan,
    plan_rows,
)
from gpudoor_pipelines.transit import tiers
from gpudoor_pipelines.transit.bucket import MANIFEST_NAME, TransitBucket, TransitObjectMissing
from gpudoor_pipelines.transit.tiers import Listed

#: A plan older than this is never applied: the bucket has changed since.
MAX_PLAN_AGE_S = DAY


class PlanNotApplicable(Exception):
    """The plan is missing or too old; the message says what to do."""


@dataclasses.dataclass
class ApplyResult:
    """What an apply did ``{(prefix, action): [objects, bytes]}`` (batches recorded before included)."""

    plan: str
    done: dict[tuple[str, str], list[int]]
    protected_since: int = 0
    batches_resumed: int = 0

    def summary(self) -> dict:
        return {
            "plan": self.plan,
            "protected_since": self.protected_since,
            "batches_resumed": self.batches_resumed,
            "by_prefix": [
                {"prefix": p, "action": a, "objects": n, "bytes": b} for (p, a), (n, b) in sorted(self.done.items())
            ],
        }


def _checkpoint_of(key: str) -> str | None:
    parts = key.split("/")
    if parts[0] == layout.CHECKPOINTS and len(parts) >= 4 and parts[2].startswith("step-"):
        return checkpoint_key(parts[1], parts[2])
    return None


def _is_manifest_delete(row: dict) -> bool:
    return row["action"] == DELETE and row["key"].endswith("/" + MANIFEST_NAME)


PASSES: dict[str, Callable[[dict], bool]] = {
    "manifests": _is_manifest_delete,
    "rest": lambda row: row["action"] != KEEP and not _is_manifest_delete(row),
}


def apply_plan(
    bucket: TransitBucket,
    plan_key: str,
    protected: Protected,
    *,
    now: float | None = None,
    workers: int = 8,
) -> ApplyResult:
    """Apply the plan at ``plan_key`` (a :class:`PlanNotApplicable` if it is gone or older than a day)."""
    now = time.time() if now is None else now
    manifest = bucket.read_manifest(plan_key)
    if manifest is None:
        raise PlanNotApplicable(f"no housekeeping plan at {bucket.uri(plan_key)}: make one first")
    age = now - float(manifest["planned_at"])
    if age > MAX_PLAN_AGE_S:
        raise PlanNotApplicable(
            f"the plan {plan_key} is {age / 3600:.0f} h old (more than {MAX_PLAN_AGE_S / 3600:.0f} h): the bucket "
            "has changed since; make a new plan and apply that"
        )
    storage_class = manifest["retention"]["storage_class"]  # checked by the fleet file it came from
    result = ApplyResult(plan_key, defaultdict(lambda: [0, 0]))
    plan = open_plan(bucket, plan_key)
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        for name, wanted in PASSES.items():
            for i, batch in enumerate(plan_rows(bucket, plan_key, plan=plan)):
                marker = f"{plan_key}/applied/{name}-{i:05d}.json"
                try:
                    recorded = json.loads(bucket.get_bytes(marker))
                except TransitObjectMissing:
                    recorded = None
                if recorded is not None:
                    result.batches_resumed += 1
                else:
                    recorded = _apply_batch(bucket, [r for r in batch if wanted(r)], protected, storage_class, pool)
                    bucket.put_bytes(marker, json.dumps(recorded).encode())
                result.protected_since += recorded["protected"]
                for prefix, action, n, size in recorded["done"]:
                    result.done[(prefix, action)][0] += n
                    result.done[(prefix, action)][1] += size
    result.done = dict(result.done)
    return result


def _apply_batch(
    bucket: TransitBucket,
    rows: list[dict],
    protected: Protected,
    storage_class: str,
    pool: concurrent.futures.ThreadPoolExecutor,
) -> dict:
    """One batch applied: ``{"done": [(prefix, action, objects, bytes)...], "protected": rows left alone}``."""
    by_action: dict[str, list[dict]] = defaultdict(list)
    protected_since = 0
    for row in rows:
        checkpoint = _checkpoint_of(row["key"])
        if row["action"] in (COLD, DELETE) and checkpoint and protected.why(checkpoint):
            protected_since += 1
            continue
        by_action[row["action"]].append(row)
    if by_action[DELETE]:
        tiers.delete(bucket, [r["key"] for r in by_action[DELETE]])
    moves = [(r["key"], storage_class) for r in by_action[COLD]] + [(r["key"], tiers.HOT) for r in by_action[RESTORE]]
    list(pool.map(lambda m: tiers.move(bucket, *m), moves))
    for r in by_action[ABORT]:
        tiers.abort_upload(bucket, Listed(r["key"], r["size"], r["modified"], r["storage_class"], r["upload_id"]))
    done: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])
    for action, items in by_action.items():
        for r in items:
            done[(_top(r["key"]), action)][0] += 1
            done[(_top(r["key"]), action)][1] += int(r["size"] or 0)
    return {"done": [(p, a, n, b) for (p, a), (n, b) in sorted(done.items())], "protected": protected_since}
