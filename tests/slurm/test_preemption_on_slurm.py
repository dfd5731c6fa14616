"""A training preempted on the Slurm test bed: SkyPilot recovers it, it resumes from its last checkpoint,
and the materialization says what the preemption cost.

Nothing is faked: the project's train spec (``task_specs/train.yaml``, on one node of one fake H200 so it
fits the bed) runs ``workloads.train`` as a managed job through the bed's API server, with its data and
checkpoints in the S3 transit bucket on 127.0.0.1. Once the step has seen the job run and the job has
published a checkpoint, its Slurm allocation is cancelled with ``scancel``, which is how Slurm takes nodes
back; SkyPilot's controller sees the cluster gone and recovers the job on a new allocation
(``job_recovery: FAILOVER``).
"""

import io
import re
import time
import uuid
from pathlib import Path

import dagster as dg
import pandas as pd
import pytest
import yaml

from gpudoor_pipelines.data.synthetic import caption_text, generate_image, image_id
from gpudoor_pipelines.launch.client import LaunchConfig, PipesSkyPilotClient
from tests.slurm.conftest import Preempter, managed_record, running_allocation, scancel, squeue
from tests.slurm.test_client_on_slurm import BED_FLEET, REPO_ROOT

MAX_STEPS, CHECKPOINT_EVERY = 40, 10
#: The step's longest wait between looks at its job (the client's ``max_poll_interval_s``). What a preemption
#: cost is known only when the step saw the job run before it (``launch/record/goodput.py``): the job is
#: preempted once SkyPilot's queue has said RUNNING for longer than this.
STEP_LOOKS_EVERY_S = 4.0
#: From the job's submission to the end of the recovered run: provisioning, the preemption seen by
#: SkyPilot's controller (measured 20-35 s), the recovery (about 30 s on the idle bed), the rest of the run.
PATIENCE_S = 900.0

# More than the 900 s every other test may take (pyproject's pytest-timeout): the patience, and the checks after.
pytestmark = [pytest.mark.slurm, pytest.mark.timeout(PATIENCE_S + 300)]


def _dataset(bucket, prefix: str, count: int = 48) -> str:
    rows = []
    for index in range(count):
        png, color, shape = generate_image(index)
        key = f"{prefix}/images/{image_id(index)}.png"
        bucket.put_bytes(key, png)
        rows.append({"image_id": image_id(index), "image_uri": bucket.uri(key), "caption": caption_text(color, shape)})
    out = io.BytesIO()
    pd.DataFrame(rows).to_parquet(out)
    bucket.put_bytes(f"{prefix}/captions.parquet", out.getvalue())
    return bucket.uri(f"{prefix}/captions.parquet")


def _one_node_train_spec(tmp_path: Path) -> Path:
    spec = yaml.safe_load((REPO_ROOT / "task_specs" / "train.yaml").read_text())
    spec["num_nodes"] = 1
    spec["resources"]["accelerators"] = "H200:1"
    spec["envs"]["WORKLOAD_THROTTLE_S"] = 0  # the test slows the steps down to preempt the job mid-run
    specs = tmp_path / "specs"
    specs.mkdir()
    (specs / "train.yaml").write_text(yaml.safe_dump(spec))
    return specs


def _checkpoints(bucket, prefix: str) -> list[int]:
    return sorted(
        int(m.group(1))
        for key in bucket.list_keys(prefix + "/")
        if (m := re.search(r"/step-(\d+)/_manifest\.json$", key))
    )


def _controller_log(job_id: int) -> str:
    """What SkyPilot's jobs controller logged of the job (its launches and recoveries)."""
    import sky

    out = io.StringIO()
    sky.jobs.tail_logs(job_id=job_id, follow=False, controller=True, output_stream=out)
    return out.getvalue()


def test_a_preempted_training_resumes_from_its_last_checkpoint_and_says_what_it_cost(testbed, transit, tmp_path):
    bucket = transit.get_bucket()
    name = f"preempt-{uuid.uuid4().hex[:8]}"
    dataset_uri = _dataset(bucket, f"datasets/{name}")
    output = f"checkpoints/{name}"
    client = PipesSkyPilotClient(
        backend="skypilot",
        api_server_endpoint=testbed.api_endpoint,
        fleet_file=str(BED_FLEET),
        specs_dir=str(_one_node_train_spec(tmp_path)),
        poll_interval_s=2.0,
        max_poll_interval_s=STEP_LOOKS_EVERY_S,
        transit=transit,
    )

    @dg.asset(name="preempted_training")
    def training(context: dg.AssetExecutionContext, skypilot: PipesSkyPilotClient) -> dg.MaterializeResult:
        env = {"MAX_STEPS": str(MAX_STEPS), "CHECKPOINT_EVERY": str(CHECKPOINT_EVERY), "WORKLOAD_THROTTLE_S": "1.0"}
        request = skypilot.request(
            context,
            "train",
            inputs={"DATASET_URI": dataset_uri, "OUTPUT_URI": bucket.uri(output)},
            config=LaunchConfig(env=env),
        )
        return skypilot.run(context=context, request=request).get_materialize_result()

    instance = dg.DagsterInstance.ephemeral()

    running_since: list[float] = []

    def preempt_after_first_checkpoint() -> dict | None:
        runs = instance.get_runs()
        job_ids = [v.split(":", 1)[1] for r in runs for k, v in r.tags.items() if k.startswith("gpudoor/job-")]
        if not job_ids:
            return None
        if not running_since:
            if managed_record(int(job_ids[0])).status.value == "RUNNING":
                running_since.append(time.monotonic())
            return None
        saved = _checkpoints(bucket, output)
        if not saved or time.monotonic() - running_since[0] <= STEP_LOOKS_EVERY_S + 1:
            return None
        allocation = running_allocation(int(job_ids[0]))
        if allocation is None:
            return None
        scancel(allocation["job_id"])
        return {"saved": saved[-1], "allocation": allocation["name"], "job_id": job_ids[0], "at": time.time()}

    with Preempter(preempt_after_first_checkpoint, within_s=PATIENCE_S) as preempter:
        result = dg.materialize([training], instance=instance, resources={"skypilot": client}, raise_on_error=False)
    logs = [e.user_message for e in instance.all_logs(result.run_id)]
    preempted = preempter.result
    assert preempted, f"the training ended before it could be preempted ({preempter.why_not()}):\n" + "\n".join(
        logs[-40:]
    )
    assert result.success, "\n".join(logs[-60:])
    md = {k: v.value for k, v in result.asset_materializations_for_node("preempted_training")[0].metadata.items()}

    # SkyPilot recovered the job, which resumed from the checkpoint saved before the preemption: the steps
    # up to it were not trained again (it may have saved one more between our look and the scancel).
    assert md["recoveries"] >= 1
    assert preempted["saved"] <= md["resumed_from_step"] <= preempted["saved"] + CHECKPOINT_EVERY < MAX_STEPS
    assert md["steps"] == MAX_STEPS and min(md["checkpoints"]) > md["resumed_from_step"]
    assert any(f"resuming from step {md['resumed_from_step']}" in line for line in logs)
    # What it cost: work since the last save before the preemption, on 1 GPU; not the whole run.
    assert 0 < md["gpu_hours_lost_to_preemption"] < md["gpu_hours_held"]
    assert 0 < md["goodput"] < 1
    assert any(line.startswith(f"Job {preempted['job_id']} was preempted") for line in logs)
    # SkyPilot's recovery (FAILOVER: first the region the job ran in) went back onto the job's pool at once;
    # the fleet's admin policy did not refuse it (each refusal costs a minute or more of backoff).
    controller_log = _controller_log(int(preempted["job_id"]))
    assert "Recovering" in controller_log and "UserRequestRejectedByPolicy" not in controller_log, controller_log[
        -3000:
    ]
    print(
        f"preempted at checkpoint {preempted['saved']}; resumed from {md['resumed_from_step']}; "
        f"{md['gpu_hours_lost_to_preemption'] * 3600:.0f} GPU-s lost of {md['gpu_hours_held'] * 3600:.0f} held, "
        f"goodput {md['goodput']}"
    )
    # Nothing stays held: the job's Slurm allocations (the preempted one and the recovery's) are gone.
    deadline = time.monotonic() + 180
    while any(j["name"] == preempted["allocation"] for j in squeue()) and time.monotonic() < deadline:
        time.sleep(2)
    assert not any(j["name"] == preempted["allocation"] for j in squeue()), squeue()
