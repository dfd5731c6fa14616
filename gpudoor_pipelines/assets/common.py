"""Small helpers shared by the asset modules."""

from __future__ import annotations

import dagster as dg

from gpudoor_pipelines.transit.bucket import MANIFEST_NAME, TransitBucket


def require_published(bucket: TransitBucket, prefix: str, upstream: str) -> dict:
    """The manifest of an upstream output, or a clear failure before anything is launched.

    Args:
        bucket: the transit bucket.
        prefix: where the upstream asset publishes.
        upstream: the upstream asset's name, for the message.
    """
    manifest = bucket.read_manifest(prefix)
    if manifest is None:
        raise dg.Failure(
            description=(
                f"Missing upstream output: {upstream} has nothing published at {bucket.uri(prefix)} "
                f"(no {MANIFEST_NAME}). Fix: materialize {upstream} first."
            )
        )
    return manifest


def require_object(bucket: TransitBucket, key: str, upstream: str) -> str:
    """The URI of an upstream object, or a clear failure before anything is launched."""
    if not bucket.exists(key):
        raise dg.Failure(
            description=f"Missing upstream output: {upstream} has no object at {bucket.uri(key)}. Fix: materialize "
            f"{upstream} first."
        )
    return bucket.uri(key)
