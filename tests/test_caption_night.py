"""Nights of captioning on the embedded default: many shards packed into jobs on a pool that fits the free GPUs.

Real Dagster runs (partition-range runs, as the nightly schedule makes them), the real caption job
as local processes on a local warm pool, and a local-folder transit bucket.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import threading
import time
from pathlib import Path

import dagster as dg
import pandas as pd
import pyarrow.parquet as pq
import yaml

from gpudoor_pipelines.assets.captioning import (
    ALL_SHARDS_CHECK,
    caption_shards,
    captioned_dataset,
    dataset_shards,
)
from gpudoor_pipelines.assets.partitions import SHARDS
from gpudoor_pipelines.automation.schedules import night_runs
from gpudoor_pipelines.data.captions import captions_prefix, done_shards
from gpudoor_pipelines.launch.backends.local import LocalBackend
from gpudoor_pipelines.launch.client import PipesSkyPilotClient
from gpudoor_pipelines.transit.io_manager import TransitIOManager
from gpudoor_pipelines.transit.resource import TransitBucketResource
from tests.conftest import SPECS_DIR, given_inputs

MODEL = "color-shape-v1"


class Night:
    """A code location of the captioning assets on a fleet whose caption pool lends ``free_gpus`` GPUs."""

    def __init__(
        self,
        tmp_path: Path,
        free_gpus: int,
        transit: TransitBucketResource | None = None,
        instance: dg.DagsterInstance | None = None,
    ) -> None:
        fleet = yaml.safe_load((SPECS_DIR / "fleet.yaml").read_text())
        fleet["pools"]["onprem"].update(gpu_cap=free_gpus, max_gpus_per_user=free_gpus)
        fleet["routes"]["caption"] = ["onprem"]
        fleet.pop("sharing", None)  # onprem's cap shrinks below the teams' quotas there
        (tmp_path / "fleet.yaml").write_text(yaml.safe_dump(fleet))
        self.home = tmp_path / "home"
        self.transit = transit or TransitBucketResource(kind="local", local_root=str(tmp_path / "bucket"))
        self.skypilot = PipesSkyPilotClient(
            backend="local",
            fleet_file=str(tmp_path / "fleet.yaml"),
            local_home=str(self.home),
            transit=self.transit,
            poll_interval_s=0.2,
            validate_with_skypilot=False,
        )
        self.defs = dg.Definitions(
            assets=[dataset_shards, caption_shards, captioned_dataset],
            resources={
                "transit": self.transit,
                "skypilot": self.skypilot,
                "io_manager": TransitIOManager(transit=self.transit),
            },
        )
        self.instance = instance or dg.DagsterInstance.ephemeral()
        self.bucket = self.transit.get_bucket()

    def materialize(
        self, key: str, *, config: dict | None = None, shards: list[str] | None = None
    ) -> dg.ExecuteInProcessResult:
        tags = {}
        if shards:
            tags = {
                "dagster/asset_partition_range_start": shards[0],
                "dagster/asset_partition_range_end": shards[-1],
            }
        return self.defs.resolve_implicit_global_asset_job_def().execute_in_process(
            instance=self.instance,
            asset_selection=[dg.AssetKey(key)],
            tags=tags or None,
            raise_on_error=False,
            run_config={"ops": {key: {"config": config}}} if config else None,
        )

    @property
    def shards(self) -> list[str]:
        return list(self.instance.get_dynamic_partitions(SHARDS))

    def materialized(self) -> set[str]:
        return set(self.instance.get_materialized_partitions(dg.AssetKey("caption_shards")))

    def batch_jobs(self) -> list[dict]:
        """State of every job the local backend ran for a batch (rank jobs on a pool)."""
        jobs = []
        for job_dir in (self.home / "jobs").iterdir() if (self.home / "jobs").is_dir() else ():
            task = json.loads((job_dir / "task.json").read_text())
            if task.get("worker_pool"):
                jobs.append({**json.loads((job_dir / "state.json").read_text()), "dir": job_dir, "rank": task["rank"]})
        return jobs


def _most_at_once(jobs: list[dict]) -> int:
    edges = sorted(
        [(j["started_at"], 1) for j in jobs if j.get("started_at")]
        + [(j["ended_at"], -1) for j in jobs if j.get("started_at")]
    )
    most = current = 0
    for _, step in edges:
        current += step
        most = max(most, current)
    return most


def test_a_200_shard_night_fits_4_free_gpus_and_materializes_every_shard(tmp_path):
    night = Night(tmp_path, free_gpus=4)
    assert night.materialize("dataset_shards", config={"num_images": 400, "shard_size": 2, "image_size": 16}).success
    assert len(night.shards) == 200
    result = night.materialize("caption_shards", shards=night.shards)
    assert result.success, [e.message for e in result.all_events if e.is_failure]

    assert night.materialized() == set(night.shards)  # each shard is its own materialization
    jobs = night.batch_jobs()
    assert 1 < len(jobs) <= 16  # packed: a few jobs per worker, not one job (or run) per shard
    assert _most_at_once(jobs) <= 4  # never more jobs at once than free GPUs
    assert done_shards(night.bucket, MODEL) == set(night.shards)
    # Few objects: one Parquet part per shard here (2 images per shard), never one per image.
    parts = [k for k in night.bucket.list_keys(f"captions/{MODEL}/") if k.endswith(".parquet")]
    assert len(parts) == 200
    record = night.instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=dg.AssetKey("caption_shards"), asset_partitions=[night.shards[7]]),
        limit=1,
    ).records[0]
    md = record.event_log_entry.asset_materialization.metadata
    assert md["images_captioned"].value == 2 and md["caption_model"].value == MODEL


def test_a_job_killed_mid_shard_resumes_without_recaptioning(tmp_path):
    night = Night(tmp_path, free_gpus=1)
    assert night.materialize("dataset_shards", config={"num_images": 12, "shard_size": 12, "image_size": 16}).success
    shard = night.shards[0]
    prefix = captions_prefix(MODEL, shard)
    killed: dict[str, bytes] = {}

    def kill_after_first_part() -> None:
        deadline = time.time() + 120
        while time.time() < deadline and not killed:
            parts = [k for k in night.bucket.list_keys(prefix + "/") if k.endswith(".parquet")]
            running = [j for j in night.batch_jobs() if j.get("state") == "RUNNING"]
            if parts and running:
                killed.update({k: night.bucket.get_bytes(k) for k in parts})
                pgid = json.loads((running[0]["dir"] / "runner.json").read_text())["pgid"]
                os.killpg(pgid, signal.SIGKILL)  # a preemption: no chance to clean up
            time.sleep(0.05)

    killer = threading.Thread(target=kill_after_first_part)
    killer.start()
    # Six parts of 2.4 s: a window of about 12 s to catch the job between its first and its last part, wide
    # enough for a machine whose other lane starves this one (sleeping costs no CPU).
    config = {"env": {"IMAGES_PER_PART": "2", "WORKLOAD_THROTTLE_S": "1.2"}}
    result = night.materialize("caption_shards", config=config, shards=[shard])
    killer.join()
    assert killed, "the job was never caught mid-shard"
    assert result.success, [e.message for e in result.all_events if e.is_failure]
    assert [j["state"] for j in sorted(night.batch_jobs(), key=lambda j: j["submitted_at"])] == [
        "FAILED",
        "SUCCEEDED",
    ]
    # The parts written before the kill are untouched; the retry only captioned what was left.
    for key, data in killed.items():
        assert night.bucket.get_bytes(key) == data
    frames = [
        pq.read_table(night.bucket.path_of(k)).to_pandas()
        for k in night.bucket.list_keys(prefix + "/")
        if k.endswith(".parquet")
    ]
    rows = pd.concat(frames)
    assert len(rows) == 12 and rows["image_uri"].is_unique
    assert night.materialized() == {shard}
    # The shard's materialization says its job was interrupted once, and what was done again (the work of
    # the killed job after its last part); the run's summary counts it and its goodput.
    (event,) = night.instance.get_event_records(
        dg.EventRecordsFilter(dg.DagsterEventType.ASSET_MATERIALIZATION, asset_key=dg.AssetKey("caption_shards"))
    )
    md = {k: v.value for k, v in event.asset_materialization.metadata.items()}
    assert md["interruptions"] == 1 and md["gpu_hours_lost_to_interruptions"] > 0
    logs = [e.user_message for e in night.instance.all_logs(result.run_id)]
    (summary,) = [m for m in logs if m.startswith("Captioning: ")]
    assert "'jobs_interrupted': 1" in summary and "'goodput': 0." in summary


def test_a_night_that_reaches_its_end_stops_launching_and_the_next_night_finishes(tmp_path):
    night = Night(tmp_path, free_gpus=1)
    assert night.materialize("dataset_shards", config={"num_images": 24, "shard_size": 4, "image_size": 16}).success
    # 24 images at 2 s each (48 s) cannot all be done by the end; a loaded machine may take ~15 s to start
    # the job (Dagster run, worker, imports), which still leaves time for a first shard (8 s) before the end.
    end = datetime.datetime.now(datetime.UTC) + datetime.timedelta(seconds=25)
    slow = {"env": {"IMAGES_PER_PART": "1", "WORKLOAD_THROTTLE_S": "2.0"}, "shards_per_job": 6}
    first = night.materialize("caption_shards", config={**slow, "window_end": end.isoformat()}, shards=night.shards)
    assert first.success  # shards left for the next night are not a failure
    done_first = night.materialized()
    assert 0 < len(done_first) < 6
    # Nothing started after the end: every part was written before it (a running part, 2 s, may finish).
    parts = [night.bucket.path_of(k) for k in night.bucket.list_keys("captions/") if k.endswith(".parquet")]
    assert parts and all(p.stat().st_mtime < end.timestamp() + 8 for p in parts)
    # And the job then exits (its reports flushed; slower where the tests get little CPU beside the bed's).
    finished = [j["ended_at"] for j in night.batch_jobs()]
    assert all(t < end.timestamp() + 30 for t in finished)

    second = night.materialize("caption_shards", config={"env": {"IMAGES_PER_PART": "2"}}, shards=night.shards)
    assert second.success
    assert night.materialized() == set(night.shards)
    for shard in night.shards:
        rows = sum(
            pq.read_metadata(night.bucket.path_of(k)).num_rows
            for k in night.bucket.list_keys(captions_prefix(MODEL, shard) + "/")
            if k.endswith(".parquet")
        )
        assert rows == 4  # nothing captioned twice across the two nights


def test_the_morning_merge_publishes_the_done_shards_and_warns_about_the_missing(tmp_path):
    night = Night(tmp_path, free_gpus=2)
    assert night.materialize("dataset_shards", config={"num_images": 12, "shard_size": 4, "image_size": 16}).success
    assert night.materialize("caption_shards", shards=night.shards[:2]).success
    merged = night.materialize("captioned_dataset")
    assert merged.success
    checks = merged.get_asset_check_evaluations()
    assert [(c.check_name, c.passed, c.severity) for c in checks] == [
        (ALL_SHARDS_CHECK, False, dg.AssetCheckSeverity.WARN)
    ]
    assert checks[0].metadata["shards_missing"].value == 1
    md = night.instance.get_latest_materialization_event(
        dg.AssetKey("captioned_dataset")
    ).asset_materialization.metadata
    table = pd.read_parquet(md["dataset_uri"].value.removeprefix("file://"))
    assert list(table.columns) == ["image_id", "image_uri", "caption", "shard"]
    assert len(table) == 8 and set(table["shard"]) == set(night.shards[:2])


def test_a_source_that_cannot_be_read_fails_before_anything_is_launched(tmp_path):
    night = Night(tmp_path, free_gpus=1)
    result = night.materialize("dataset_shards", config={"source": str(tmp_path / "no-such-folder")})
    assert not result.success
    message = next(e for e in result.all_events if e.is_step_failure).event_specific_data.error.message
    assert "no-such-folder" in message and "Fix:" in message and "Nothing was launched" in message
    assert night.shards == [] and not (night.home / "jobs").exists()


def test_new_images_in_the_source_become_new_shards(tmp_path):
    from gpudoor_pipelines.data.synthetic import generate_image

    night = Night(tmp_path, free_gpus=1)
    images = tmp_path / "team-images"
    images.mkdir()
    for i in range(10):
        (images / f"img-{i:03d}.png").write_bytes(generate_image(i, size=16)[0])
    (images / ".DS_Store").write_bytes(b"x")
    config = {"source": str(images), "name": "team", "shard_size": 4}
    first = night.materialize("dataset_shards", config=config)
    assert first.success and night.shards == ["team-00000", "team-00001", "team-00002"]
    md = first.asset_materializations_for_node("dataset_shards")[0].metadata
    assert md["files_skipped"].value == 1
    before = night.bucket.get_bytes("datasets/team/shards/team-00002/_manifest.json")

    for i in range(10, 15):
        (images / f"img-{i:03d}.png").write_bytes(generate_image(i, size=16)[0])
    assert night.materialize("dataset_shards", config=config).success
    assert night.shards == ["team-00000", "team-00001", "team-00002", "team-00003", "team-00004"]
    assert night.bucket.get_bytes("datasets/team/shards/team-00002/_manifest.json") == before  # old shards never move


def test_night_runs_cover_only_the_shards_not_done(tmp_path):
    shards = [f"d-{i:05d}" for i in range(10)]
    done = {"d-00000", "d-00001", "d-00005"}
    requests = night_runs(shards, done, night="2026-12-01", window_end="2026-12-01T06:00:00+01:00", max_shards=4)
    ranges = [
        (r.tags["dagster/asset_partition_range_start"], r.tags["dagster/asset_partition_range_end"]) for r in requests
    ]
    assert ranges == [("d-00002", "d-00006"), ("d-00007", "d-00009")]
    assert {r.run_key for r in requests} == {"2026-12-01-0000", "2026-12-01-0001"}
    assert requests[0].run_config["ops"]["caption_shards"]["config"]["window_end"] == "2026-12-01T06:00:00+01:00"
    assert night_runs(shards, set(shards), night="n", window_end="e") == []


def test_the_local_backend_pool_is_given_back_after_the_night(tmp_path):
    night = Night(tmp_path, free_gpus=2)
    assert night.materialize("dataset_shards", config={"num_images": 8, "shard_size": 4, "image_size": 16}).success
    assert night.materialize("caption_shards", shards=night.shards).success
    backend = LocalBackend(home=night.home)
    deadline = time.time() + 10
    while backend.usage().gpus and time.time() < deadline:
        time.sleep(0.1)
    assert backend.usage().gpus == {}


def _hold_the_gpu(night: Night, seconds: int) -> str:
    """Another job of the team holds the caption pool's one GPU for ``seconds``."""
    from gpudoor_pipelines.launch.resolve.request import LaunchRequest, resolve
    from gpudoor_pipelines.launch.resolve.specs import load_spec

    spec = load_spec("caption", skypilot=False)
    request = LaunchRequest(
        spec=spec,
        inputs=given_inputs(spec),  # the job only sleeps
        env={},
        user="someone-else",
        asset="other",
        partition=None,
        step="caption",
    )
    job = resolve(request, night.skypilot.get_fleet())
    job.config["run"] = f"sleep {seconds}"
    job.config.pop("setup", None)
    return LocalBackend(home=night.home).submit(job)


def test_with_no_free_gpu_the_run_waits_then_gives_up_clearly(tmp_path):
    night = Night(tmp_path, free_gpus=1)
    assert night.materialize("dataset_shards", config={"num_images": 4, "shard_size": 4, "image_size": 16}).success
    holder = _hold_the_gpu(night, 60)
    try:
        result = night.materialize("caption_shards", config={"wait_for_gpus_s": 2}, shards=night.shards)
    finally:
        LocalBackend(home=night.home).cancel(holder)
    assert not result.success
    message = next(e for e in result.all_events if e.is_step_failure).event_specific_data.error.message
    assert "No free GPU" in message and "at its cap" in message and "Fix:" in message
    assert night.batch_jobs() == [] and night.materialized() == set()  # nothing was launched


def test_a_run_waits_for_a_gpu_to_free_up(tmp_path):
    night = Night(tmp_path, free_gpus=1)
    assert night.materialize("dataset_shards", config={"num_images": 4, "shard_size": 4, "image_size": 16}).success
    _hold_the_gpu(night, 3)
    result = night.materialize("caption_shards", config={"wait_for_gpus_s": 30}, shards=night.shards)
    assert result.success
    logs = [e.user_message for e in night.instance.all_logs(result.run_id)]
    assert any("No free GPU for captioning" in m and "at its cap" in m and "waiting" in m for m in logs)
    assert night.materialized() == set(night.shards)
