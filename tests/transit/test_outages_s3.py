"""The transit bucket going away for a while, and coming back: the night, its merge, the checkpoint sensor and
the IO manager go on across the outage, and fail cleanly, naming the bucket, when it lasts past the bound.

A real S3 API over HTTP on 127.0.0.1, reached through a proxy (``outage_proxy.py``) that refuses connections
and cuts open ones while down. The outage lasts ``GPUDOOR_TEST_OUTAGE_S`` (5 s by default, to keep CI short;
the same tests pass with 45).
"""

from __future__ import annotations

import io
import os
import threading
import time
from urllib.parse import urlparse

import dagster as dg
import pandas as pd
import pytest
from outage_proxy import OutageProxy
from transit_helpers import TEST_KEY_ID, TEST_REGION, TEST_SECRET

from gpudoor_pipelines import outage
from gpudoor_pipelines.automation import sensors
from gpudoor_pipelines.transit.io_manager import TransitIOManager
from gpudoor_pipelines.transit.resource import TransitBucketResource
from tests.test_caption_night import Night
from tests.test_checkpoint_sensor import Door, write_checkpoint

pytestmark = pytest.mark.s3

OUTAGE_S = float(os.environ.get("GPUDOOR_TEST_OUTAGE_S", "5"))
#: What a Dagster run shows of the outage (``dagster.yaml`` ships the same setting).
OUTAGE_LOGS = {"python_logs": {"managed_python_loggers": [outage.__name__]}}


@pytest.fixture
def proxy(s3_server):
    url = urlparse(s3_server)
    p = OutageProxy((url.hostname, url.port))
    yield p
    p.close()


def _transit(proxy: OutageProxy, bucket: str) -> TransitBucketResource:
    return TransitBucketResource(
        kind="s3",
        bucket=bucket,
        prefix="transit",
        endpoint_url=proxy.url,
        region=TEST_REGION,
        access_key_id=TEST_KEY_ID,
        secret_access_key=TEST_SECRET,
        max_attempts=2,
    )


def _said(instance: dg.DagsterInstance, run_id: str) -> list[str]:
    return [e.user_message for e in instance.all_logs(run_id)]


def test_a_night_and_its_merge_go_on_across_an_outage_of_the_bucket_and_fail_clearly_past_the_bound(
    tmp_path, proxy, s3_bucket_name, monkeypatch
):
    with dg.instance_for_test(overrides=OUTAGE_LOGS) as instance:
        night = Night(tmp_path, free_gpus=2, transit=_transit(proxy, s3_bucket_name), instance=instance)
        assert night.materialize("dataset_shards", config={"num_images": 8, "shard_size": 4, "image_size": 16}).success
        # The bucket goes away once the night's jobs run (they read their shards, and write captions, through it).
        runs: list[dg.ExecuteInProcessResult] = []
        worker = threading.Thread(target=lambda: runs.append(night.materialize("caption_shards", shards=night.shards)))
        worker.start()
        deadline = time.monotonic() + 60
        while not night.batch_jobs() and time.monotonic() < deadline:
            time.sleep(0.1)
        with proxy.outage(OUTAGE_S):
            worker.join(timeout=300)
        (result,) = runs
        assert result.success
        assert night.materialized() == set(night.shards)
        said = _said(instance, result.run_id)
        # The jobs' own bucket client waited too, and said so in their logs, which the run shows.
        assert any(m.startswith("[job ") and "did not answer while reading" in m for m in said)
        assert any(m.startswith("[job ") and "is back after" in m for m in said)

        # The morning merge starts while the bucket is away, and waits for it.
        with proxy.outage(OUTAGE_S):
            merged = night.materialize("captioned_dataset")
        assert merged.success
        md = instance.get_latest_materialization_event(dg.AssetKey("captioned_dataset")).asset_materialization.metadata
        table = pd.read_parquet(io.BytesIO(night.bucket.get_bytes(night.bucket.key_of(md["dataset_uri"].value))))
        assert len(table) == 8 and table["caption"].notna().all()
        said = _said(instance, merged.run_id)
        assert any("did not answer while" in m and "waiting up to 300 s" in m for m in said)
        assert any("is back after" in m for m in said)

        # Past the bound, the next night and merge fail saying which service, and for how long.
        monkeypatch.setenv(outage.TOLERANCE_ENV, "2")
        proxy.down()
        try:
            failed = [night.materialize("caption_shards", shards=night.shards), night.materialize("captioned_dataset")]
        finally:
            proxy.up()
        for run in failed:
            (failure,) = [e for e in run.all_events if e.is_step_failure]
            text = failure.step_failure_data.error.to_string()
            assert f"the transit bucket s3://{s3_bucket_name}/transit at {proxy.url} has not answered for" in text
            assert "longer than GPUDOOR_OUTAGE_TOLERANCE_S=2 s" in text


def test_the_checkpoint_sensor_skips_during_an_outage_and_goes_on_from_its_cursor(
    tmp_path, proxy, s3_bucket_name, monkeypatch
):
    door = Door(tmp_path, transit=_transit(proxy, s3_bucket_name))
    door.start("run-a")
    assert door.tick() == []
    first = write_checkpoint(door.bucket, "run-a", 100)
    monkeypatch.setattr(sensors, "TICK_WAIT_S", 1.5)  # a tick waits this long, then skips
    before = door.cursor
    proxy.down()
    try:
        skipped = door.evaluate()
    finally:
        proxy.up()
    reason = skipped.skip_reason.skip_message
    assert not skipped.run_requests and f"the transit bucket s3://{s3_bucket_name}/transit" in reason
    assert "has not answered" in reason and "the cursor is kept" in reason and door.cursor == before
    assert door.tick() == [[first]]  # the next tick goes on: nothing lost


def test_past_the_bound_the_sensor_tick_fails_naming_the_bucket(tmp_path, proxy, s3_bucket_name, monkeypatch):
    door = Door(tmp_path, transit=_transit(proxy, s3_bucket_name))
    door.start("run-a")
    door.tick()
    monkeypatch.setenv(outage.TOLERANCE_ENV, "1")
    proxy.down()
    try:
        with pytest.raises(outage.ServiceUnavailable, match=f"the transit bucket s3://{s3_bucket_name}/transit at"):
            door.evaluate()
    finally:
        proxy.up()


@dg.asset
def table() -> pd.DataFrame:
    return pd.DataFrame({"x": range(100)})


@dg.asset
def total(table: pd.DataFrame) -> int:
    return int(table["x"].sum())


def test_the_io_manager_waits_out_an_outage_and_fails_clearly_past_the_bound(proxy, s3_bucket_name, monkeypatch):
    io_manager = TransitIOManager(transit=_transit(proxy, s3_bucket_name))
    with dg.instance_for_test(overrides=OUTAGE_LOGS) as instance:
        assert dg.materialize([table], instance=instance, resources={"io_manager": io_manager}).success
        with proxy.outage(OUTAGE_S):  # the load of `table` and the store of `total` meet it
            result = dg.materialize(
                [table, total], selection=[total], instance=instance, resources={"io_manager": io_manager}
            )
        assert result.success and result.output_for_node("total") == 4950
        assert any("is back after" in m for m in _said(instance, result.run_id))

        monkeypatch.setenv(outage.TOLERANCE_ENV, "2")
        proxy.down()
        try:
            t0 = time.monotonic()
            failed = dg.materialize(
                [table, total],
                selection=[total],
                instance=instance,
                resources={"io_manager": io_manager},
                raise_on_error=False,
            )
        finally:
            proxy.up()
    assert not failed.success and time.monotonic() - t0 < 30
    (failure,) = [e for e in failed.all_events if e.is_step_failure]
    text = failure.step_failure_data.error.to_string()
    assert f"the transit bucket s3://{s3_bucket_name}/transit at {proxy.url} has not answered for" in text
    assert "GPUDOOR_OUTAGE_TOLERANCE_S=2" in text


def test_an_endpoint_that_never_answered_is_a_wrong_setting_not_an_outage(proxy, s3_bucket_name):
    from gpudoor_pipelines.transit.bucket import TransitConfigError

    bucket = _transit(proxy, s3_bucket_name).get_bucket()
    proxy.down()
    t0 = time.monotonic()
    with pytest.raises(TransitConfigError, match="endpoint_url"):
        bucket.get_bytes("anything")
    assert time.monotonic() - t0 < 10
