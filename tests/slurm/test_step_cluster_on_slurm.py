"""A step the fleet launches as a cluster of its own (``launch_as``), on the real test bed.

The bed's fleet launches smoke steps as clusters: ``sky.launch`` of a ``gpudoor-step-…`` cluster through
the bed's API server (admin policy on), the job's log followed, ``sky.down`` once it ends. Nothing is
faked. It runs in the bed's onprem lane (tests/lanes.py), beside the h200 lane's jobs within the pool's cap.
"""

import time
import uuid
from pathlib import Path

import dagster as dg
import pytest
import yaml

from gpudoor_pipelines.launch.client import PipesSkyPilotClient
from tests.slurm.conftest import Preempter, scancel
from tests.slurm.test_client_on_slurm import _logs, _resource

pytestmark = pytest.mark.slurm


def test_a_smoke_step_runs_on_a_cluster_of_its_own_relaunched_after_a_preemption_and_gone_afterwards(
    testbed, transit, tmp_path, slurm_queue
):
    """The bed's fleet launches smoke steps as clusters (``launch_as``): sky.launch, log, sky.down. The Slurm
    allocation under the running step cluster is cancelled (as a preemption would): the step sees its
    cluster gone, launches it again, and the job runs to its end on the new allocation."""
    import sky

    specs = tmp_path / "specs"
    specs.mkdir()
    # The first attempt marks that it runs (the bed's nodes are this machine) and waits to be preempted; the
    # attempt after the relaunch finds the mark and ends.
    marker = Path(f"/tmp/gpudoor-bed/markers/smoke-{uuid.uuid4().hex[:8]}")
    run = (
        f"echo smoke on $GPUDOOR_POOL; echo smoke attempt started; if [ ! -e {marker} ]; then mkdir -p "
        f"{marker.parent}; "
        f"touch {marker}; sleep 600; fi; echo smoke done"
    )
    (specs / "smoke.yaml").write_text(
        yaml.safe_dump({"name": "bed-smoke", "resources": {"accelerators": "H200:1"}, "run": run})
    )

    @dg.asset
    def preempted_smoke(context: dg.AssetExecutionContext, skypilot: PipesSkyPilotClient) -> dg.MaterializeResult:
        return skypilot.run(context=context, request=skypilot.request(context, "smoke")).get_materialize_result()

    instance = dg.DagsterInstance.ephemeral()

    def preempt_once_running() -> dict | None:
        allocations = [j for j in slurm_queue() if "gpudoor-step" in j["name"] and j["state"] == "RUNNING"]
        if not (marker.exists() and allocations):
            return None
        scancel(allocations[0]["job_id"])
        return {"allocation": allocations[0]["name"]}

    with Preempter(preempt_once_running, within_s=900) as preempter:
        result = dg.materialize(
            [preempted_smoke],
            instance=instance,
            resources={"skypilot": _resource(testbed, transit, specs)},
            raise_on_error=False,
        )
    logs = _logs(instance, result.run_id)
    assert preempter.result, (
        f"the step ended before its cluster could be preempted ({preempter.why_not()}):\n" + "\n".join(logs[-40:])
    )
    assert result.success, "\n".join(logs[-60:])
    md = {k: v.value for k, v in result.asset_materializations_for_node("preempted_smoke")[0].metadata.items()}
    cluster = md["job_id"].split("/")[0]
    assert md["launched_as"] == "cluster" and cluster.startswith("gpudoor-step-") and md["pool"] == "h200"
    assert any(line.endswith("smoke on h200") for line in logs)
    assert md["recoveries"] == 1 and md["status"] == "SUCCEEDED"
    assert any(f"cluster {cluster} was lost (preempted): launching it again" in line for line in logs)
    # The attempt after the relaunch ran to its end: "smoke done" only follows the mark the first attempt left
    # (which then waited to be preempted). The first attempt's own lines may not have been streamed before its
    # allocation went.
    assert any(line.endswith("smoke attempt started") for line in logs) and any(
        line.endswith("smoke done") for line in logs
    )
    assert any("was preempted 1 time(s) and recovered" in line for line in logs)
    # No managed job was launched for it; its cluster is torn down (asked for when the job ended) and its
    # Slurm allocations with it.
    records, *_ = sky.get(sky.jobs.queue_v2(refresh=False, all_users=True, fields=["job_id", "labels"]))
    assert not [r for r in records if (r.labels or {}).get("dagster-run-id") == result.run_id]
    deadline = time.monotonic() + 180
    while sky.get(sky.status(cluster_names=[cluster], all_users=True)) and time.monotonic() < deadline:
        time.sleep(3)
    assert not sky.get(sky.status(cluster_names=[cluster], all_users=True))
    while any("gpudoor-step" in j["name"] for j in slurm_queue()) and time.monotonic() < deadline:
        time.sleep(2)
    assert not any("gpudoor-step" in j["name"] for j in slurm_queue()), slurm_queue()
