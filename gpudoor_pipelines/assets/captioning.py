"""Captioning: a dataset split into shards, each shard captioned by a GPU job, then merged."""

import json

import dagster as dg
import pandas as pd
from pydantic import Field

from gpudoor_pipelines.assets.common import require_published
from gpudoor_pipelines.assets.partitions import NUM_SHARDS, SHARD_KEYS, shard_partitions
from gpudoor_pipelines.concurrency import STEP_POOLS
from gpudoor_pipelines.launch.client import LaunchConfig, PipesSkyPilotClient
from gpudoor_pipelines.transit.bucket import MANIFEST_NAME
from gpudoor_pipelines.transit.io_manager import TransitRef
from gpudoor_pipelines.transit.resource import TransitBucketResource

DATASET_NAME = "synthetic"


class DatasetConfig(dg.Config):
    """How big the generated sample dataset is."""

    num_images: int = Field(
        default=96, description="Images in the generated dataset, spread over the shards."
    )
    image_size: int = Field(default=32, description="Width and height of each image, in pixels.")


def shard_prefix(shard: str) -> str:
    """Where a shard's images live in the bucket."""
    return f"datasets/{DATASET_NAME}/shards/{shard}"


def captions_prefix(model: str, shard: str) -> str:
    """Where a shard's captions live: per model, so a new model does not skip the old model's work."""
    return f"captions/{model}/{shard}"


@dg.asset(group_name="captioning", kinds={"python", "s3"})
def dataset_shards(
    context: dg.AssetExecutionContext, config: DatasetConfig, transit: TransitBucketResource
) -> pd.DataFrame:
    """The raw image dataset, split into shards in the transit bucket (a small synthetic one by default)."""
    from workloads.synthetic import generate_image, image_id

    if config.num_images < NUM_SHARDS:
        raise dg.Failure(
            description=f"run config num_images={config.num_images}: need at least {NUM_SHARDS} (one per shard)."
        )
    bucket = transit.get_bucket()
    rows = []
    for s, shard in enumerate(SHARD_KEYS):
        numbers = range(s, config.num_images, NUM_SHARDS)
        ids = [image_id(i) for i in numbers]
        files = {f"images/{image_id(i)}.png": generate_image(i, size=config.image_size)[0] for i in numbers}
        bucket.publish(shard_prefix(shard), {"shard": shard, "images": ids, "count": len(ids)}, files=files)
        rows.append({"shard": shard, "uri": bucket.uri(shard_prefix(shard)), "num_images": len(ids)})
    context.add_output_metadata({"num_images": config.num_images, "num_shards": NUM_SHARDS})
    return pd.DataFrame(rows)


class CaptionConfig(LaunchConfig):
    """Run config of a caption shard: the launch overrides, nothing else."""


@dg.asset(
    group_name="captioning",
    partitions_def=shard_partitions,
    kinds={"skypilot"},
    pool=STEP_POOLS["caption"],
)
def caption_shards(
    context: dg.AssetExecutionContext,
    config: CaptionConfig,
    skypilot: PipesSkyPilotClient,
    transit: TransitBucketResource,
    dataset_shards: pd.DataFrame,
) -> dg.MaterializeResult[TransitRef]:
    """One caption per image of a shard, written by a GPU job on on-prem or idle inference GPUs.

    The job writes straight into the bucket, one object per image; relaunched after a preemption it
    skips the images already captioned.
    """
    request = skypilot.request(context, "caption", config=config)
    shard = request.partition or ""
    if shard not in set(dataset_shards["shard"]):
        raise dg.Failure(
            description=f"dataset_shards has no shard '{shard}'. Fix: re-materialize dataset_shards."
        )
    bucket = transit.get_bucket()
    require_published(bucket, shard_prefix(shard), "dataset_shards")
    out_prefix = captions_prefix(request.env_value("CAPTION_MODEL") or "default", shard)
    done = skypilot.run(
        context=context,
        request=request.with_inputs(SHARD_URI=bucket.uri(shard_prefix(shard)), OUTPUT_URI=bucket.uri(out_prefix)),
    )
    manifest = require_published(bucket, out_prefix, f"the caption job {done.record.job_id}")
    return done.get_materialize_result(
        value=TransitRef(uri=bucket.uri(out_prefix), manifest=manifest),
        metadata={"captions_uri": dg.MetadataValue.path(bucket.uri(out_prefix)), "images_total": manifest.get("count")},
    )


@dg.asset(group_name="captioning", kinds={"pandas", "parquet"})
def captioned_dataset(
    context: dg.AssetExecutionContext, transit: TransitBucketResource, caption_shards: dict[str, TransitRef]
) -> TransitRef:
    """All shards' captions merged into one Parquet table next to the images (image_id, image_uri, caption, shard)."""
    bucket = transit.get_bucket()
    missing = [s for s in SHARD_KEYS if s not in caption_shards]
    if missing:
        raise dg.Failure(
            description=f"caption_shards is missing partitions {missing}. Fix: materialize those shards first."
        )
    rows = []
    for shard, ref in sorted(caption_shards.items()):
        prefix = bucket.key_of(ref.uri)
        for key in bucket.list_keys(prefix + "/"):
            if key.endswith(".json") and not key.endswith(MANIFEST_NAME):
                record = json.loads(bucket.get_bytes(key))
                rows.append(
                    {
                        "image_id": record["image_id"],
                        "image_uri": record["image_uri"],
                        "caption": record["caption"],
                        "shard": shard,
                    }
                )
    df = pd.DataFrame(rows).sort_values("image_id").reset_index(drop=True)
    prefix = f"datasets/{DATASET_NAME}/captioned"
    manifest = {"rows": len(df), "file": "data.parquet", "shards": sorted(caption_shards)}
    bucket.publish(prefix, manifest, files={"data.parquet": df.to_parquet(index=False)})
    context.add_output_metadata(
        {
            "rows": len(df),
            "dataset_uri": dg.MetadataValue.path(bucket.uri(f"{prefix}/data.parquet")),
            "captions_per_shard": dg.MetadataValue.json(df.groupby("shard").size().to_dict()),
            "preview": dg.MetadataValue.md(
                df.head(8).to_markdown(index=False) if _has_tabulate() else df.head(8).to_string()
            ),
        }
    )
    return TransitRef(uri=bucket.uri(prefix), manifest=manifest)


def _has_tabulate() -> bool:
    try:
        import tabulate  # noqa: F401
    except ImportError:
        return False
    return True
