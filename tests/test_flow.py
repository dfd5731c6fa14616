"""The whole flow, dataset to demo, materialized on the embedded default in a test Dagster instance."""

from __future__ import annotations

import json
import urllib.request

import dagster as dg
import pytest

from gpudoor_pipelines.flow import run_flow

pytestmark = pytest.mark.e2e


@pytest.fixture
def instance():
    with dg.instance_for_test() as inst:
        yield inst


def _md(instance, key, partition=None):
    if partition:
        records = instance.fetch_materializations(
            dg.AssetRecordsFilter(asset_key=dg.AssetKey(key), asset_partitions=[partition]), limit=1
        ).records
        event = records[0].event_log_entry.asset_materialization
    else:
        event = instance.get_latest_materialization_event(dg.AssetKey(key)).asset_materialization
    return {k: v.value for k, v in event.metadata.items()}


def test_whole_flow_on_the_embedded_default(instance, _isolated_homes):
    from gpudoor_pipelines.definitions import defs

    summary = run_flow(defs, instance, run_config={"dataset_shards": {"num_images": 64}})
    with dg.build_resources({"transit": defs.resources["transit"], "skypilot": defs.resources["skypilot"]}) as res:
        _check_flow(instance, summary, res.transit.get_bucket(), res.skypilot)


def _check_flow(instance, summary, bucket, skypilot):
    try:
        # Outputs exist in the bucket.
        assert bucket.read_manifest("datasets/synthetic/captioned")["rows"] == 64
        for shard in ("shard-000", "shard-003"):
            assert bucket.read_manifest(f"captions/color-shape-v1/{shard}")["count"] == 16
        assert len(summary.checkpoints) >= 2
        for ckpt in summary.checkpoints:
            training_id, step = ckpt.split(".")
            assert bucket.exists(f"checkpoints/{training_id}/{step}/model.pt")
            assert bucket.exists(f"evals/{ckpt}/metrics.json")

        # Launch metadata, and what the jobs reported through Pipes, are on the materializations.
        caption = _md(instance, "caption_shards", "shard-001")
        for key in ("job_id", "pool", "infra", "gpu_hours", "cost_usd_estimate", "images_captioned"):
            assert key in caption, key
        assert caption["pool"] == "onprem" and caption["images_captioned"] == 16
        train = _md(instance, "training_run")
        assert train["pool"] == "h200" and train["num_nodes"] == 2 and "smoke_job_id" in train
        assert "final_loss" in train
        evals = _md(instance, "checkpoint_evals", summary.checkpoints[-1])
        assert 0.0 <= evals["accuracy"] <= 1.0 and evals["pool"] == "inference"
        checks = instance.event_log_storage.get_latest_asset_check_execution_by_key(
            [dg.AssetCheckKey(dg.AssetKey("checkpoint_evals"), "accuracy_above_chance")]
        )
        assert checks, "the eval asset check was recorded"

        best = _md(instance, "best_checkpoint")
        assert best["checkpoint"] == summary.best_checkpoint and best["accuracy"] == pytest.approx(summary.accuracy)
        assert summary.accuracy > 1 / 18, "the trained model beats chance on held-out images"

        usage = _md(instance, "gpu_usage")
        assert usage["launches"] >= 4 + 1 + len(summary.checkpoints) and usage["gpu_hours"] > 0

        # The demo answers with a sample from the best checkpoint.
        assert summary.demo_cluster.startswith("lab-")
        with urllib.request.urlopen(summary.demo_url + "/?color=red&shape=circle", timeout=10) as r:
            answer = json.loads(r.read())
        assert "prediction" in answer and summary.best_checkpoint.split(".")[1] in answer["checkpoint"]
    finally:
        skypilot.stop_service("lab-gpudoor-demo")
