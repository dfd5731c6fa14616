"""Partitions of the flow: dataset shards and checkpoints, both dynamic (registered from the data)."""

from __future__ import annotations

import dagster as dg

SHARDS = "shards"
#: One partition per dataset shard (``<dataset>-NNNNN``), added by ``dataset_shards`` as the data grows.
shard_partitions = dg.DynamicPartitionsDefinition(name=SHARDS)
#: One partition per checkpoint chosen for evaluation (``<training id>.step-NNNNNN``), added by the
#: checkpoint sensor (or by hand in the UI); see ``gpudoor_pipelines.data.checkpoints`` for the keys.
checkpoint_partitions = dg.DynamicPartitionsDefinition(name="checkpoints")
