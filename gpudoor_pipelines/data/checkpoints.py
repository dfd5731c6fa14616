"""Checkpoints in the transit bucket, and finding the new ones in a bucket of any size.

Layout (keys relative to the bucket's root)::

    checkpoints/<training id>/step-NNNNNN/model.pt            one checkpoint ...
    checkpoints/<training id>/step-NNNNNN/_manifest.json      ... complete once this is written (last)
    checkpoints/<training id>/_run.json                       what the training trains on
    checkpoints/<training id>/_manifest.json                  the run manifest of a finished training
    checkpoints/<training id>/_ended/<start>.json             how one start of the training ended
    trainings/<day>/<start>-<training id>.json                journal: one entry per (re)start

:func:`scan_checkpoints` finds new complete checkpoints with work proportional to what is new, never
to what is stored: the journal says which trainings (re)started, each watched training is listed from
its own last complete checkpoint (S3 ``StartAfter``), and a training leaves the watch list when its
end marker appears, or after a long silence (its run worker died before it could say). A training
nobody journaled (a program of its own writing this layout) is found by its folder: ids made by
:func:`new_training_id` sort by start time, so one listing after the newest id seen finds the new
ones. Its cursor holds only the trainings being watched, and the newest id. No Dagster here.
"""

from __future__ import annotations

import calendar
import dataclasses
import datetime
import json
import re
import time
from collections.abc import Iterable
from typing import Any

from gpudoor_pipelines.data import layout
from gpudoor_pipelines.transit.bucket import MANIFEST_NAME, TransitBucket

#: A training id: a single key segment with no ``.`` (a checkpoint's partition key is ``<id>.step-N``).
TRAINING_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,79}")
#: Journal entries written up to this long before the newest one seen are read again: a slow writer
#: or a clock behind the others' still gets its training watched.
JOURNAL_LOOKBACK_S = 600.0
#: Keys the one-time backlog walk lists per tick (a few S3 pages; the rest goes on next tick).
WALK_KEYS_PER_TICK = 20_000
#: The id format of :func:`new_training_id`: ``<UTC start>-<suffix>``; such ids sort by start time.
DATED_TRAINING_ID = re.compile(r"\d{8}T\d{6}-[A-Za-z0-9_-]+")
#: Trainings nobody journaled taken into the watch list per tick (one listing each).
DISCOVER_PER_TICK = 50
CURSOR_VERSION = 2


def checkpoint_key(training_id: str, step_dir: str) -> str:
    """The partition key of one checkpoint: ``<training id>.<step dir>``."""
    return f"{training_id}.{step_dir}"


def checkpoint_prefix(partition_key: str) -> str:
    """The bucket prefix of a checkpoint partition (inverse of :func:`checkpoint_key`)."""
    training_id, _, step_dir = partition_key.partition(".")
    if not training_id or not step_dir.startswith("step-"):
        raise ValueError(f"'{partition_key}' is not a checkpoint partition key (<training id>.step-NNNNNN)")
    return f"{layout.CHECKPOINTS}/{training_id}/{step_dir}"


def training_of(partition_key: str) -> str:
    """The training id of a checkpoint partition key."""
    return checkpoint_prefix(partition_key).split("/")[1]


def checkpoint_from_manifest_key(key: str) -> str | None:
    """``checkpoints/<id>/step-NNNNNN/_manifest.json`` → its partition key, else None."""
    parts = key.split("/")
    if (
        len(parts) == 4
        and parts[0] == layout.CHECKPOINTS
        and parts[2].startswith("step-")
        and parts[3] == MANIFEST_NAME
    ):
        return checkpoint_key(parts[1], parts[2])
    return None


def training_prefix(training_id: str) -> str:
    """Where a training's checkpoints live."""
    return f"{layout.CHECKPOINTS}/{training_id}"


def check_training_id(value: str) -> str:
    """``value`` if it can name a training, else a ValueError saying what to use instead."""
    if not TRAINING_ID.fullmatch(value or ""):
        raise ValueError(
            f"'{value}' cannot be a training id: use letters, digits, '-' and '_' only (at most 80, no '.' "
            "or '/'); to resume a training give the id shown in training_run's metadata, and to name one "
            "set training_name (kept as a label)"
        )
    return value


def new_training_id(run_id: str, now: float | None = None) -> str:
    """A fresh training id: its UTC start time then the run's id, so ids sort by start time."""
    start = time.gmtime(time.time() if now is None else now)
    return f"{time.strftime('%Y%m%dT%H%M%S', start)}-{run_id.replace('-', '')[:8]}"


def stamp(t: float) -> str:
    """A UTC time as a string that sorts like the time (microseconds)."""
    return datetime.datetime.fromtimestamp(t, datetime.UTC).strftime("%Y%m%dT%H%M%S.%fZ")


def stamp_time(s: str) -> float:
    """Inverse of :func:`stamp`."""
    return datetime.datetime.strptime(s, "%Y%m%dT%H%M%S.%fZ").replace(tzinfo=datetime.UTC).timestamp()


def journal_position(t: float) -> str:
    """Where the journal's entries of time ``t`` start: one folder per day, so that a listing from a
    time opens only the days after it, on a local folder as on S3."""
    s = stamp(t)
    return f"{layout.TRAININGS}/{s[:8]}/{s}"


@dataclasses.dataclass(frozen=True)
class TrainingStart:
    """One start (or restart) of a training, as its journal entry records it."""

    training_id: str
    started_at: float
    after: str | None  # the key of its last complete checkpoint at this start: older ones are not new
    name: str | None = None
    run_id: str | None = None

    @property
    def journal_key(self) -> str:
        return f"{journal_position(self.started_at)}-{self.training_id}.json"

    @property
    def ended_key(self) -> str:
        """Where this start's end is recorded, by the job or by the orchestrator."""
        return f"{training_prefix(self.training_id)}/{layout.ENDED_DIR}/{stamp(self.started_at)}.json"


def last_checkpoint_key(bucket: TransitBucket, training_id: str) -> str | None:
    """The manifest key of the training's last complete checkpoint (one listing of the training)."""
    last = None
    for key in bucket.list_keys(training_prefix(training_id) + "/"):
        if checkpoint_from_manifest_key(key):
            last = key
    return last


def record_start(
    bucket: TransitBucket,
    training_id: str,
    *,
    name: str | None = None,
    run_id: str | None = None,
    now: float | None = None,
) -> TrainingStart:
    """Writes the journal entry of a (re)start, so a checkpoint sensor watches the training."""
    start = TrainingStart(
        training_id=check_training_id(training_id),
        started_at=time.time() if now is None else now,
        after=last_checkpoint_key(bucket, training_id),
        name=name,
        run_id=run_id,
    )
    bucket.put_bytes(start.journal_key, json.dumps(dataclasses.asdict(start)).encode())
    return start


def record_end(bucket: TransitBucket, ended_key: str, state: str, reason: str | None = None) -> None:
    """Records how a start of a training ended (``succeeded``, ``failed``, ``cancelled``)."""
    body = {"state": state, "reason": reason, "at": datetime.datetime.now(datetime.UTC).isoformat()}
    bucket.put_bytes(ended_key, json.dumps(body).encode())


# ---------------------------------------------------------------------------------------- the scan
@dataclasses.dataclass
class ScanPolicy:
    """What a scan hands out (see ``EvalPolicy`` in the fleet file)."""

    backlog_per_training: int = 1
    max_checkpoints: int = 200
    forget_after_s: float = 48 * 3600.0


@dataclasses.dataclass
class ScanResult:
    """New checkpoints (partition keys, in the order to register them), the next cursor, and the cost."""

    checkpoints: list[str]
    cursor: dict[str, Any]
    forgotten: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    lists: int = 0
    exists: int = 0
    keys_listed: int = 0
    capped: bool = False


class _Scan:
    def __init__(self, bucket: TransitBucket, cursor: dict, policy: ScanPolicy, now: float) -> None:
        self.bucket, self.policy, self.now = bucket, policy, now
        fresh = not cursor or cursor.get("v") != CURSOR_VERSION
        self.since: float = now if fresh else float(cursor["since"])
        journal = {} if fresh else dict(cursor.get("journal", {}))
        # First tick: read back the starts of the forget window, so running trainings get watched.
        self.journal_last: float = float(journal.get("last", self.since - policy.forget_after_s))
        self.journal_seen: dict[str, float] = dict(journal.get("seen", {}))
        self.active: dict[str, dict[str, Any]] = (
            {} if fresh else {k: dict(v) for k, v in cursor.get("active", {}).items()}
        )
        # Once, over what is there at turn-on: the backlog's latest N per training (none with N = 0), and the
        # newest dated id, where looking for trainings nobody journaled starts.
        self.walk: dict[str, Any] | None = (
            {"after": None, "training": None, "latest": [], "newest": ""} if fresh else cursor.get("walk")
        )
        self.next_training: str = "" if fresh else str(cursor.get("next", ""))
        # The newest dated training id seen: a dated folder after it is a training nobody journaled.
        self.newest: str = "" if fresh else str(cursor.get("newest", ""))
        self.folders: dict[str, str | None] = {"listed": None, "listed_twice": None}
        if not fresh:
            self.folders.update(cursor.get("folders") or {})
        self.found: list[str] = []
        self.result = ScanResult(checkpoints=self.found, cursor={})

    # ------------------------------------------------------------------ listing, counted
    def _list(self, prefix: str, start_after: str | None) -> Iterable[str]:
        self.result.lists += 1
        for key in self.bucket.list_keys(prefix, start_after=start_after):
            self.result.keys_listed += 1
            yield key

    def _exists(self, key: str) -> bool:
        self.result.exists += 1
        return self.bucket.exists(key)

    @property
    def _room(self) -> int:
        return self.policy.max_checkpoints - len(self.found)

    def _take(self, checkpoints: Iterable[str]) -> None:
        self.found.extend(checkpoints)

    # ------------------------------------------------------------------ the three sources
    def read_journal(self) -> None:
        """Trainings (re)started since the last tick join the watch list."""
        floor = self.journal_last - JOURNAL_LOOKBACK_S
        for key in self._list(f"{layout.TRAININGS}/", journal_position(max(floor, 0))):
            if key in self.journal_seen:
                continue
            try:
                start = TrainingStart(**json.loads(self.bucket.get_bytes(key)))
                check_training_id(start.training_id)
            except (ValueError, TypeError, KeyError):
                continue  # not a journal entry: nothing to watch
            self.journal_seen[key] = start.started_at
            self.journal_last = max(self.journal_last, start.started_at)
            watched = self.active.get(start.training_id)
            self.active[start.training_id] = {
                # Already watched (a retry of a running training): keep its place.
                "after": watched["after"] if watched else start.after,
                "ended": start.ended_key,
                "seen": self.now,
                # Started before the sensor: what it wrote before is a backlog (its latest N only).
                "backlog": watched.get("backlog", False) if watched else start.started_at < self.since,
            }
        floor = self.journal_last - JOURNAL_LOOKBACK_S
        self.journal_seen = {k: t for k, t in self.journal_seen.items() if t >= floor}

    def _may_run(self, training: str) -> bool:
        """Whether a training nobody journaled may still be running: a dated id that started within the
        forget window (a finished one leaves the watch list at its run manifest, or at the window's end)."""
        if not DATED_TRAINING_ID.fullmatch(training):
            return False
        started = calendar.timegm(time.strptime(training[:15], "%Y%m%dT%H%M%S"))
        return self.now - started <= self.policy.forget_after_s

    def _unjournaled(self, training: str, after: str | None) -> dict[str, Any]:
        """A watch-list entry for a training nobody journaled: it ends with its run manifest."""
        return {"after": after, "ended": f"{training_prefix(training)}/{MANIFEST_NAME}", "seen": self.now}

    def discover(self) -> None:
        """Trainings nobody journaled: dated folders of ``checkpoints/`` after the newest id seen, one listing
        each (a tick with none: one listing, finding nothing). They are watched from their first checkpoint;
        they leave on a run manifest (``checkpoints/<id>/_manifest.json``) or after a long silence."""
        if self.walk is not None:  # the walk over the backlog has not seen every folder yet
            return
        # On a local folder, listing reads the whole folder: only while a training's folder was added lately.
        # A listing right after a folder is made can miss it (its first file not written yet): each version is
        # listed at two ticks before the listing stops.
        version = self.bucket.folder_version(f"{layout.CHECKPOINTS}/")  # read before the listing
        if version is not None and version == self.folders["listed_twice"]:
            return
        if version is not None and version == self.folders["listed"]:
            self.folders["listed_twice"] = version
        self.folders["listed"] = version
        prefix = f"{layout.CHECKPOINTS}/2"  # dated ids start with their year
        # A folder's keys all sort before ``<id>0`` and after ``<id>``: the next folder starts after it.
        after = f"{layout.CHECKPOINTS}/{self.newest}0" if self.newest else None
        for _ in range(DISCOVER_PER_TICK):
            key = next(iter(self._list(prefix, after)), None)
            if key is None:
                return
            training = key.split("/")[1]
            after = f"{layout.CHECKPOINTS}/{training}0"
            if not DATED_TRAINING_ID.fullmatch(training):
                continue
            self.newest = max(self.newest, training)
            if training not in self.active:
                self.active[training] = self._unjournaled(training, after=None)
        self.folders["listed_twice"] = None  # more than a tick's worth: the next tick lists on from here

    def watch(self) -> None:
        """Each watched training, listed from its last complete checkpoint; ended ones leave."""
        order = sorted(self.active)
        first = next((i for i, t in enumerate(order) if t >= self.next_training), 0)
        self.next_training = ""
        for training in order[first:] + order[:first]:
            if self._room <= 0:
                self.next_training, self.result.capped = training, True  # the next tick starts here
                return
            entry = self.active[training]
            backlog = entry.pop("backlog", False)
            new: list[str] = []
            capped = False
            for key in self._list(training_prefix(training) + "/", entry["after"]):
                checkpoint = checkpoint_from_manifest_key(key)
                if checkpoint is None:
                    continue
                if not backlog and len(new) >= self._room:
                    capped = True
                    break
                new.append(checkpoint)
                entry["after"] = key  # never past a checkpoint whose manifest is not written yet
            if backlog:
                keep = self.policy.backlog_per_training
                new = (new[-keep:] if keep else [])[: self._room]
            self._take(new)
            if new:
                entry["seen"] = self.now
                if capped:
                    self.next_training, self.result.capped = training, True
                    return
                continue
            if self._exists(entry["ended"]):
                del self.active[training]
                self.result.forgotten.append((training, "ended"))
            elif self.now - float(entry["seen"]) > self.policy.forget_after_s:
                del self.active[training]
                hours = (self.now - float(entry["seen"])) / 3600
                self.result.forgotten.append((training, f"nothing new for {hours:.0f} h and no end marker"))

    def walk_backlog(self) -> None:
        """Once, over what was there when the sensor was turned on: the latest N of each training; a dated
        training nobody journaled that started within the forget window is watched from its last checkpoint
        (it may be running), and the newest dated id is where :meth:`discover` starts."""
        walk = self.walk
        if walk is None:
            return
        keep = self.policy.backlog_per_training

        def flush() -> None:
            training = walk["training"]
            if training and training not in self.active:
                if keep:
                    self._take(walk["latest"][-keep:])
                if walk["latest"] and self._may_run(training):  # nobody journaled it: watch it from here
                    last = f"{checkpoint_prefix(walk['latest'][-1])}/{MANIFEST_NAME}"
                    self.active[training] = self._unjournaled(training, after=last)
            walk["training"], walk["latest"] = None, []

        listed = 0
        for key in self._list(f"{layout.CHECKPOINTS}/", walk["after"]):
            training = key.split("/")[1] if key.count("/") >= 2 else None
            if training != walk["training"]:
                if self._room < keep:
                    self.result.capped = True
                    return  # at a training's first key: the next tick starts with it
                flush()
                walk["training"] = training
                if training and DATED_TRAINING_ID.fullmatch(training):
                    walk["newest"] = max(walk.get("newest") or "", training)
            checkpoint = checkpoint_from_manifest_key(key)
            if checkpoint is not None:
                walk["latest"] = [*walk["latest"], checkpoint][-max(keep, 1) :]
            walk["after"] = key
            listed += 1
            if listed >= WALK_KEYS_PER_TICK:
                return
        flush()
        self.newest = max(self.newest, walk.get("newest") or "")
        self.walk = None  # the backlog is done

    def cursor(self) -> dict[str, Any]:
        return {
            "v": CURSOR_VERSION,
            "since": self.since,
            "journal": {"last": self.journal_last, "seen": self.journal_seen},
            "active": self.active,
            "walk": self.walk,
            "next": self.next_training,
            "newest": self.newest,
            "folders": self.folders,
        }


def scan_checkpoints(
    bucket: TransitBucket,
    cursor: dict | None,
    policy: ScanPolicy | None = None,
    *,
    now: float | None = None,
) -> ScanResult:
    """New complete checkpoints since ``cursor`` (at most ``policy.max_checkpoints``), and the next cursor.

    Args:
        bucket: the transit bucket.
        cursor: the previous result's cursor; None or ``{}`` the first time (the sensor is turned on
            now: checkpoints already there are a backlog, of which the latest N per training count).
        policy: what to hand out.
        now: the time (tests move it).

    A checkpoint is handed out once: each source moves past what it hands out, and the walk over the
    backlog skips the trainings the journal has them watch.
    """
    scan = _Scan(bucket, cursor or {}, policy or ScanPolicy(), time.time() if now is None else now)
    scan.read_journal()
    scan.discover()
    scan.watch()
    if scan._room > 0:
        scan.walk_backlog()
    scan.result.cursor = scan.cursor()
    return scan.result
