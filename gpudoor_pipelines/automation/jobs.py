"""Asset jobs the schedules and sensors launch."""

from __future__ import annotations

import dagster as dg

from gpudoor_pipelines.assets.captioning import caption_shards, captioned_dataset
from gpudoor_pipelines.assets.evaluation import checkpoint_evals
from gpudoor_pipelines.assets.housekeeping import housekeeping_applied, housekeeping_plan

captioning_job = dg.define_asset_job(
    "captioning_job",
    selection=dg.AssetSelection.assets(caption_shards),
    description="Caption one dataset shard.",
)
merge_captions_job = dg.define_asset_job(
    "merge_captions_job",
    selection=dg.AssetSelection.assets(captioned_dataset),
    description="Merge all shards' captions.",
)
eval_job = dg.define_asset_job(
    "eval_job",
    selection=dg.AssetSelection.assets(checkpoint_evals),
    description="Evaluate one checkpoint.",
)
housekeeping_job = dg.define_asset_job(
    "housekeeping_job",
    selection=dg.AssetSelection.assets(housekeeping_plan, housekeeping_applied),
    description="Plan what to keep, move and delete in the transit bucket, then apply it if the fleet says so.",
)
