"""A night of captioning: many shards packed into a few jobs on a warm pool sized to the free GPUs.

The packing, waves, retries and waiting for GPUs are :class:`~gpudoor_pipelines.assets.packed.PackedRun`'s;
this module says what a shard is to it. After the window's end nothing new launches: running jobs
finish their current part and the rest waits for the next night.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import dagster as dg

from gpudoor_pipelines.assets.packed import PackedRun
from gpudoor_pipelines.data.captions import captions_prefix, done_shards
from gpudoor_pipelines.data.datasets import shard_prefix


def dataset_of(shard: str) -> str:
    """The dataset a shard key belongs to (``<dataset>-<NNNNN>``)."""
    dataset, _, number = shard.rpartition("-")
    if not dataset or not number.isdigit():
        raise ValueError(f"'{shard}' is not a shard key (<dataset>-NNNNN)")
    return dataset


class CaptionNight(PackedRun):
    """Captions the shards of one run, in waves of batches on one warm pool (see :class:`PackedRun`)."""

    batch_env = "CAPTION_BATCH_URI"
    item_field = "shard"
    kind = "caption"
    doing = "captioning"

    def __init__(self, *args: Any, shards_per_job: int | None = None, **kwargs: Any) -> None:
        super().__init__(*args, items_per_job=shards_per_job, **kwargs)
        self.model = self.request.env_value("CAPTION_MODEL") or "default"

    def done_items(self, items: Sequence[str]) -> set[str]:
        return done_shards(self.bucket, self.model) & set(items)  # one listing, not one request per shard

    def batch_fields(self) -> dict[str, Any]:
        return {"window_end": self.window_end.timestamp() if self.window_end else None}

    def entry(self, item: str) -> dict[str, str]:
        return {
            "shard": item,
            "shard_uri": self.bucket.uri(shard_prefix(dataset_of(item), item)),
            "output_uri": self.bucket.uri(captions_prefix(self.model, item)),
        }

    def materialize(self, item: str, message: Mapping[str, Any], rank: int | None = None) -> None:
        metadata: dict[str, Any] = {
            "caption_model": self.model,
            "captions_uri": dg.MetadataValue.path(self.bucket.uri(captions_prefix(self.model, item))),
        }
        for key, name in (
            ("total", "images_total"),
            ("captioned", "images_captioned"),
            ("skipped", "images_skipped"),
            ("parts", "parts"),
            ("seconds", "seconds"),
        ):
            if key in message:
                metadata[name] = message[key]
        if message.get("skipped_images"):
            metadata["skipped_images"] = dg.MetadataValue.json(list(message["skipped_images"]))
        metadata.update(self.job_share(item, rank, float(message.get("seconds") or 0.0)))
        if message.get("state") == "already done":
            metadata["note"] = f"already captioned by {self.model}"
        self.context.log_event(
            dg.AssetMaterialization(asset_key=self.context.asset_key, partition=item, metadata=metadata)
        )
