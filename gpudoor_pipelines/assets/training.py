"""Training: a smoke test on the target GPU, then the multi-node run that writes checkpoints."""

import json

import dagster as dg
from pydantic import Field

from gpudoor_pipelines.assets.common import require_published
from gpudoor_pipelines.assets.concurrency import STEP_POOLS
from gpudoor_pipelines.data import layout
from gpudoor_pipelines.data.checkpoints import (
    check_training_id,
    checkpoint_from_manifest_key,
    new_training_id,
    record_end,
    record_start,
    training_prefix,
)
from gpudoor_pipelines.launch.client import LaunchConfig, PipesSkyPilotClient
from gpudoor_pipelines.transit.io_manager import TransitRef
from gpudoor_pipelines.transit.resource import TransitBucketResource

TAG_TRAINING_ID = "gpudoor/training-id"
TAG_TRAINING_NAME = "gpudoor/training-name"


class TrainConfig(LaunchConfig):
    """Run config of a training run."""

    training_id: str | None = Field(
        default=None,
        description="Resume this training (its checkpoints are reused): the id shown in training_run's metadata; "
        "default: a new id (UTC start time + run id), kept across re-executions.",
    )
    training_name: str | None = Field(
        default=None, description="A name for people (kept as a label in the metadata and run tags, not in keys)."
    )
    skip_smoke_test: bool = Field(default=False, description="Skip the short run on the target GPU (not recommended).")


def run_info_key(training_id: str) -> str:
    """A small JSON written before training starts: which dataset the run trains on."""
    return f"{training_prefix(training_id)}/_run.json"


def _training_id(context: dg.AssetExecutionContext, config: TrainConfig) -> str:
    if config.training_id:
        try:
            return check_training_id(config.training_id)
        except ValueError as e:
            raise dg.Failure(description=f"Nothing was launched. run config training_run.training_id: {e}") from None
    existing = context.run.tags.get(TAG_TRAINING_ID)
    if existing:  # A re-execution of a failed run resumes the same training.
        return existing
    new_id = new_training_id(context.run.run_id)
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
    fails. A preempted run restarts from its last checkpoint. Each start is written to the journal the
    checkpoint sensor reads, and each way out (done, failed, cancelled) to the start's end marker.
    """
    bucket = transit.get_bucket()
    dataset_prefix = bucket.key_of(captioned_dataset.uri)
    manifest = require_published(bucket, dataset_prefix, "captioned_dataset")
    dataset_uri = bucket.uri(f"{dataset_prefix}/{manifest.get('file', 'data.parquet')}")
    training_id = _training_id(context, config)
    name = config.training_name or context.run.tags.get(TAG_TRAINING_NAME)
    if name:
        context.instance.add_run_tags(context.run.run_id, {TAG_TRAINING_NAME: name})
    bucket.put_bytes(
        run_info_key(training_id),
        json.dumps({"dataset_uri": dataset_uri, "dagster_run_id": context.run.run_id, "training_name": name}).encode(),
    )
    # The journal entry makes the checkpoint sensor watch this training; the end marker lets it stop.
    start = record_start(bucket, training_id, name=name, run_id=context.run.run_id)

    def end(state: str, reason: str | None = None) -> None:
        try:
            record_end(bucket, start.ended_key, state, reason)
        except Exception as e:  # the bucket is down: the sensor's age limit stops watching it instead
            context.log.warning(f"Could not record that training {training_id} {state}: {e}")

    try:
        result = _smoke_then_train(context, config, skypilot, bucket, training_id, dataset_uri, start.ended_key)
    except (dg.DagsterExecutionInterruptedError, KeyboardInterrupt):
        end("cancelled", "the Dagster run was cancelled")
        raise
    except Exception as e:
        end("failed", f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}")
        raise
    end("succeeded")
    return result


def _smoke_then_train(
    context: dg.AssetExecutionContext,
    config: TrainConfig,
    skypilot: PipesSkyPilotClient,
    bucket,
    training_id: str,
    dataset_uri: str,
    ended_key: str,
) -> dg.MaterializeResult[TransitRef]:
    prefix = training_prefix(training_id)
    overrides = LaunchConfig(pool=config.pool, infra=config.infra)

    smoke_md: dict = {}
    if not config.skip_smoke_test:
        context.log.info("Smoke test on the target GPU before the long run.")
        inputs = {"DATASET_URI": dataset_uri, "OUTPUT_URI": bucket.uri(f"{layout.SMOKE}/{training_id}")}
        smoke = skypilot.run(
            context=context, request=skypilot.request(context, "smoke", inputs=inputs, config=overrides)
        )
        smoke_md = {
            f"smoke_{k}": v
            for k, v in smoke.record.to_metadata().items()
            if k in ("job_id", "pool", "running_s", "status", "gpu_hours", "cost_usd_estimate")
        }
    inputs = {"DATASET_URI": dataset_uri, "OUTPUT_URI": bucket.uri(prefix), "ENDED_MARKER_URI": bucket.uri(ended_key)}
    done = skypilot.run(context=context, request=skypilot.request(context, "train", inputs=inputs, config=config))
    checkpoints = sorted(
        k for k in (checkpoint_from_manifest_key(key) for key in bucket.list_keys(prefix + "/")) if k is not None
    )
    if not checkpoints:
        raise dg.Failure(
            description=f"Training job {done.record.job_id} ended without a checkpoint under {bucket.uri(prefix)}."
        )
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
            **({"training_name": config.training_name} if config.training_name else {}),
            "checkpoints": dg.MetadataValue.json(checkpoints),
            "checkpoints_uri": dg.MetadataValue.path(bucket.uri(prefix)),
        },
    )
