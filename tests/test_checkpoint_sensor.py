"""The checkpoint sensor: which checkpoints it hands to evaluation, how many at once, and across restarts.

Real Dagster sensor evaluations (``build_sensor_context``) on a local-folder transit bucket; checkpoints
are written the way the training job writes them (the files, then the manifest last).
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import dagster as dg
import pytest
import yaml

from gpudoor_pipelines.assets.partitions import checkpoint_partitions
from gpudoor_pipelines.automation import sensors
from gpudoor_pipelines.automation.sensors import RANGE_END, RANGE_START, new_checkpoint_sensor
from gpudoor_pipelines.data.checkpoints import (
    ScanPolicy,
    check_training_id,
    new_training_id,
    record_end,
    record_start,
    scan_checkpoints,
)
from gpudoor_pipelines.launch.client import PipesSkyPilotClient
from gpudoor_pipelines.transit.bucket import MANIFEST_NAME, TransitBucket
from gpudoor_pipelines.transit.resource import TransitBucketResource
from tests.conftest import SPECS_DIR

HOUR = 3600.0
T0 = 1_800_000_000.0  # the sensor is turned on at T0 in these tests


def write_checkpoint(bucket: TransitBucket, training: str, step: int, *, complete: bool = True) -> str:
    """A checkpoint as the training job writes it; returns its partition key."""
    folder = f"checkpoints/{training}/step-{step:06d}"
    bucket.put_bytes(f"{folder}/model.pt", b"weights")
    if complete:
        bucket.put_bytes(f"{folder}/{MANIFEST_NAME}", json.dumps({"step": step}).encode())
    return f"{training}.step-{step:06d}"


class Door:
    """The sensor with its resources, a Dagster instance, and a clock the test moves."""

    def __init__(self, tmp_path: Path, transit: TransitBucketResource | None = None, **evaluation: float) -> None:
        fleet = yaml.safe_load((SPECS_DIR / "fleet.yaml").read_text())
        fleet["evaluation"] = {**fleet.get("evaluation", {}), **evaluation}
        (tmp_path / "fleet.yaml").write_text(yaml.safe_dump(fleet))
        self.transit = transit or TransitBucketResource(kind="local", local_root=str(tmp_path / "bucket"))
        self.skypilot = PipesSkyPilotClient(
            backend="local",
            fleet_file=str(tmp_path / "fleet.yaml"),
            local_home=str(tmp_path / "home"),
            transit=self.transit,
            validate_with_skypilot=False,
        )
        self.bucket = self.transit.get_bucket()
        self.instance = dg.DagsterInstance.ephemeral()
        self.cursor: str | None = None
        self.now = T0

    def evaluate(self, cursor: str | None = None) -> dg.SensorResult:
        """One tick from ``cursor`` (default: the last applied one), not applied."""
        with (
            mock.patch.object(sensors, "time", SimpleNamespace(time=lambda: self.now)),
            dg.build_sensor_context(
                instance=self.instance,
                cursor=self.cursor if cursor is None else cursor,
                resources={"transit": self.transit, "skypilot": self.skypilot},
            ) as context,
        ):
            return new_checkpoint_sensor(context)

    def apply(self, result: dg.SensorResult) -> list[list[str]]:
        """What the daemon does with a result: add the partitions, keep the cursor; returns the
        checkpoints of each run requested (a partition or a partition range)."""
        for request in result.dynamic_partitions_requests or ():
            self.instance.add_dynamic_partitions(checkpoint_partitions.name, list(request.partition_keys))
        self.cursor = result.cursor
        return [self.checkpoints_of(r) for r in result.run_requests or ()]

    def checkpoints_of(self, request: dg.RunRequest) -> list[str]:
        if request.partition_key:
            return [request.partition_key]
        keys = list(self.instance.get_dynamic_partitions(checkpoint_partitions.name))
        start, end = keys.index(request.tags[RANGE_START]), keys.index(request.tags[RANGE_END])
        return keys[start : end + 1]

    def tick(self) -> list[list[str]]:
        self.now += 30
        return self.apply(self.evaluate())

    def start(self, training: str, at: float | None = None):
        return record_start(self.bucket, training, now=self.now if at is None else at)


def flat(runs: list[list[str]]) -> list[str]:
    return [c for run in runs for c in run]


def test_a_new_checkpoint_becomes_one_partition_and_one_run_with_a_run_key(tmp_path):
    door = Door(tmp_path)
    assert door.tick() == []  # turned on over an empty bucket
    door.start("20261201T090000-aaaaaaaa")
    checkpoint = write_checkpoint(door.bucket, "20261201T090000-aaaaaaaa", 20)
    result = door.evaluate()
    assert [r.run_key for r in result.run_requests] == [checkpoint]
    assert result.run_requests[0].partition_key == checkpoint
    assert door.apply(result) == [[checkpoint]]
    assert door.instance.get_dynamic_partitions(checkpoint_partitions.name) == [checkpoint]
    assert door.tick() == []  # nothing new: nothing requested again


def test_a_checkpoint_counts_only_once_its_manifest_is_written(tmp_path):
    door = Door(tmp_path)
    door.tick()
    training = "20261201T090000-aaaaaaaa"
    door.start(training)
    write_checkpoint(door.bucket, training, 20, complete=False)  # model.pt uploaded, manifest not yet
    assert door.tick() == []
    checkpoint = write_checkpoint(door.bucket, training, 20)
    assert door.tick() == [[checkpoint]]


def test_a_restart_between_listing_and_result_loses_and_repeats_nothing(tmp_path):
    door = Door(tmp_path)
    door.tick()
    training = "20261201T090000-aaaaaaaa"
    door.start(training)
    first = [write_checkpoint(door.bucket, training, s) for s in (10, 20)]
    before = door.cursor
    door.evaluate()  # the sensor listed and died before returning: nothing of it was applied
    more = write_checkpoint(door.bucket, training, 30)
    runs = door.apply(door.evaluate(before))  # the next tick starts from the last applied cursor
    assert flat(runs) == [*first, more]
    assert door.tick() == []  # and nothing is handed out twice
    assert door.instance.get_dynamic_partitions(checkpoint_partitions.name) == [*first, more]


def test_a_tick_resumed_after_its_partitions_were_added_asks_for_no_range_over_others(tmp_path):
    door = Door(tmp_path, checkpoints_per_run=10)
    door.tick()
    training = "20261201T090000-aaaaaaaa"
    door.start(training)
    made = [write_checkpoint(door.bucket, training, s) for s in (10, 20, 30)]
    before = door.cursor
    result = door.evaluate()
    door.apply(result)  # partitions added, then the daemon died before the runs and the cursor
    door.instance.add_dynamic_partitions(checkpoint_partitions.name, ["someone-else.step-000001"])
    again = door.evaluate(before)
    # Same checkpoints, each its own run now: a range could cover the partition added in between.
    assert [r.run_key for r in result.run_requests] == [f"{made[0]}..{made[-1]}"]
    assert [door.checkpoints_of(r) for r in again.run_requests] == [[c] for c in made]


def test_running_trainings_keep_adding_checkpoints_behind_newer_ones_and_none_is_missed(tmp_path):
    door = Door(tmp_path)
    door.tick()
    old, new = "20261201T080000-aaaaaaaa", "20261201T090000-bbbbbbbb"
    door.start(old)
    door.start(new)
    got = flat(door.tick())
    expected: list[str] = []
    for step in (10, 20, 30):
        expected += [write_checkpoint(door.bucket, new, step), write_checkpoint(door.bucket, old, step)]
        got += flat(door.tick())
    # A training whose id sorts before every other (a custom name) that starts last is seen too.
    door.start("Aaa-first-in-order")
    expected.append(write_checkpoint(door.bucket, "Aaa-first-in-order", 10))
    got += flat(door.tick())
    assert sorted(got) == sorted(expected) and len(got) == len(set(got))


def test_turned_on_over_existing_checkpoints_it_takes_the_latest_of_each_then_every_new_one(tmp_path):
    door = Door(tmp_path, backlog_per_training=1, max_runs_per_tick=2, checkpoints_per_run=3)
    trainings = [f"20261101T0{i}0000-0000000{i}" for i in range(8)]
    for t in trainings:  # finished long before the sensor is turned on
        start = door.start(t, at=T0 - 30 * 24 * HOUR)
        for step in range(10, 110, 10):
            write_checkpoint(door.bucket, t, step)
        record_end(door.bucket, start.ended_key, "succeeded")
    first = door.tick()
    assert len(first) <= 2 and all(len(run) <= 3 for run in first)  # the cap, not 80 runs
    backlog = flat(first)
    while True:
        runs = door.tick()
        if not runs:
            break
        backlog += flat(runs)
    assert sorted(backlog) == [f"{t}.step-000100" for t in trainings]  # the latest of each, once
    # New trainings after the sensor was turned on: every checkpoint, a batch per run.
    fresh = "20261201T100000-ffffffff"
    door.start(fresh)
    made = [write_checkpoint(door.bucket, fresh, step) for step in range(1, 8)]
    runs = door.tick()
    assert runs == [made[:3], made[3:6]]  # at most 2 runs of 3 this tick ...
    assert door.tick() == [made[6:]]  # ... and the rest on the next


def test_with_no_backlog_only_what_is_written_after_turn_on_is_evaluated(tmp_path):
    door = Door(tmp_path, backlog_per_training=0)
    running = "20261201T080000-aaaaaaaa"
    door.start(running, at=T0 - HOUR)  # started before the sensor, still running
    write_checkpoint(door.bucket, running, 10)
    write_checkpoint(door.bucket, "20250101T000000-00000000", 10)  # an old training, no journal
    assert door.tick() == []
    later = write_checkpoint(door.bucket, running, 20)
    assert door.tick() == [[later]]


def test_the_cursor_forgets_trainings_that_ended_or_went_silent_and_sees_them_restart(tmp_path):
    door = Door(tmp_path, forget_training_after_hours=2)
    door.tick()
    ended, silent = "20261201T080000-aaaaaaaa", "20261201T090000-bbbbbbbb"
    ended_start = door.start(ended)
    door.start(silent)
    write_checkpoint(door.bucket, ended, 10)
    write_checkpoint(door.bucket, silent, 10)
    door.tick()
    assert set(json.loads(door.cursor)["active"]) == {ended, silent}
    record_end(door.bucket, ended_start.ended_key, "failed", "loss is NaN")
    door.tick()
    assert set(json.loads(door.cursor)["active"]) == {silent}  # the end marker: no longer watched
    door.now += 3 * HOUR  # its run worker died: nothing written, no end marker
    door.tick()
    assert json.loads(door.cursor)["active"] == {}
    # Resumed later (a new start in the journal): watched again, only its new checkpoints count.
    door.start(silent)
    resumed = write_checkpoint(door.bucket, silent, 20)
    assert door.tick() == [[resumed]]


def test_the_cursor_stays_small_over_many_finished_trainings(tmp_path):
    door = Door(tmp_path, backlog_per_training=0)
    door.tick()
    for i in range(60):  # a training every 5 minutes for 5 hours
        door.now += 300
        training = new_training_id(f"{i:08d}", now=door.now)
        start = door.start(training)
        write_checkpoint(door.bucket, training, 10)
        door.tick()
        record_end(door.bucket, start.ended_key, "succeeded")
    door.tick()
    cursor = json.loads(door.cursor)
    assert cursor["active"] == {}
    # Only the journal entries of the last 10 minutes of starts are remembered (to read late writers).
    assert len(cursor["journal"]["seen"]) <= 3
    assert len(door.cursor) < 600


def test_steady_ticks_list_only_the_watched_trainings(tmp_path):
    """O(new): many finished trainings in the bucket cost nothing per tick."""
    door = Door(tmp_path, backlog_per_training=0)
    for i in range(200):
        for step in (10, 20):
            write_checkpoint(door.bucket, f"20250101T000000-{i:08d}", step)
    door.tick()
    running = "20261201T080000-aaaaaaaa"
    door.start(running)
    door.tick()
    write_checkpoint(door.bucket, running, 10)
    assert door.tick() == [[f"{running}.step-000010"]]
    write_checkpoint(door.bucket, running, 20)
    result = scan_checkpoints(door.bucket, json.loads(door.cursor), ScanPolicy(backlog_per_training=0), now=door.now)
    assert result.checkpoints == [f"{running}.step-000020"]
    # The journal, the one running training, and one listing for dated folders after the newest id.
    assert result.lists == 3 and result.exists == 0
    # The journal's entry (read again within its lookback); the training's keys after its last manifest
    # (that checkpoint's model.pt, the new checkpoint's two files); nothing from the 200 finished ones.
    assert result.keys_listed <= 4


def test_a_training_nobody_journaled_is_found_by_its_folder_and_leaves_on_its_run_manifest(tmp_path):
    """A program of its own writing the layout, with a dated id and no journal entry."""
    door = Door(tmp_path)
    old = "20250101T000000-00000000"
    write_checkpoint(door.bucket, old, 10)
    running = new_training_id("0e0e0e0e", now=T0 - HOUR)  # started an hour before the sensor was turned on
    write_checkpoint(door.bucket, running, 10)
    latest = write_checkpoint(door.bucket, running, 20)
    # Turned on: the backlog's latest of each training; the one that may still run is watched from there.
    assert sorted(flat(door.tick())) == [f"{old}.step-000010", latest]
    later = write_checkpoint(door.bucket, running, 30)
    assert door.tick() == [[later]]
    own = new_training_id("0a0b0c0d", now=door.now)
    first, second = write_checkpoint(door.bucket, own, 10), write_checkpoint(door.bucket, own, 20)
    write_checkpoint(door.bucket, "my-run", 10)  # not a dated id: it would not sort by start, and is not looked for
    assert flat(door.tick()) == [first, second]  # all of it: it started after the sensor
    third = write_checkpoint(door.bucket, own, 30)
    assert door.tick() == [[third]]
    door.bucket.put_bytes(f"checkpoints/{own}/{MANIFEST_NAME}", b"{}")  # its run manifest: it is over
    door.tick()
    assert own not in json.loads(door.cursor)["active"]
    write_checkpoint(door.bucket, old, 20)  # older than the newest id seen, never journaled: not looked at
    assert door.tick() == [] and door.tick() == []


def test_training_ids_sort_by_start_and_names_that_break_keys_are_refused():
    assert new_training_id("0f3a9c1e-aaaa", now=T0) < new_training_id("00000000-bbbb", now=T0 + 1)
    assert check_training_id(new_training_id("0f3a9c1e-aaaa"))
    for bad in ("my.run", "a/b", "", "-x", "x" * 81, "é"):
        with pytest.raises(ValueError, match="training_name"):
            check_training_id(bad)
