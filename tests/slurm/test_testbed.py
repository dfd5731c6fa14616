"""The test bed itself: real SkyPilot managed jobs on the local Slurm cluster, SDK only."""

from __future__ import annotations

import os
import re
import time

import pytest

pytestmark = pytest.mark.slurm

ANSI = re.compile(r"\x1b\[[0-9;]*m")

# Bound on each wait for a status. On an idle 2-core machine a managed job takes ~70-110 s end to
# end; on a loaded one several minutes.
WAIT_S = float(os.environ.get("GPUDOOR_SLURM_WAIT_S", "300"))

# Labels put on every task here, as `k=v,k=v`: a server started with an admin policy may demand
# some (e.g. GPUDOOR_TESTBED_TASK_LABELS=gpudoor-cost-owner=ml-research).
TASK_LABELS = dict(
    item.split("=", 1) for item in os.environ.get("GPUDOOR_TESTBED_TASK_LABELS", "").split(",") if "=" in item
)


@pytest.fixture(autouse=True)
def _plain_skypilot_or_labels(testbed):
    if testbed.admin_policy and not TASK_LABELS:
        pytest.skip(
            f"the bed's API server runs admin policy {testbed.admin_policy}, which may refuse these bare "
            "tasks: set GPUDOOR_TESTBED_TASK_LABELS, or bring the bed up without GPUDOOR_TESTBED_ADMIN_POLICY"
        )


def _task(name: str, run: str, accelerators: str, infra: str):
    import sky

    task = sky.Task(name=name, run=run)
    task.set_resources(sky.Resources(accelerators=accelerators, infra=infra, labels=TASK_LABELS or None))
    return task


def test_managed_job_succeeds_on_onprem_l4(testbed, managed_jobs):
    task = _task("bed-hello", "echo hello-from-slurm; echo $SKYPILOT_NODE_RANK", "L4:1", testbed.infra_onprem)
    started = time.time()
    job_id = managed_jobs.launch(task, name="bed-hello")

    record = managed_jobs.wait_for(job_id, {"SUCCEEDED"}, timeout_s=WAIT_S)

    print(f"managed job {job_id} SUCCEEDED in {time.time() - started:.0f}s: {record}")
    assert record["job_name"] == "bed-hello"
    assert record["recovery_count"] == 0
    assert (record["zone"] or "") == "onprem", record
    logs = ANSI.sub("", managed_jobs.logs(job_id))
    assert re.search(r"^\(bed-hello, pid=\d+\) hello-from-slurm$", logs, re.M), logs
    assert re.search(r"^\(bed-hello, pid=\d+\) 0$", logs, re.M), logs  # $SKYPILOT_NODE_RANK


def test_managed_job_on_h200_partition(testbed, managed_jobs):
    task = _task("bed-h200", "echo hello-from-h200", "H200:1", testbed.infra_h200)
    job_id = managed_jobs.launch(task, name="bed-h200")

    record = managed_jobs.wait_for(job_id, {"SUCCEEDED"}, timeout_s=WAIT_S)

    assert (record["zone"] or "") == "h200", record
    assert "hello-from-h200" in managed_jobs.logs(job_id)


def test_failing_run_ends_failed(testbed, managed_jobs):
    task = _task("bed-exit3", "exit 3", "L4:1", testbed.infra_onprem)
    job_id = managed_jobs.launch(task, name="bed-exit3")

    record = managed_jobs.wait_for(job_id, {"FAILED"}, timeout_s=WAIT_S)

    assert record["job_name"] == "bed-exit3"
    assert "exit code 3" in (record["failure_reason"] or ""), record


def test_cancel_long_job(testbed, managed_jobs, slurm_queue):
    task = _task("bed-sleep", "echo sleeping; sleep 300", "L4:1", testbed.infra_onprem)
    job_id = managed_jobs.launch(task, name="bed-sleep")
    running = managed_jobs.wait_for(job_id, {"RUNNING"}, timeout_s=WAIT_S)
    # The job's SkyPilot cluster is one Slurm job named after the cluster. (Other clients of
    # the bed may have Slurm jobs of their own, so only this one is looked at.)
    cluster = running["cluster_name_on_cloud"]
    assert cluster, running
    assert any(j["name"] == cluster for j in slurm_queue()), slurm_queue()

    started = time.time()
    managed_jobs.cancel(job_id)
    managed_jobs.wait_for(job_id, {"CANCELLED"}, timeout_s=WAIT_S)
    print(f"managed job {job_id}: RUNNING -> CANCELLED in {time.time() - started:.0f}s")

    deadline = time.time() + WAIT_S  # the cluster's Slurm job goes away at teardown
    while any(j["name"] == cluster for j in slurm_queue()) and time.time() < deadline:
        time.sleep(2)
    assert not any(j["name"] == cluster for j in slurm_queue()), slurm_queue()
