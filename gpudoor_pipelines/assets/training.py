"""Training: a smoke test on the target GPU, then the multi-node run that writes checkpoints."""

import json
import time

import dagster as dg
from pydantic import Field

from gpudoor_pipelines.assets.common import require_published
from gpudoor_pipelines.assets.partitions import (
    CHECKPOINTS_PREFIX,
    checkpoint_from_manifest_key,
    checkpoint_partitions,
)
from gpudoor_pipelines.concurrency import STEP_POOLS
from gpudoor_pipelines.launch.client import LaunchConfig, PipesSkyPilotClient
from gpudoor_pipelines.transit.io_manager import TransitRef
from gpudoor_pipelines.transit.resource import TransitBucketResource

TAG_TRAINING_ID = "gpudoor/training-id"


class TrainConfig(LaunchConfig):
    """Run config of a training run."""

    training_id: str | None = Field(
        default=None,
        description="Resume this training (its checkpoints are reused); default: this run's own id, kept across re-executions.",
    )
    skip_smoke_test: bool = Field(
        default=False, description="Skip the short run on the target GPU (not recommended)."
    )


def training_prefix(training_id: str) -> str:
    """Where a training run's checkpoints live."""
    return f"{CHECKPOINTS_PREFIX}/{training_id}"


def run_info_key(training_id: str) -> str:
    """A small JSON written before training starts: which dataset the run trains on."""
    return f"{training_prefix(training_id)}/_run.json"


def _training_id(context: dg.AssetExecutionContext, config: TrainConfig) -> str:
    if config.training_id:
        return config.training_id
    existing = context.run.tags.get(TAG_TRAINING_ID)
    if existing:  # A re-execution of a failed run resumes the same training.
        return existing
    new_id = f"{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}-{context.run.run_id[:8]}"
    context.instance.add_run_tags(context.run.run_id, {TAG_TRAINING_ID: new_id})
    return new_id


@dg.asset(group_name="training", kinds={"skypilot", "pytorch"}, pool=STEP_POOLS["train"])
def training_run(
    context: dg.AssetExecutionContext,
    config: TrainConfig,
    skypilot: PipesSkyPilotClient,
    transit: TransitBucketResource,
    captioned_dataset: TransitRef,
) -> dg.MaterializeResult[TransitRef]:
    """A multi-node training run on the H200 InfiniBand cluster, checkpointing into the transit bucket.

    A ~60 s smoke test of the same code on the target GPU runs first; a long run never starts if it
    fails. A preempted run restarts from its last checkpoint.
    """
    bucket = transit.get_bucket()
    dataset_prefix = bucket.key_of(captioned_dataset.uri)
    manifest = require_published(bucket, dataset_prefix, "captioned_dataset")
    dataset_uri = bucket.uri(f"{dataset_prefix}/{manifest.get('file', 'data.parquet')}")
    training_id = _training_id(context, config)
    prefix = training_prefix(training_id)
    bucket.put_bytes(
        run_info_key(training_id),
        json.dumps({"dataset_uri": dataset_uri, "dagster_run_id": context.run.run_id}).encode(),
    )
    overrides = LaunchConfig(pool=config.pool, infra=config.infra)

    smoke_md: dict = {}
    if not config.skip_smoke_test:
        context.log.info("Smoke test on the target GPU before the long run.")
        inputs = {"DATASET_URI": dataset_uri, "OUTPUT_URI": bucket.uri(f"smoke/{training_id}")}
        smoke = skypilot.run(context=context, request=skypilot.request(context, "smoke", inputs=inputs, config=overrides))
        smoke_md = {
            f"smoke_{k}": v
            for k, v in smoke.record.to_metadata().items()
            if k in ("job_id", "pool", "running_s", "status", "gpu_hours", "cost_usd_estimate")
        }
    inputs = {"DATASET_URI": dataset_uri, "OUTPUT_URI": bucket.uri(prefix)}
    done = skypilot.run(context=context, request=skypilot.request(context, "train", inputs=inputs, config=config))
    checkpoints = sorted(
        k
        for k in (checkpoint_from_manifest_key(key) for key in bucket.list_keys(prefix + "/"))
        if k is not None
    )
    if not checkpoints:
        raise dg.Failure(
            description=f"Training job {done.record.job_id} ended without a checkpoint under {bucket.uri(prefix)}."
        )
    new = [
        k for k in checkpoints if not context.instance.has_dynamic_partition(checkpoint_partitions.name, k)
    ]
    if new:
        context.instance.add_dynamic_partitions(checkpoint_partitions.name, new)
    run_manifest = {
        "training_id": training_id,
        "checkpoints": checkpoints,
        "dataset_uri": dataset_uri,
        "job_id": done.record.job_id,
    }
    bucket.publish(prefix, run_manifest)
    return done.get_materialize_result(
        value=TransitRef(uri=bucket.uri(prefix), manifest=run_manifest),
        metadata={
            **smoke_md,
            "training_id": training_id,
            "checkpoints": dg.MetadataValue.json(checkpoints),
            "checkpoints_uri": dg.MetadataValue.path(bucket.uri(prefix)),
        },
    )
