"""The whole flow, dataset to demo, materialized on the embedded default in a test Dagster instance."""

from __future__ import annotations

import json
import urllib.request
import uuid

import dagster as dg
import pytest

from gpudoor_pipelines.cli.flow import run_flow

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


def _run_and_check(instance, **flow_options):
    from gpudoor_pipelines.definitions import build_defs

    defs = build_defs()
    # A shorter training than the default (2 checkpoints) keeps the suite quick on 2 cores.
    run_config = {
        "dataset_shards": {"num_images": 64, "shard_size": 16},
        "training_run": {"env": {"MAX_STEPS": "30", "CHECKPOINT_EVERY": "15"}},
    }
    summary = run_flow(defs, instance, run_config=run_config, **flow_options)
    with dg.build_resources({"transit": defs.resources["transit"], "skypilot": defs.resources["skypilot"]}) as res:
        bucket = res.transit.get_bucket()
        _check_flow(instance, summary, bucket, res.skypilot)
    return summary, bucket


def test_whole_flow_on_the_embedded_default(instance, tmp_path, capfd):
    """`gpudoor flow`'s view of it: one line per step with its pool, job and state; the event log in a file."""
    import io

    from gpudoor_pipelines.cli.progress import FlowProgress

    out = io.StringIO()
    progress = FlowProgress(instance, tmp_path / "flow.log", out=out, poll_s=0.2)
    try:
        _, bucket = _run_and_check(instance, watch=progress.watch, console_log_level="CRITICAL")
    finally:
        progress.close()
    assert bucket.root_uri.startswith("file://")
    lines = out.getvalue().splitlines()
    finals = {}
    for line in lines:
        step = line.split("]", 1)[1].split()[0]
        finals[step.split("[")[0]] = line
    assert set(finals) == {
        "dataset_shards",
        "caption_shards",
        "captioned_dataset",
        "training_run",
        "checkpoint_evals",
        "best_checkpoint",
        "demo",
        "gpu_usage",
    }
    assert all(line.endswith("done") for line in finals.values()), finals
    assert "pool h200" in finals["training_run"] and " job " in finals["training_run"]
    # The smoke test before the training says so while it runs.
    smoke_lines = [line for line in lines if line.split("]", 1)[1].split()[0].startswith("training_run")]
    assert any("  smoke test  pool h200" in line for line in smoke_lines), smoke_lines
    assert any("caption_shards[" in line and " job " in line for line in lines)
    log = (tmp_path / "flow.log").read_text()
    assert "STEP_SUCCESS" in log and "Submitted job" in log
    # Dagster's console stream is off: what it would have printed is in the file, not on the terminal.
    assert "STEP_SUCCESS" not in capfd.readouterr().err


def test_a_failed_step_says_what_failed_and_the_fix_without_a_traceback(instance, tmp_path):
    from gpudoor_pipelines.cli.flow import FlowFailed
    from gpudoor_pipelines.definitions import build_defs

    with pytest.raises(FlowFailed) as err:
        run_flow(
            build_defs(),
            instance,
            run_config={"dataset_shards": {"source": str(tmp_path / "no-such-folder")}},
            console_log_level="CRITICAL",
        )
    assert err.value.label == "dataset_shards" and "no-such-folder" in err.value.why
    assert "Fix" in err.value.why and "Traceback" not in err.value.why


@pytest.mark.s3
def test_whole_flow_through_the_s3_transit_bucket(instance, s3_server, monkeypatch):
    """The same flow with the transit bucket on S3 (a real S3 API over HTTP on 127.0.0.1)."""
    import boto3

    name = f"flow-{uuid.uuid4().hex[:8]}"
    secret = f"flow-secret-{uuid.uuid4().hex}"
    boto3.client(
        "s3",
        endpoint_url=s3_server,
        region_name="us-east-1",
        aws_access_key_id="flow-key-id",
        aws_secret_access_key=secret,
    ).create_bucket(Bucket=name)
    for var, value in {
        "GPUDOOR_TRANSIT": "s3",
        "GPUDOOR_S3_BUCKET": name,
        "GPUDOOR_S3_PREFIX": "transit",
        "GPUDOOR_S3_ENDPOINT_URL": s3_server,
        "GPUDOOR_S3_ACCESS_KEY_ID": "flow-key-id",
        "GPUDOOR_S3_SECRET_ACCESS_KEY": secret,
    }.items():
        monkeypatch.setenv(var, value)
    summary, bucket = _run_and_check(instance)
    assert bucket.root_uri == f"s3://{name}/transit"
    # Jobs read and wrote the bucket themselves: the checkpoints are S3 objects.
    assert any(k.endswith("/model.pt") for k in bucket.list_keys("checkpoints/"))
    # The secret never reached the run logs or the metadata.
    for run_id in summary.run_ids:
        for entry in instance.all_logs(run_id):
            assert secret not in (entry.user_message or "")
            assert secret not in str(entry.dagster_event.event_specific_data if entry.dagster_event else "")


def _check_flow(instance, summary, bucket, skypilot):
    try:
        # Outputs exist in the bucket.
        assert bucket.read_manifest("datasets/sample/captioned/color-shape-v1")["rows"] == 64
        for shard in ("sample-00000", "sample-00003"):
            assert bucket.read_manifest(f"captions/color-shape-v1/{shard}")["count"] == 16
        assert len(summary.checkpoints) >= 2
        for ckpt in summary.checkpoints:
            training_id, step = ckpt.split(".")
            assert bucket.exists(f"checkpoints/{training_id}/{step}/model.pt")
            assert bucket.exists(f"evals/{ckpt}/metrics.json")

        # Launch metadata, and what the jobs reported through Pipes, are on the materializations.
        caption = _md(instance, "caption_shards", "sample-00001")
        for key in ("job_id", "pool", "infra", "gpu_hours", "cost_usd_estimate", "images_captioned"):
            assert key in caption, key
        assert caption["pool"] == "onprem" and caption["images_captioned"] == 16
        train = _md(instance, "training_run")
        assert train["pool"] == "h200" and train["num_nodes"] == 2 and "smoke_job_id" in train
        assert "final_loss" in train
        # Every checkpoint of the training evaluated by one run, each its own materialization with its
        # accuracy as a number (the UI plots it across checkpoints) and its own check result.
        training_id = train["training_id"]
        eval_runs = set()
        for ckpt in summary.checkpoints:
            evals = _md(instance, "checkpoint_evals", ckpt)
            assert isinstance(evals["accuracy"], float) and 0.0 <= evals["accuracy"] <= 1.0
            assert evals["pool"] == "inference" and evals["training_id"] == training_id and evals["job_id"]
            eval_runs.add(
                instance.fetch_materializations(
                    dg.AssetRecordsFilter(asset_key=dg.AssetKey("checkpoint_evals"), asset_partitions=[ckpt]), limit=1
                )
                .records[0]
                .run_id
            )
        assert len(eval_runs) == 1
        checks = instance.event_log_storage.get_asset_check_execution_history(
            dg.AssetCheckKey(dg.AssetKey("checkpoint_evals"), "accuracy_above_chance"), limit=10
        )
        assert sorted(c.partition for c in checks if c.partition) == sorted(summary.checkpoints)

        best = _md(instance, "best_checkpoint")
        assert best["checkpoint"] == summary.best_checkpoint and best["accuracy"] == pytest.approx(summary.accuracy)
        assert best["training_id"] == training_id and best["chosen_by"] == "the latest training"
        # The training said it started (the journal the checkpoint sensor reads) and how it ended.
        assert any(training_id in k for k in bucket.list_keys("trainings/"))
        ended = [k for k in bucket.list_keys(f"checkpoints/{training_id}/_ended/")]
        assert len(ended) == 1 and json.loads(bucket.get_bytes(ended[0]))["state"] == "succeeded"
        assert summary.accuracy > 1 / 18, "the trained model beats chance on held-out images"

        # This week's GPU usage counts every job of the flow, the demo still serving included.
        usage = _md(instance, "gpu_usage")
        assert usage["jobs"] >= 5 and usage["gpu_hours_h200"] > 0 and usage["gpu_hours_inference"] > 0
        assert 0 < usage["share_off_h200"] < 1 and usage["chart"].startswith("![")

        # The demo answers with a sample from the best checkpoint.
        assert summary.demo_cluster.startswith("lab-")
        with urllib.request.urlopen(summary.demo_url + "/?color=red&shape=circle", timeout=10) as r:
            answer = json.loads(r.read())
        assert "prediction" in answer and summary.best_checkpoint.split(".")[1] in answer["checkpoint"]
    finally:
        skypilot.stop_service("lab-gpudoor-demo")
