"""The SkyPilot Pipes client against the real test bed: managed jobs on Slurm through the SkyPilot API server.

Nothing is faked here: the SDK talks to the bed's API server (admin policy on), which runs managed
jobs on the one-machine Slurm cluster; the transit bucket is the S3 server on 127.0.0.1.
"""

import threading
import time
from pathlib import Path

import dagster as dg
import pytest
import yaml

from gpudoor_pipelines.launch.client import LaunchConfig, PipesSkyPilotClient

pytestmark = pytest.mark.slurm

REPO_ROOT = Path(__file__).resolve().parents[2]
BED_FLEET = REPO_ROOT / "testbed" / "fleet.yaml"


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
        return skypilot.run(
            context=context, request=skypilot.request(context, "caption", config=config)
        ).get_materialize_result()

    return probe


def _logs(instance, run_id) -> list[str]:
    return [e.user_message for e in instance.all_logs(run_id)]


def test_failing_job_surfaces_failed_with_its_log_tail(testbed, transit, tmp_path):
    specs = _spec_dir(tmp_path, "echo bed-failing-now; echo 'something broke' >&2; exit 3")
    result = dg.materialize(
        [_probe_asset()], resources={"skypilot": _resource(testbed, transit, specs)}, raise_on_error=False
    )
    assert not result.success
    (failure,) = [e for e in result.all_events if e.is_step_failure]
    text = failure.step_failure_data.user_failure_data.description
    assert "ended FAILED" in text and "bed-failing-now" in text


def test_two_shards_side_by_side_land_on_two_pools_with_env_labels_and_no_secret(
    testbed, transit, tmp_path, monkeypatch
):
    # A pool at its cap spills to the next in the route's order: start soonest, which could send the first shard
    # to inference while the other lane holds onprem's GPUs, has a bed test of its own (test_sharing_on_slurm.py).
    from gpudoor_pipelines.launch.ledger import Ledger

    monkeypatch.setattr(Ledger, "outlook", lambda self, figures: None)
    run = "echo pool=$GPUDOOR_POOL cache=$LOCAL_CACHE_DIR; echo secret=$AWS_SECRET_ACCESS_KEY; sleep 5"
    specs = _spec_dir(tmp_path, run)
    results: dict[str, object] = {}
    started = time.time()

    def materialize(key: str, instance) -> None:
        results[key] = dg.materialize(
            [_probe_asset(key)],
            resources={"skypilot": _resource(testbed, transit, specs)},
            instance=instance,
            raise_on_error=False,
        )

    # Two runs at once in one process: an instance without instance settings, whose runs never call
    # logging.config.dictConfig (with settings, each new run does, and it can deadlock with the other
    # run's logging thread: a lock-order inversion in Python's logging).
    with dg.DagsterInstance.ephemeral() as instance:
        first = threading.Thread(target=materialize, args=("shard_a", instance))
        first.start()
        # The second shard is routed once the first is queued: onprem (cap 1) is then full.
        import sky

        deadline = time.time() + 180
        while time.time() < deadline:
            records, *_ = sky.get(
                sky.jobs.queue_v2(refresh=False, skip_finished=True, all_users=True, fields=["job_id", "labels"])
            )
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
    assert "onprem cache=/tmp/gpudoor-bed/onprem/cache" in " ".join(logs) and "pool=inference" in " ".join(logs)
    # The secret reached the job (SkyPilot secrets) but never the Dagster log or metadata.
    secret = transit.secret_access_key
    assert any(line.endswith("secret=****") for line in logs)
    assert not any(secret in line for line in logs)
    assert not any(secret in str(v.value) for md in (md_a, md_b) for v in md.values())
    # The labels SkyPilot received, as the queue showed them while the job was queued.
    labels = queued[0].labels
    assert labels["gpudoor-cost-owner"] == "ml-research" and labels["dagster-asset"] == "shard_a"
    assert labels["dagster-run-id"] == a.run_id and labels["gpudoor-pool"] == "onprem"
    # The weekly usage reads both jobs back from the server's queue (and its cluster history), by label.
    ids = {str(md_a["job_id"].value), str(md_b["job_id"].value)}
    history = _resource(testbed, transit).get_backend().job_history(started, time.time())
    mine = {j.job_id: j for j in history if j.job_id in ids}
    assert {j.pool for j in mine.values()} == {"onprem", "inference"}, history
    assert all(j.gpus >= 1 and j.state.value == "SUCCEEDED" and j.cost_owner == "ml-research" for j in mine.values())
    assert all(j.ended_at and j.ran_s and 0 < j.ran_s <= j.ended_at - j.started_at + 1 for j in mine.values())


def test_server_policy_rejects_before_anything_is_submitted(testbed, transit):
    """Bypassing the client-side rules, the API server's admin policy still refuses the job, saying every problem."""
    import sky

    from gpudoor_pipelines.launch.backends.skypilot import SkyPilotBackend
    from gpudoor_pipelines.launch.errors import LaunchConfigError
    from gpudoor_pipelines.launch.resolve.request import ResolvedJob

    config = {
        "name": "past-the-door",
        "resources": {
            "accelerators": "L4:1",
            "infra": testbed.infra_onprem,
            "labels": {"gpudoor-cost-owner": "marketing"},
        },
        "envs": {"DATA_DIR": "/mnt/data"},
        "run": "echo should-not-run",
    }
    backend = SkyPilotBackend(testbed.api_endpoint)
    with pytest.raises(LaunchConfigError) as err:
        backend.submit(ResolvedJob(name="past-the-door", config=config, workdir=str(REPO_ROOT), pool="onprem"))
    assert "unknown cost owner 'marketing'" in str(err.value) and "field 'envs.DATA_DIR'" in str(err.value)
    # Nothing was submitted (found by name: the other bed lane submits jobs of its own meanwhile).
    records, *_ = sky.get(sky.jobs.queue_v2(refresh=False, all_users=True, fields=["job_id", "job_name"]))
    assert not [r for r in records if r["job_name"] == "past-the-door"]
