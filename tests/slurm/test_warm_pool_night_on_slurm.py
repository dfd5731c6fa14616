"""A night of captioning on a real warm pool of the test bed, one worker preempted midway.

One Dagster run over two shards of two datasets, as the nightly schedule makes them: one ``pool_apply`` (setup
once per worker), one ``jobs.launch(pool=, num_jobs=2)``, each job told its ``SKYPILOT_JOB_RANK``; Pipes over
S3. While the second shard is being captioned, the Slurm allocation of the worker running it is cancelled after
its first Parquet part is in the bucket. SkyPilot recovers the job on a new worker of the pool, and the shard
resumes at its last part: no image is captioned twice, and the step counts what the preemption cost. (Two
shards prove what three did: one launch of one job per shard, each told its own rank; the pool has one worker,
so a third shard only added a job's turn on it.)

The night runs once for the module (a warm pool costs the bed minutes to bring up and give back); each test
asserts on its own part of it. Nothing is faked. It runs in the bed's onprem lane (tests/lanes.py).
"""

from __future__ import annotations

import dataclasses
import io
import time

import dagster as dg
import pyarrow.parquet as pq
import pytest

from gpudoor_pipelines.data.captions import done_shards
from gpudoor_pipelines.launch.resolve.request import slug
from tests.slurm.conftest import Preempter, managed_record, new_transit, scancel, squeue
from tests.slurm.test_client_on_slurm import _logs, _resource

#: The night's fixture runs in its first test: its bound is the run's (a loaded machine takes twice as long).
pytestmark = [pytest.mark.slurm, pytest.mark.timeout(1800)]

#: The preempted shard: its images, captioned a part of PER_PART images at a time, THROTTLE_S seconds an image.
#: Its job is preempted after its first part: the three parts after leave the test some 24 s to see it and act
#: (a look takes the preempter a second or two, five on a loaded runner), and take as long again when it resumes.
IMAGES, PER_PART, THROTTLE_S = 8, 2, 4


@dataclasses.dataclass
class Night:
    """What the night left: its run, its shards, what was preempted and what the pool's status said after."""

    instance: dg.DagsterInstance
    transit: object
    result: dg.ExecuteInProcessResult
    logs: list[str]
    batch: list[str]  # the shard that is not preempted
    preempted_shard: str
    preempted: dict | None
    why_not_preempted: str
    pools_left: list[dict]

    @property
    def shards(self) -> list[str]:
        return [*self.batch, self.preempted_shard]

    def metadata(self, shard: str) -> dict:
        record = self.instance.fetch_materializations(
            dg.AssetRecordsFilter(asset_key=dg.AssetKey("caption_shards"), asset_partitions=[shard]), limit=1
        ).records[0]
        return {k: v.value for k, v in record.event_log_entry.asset_materialization.metadata.items()}


@pytest.fixture(scope="module")
def night(testbed, s3_server, tmp_path_factory) -> Night:
    import sky

    from gpudoor_pipelines.assets.captioning import caption_shards, dataset_shards
    from gpudoor_pipelines.transit.io_manager import TransitIOManager

    transit = new_transit(s3_server)
    bucket = transit.get_bucket()
    instance = dg.DagsterInstance.ephemeral()
    with pytest.MonkeyPatch.context() as mp:
        # A module's fixture is set up before the test's own: the homes and the bed's client settings are set here.
        mp.setenv("GPUDOOR_HOME", str(tmp_path_factory.mktemp("night_gpudoor_home")))
        for key, value in testbed.env.items():
            mp.setenv(key, value)
        defs = dg.Definitions(
            assets=[dataset_shards, caption_shards],
            resources={
                "transit": transit,
                "skypilot": _resource(testbed, transit),
                "io_manager": TransitIOManager(transit=transit),
            },
        )
        job = defs.resolve_implicit_global_asset_job_def()
        for dataset in (
            {"num_images": 3, "shard_size": 3, "image_size": 16},
            {"name": "preempted-captions", "num_images": IMAGES, "shard_size": IMAGES, "image_size": 16},
        ):
            assert job.execute_in_process(
                instance=instance,
                asset_selection=[dg.AssetKey("dataset_shards")],
                run_config={"ops": {"dataset_shards": {"config": dataset}}},
            ).success
        *batch, preempted_shard = instance.get_dynamic_partitions("shards")
        assert len(batch) == 1 and preempted_shard.startswith("preempted-captions-"), (batch, preempted_shard)

        def preempt_after_first_part() -> dict | None:
            parts = [k for k in bucket.list_keys("captions/") if preempted_shard in k and k.endswith(".parquet")]
            # The workers of this run's pool (another test's pool may be up beside it).
            pool = f"gpudoor-caption-{slug(instance.get_runs(limit=1)[0].run_id, 8)}"
            workers = [j for j in squeue() if j["name"].startswith(pool) and j["state"] == "RUNNING"]
            if not (parts and workers):
                return None
            scancel(workers[0]["job_id"])
            return {"parts": len(parts), "allocation": workers[0]["name"]}

        env = {"IMAGES_PER_PART": str(PER_PART), "WORKLOAD_THROTTLE_S": str(THROTTLE_S)}
        config = {"shards_per_job": 1, "max_workers": 1, "max_attempts": 2, "env": env}
        with Preempter(preempt_after_first_part, within_s=1800) as preempter:
            result = job.execute_in_process(
                instance=instance,
                asset_selection=[dg.AssetKey("caption_shards")],
                raise_on_error=False,
                tags={
                    "dagster/asset_partition_range_start": batch[0],
                    "dagster/asset_partition_range_end": preempted_shard,
                },
                run_config={"ops": {"caption_shards": {"config": config}}},
            )
        # The pool was given back when the run ended. pool_down returns once it has signalled the pool's
        # controller, which starts shutting the workers down within seconds: look until it has.
        pool = f"gpudoor-caption-{result.run_id[:8]}"
        deadline = time.monotonic() + 60
        while True:
            left = [p for p in sky.get(sky.jobs.pool_status(None)) if p["name"] == pool]
            if all(str(p["status"].value) == "SHUTTING_DOWN" for p in left) or time.monotonic() > deadline:
                break
            time.sleep(1)
    return Night(
        instance=instance,
        transit=transit,
        result=result,
        logs=_logs(instance, result.run_id),
        batch=batch,
        preempted_shard=preempted_shard,
        preempted=preempter.result,
        why_not_preempted=preempter.why_not(),
        pools_left=left,
    )


def test_caption_shards_run_as_one_batch_on_a_warm_pool_on_slurm(night):
    """The night's path on real SkyPilot: one Dagster run over the shards, one pool_apply, one jobs.launch of
    one job per shard, each told its rank; what the jobs report comes back through Pipes over S3."""
    assert night.result.success, night.logs[-40:]
    assert night.instance.get_materialized_partitions(dg.AssetKey("caption_shards")) == set(night.shards)
    mds = [night.metadata(s) for s in night.batch]
    assert [md["images_captioned"] for md in mds] == [3]  # reported by the job itself, through Pipes over S3
    assert {md["pool"] for md in mds} == {"onprem"} and all("gpudoor-bed" in md["infra"] for md in mds)
    assert sorted(night.metadata(s)["job_rank"] for s in night.shards) == [0, 1]
    assert done_shards(night.transit.get_bucket(), "color-shape-v1") == set(night.shards)
    for md in mds:
        managed = managed_record(int(md["job_id"]))  # a pool's jobs carry no labels in the queue: the pool's task does
        assert (
            managed.status.value == "SUCCEEDED"
            and managed.pool == md["worker_pool"] == f"gpudoor-caption-{night.result.run_id[:8]}"
        )
    assert any(f"shard {night.batch[0]}: done, 3 captioned" in line for line in night.logs), night.logs[-40:]
    assert all(str(p["status"].value) == "SHUTTING_DOWN" for p in night.pools_left), night.pools_left


def test_a_preempted_caption_job_resumes_its_shard_at_its_last_part(night):
    shard, preempted = night.preempted_shard, night.preempted
    assert preempted, (
        f"the shard was captioned before its job could be preempted ({night.why_not_preempted}):\n"
        + "\n".join(night.logs[-40:])
    )
    assert night.result.success, "\n".join(night.logs[-60:])
    md = night.metadata(shard)
    # The next wave resumed the shard at its parts: every image captioned once, none twice.
    assert any(f"shard {shard}: resuming," in line for line in night.logs), night.logs[-40:]
    # SkyPilot recovered the pool's job on a new worker (it does, for pool jobs too): the step counted it.
    # The work lost is counted until the step saw the job recovering (SkyPilot's detection included).
    assert md["interruptions"] == 1 and md["gpu_hours_lost_to_interruptions"] > 0
    assert any(line.startswith("Captioning: ") and "'jobs_interrupted': 1" in line for line in night.logs)
    bucket = night.transit.get_bucket()
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
