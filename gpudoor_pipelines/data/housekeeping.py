"""Housekeeping's plan: every object of the transit bucket with what to do with it and why.

Checkpoints are kept by value, per training: the best ``keep_best`` by the eval metric, the latest
``keep_latest``, and every one something points at (:class:`Protected`: the current best checkpoint, the
served one, a pinned one, those of a running eval, a running training's newest). The rest move to cheaper
storage ``cold_after_days`` after they were written and are deleted ``delete_after_days`` after (0: never);
a checkpoint's manifest stays where it is until it is deleted (first), so it still says the checkpoint is
there, and how old. Smoke outputs, Pipes sessions, caption parts of a caption model no longer current once
its merge covered every shard, old plans, temp files and unfinished uploads go after their own ages.

The plan is computed in one listing of the bucket, page by page, in key order: a training's checkpoints are
decided together (one training in memory at a time), everything else object by object, and rows are written
to Parquet a batch at a time. Eval scores are kept in an index in the bucket (``housekeeping/scores.json``),
so a plan reads only the metrics written since the last one. No Dagster: the assets and the CLI call it.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterable, Iterator
from typing import Any

from gpudoor_pipelines.data import layout
from gpudoor_pipelines.data.checkpoints import TrainingStart, checkpoint_key, journal_position, stamp
from gpudoor_pipelines.transit import tiers
from gpudoor_pipelines.transit.bucket import MANIFEST_NAME, TransitBucket, TransitObjectMissing
from gpudoor_pipelines.transit.tiers import Listed

PLANS = f"{layout.HOUSEKEEPING}/plans"
SCORES_KEY = f"{layout.HOUSEKEEPING}/scores.json"
PLAN_FILE = "plan.parquet"
#: Plans are kept this long (what each run did stays readable for a month).
PLANS_KEPT_DAYS = 28.0
#: Rows per Parquet row group, and per step of an apply (each step is recorded once done).
BATCH_ROWS = 20_000
DAY = 86400.0
KEEP, COLD, RESTORE, DELETE, ABORT = "keep", "cold", "restore", "delete", "abort"
ACTIONS = (KEEP, COLD, RESTORE, DELETE, ABORT)


def restore_command(checkpoint: str) -> str:
    """What a person runs to bring a cold checkpoint back where jobs read it."""
    return f"gpudoor housekeeping --restore {checkpoint}"


@dataclasses.dataclass(frozen=True)
class Retention:
    """What to keep, and for how long (the fleet file's ``housekeeping:``; see ``HousekeepingPolicy``)."""

    keep_best: int = 3
    keep_latest: int = 2
    metric: str = "accuracy"
    cold_after_days: float = 30.0
    delete_after_days: float = 0.0
    storage_class: str = "STANDARD_IA"
    smoke_days: float = 14.0
    pipes_days: float = 2.0
    leftovers_days: float = 1.0
    caption_model: str | None = None  # the current one; None: no caption part is removed
    running_window_days: float = 2.0  # a training started this recently with no end recorded is running


@dataclasses.dataclass
class Protected:
    """Checkpoints (partition keys) and trainings something still points at, each with why."""

    checkpoints: dict[str, str] = dataclasses.field(default_factory=dict)
    trainings: dict[str, str] = dataclasses.field(default_factory=dict)  # running: its newest is kept
    ranges: list[tuple[str, str, str]] = dataclasses.field(default_factory=list)  # (first, last, why)

    def why(self, checkpoint: str) -> str | None:
        if checkpoint in self.checkpoints:
            return self.checkpoints[checkpoint]
        return next((why for first, last, why in self.ranges if first <= checkpoint <= last), None)


@dataclasses.dataclass
class PlanResult:
    """The plan's key in the bucket, its totals ``{(prefix, action): [objects, bytes]}``, and its cost."""

    key: str
    planned_at: float
    totals: dict[tuple[str, str], list[int]]
    rows: int
    scores_read: int
    seconds: float = 0.0

    def summary(self) -> dict[str, Any]:
        by_action: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        for (_, action), (n, b) in self.totals.items():
            by_action[action][0] += n
            by_action[action][1] += b
        return {
            "plan": self.key,
            "planned_at": self.planned_at,
            "objects": self.rows,
            "bytes": sum(b for a, (_, b) in by_action.items() if a != ABORT),
            "by_action": {a: {"objects": n, "bytes": b} for a, (n, b) in sorted(by_action.items())},
            "by_prefix": [
                {"prefix": p, "action": a, "objects": n, "bytes": b} for (p, a), (n, b) in sorted(self.totals.items())
            ],
        }


def _top(key: str) -> str:
    return key.split("/", 1)[0] if "/" in key else "(root)"


class _Rows:
    """Rows written to a Parquet file a batch at a time, with totals by top prefix and action."""

    def __init__(self, path: str) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        self.schema = pa.schema(
            [
                ("key", pa.string()),
                ("size", pa.int64()),
                ("modified", pa.float64()),
                ("storage_class", pa.string()),
                ("action", pa.string()),
                ("reason", pa.string()),
                ("upload_id", pa.string()),
            ]
        )
        self.writer = pq.ParquetWriter(path, self.schema)
        self.columns = self.schema.names
        self.batch: dict[str, list] = {c: [] for c in self.columns}
        self.totals: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])
        self.rows = 0

    def add(self, item: Listed, action: str, reason: str) -> None:
        values = (item.key, item.size, item.modified, item.storage_class, action, reason, item.upload_id)
        for column, value in zip(self.columns, values, strict=True):
            self.batch[column].append(value)
        total = self.totals[(_top(item.key), action)]
        total[0] += 1
        total[1] += item.size
        self.rows += 1
        if len(self.batch["key"]) >= BATCH_ROWS:
            self.flush()

    def flush(self) -> None:
        import pyarrow as pa

        if self.batch["key"]:
            self.writer.write_table(pa.Table.from_pydict(self.batch, schema=self.schema))
            self.batch = {c: [] for c in self.columns}

    def close(self) -> None:
        self.flush()
        self.writer.close()


# ------------------------------------------------------------------------------------------ what it knows
def read_scores(bucket: TransitBucket, metric: str) -> tuple[dict[str, float], int]:
    """Every evaluated checkpoint's score, from the index in the bucket plus the metrics written (or written
    again) since (read 16 at a time); the index is written back. Returns the scores and how many were read."""
    try:
        index = json.loads(bucket.get_bytes(SCORES_KEY))
    except (TransitObjectMissing, ValueError):
        index = {}
    if index.get("metric") != metric:
        index = {"metric": metric, "scores": {}}
    scores: dict[str, list] = index["scores"]  # checkpoint -> [score or None, when its metrics were written]
    todo: list[tuple[str, str, float]] = []
    listed: set[str] = set()
    for item in tiers.list_objects(bucket, f"{layout.EVALS}/"):
        parts = item.key.split("/")
        if len(parts) == 3 and parts[2] == "metrics.json":
            listed.add(parts[1])
            if parts[1] not in scores or scores[parts[1]][1] != item.modified:  # new, or evaluated again
                todo.append((parts[1], item.key, item.modified))
    gone = [c for c in scores if c not in listed]  # their metrics were deleted: so is their score
    for checkpoint in gone:
        del scores[checkpoint]

    def score(item: tuple[str, str, float]) -> tuple[str, list]:
        checkpoint, key, modified = item
        try:
            value = json.loads(bucket.get_bytes(key)).get(metric)
        except (TransitObjectMissing, ValueError, AttributeError):
            value = None
        return checkpoint, [float(value) if isinstance(value, int | float) else None, modified]

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        scores.update(pool.map(score, todo))
    if todo or gone:
        bucket.put_bytes(SCORES_KEY, json.dumps(index).encode())
    return {c: v[0] for c, v in scores.items() if v[0] is not None}, len(todo)


def recent_starts(bucket: TransitBucket, since: float) -> dict[str, list[TrainingStart]]:
    """The journal's (re)starts since ``since``, by training."""
    starts: dict[str, list[TrainingStart]] = defaultdict(list)
    for key in bucket.list_keys(f"{layout.TRAININGS}/", journal_position(since)):
        try:
            start = TrainingStart(**json.loads(bucket.get_bytes(key)))
        except (ValueError, TypeError, TransitObjectMissing):
            continue
        starts[start.training_id].append(start)
    return starts


def merged_everything(bucket: TransitBucket, cache: dict, dataset: str, model: str) -> bool:
    """Whether ``model``'s captions of ``dataset`` were merged with no shard missing (cached per pair)."""
    if (dataset, model) not in cache:
        manifest = bucket.read_manifest(f"{layout.DATASETS}/{dataset}/captioned/{model}")
        cache[(dataset, model)] = bool(manifest) and int(manifest.get("missing_count", 1)) == 0
    return cache[(dataset, model)]


# ------------------------------------------------------------------------------------------ the plan
class _Planner:
    def __init__(self, bucket: TransitBucket, retention: Retention, protected: Protected, now: float) -> None:
        self.bucket, self.r, self.protected, self.now = bucket, retention, protected, now
        self.scores: dict[str, float] = {}
        self.starts: dict[str, list[TrainingStart]] = {}
        self.merged: dict = {}

    def age(self, item: Listed) -> float:
        return (self.now - item.modified) / DAY

    def decide(self, rows: _Rows, items: Iterator[Listed]) -> None:
        group: list[Listed] = []
        group_id: tuple[str, str] | None = None
        for item in items:
            gid = self.group_of(item.key)
            if gid != group_id and group:
                self.decide_group(rows, group_id, group)
                group = []
            group_id = gid
            if gid is None:
                rows.add(item, *self.decide_one(item))
            else:
                group.append(item)
        if group:
            self.decide_group(rows, group_id, group)

    @staticmethod
    def group_of(key: str) -> tuple[str, str] | None:
        """Objects decided together: a training's checkpoints, a training's smoke output, a Pipes session."""
        parts = key.split("/")
        if parts[0] in (layout.CHECKPOINTS, layout.SMOKE) and len(parts) >= 3:
            return parts[0], parts[1]
        if parts[0] == layout.PIPES_PREFIX and len(parts) >= 4:
            return parts[0], "/".join(parts[1:3])
        return None

    def decide_one(self, item: Listed) -> tuple[str, str]:
        parts = item.key.split("/")
        if parts[0] == layout.CAPTIONS and len(parts) >= 4 and self.r.caption_model:
            model, shard = parts[1], parts[2]
            if model == self.r.caption_model:
                return KEEP, "captions of the current caption model"
            if "-" in shard and merged_everything(self.bucket, self.merged, shard.rsplit("-", 1)[0], model):
                return DELETE, f"caption part of {model}, not the current model, merged with every shard"
            return KEEP, f"captions of {model} not merged with every shard"
        if item.key.startswith(PLANS + "/") and self.age(item) >= PLANS_KEPT_DAYS:
            return DELETE, f"a plan older than {PLANS_KEPT_DAYS:.0f} days"
        return KEEP, "not housekeeping's"

    def decide_group(self, rows: _Rows, gid: tuple[str, str], items: list[Listed]) -> None:
        kind, name = gid
        if kind == layout.CHECKPOINTS:
            self.decide_training(rows, name, items)
            return
        days = self.r.smoke_days if kind == layout.SMOKE else self.r.pipes_days
        newest = min(self.age(i) for i in items)  # in days, of the newest object
        what = "smoke output" if kind == layout.SMOKE else "Pipes session"
        for item in items:
            if newest >= days:
                rows.add(item, DELETE, f"{what} untouched for {newest:.1f} days (after {days:g})")
            else:
                rows.add(item, KEEP, f"{what} younger than {days:g} days")

    def running(self, training: str, keys: set[str]) -> str | None:
        if training in self.protected.trainings:
            return self.protected.trainings[training]
        if f"{layout.CHECKPOINTS}/{training}/{MANIFEST_NAME}" in keys:
            return None
        for start in self.starts.get(training, ()):
            if start.ended_key not in keys:
                return "its training is running (started, no end recorded)"
        return None

    def decide_training(self, rows: _Rows, training: str, items: list[Listed]) -> None:
        steps: dict[str, list[Listed]] = defaultdict(list)
        keys = {i.key for i in items}
        for item in items:
            parts = item.key.split("/")
            if len(parts) >= 4 and parts[2].startswith("step-"):
                steps[parts[2]].append(item)
            else:
                rows.add(item, KEEP, "the training's record")
        manifest_of = {s: f"{layout.CHECKPOINTS}/{training}/{s}/{MANIFEST_NAME}" for s in steps}
        complete = sorted(s for s in steps if manifest_of[s] in keys)
        running = self.running(training, keys)
        keep: dict[str, str] = {}
        for step in complete[-self.r.keep_latest :] if self.r.keep_latest else []:
            keep[step] = f"one of the latest {self.r.keep_latest}"
        scored = [
            (self.scores[checkpoint_key(training, s)], s)
            for s in complete
            if checkpoint_key(training, s) in self.scores
        ]
        for _, step in sorted(scored, reverse=True)[: self.r.keep_best]:
            keep.setdefault(step, f"one of the best {self.r.keep_best} by {self.r.metric}")
        if running and complete:
            keep[complete[-1]] = running
            for step in complete:  # the sensor has yet to hand them to an eval
                if checkpoint_key(training, step) not in self.scores:
                    keep.setdefault(step, "not evaluated yet, and its training is running")
        for step in steps:
            why = self.protected.why(checkpoint_key(training, step))
            if why:
                keep[step] = why
        for step, files in steps.items():
            manifest = next((f for f in files if f.key == manifest_of[step]), None)
            if manifest is None:  # no manifest: being written, or its writer died
                newest = min(self.age(f) for f in files)
                dead = newest >= self.r.leftovers_days and not running
                for f in files:
                    if dead:
                        rows.add(f, DELETE, f"an unfinished checkpoint, untouched for {newest:.1f} days")
                    else:
                        rows.add(f, KEEP, "a checkpoint being written")
                continue
            if step in keep:
                for f in files:
                    if f.cold:  # what is kept is kept where jobs read it
                        rows.add(f, RESTORE, f"cold, but {keep[step]}")
                    else:
                        rows.add(f, KEEP, keep[step])
                continue
            age = self.age(manifest)
            for f in files:
                if self.r.delete_after_days and age >= self.r.delete_after_days:
                    rows.add(
                        f,
                        DELETE,
                        f"past the keep set, written {age:.0f} days ago (delete after {self.r.delete_after_days:g})",
                    )
                elif age < self.r.cold_after_days:
                    rows.add(f, KEEP, f"past the keep set, younger than {self.r.cold_after_days:g} days")
                elif f is manifest:
                    rows.add(f, KEEP, "a cold checkpoint's manifest stays (it says the checkpoint is there)")
                elif f.cold:
                    rows.add(f, KEEP, "cold already")
                else:
                    rows.add(
                        f,
                        COLD,
                        f"past the keep set, written {age:.0f} days ago (cold after {self.r.cold_after_days:g})",
                    )

    def leftovers(self, rows: _Rows) -> None:
        for item in tiers.leftovers(self.bucket):
            if self.age(item) >= self.r.leftovers_days:
                rows.add(item, ABORT, f"an unfinished write, started {self.age(item):.1f} days ago")


def make_plan(
    bucket: TransitBucket, retention: Retention, protected: Protected, *, now: float | None = None
) -> PlanResult:
    """The plan of the bucket now, written to ``housekeeping/plans/<time>/plan.parquet`` (published: its
    manifest holds the totals and the retention it followed)."""
    started = time.monotonic()
    now = time.time() if now is None else now
    planner = _Planner(bucket, retention, protected, now)
    planner.scores, scores_read = read_scores(bucket, retention.metric)
    planner.starts = recent_starts(bucket, now - retention.running_window_days * DAY)
    with tempfile.TemporaryDirectory(prefix="housekeeping-") as tmp:
        path = os.path.join(tmp, PLAN_FILE)
        rows = _Rows(path)
        try:
            planner.decide(rows, tiers.list_objects(bucket))
            planner.leftovers(rows)
        finally:
            rows.close()
        result = PlanResult(f"{PLANS}/{stamp(now)}", now, dict(rows.totals), rows.rows, scores_read)
        result.seconds = time.monotonic() - started
        manifest = {**result.summary(), "retention": dataclasses.asdict(retention), "seconds": result.seconds}
        bucket.publish(result.key, manifest, {PLAN_FILE: path})
    return result


def open_plan(bucket: TransitBucket, plan_key: str) -> Any:
    """The plan's Parquet file (a ``pyarrow.parquet.ParquetFile``), read once from the bucket."""
    import io

    import pyarrow.parquet as pq

    return pq.ParquetFile(io.BytesIO(bucket.get_bytes(f"{plan_key}/{PLAN_FILE}")))


def plan_rows(
    bucket: TransitBucket, plan_key: str, actions: Iterable[str] | None = None, *, plan: Any = None
) -> Iterator[list[dict]]:
    """The plan's rows a batch at a time (only those of ``actions``, if given); ``plan``: :func:`open_plan`'s,
    for a caller that goes over the plan more than once."""
    wanted = set(actions) if actions is not None else None
    for batch in (plan or open_plan(bucket, plan_key)).iter_batches(batch_size=BATCH_ROWS):
        rows = batch.to_pylist()
        yield [r for r in rows if wanted is None or r["action"] in wanted]
