"""The transit bucket: data crosses clusters only through it (a local folder or an S3 bucket).

``bucket`` has no Dagster imports; ``resource`` and ``io_manager`` (Dagster) are imported lazily
so that jobs can use the bucket without importing Dagster.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .bucket import (
    MANIFEST_NAME,
    LocalTransitBucket,
    S3TransitBucket,
    TransitBucket,
    TransitConfigError,
    TransitError,
    TransitObjectMissing,
    asset_object_key,
)

if TYPE_CHECKING:  # pragma: no cover
    from .io_manager import TransitIOManager, TransitRef
    from .resource import TransitBucketResource, bucket_from_env

_LAZY = {
    "TransitBucketResource": "resource",
    "bucket_from_env": "resource",
    "TransitIOManager": "io_manager",
    "TransitRef": "io_manager",
}

__all__ = [
    "MANIFEST_NAME",
    "LocalTransitBucket",
    "S3TransitBucket",
    "TransitBucket",
    "TransitBucketResource",
    "TransitConfigError",
    "TransitError",
    "TransitIOManager",
    "TransitObjectMissing",
    "TransitRef",
    "asset_object_key",
    "bucket_from_env",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        mod = importlib.import_module(f".{_LAZY[name]}", __name__)
        return getattr(mod, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
