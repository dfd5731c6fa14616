"""The SkyPilot Pipes client against the real test bed: managed jobs on Slurm through the SkyPilot API server.

Nothing is faked here: the SDK talks to the bed's API server (admin policy on), which runs managed
jobs on the one-machine Slurm cluster; the transit bucket is the S3 server on 127.0.0.1.
"""

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from pathlib import Path

import boto3
import dagster as dg
import pytest
import yaml

from gpudoor_pipelines.launch.client import LaunchConfig, PipesSkyPilotClient
from gpudoor_pipelines.transit.resource import TransitBucketResource

pytestmark = pytest.mark.slurm

REPO_ROOT = Path(__file__).resolve().parents[2]
BED_FLEET = REPO_ROOT / "testbed" / "fleet.yaml"


@pytest.fixture
def transit(s3_server) -> TransitBucketResource:
    name = f"bed-{uuid.uuid4().hex[:10]}"
    secret = f"bed-secret-{uuid.uuid4().hex}"
    boto3.client("s3", endpoint_url=s3_server, region_name="us-east-1", aws_access_key_id="bed-key",
                 aws_secret_access_key=secret).create_bucket(Bucket=name)  # fmt: skip
    return TransitBucketResource(
        kind="s3", bucket=name, endpoint_url=s3_server, access_key_id="bed-key", secret_access_key=secret
    )


def _resource(testbed, transit, specs_dir: Path | None = None) -> PipesSkyPilotClient:
    return PipesSkyPilotClient(
        backend="skypilot",
        api_server_endpoint=testbed.api_endpoint,
        fleet_file=str(BED_FLEET),
        specs_dir=str(specs_dir) if specs_dir else None,
        poll_interval_s=2.0,
        cancel_timeout_s=180.0,
        transit=transit,
    )


def _spec_dir(tmp_path: Path, run: str) -> Path:
    specs = tmp_path / "specs"
    specs.mkdir(exist_ok=True)
    (specs / "caption.yaml").write_text(
        yaml.safe_dump({"name": "bed-probe", "resources": {"accelerators": {"L4": 1, "H200": 1}}, "run": run})
    )
    return specs


def _probe_asset(name: str = "probe"):
    @dg.asset(name=name)
    def probe(
        context: dg.AssetExecutionContext, config: LaunchConfig, skypilot: PipesSkyPilotClient
    ) -> dg.MaterializeResult:
        return skypilot.run(context=context, request=skypilot.request(context, "caption", config=config)).get_materialize_result()

    return probe


def _managed(job_id: int):
    import sky

    records, *_ = sky.get(sky.jobs.queue_v2(refresh=False, all_users=True, job_ids=[job_id],
                                            fields=["job_id", "status", "labels", "infra", "job_name"]))  # fmt: skip
    return records[0]


def _logs(instance, run_id) -> list[str]:
    return [e.user_message for e in instance.all_logs(run_id)]


def test_caption_shard_is_a_managed_job_on_slurm(testbed, transit, tmp_path):
    from workloads.synthetic import generate_image, image_id

    bucket = transit.get_bucket()
    for i in range(6):
        bucket.put_bytes(f"shard/images/{image_id(i)}.png", generate_image(i)[0])

    @dg.asset
    def caption_shard(context: dg.AssetExecutionContext, skypilot: PipesSkyPilotClient) -> dg.MaterializeResult:
        inputs = {"SHARD_URI": bucket.uri("shard"), "OUTPUT_URI": bucket.uri("captions")}
        return skypilot.run(context=context, request=skypilot.request(context, "caption", inputs=inputs)).get_materialize_result()

    with dg.instance_for_test() as instance:
        result = dg.materialize(
            [caption_shard], resources={"skypilot": _resource(testbed, transit)}, instance=instance
        )
        assert result.success
        md = result.asset_materializations_for_node("caption_shard")[0].metadata
        logs = _logs(instance, result.run_id)
    assert md["backend"].value == "skypilot" and md["pool"].value == "onprem"
    assert "gpudoor-bed" in md["infra"].value and md["status"].value == "SUCCEEDED"
    assert md["images_captioned"].value == 6  # reported by the job itself, through Pipes over S3
    assert any("captioned 6/6" in line for line in logs) and any("done: 6 captioned" in line for line in logs), logs[-30:]
    assert bucket.read_manifest("captions")["count"] == 6
    assert _managed(int(md["job_id"].value)).status.value == "SUCCEEDED"


def test_failing_job_surfaces_failed_with_its_log_tail(testbed, transit, tmp_path):
    specs = _spec_dir(tmp_path, "echo bed-failing-now; echo 'something broke' >&2; exit 3")
    result = dg.materialize(
        [_probe_asset()], resources={"skypilot": _resource(testbed, transit, specs)}, raise_on_error=False
    )
    assert not result.success
    (failure,) = [e for e in result.all_events if e.is_step_failure]
    text = failure.step_failure_data.user_failure_data.description
    assert "ended FAILED" in text and "bed-failing-now" in text


def test_terminated_run_leaves_the_job_cancelled_and_slurm_empty(testbed, transit, tmp_path, slurm_queue):
    specs = _spec_dir(tmp_path, "echo bed-long-job-started; sleep 600")
    script = tmp_path / "run.py"
    script.write_text(textwrap.dedent(f"""
        import dagster as dg
        from pathlib import Path
        from tests.slurm.test_client_on_slurm import _probe_asset, _resource
        from gpudoor_pipelines.transit.resource import TransitBucketResource
        transit = TransitBucketResource.model_validate_json({transit.model_dump_json()!r})
        class Bed:
            api_endpoint = {testbed.api_endpoint!r}
        dg.materialize([_probe_asset()], resources={{"skypilot": _resource(Bed, transit, Path({str(specs)!r}))}})
    """))  # fmt: skip
    proc = subprocess.Popen([sys.executable, str(script)], cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})  # fmt: skip
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        deadline = time.time() + 300
        while time.time() < deadline and not any("bed-long-job-started" in line for line in lines):
            assert proc.poll() is None, "".join(lines[-40:])
            time.sleep(2)
        assert any("bed-long-job-started" in line for line in lines), "".join(lines[-40:])
        proc.send_signal(signal.SIGINT)  # What Dagster does to a step when its run is terminated.
        proc.wait(timeout=300)
    finally:
        proc.kill()
    reader.join(timeout=10)
    text = "".join(lines)
    assert "cancelling job" in text and "is CANCELLED" in text, text[-3000:]
    job_id = int(text.split("Submitted job ")[1].split(".")[0])
    assert _managed(job_id).status.value == "CANCELLED"
    deadline = time.time() + 120
    while time.time() < deadline and slurm_queue():
        time.sleep(3)
    assert slurm_queue() == []


def test_two_shards_side_by_side_land_on_two_pools_with_env_labels_and_no_secret(testbed, transit, tmp_path):
    run = "echo pool=$GPUDOOR_POOL cache=$LOCAL_CACHE_DIR; echo secret=$AWS_SECRET_ACCESS_KEY; sleep 25"
    specs = _spec_dir(tmp_path, run)
    results: dict[str, object] = {}

    def materialize(key: str, instance) -> None:
        results[key] = dg.materialize([_probe_asset(key)], resources={"skypilot": _resource(testbed, transit, specs)},
                                      instance=instance, raise_on_error=False)  # fmt: skip

    with dg.instance_for_test() as instance:
        first = threading.Thread(target=materialize, args=("shard_a", instance))
        first.start()
        # The second shard is routed once the first is queued: onprem (cap 1) is then full.
        import sky

        deadline = time.time() + 180
        while time.time() < deadline:
            records, *_ = sky.get(sky.jobs.queue_v2(refresh=False, skip_finished=True, all_users=True, fields=["job_id", "labels"]))
            queued = [r for r in records if (r.labels or {}).get("dagster-asset") == "shard_a"]
            if queued:
                break
            time.sleep(2)
        materialize("shard_b", instance)
        first.join(timeout=400)
        a, b = results["shard_a"], results["shard_b"]
        assert a.success and b.success
        md_a = a.asset_materializations_for_node("shard_a")[0].metadata
        md_b = b.asset_materializations_for_node("shard_b")[0].metadata
        logs = _logs(instance, a.run_id) + _logs(instance, b.run_id)
    assert md_a["pool"].value == "onprem" and md_b["pool"].value == "inference"
    assert md_a["infra"].value != md_b["infra"].value
    assert "onprem cache=/tmp/gpudoor-bed/onprem/cache" in " ".join(logs) and "pool=inference" in " ".join(
        logs
    )
    # The secret reached the job (SkyPilot secrets) but never the Dagster log or metadata.
    secret = transit.secret_access_key
    assert any(line.endswith("secret=****") for line in logs)
    assert not any(secret in line for line in logs)
    assert not any(secret in str(v.value) for md in (md_a, md_b) for v in md.values())
    # The labels SkyPilot received, as the queue showed them while the job was queued.
    labels = queued[0].labels
    assert labels["gpudoor-cost-owner"] == "ml-research" and labels["dagster-asset"] == "shard_a"
    assert labels["dagster-run-id"] == a.run_id and labels["gpudoor-pool"] == "onprem"


def test_server_policy_rejects_before_anything_is_submitted(testbed, transit):
    """Bypassing the client-side rules, the API server's admin policy still refuses the job."""
    import sky

    from gpudoor_pipelines.launch.backends.base import ResolvedJob
    from gpudoor_pipelines.launch.backends.skypilot import SkyPilotBackend
    from gpudoor_pipelines.launch.errors import LaunchConfigError

    config = {
        "name": "no-owner",
        "resources": {"accelerators": "L4:1", "infra": testbed.infra_onprem},
        "run": "echo should-not-run",
    }
    backend = SkyPilotBackend(testbed.api_endpoint)
    before = len(sky.get(sky.jobs.queue_v2(refresh=False, all_users=True, fields=["job_id"]))[0])
    with pytest.raises(LaunchConfigError, match="no cost owner"):
        backend.submit(ResolvedJob(name="no-owner", config=config, workdir=str(REPO_ROOT), pool="onprem"))
    assert len(sky.get(sky.jobs.queue_v2(refresh=False, all_users=True, fields=["job_id"]))[0]) == before
