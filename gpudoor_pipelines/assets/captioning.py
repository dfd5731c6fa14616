"""Captioning: a dataset split into shards, the shards captioned on GPUs at night, then merged."""

import datetime

import dagster as dg
from pydantic import Field

from gpudoor_pipelines.assets.concurrency import STEP_POOLS
from gpudoor_pipelines.assets.k8s import cpu_step_tags
from gpudoor_pipelines.assets.night import CaptionNight, dataset_of
from gpudoor_pipelines.assets.partitions import SHARDS, shard_partitions
from gpudoor_pipelines.data import layout
from gpudoor_pipelines.data.captions import merge_captions
from gpudoor_pipelines.data.datasets import check_dataset_name, register_dataset, shard_key, write_synthetic
from gpudoor_pipelines.data.sources import DatasetSourceError, list_images, resolver_for
from gpudoor_pipelines.launch.client import LaunchConfig, PipesSkyPilotClient
from gpudoor_pipelines.launch.resolve.specs import load_spec
from gpudoor_pipelines.transit.io_manager import TransitRef
from gpudoor_pipelines.transit.resource import TransitBucketResource

SAMPLE_DATASET = "sample"
#: Runs of a backfill over many shards take at most this many shards each (one batch per run).
MAX_SHARDS_PER_RUN = 2500


class DatasetConfig(dg.Config):
    """Which images to caption, and how many go in a shard."""

    source: str = Field(
        default="",
        description=(
            "Images to caption: a folder (path or file:///…), an S3 prefix (s3://bucket/prefix), or a "
            ".parquet/.csv table with an image_uri column. Empty: the generated sample."
        ),
    )
    name: str = Field(
        default=SAMPLE_DATASET,
        description="Dataset name (lowercase, digits, '-'); shard keys are <name>-NNNNN.",
    )
    shard_size: int = Field(
        default=24, ge=1, description="Images per shard (new shards only: known images keep theirs)."
    )
    num_images: int = Field(default=96, ge=1, description="Images of the generated sample (no source).")
    image_size: int = Field(default=32, ge=8, description="Width and height of the generated images, in pixels.")


@dg.asset(
    group_name="captioning",
    kinds={"python", "s3"},
    # Lists every image of the source and keeps the dataset's index in memory: grows with the image count.
    op_tags=cpu_step_tags("1", "4Gi"),
)
def dataset_shards(
    context: dg.AssetExecutionContext, config: DatasetConfig, transit: TransitBucketResource
) -> dg.MaterializeResult[TransitRef]:
    """The dataset's images split into shards: each shard a manifest of image URIs (images are not copied).

    New images become new shards (new partitions of ``caption_shards``); known images keep theirs.
    A source that cannot be read fails here, before any GPU is asked for.
    """
    bucket = transit.get_bucket()
    try:
        check_dataset_name(config.name)
        source = config.source or write_synthetic(bucket, config.name, config.num_images, config.image_size)
        listing = list_images(source, bucket_for=resolver_for(bucket))
        registration = register_dataset(bucket, config.name, listing, config.shard_size)
    except (DatasetSourceError, ValueError) as e:
        raise dg.Failure(description=f"Nothing was launched. run config dataset_shards: {e}") from None
    if registration.new_shards:
        context.instance.add_dynamic_partitions(SHARDS, registration.new_shards)
    skipped = listing.skipped_by_reason()
    manifest = {
        "dataset": config.name,
        "num_shards": len(registration.shards),
        "images": registration.images_total,
    }
    return dg.MaterializeResult(
        value=TransitRef(uri=registration.index_uri, manifest=manifest),
        metadata={
            "dataset": config.name,
            "source": dg.MetadataValue.path(listing.source or source),
            "images_total": registration.images_total,
            "images_new": registration.images_new,
            "images_gone_from_source": registration.images_missing,
            "shards": len(registration.shards),
            "shards_new": len(registration.new_shards),
            "files_skipped": len(listing.skipped),
            "files_skipped_by_reason": dg.MetadataValue.json(skipped),
            "files_skipped_sample": dg.MetadataValue.json([{"uri": u, "reason": r} for u, r in listing.skipped[:20]]),
        },
    )


class CaptionConfig(LaunchConfig):
    """Run config of a captioning run: the launch overrides, the window, and how to pack the shards."""

    window_end: str | None = Field(
        default=None,
        description="ISO time after which no job starts new work (the nightly schedule sets it).",
    )
    max_workers: int | None = Field(default=None, ge=1, description="At most this many workers, whatever is free.")
    shards_per_job: int | None = Field(
        default=None, ge=1, description="Shards per job (default: a few jobs per worker)."
    )
    max_attempts: int = Field(default=3, ge=1, description="Tries per shard in this run before it is reported failed.")
    wait_for_gpus_s: float = Field(default=600.0, ge=0, description="How long to wait for a free GPU when none is.")


@dg.asset(
    group_name="captioning",
    partitions_def=shard_partitions,
    kinds={"skypilot"},
    pool=STEP_POOLS["caption"],
    deps=[dataset_shards],
    output_required=False,
    backfill_policy=dg.BackfillPolicy.multi_run(max_partitions_per_run=MAX_SHARDS_PER_RUN),
)
def caption_shards(
    context: dg.AssetExecutionContext,
    config: CaptionConfig,
    skypilot: PipesSkyPilotClient,
    transit: TransitBucketResource,
):
    """Captions of each shard (Parquet parts under ``captions/<model>/<shard>``), written by GPU jobs.

    A run covers one shard or a range of them. The shards not yet captioned by the model are packed
    into a few jobs on a warm pool sized to the free GPUs; each shard is materialized the moment its
    job reports it done. A job stopped by a preemption or the window's end resumes at its last part.

    It yields no output: a generator that yields nothing (``output_required=False``) materializes
    only the shards it logged as done, never the whole range at once.
    """
    yield from ()
    request = skypilot.request(context, "caption", config=config)
    shards = list(context.partition_keys)
    for shard in shards:
        try:
            dataset_of(shard)
        except ValueError as e:
            raise dg.Failure(description=f"Nothing was launched. {e}. Fix: re-materialize dataset_shards.") from None
    window_end = datetime.datetime.fromisoformat(config.window_end) if config.window_end else None
    night = CaptionNight(
        context,
        skypilot,
        transit.get_bucket(),
        request,
        window_end=window_end,
        max_workers=config.max_workers,
        shards_per_job=config.shards_per_job,
        max_attempts=config.max_attempts,
        wait_for_gpus_s=config.wait_for_gpus_s,
    )
    report = night.run(shards)
    context.log.info(f"Captioning: {report.to_metadata('shards')}")
    if report.left:
        context.log.warning(
            f"{len(report.left)} shards left for the next night"
            + (" (the window ended)." if window_end else " (no free GPU).")
        )
        if window_end is None:
            raise dg.Failure(
                description=f"No free GPU for captioning within {config.wait_for_gpus_s:.0f} s ({report.no_gpu}); "
                f"{len(report.left)} shards not captioned. Fix: free GPUs on the caption pools, or retry later.",
                metadata=report.to_metadata("shards"),
            )
    if report.failed:
        shard, reason = next(iter(report.failed.items()))
        raise dg.Failure(
            description=f"{len(report.failed)} shards failed after {config.max_attempts} tries "
            f"(the others are materialized). Shard {shard}: {reason}",
            metadata={
                **report.to_metadata("shards"),
                "failed_shards": dg.MetadataValue.json(sorted(report.failed)[:100]),
            },
        )


def default_caption_model() -> str:
    """The caption model of the caption task spec (what the nightly run uses)."""
    return load_spec("caption", skypilot=False).envs.get("CAPTION_MODEL", "default")


class MergeConfig(dg.Config):
    """Which captions to merge."""

    caption_model: str = Field(
        default="", description="Caption model whose captions to merge (default: the caption spec's)."
    )


ALL_SHARDS_CHECK = "all_shards_captioned"


@dg.asset(
    group_name="captioning",
    kinds={"pandas", "parquet"},
    deps=[caption_shards],
    # The merge streams Parquet parts through a local file: memory stays small whatever the caption count.
    op_tags=cpu_step_tags("1", "2Gi"),
    check_specs=[
        dg.AssetCheckSpec(
            ALL_SHARDS_CHECK,
            asset="captioned_dataset",
            description="Every shard of the dataset is captioned.",
        )
    ],
)
def captioned_dataset(
    context: dg.AssetExecutionContext,
    config: MergeConfig,
    transit: TransitBucketResource,
    dataset_shards: TransitRef,
):
    """The dataset's captions as one Parquet table (image_id, image_uri, caption, shard), merged by morning.

    Merges whatever shards are done; the shards still missing are named by a warning check rather
    than failing the morning.
    """
    bucket = transit.get_bucket()
    dataset = dataset_shards.manifest["dataset"]
    model = config.caption_model or default_caption_model()
    shards = [shard_key(dataset, n) for n in range(int(dataset_shards.manifest["num_shards"]))]
    result = merge_captions(bucket, model, shards, f"{layout.DATASETS}/{dataset}/captioned/{model}")
    if not result.shards_merged:
        raise dg.Failure(
            description=f"No shard of dataset '{dataset}' is captioned by {model} yet. Fix: materialize "
            "caption_shards first."
        )
    prefix = result.manifest_key.rsplit("/", 1)[0]
    manifest = bucket.read_manifest(prefix) or {}
    return dg.MaterializeResult(
        value=TransitRef(uri=bucket.uri(prefix), manifest=manifest),
        metadata={
            "rows": result.rows,
            "dataset": dataset,
            "caption_model": model,
            "dataset_uri": dg.MetadataValue.path(bucket.uri(result.file_key)),
            "shards_merged": len(result.shards_merged),
            "shards_missing": len(result.missing),
            "images_skipped": result.skipped,
            "bytes": result.bytes,
        },
        check_results=[
            dg.AssetCheckResult(
                check_name=ALL_SHARDS_CHECK,
                passed=not result.missing,
                severity=dg.AssetCheckSeverity.WARN,
                metadata={
                    "shards_missing": len(result.missing),
                    "missing_sample": dg.MetadataValue.json(result.missing[:20]),
                },
                description=(
                    f"{len(result.missing)} of {len(shards)} shards are not captioned yet; merged the others."
                    if result.missing
                    else f"All {len(shards)} shards merged."
                ),
            )
        ],
    )
