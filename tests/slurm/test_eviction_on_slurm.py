"""A managed job evicted from a pool whose ``recover_to`` names another moves there, on the real test bed.

The bed's fleet lets a job evicted from ``inference`` move to ``spare`` (an L4 of the onprem partition
kept for this). The job runs on inference; its Slurm allocation is cancelled, as an eviction would;
SkyPilot marks it RECOVERING; the step launches it on spare with that pool's env, cancels the one
recovering, verifies its release and follows the new job to its end. Nothing is faked. It runs in the
bed's h200 lane (tests/lanes.py).
"""

import time
import uuid
from pathlib import Path

import dagster as dg
import pytest
import yaml

from gpudoor_pipelines.launch.client import LaunchConfig, PipesSkyPilotClient
from tests.slurm.conftest import Preempter, managed_record, running_allocation, scancel, squeue
from tests.slurm.test_client_on_slurm import _logs, _resource

#: A loaded runner took 611 s for this test (two managed jobs launched one after the other, one cancelled).
pytestmark = [pytest.mark.slurm, pytest.mark.timeout(1800)]


def test_a_job_evicted_from_inference_moves_to_the_pool_its_recover_to_names(testbed, transit, tmp_path):
    specs = tmp_path / "specs"
    specs.mkdir()
    # On inference the job waits to be evicted (it marks that it runs: the bed's nodes are this machine); it
    # can end only where it moved to.
    marker = Path(f"/tmp/gpudoor-bed/markers/evicted-{uuid.uuid4().hex[:8]}")
    run = (
        f"echo attempt on $GPUDOOR_POOL cache=$LOCAL_CACHE_DIR; if [ $GPUDOOR_POOL = inference ]; then "
        f"mkdir -p {marker.parent}; touch {marker}; sleep 600; fi; echo finished on $GPUDOOR_POOL"
    )
    (specs / "caption.yaml").write_text(
        yaml.safe_dump({"name": "bed-evicted", "resources": {"accelerators": {"L4": 1, "H200": 1}}, "run": run})
    )

    @dg.asset
    def evicted(context: dg.AssetExecutionContext, skypilot: PipesSkyPilotClient) -> dg.MaterializeResult:
        request = skypilot.request(context, "caption", config=LaunchConfig(pool="inference"))
        return skypilot.run(context=context, request=request).get_materialize_result()

    instance = dg.DagsterInstance.ephemeral()

    def evict_once_running() -> dict | None:
        if not marker.exists():
            return None
        (run,) = instance.get_runs()
        job_id = next(v.split(":", 1)[1] for k, v in run.tags.items() if k.startswith("gpudoor/job-"))
        allocation = running_allocation(int(job_id))
        if allocation is None:
            return None
        scancel(allocation["job_id"])
        return {"job_id": job_id, "allocation": allocation["name"]}

    with Preempter(evict_once_running, within_s=1500) as evictor:
        result = dg.materialize(
            [evicted],
            instance=instance,
            resources={"skypilot": _resource(testbed, transit, specs)},
            raise_on_error=False,
        )
    logs = _logs(instance, result.run_id)
    evicted_job = evictor.result
    assert evicted_job, f"the job ended before it could be evicted ({evictor.why_not()}):\n" + "\n".join(logs[-40:])
    assert result.success, "\n".join(logs[-60:])
    md = {k: v.value for k, v in result.asset_materializations_for_node("evicted")[0].metadata.items()}
    old = evicted_job["job_id"]
    # It ran to its end on spare, with spare's env, as a new managed job; the one evicted was cancelled.
    assert md["pool"] == "spare" and md["job_id"] != old and md["status"] == "SUCCEEDED" and md["recoveries"] >= 1
    assert any(line.endswith("finished on spare") for line in logs), logs[-30:]
    assert not any(line.endswith("finished on inference") for line in logs)
    assert any(
        line.startswith(f"Job {old} was evicted from pool 'inference': launched again on pool 'spare'") for line in logs
    )
    assert managed_record(int(old)).status.value == "CANCELLED"
    assert instance.get_run_by_id(result.run_id).tags[f"gpudoor/released-job-{old}"].startswith("confirmed in")
    # Nothing stays held: the evicted allocation and the new job's are gone.
    deadline = time.monotonic() + 180
    while any(j["name"] == evicted_job["allocation"] for j in squeue()) and time.monotonic() < deadline:
        time.sleep(2)
    assert not any(j["name"] == evicted_job["allocation"] for j in squeue()), squeue()
