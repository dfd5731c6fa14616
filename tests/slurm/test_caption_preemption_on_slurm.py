"""A caption job preempted on the real test bed: the Slurm allocation of the warm-pool worker running it is
cancelled after its first Parquet part is in the bucket. SkyPilot recovers the job on a new worker of the
pool, and the shard resumes at its last part: no image is captioned twice, and the step counts what the
preemption cost.
Nothing is faked. It runs in the bed's onprem lane (tests/lanes.py).
"""

import io
import time

import dagster as dg
import pyarrow.parquet as pq
import pytest

from gpudoor_pipelines.data.captions import done_shards
from gpudoor_pipelines.launch.resolve.request import slug
from tests.slurm.conftest import Preempter, scancel, squeue
from tests.slurm.test_client_on_slurm import _logs, _resource

pytestmark = pytest.mark.slurm

IMAGES, PER_PART = 8, 2


def test_a_preempted_caption_job_resumes_its_shard_at_its_last_part(testbed, transit):
    from gpudoor_pipelines.assets.captioning import caption_shards, dataset_shards
    from gpudoor_pipelines.transit.io_manager import TransitIOManager

    bucket = transit.get_bucket()
    defs = dg.Definitions(
        assets=[dataset_shards, caption_shards],
        resources={
            "transit": transit,
            "skypilot": _resource(testbed, transit),
            "io_manager": TransitIOManager(transit=transit),
        },
    )
    job = defs.resolve_implicit_global_asset_job_def()
    instance = dg.DagsterInstance.ephemeral()
    dataset = {
        "ops": {
            "dataset_shards": {
                "config": {"name": "preempted-captions", "num_images": IMAGES, "shard_size": IMAGES, "image_size": 16}
            }
        }
    }
    assert job.execute_in_process(
        instance=instance, asset_selection=[dg.AssetKey("dataset_shards")], run_config=dataset
    ).success
    (shard,) = instance.get_dynamic_partitions("shards")

    def preempt_after_first_part() -> dict | None:
        parts = [k for k in bucket.list_keys("captions/") if shard in k and k.endswith(".parquet")]
        # The workers of this run's pool (another test's pool may be up beside it).
        pool = f"gpudoor-caption-{slug(instance.get_runs(limit=1)[0].run_id, 8)}"
        workers = [j for j in squeue() if j["name"].startswith(pool) and j["state"] == "RUNNING"]
        if not (parts and workers):
            return None
        scancel(workers[0]["job_id"])
        return {"parts": len(parts), "allocation": workers[0]["name"]}

    env = {"IMAGES_PER_PART": str(PER_PART), "WORKLOAD_THROTTLE_S": "4"}
    with Preempter(preempt_after_first_part, within_s=600) as preempter:
        result = job.execute_in_process(
            instance=instance,
            asset_selection=[dg.AssetKey("caption_shards")],
            raise_on_error=False,
            partition_key=shard,
            run_config={
                "ops": {
                    "caption_shards": {"config": {"shards_per_job": 1, "max_workers": 1, "max_attempts": 2, "env": env}}
                }
            },
        )
    logs = _logs(instance, result.run_id)
    preempted = preempter.result
    assert preempted, (
        f"the shard was captioned before its job could be preempted ({preempter.why_not()}):\n" + "\n".join(logs[-40:])
    )
    assert result.success, "\n".join(logs[-60:])
    record = instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=dg.AssetKey("caption_shards"), asset_partitions=[shard]), limit=1
    ).records[0]
    md = {k: v.value for k, v in record.event_log_entry.asset_materialization.metadata.items()}
    # The next wave resumed the shard at its parts: every image captioned once, none twice.
    assert any(f"shard {shard}: resuming," in line for line in logs), logs[-40:]
    # SkyPilot recovered the pool's job on a new worker (it does, for pool jobs too): the step counted it.
    # The work lost is counted until the step saw the job recovering (SkyPilot's detection included).
    assert md["interruptions"] == 1 and md["gpu_hours_lost_to_interruptions"] > 0
    assert any(line.startswith("Captioning: ") and "'jobs_interrupted': 1" in line for line in logs)
    assert shard in done_shards(bucket, "color-shape-v1")
    ids = []
    for key in bucket.list_keys("captions/"):
        if shard in key and key.endswith(".parquet"):
            ids += pq.read_table(io.BytesIO(bucket.get_bytes(key))).column("image_id").to_pylist()
    assert len(ids) == IMAGES and len(set(ids)) == IMAGES
    # The preempted worker's allocation is gone, and the pool was given back.
    deadline = time.monotonic() + 180
    while any(j["name"] == preempted["allocation"] for j in squeue()) and time.monotonic() < deadline:
        time.sleep(2)
    assert not any(j["name"] == preempted["allocation"] for j in squeue()), squeue()
