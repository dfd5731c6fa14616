"""Partitions of the flow: dataset shards and checkpoints, both dynamic (registered from the data)."""

from __future__ import annotations

import dagster as dg

from gpudoor_pipelines.transit.bucket import MANIFEST_NAME

SHARDS = "shards"
#: One partition per dataset shard (``<dataset>-NNNNN``), added by ``dataset_shards`` as the data grows.
shard_partitions = dg.DynamicPartitionsDefinition(name=SHARDS)
checkpoint_partitions = dg.DynamicPartitionsDefinition(name="checkpoints")

CHECKPOINTS_PREFIX = "checkpoints"


def checkpoint_key(training_id: str, step_dir: str) -> str:
    """The partition key of one checkpoint: ``<training id>.<step dir>``."""
    return f"{training_id}.{step_dir}"


def checkpoint_prefix(partition_key: str) -> str:
    """The bucket prefix of a checkpoint partition (inverse of :func:`checkpoint_key`)."""
    training_id, _, step_dir = partition_key.partition(".")
    if not training_id or not step_dir.startswith("step-"):
        raise ValueError(f"'{partition_key}' is not a checkpoint partition key (<training id>.step-NNNNNN)")
    return f"{CHECKPOINTS_PREFIX}/{training_id}/{step_dir}"


def checkpoint_from_manifest_key(key: str) -> str | None:
    """``checkpoints/<id>/step-NNNNNN/_manifest.json`` → its partition key, else None."""
    parts = key.split("/")
    if (
        len(parts) == 4
        and parts[0] == CHECKPOINTS_PREFIX
        and parts[2].startswith("step-")
        and parts[3] == MANIFEST_NAME
    ):
        return checkpoint_key(parts[1], parts[2])
    return None
