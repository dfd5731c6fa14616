"""Dagster resource that hands out the transit bucket.

Bind it once in ``definitions.py`` (``bucket_from_env()`` reads the ``GPUDOOR_*`` variables) and
depend on it from assets, sensors and the :class:`~gpudoor_pipelines.transit.io_manager.TransitIOManager`.
"""

from __future__ import annotations

import os
from pathlib import Path

import dagster as dg
from pydantic import Field, PrivateAttr

from .bucket import LocalTransitBucket, S3TransitBucket, TransitBucket, TransitConfigError

KINDS = ("local", "s3")


def default_local_root() -> Path:
    """``$GPUDOOR_HOME/transit`` if GPUDOOR_HOME is set, else ``~/.gpudoor/transit``."""
    home = os.environ.get("GPUDOOR_HOME")
    base = Path(home).expanduser() if home else Path.home() / ".gpudoor"
    return base / "transit"


def _plain(value):
    """The value of a field that may still be an unresolved ``dg.EnvVar`` (when the resource is used
    outside a run, e.g. ``bucket_from_env().get_bucket()`` in a script)."""
    if isinstance(value, dg.EnvVar):
        return value.get_value()
    return value


class TransitBucketResource(dg.ConfigurableResource):
    """The transit bucket: where data crosses between the orchestrator and the GPU clusters.

    ``kind="local"`` keeps it in a folder on this machine (jobs run as local processes);
    ``kind="s3"`` uses an S3 bucket or any S3-compatible endpoint. Bind the credentials with
    ``dg.EnvVar`` so they are resolved at run time and never stored in run config; they are hidden
    from ``repr``.
    """

    kind: str = Field(
        default="local",
        description='"local" (a folder on this machine) or "s3" (S3 or an S3-compatible endpoint). '
        "Env: GPUDOOR_TRANSIT.",
    )
    local_root: str | None = Field(
        default=None,
        description="kind=local: folder of the bucket. Default: $GPUDOOR_HOME/transit, else "
        "~/.gpudoor/transit (resolved when first used). Env: GPUDOOR_TRANSIT_ROOT.",
    )
    bucket: str | None = Field(
        default=None,
        description="kind=s3: bucket name (no s3://, no folders). Env: GPUDOOR_S3_BUCKET.",
    )
    prefix: str = Field(
        default="",
        description="kind=s3: key prefix inside the bucket, e.g. 'gpudoor/prod'. Env: GPUDOOR_S3_PREFIX.",
    )
    endpoint_url: str | None = Field(
        default=None,
        description="kind=s3: endpoint of an S3-compatible server, e.g. http://127.0.0.1:9000; "
        "unset = AWS S3. Env: GPUDOOR_S3_ENDPOINT_URL.",
    )
    region: str = Field(
        default="us-east-1",
        description="kind=s3: signing region. Env: GPUDOOR_S3_REGION.",
    )
    access_key_id: str | None = Field(
        default=None,
        repr=False,
        description="kind=s3: access key id; bind with dg.EnvVar('GPUDOOR_S3_ACCESS_KEY_ID'). "
        "Unset = the default AWS credential chain (AWS_* env, profile, instance role).",
    )
    secret_access_key: str | None = Field(
        default=None,
        repr=False,
        description="kind=s3: secret access key; bind with dg.EnvVar('GPUDOOR_S3_SECRET_ACCESS_KEY').",
    )

    _bucket: TransitBucket | None = PrivateAttr(default=None)

    def get_bucket(self) -> TransitBucket:
        """The bucket these settings describe (created once per resource instance)."""
        if self._bucket is None:
            self._bucket = self._build()
        return self._bucket

    def _build(self) -> TransitBucket:
        kind = (_plain(self.kind) or "local").strip().lower()
        if kind not in KINDS:
            raise TransitConfigError(
                f"unknown transit bucket kind {self.kind!r}: set `kind` (GPUDOOR_TRANSIT) to 'local' or 's3'"
            )
        if kind == "local":
            root = _plain(self.local_root)
            return LocalTransitBucket(Path(root).expanduser() if root else default_local_root())
        bucket = _plain(self.bucket)
        if not bucket:
            raise TransitConfigError(
                "transit kind is 's3' but no bucket is set: set `bucket` (GPUDOOR_S3_BUCKET) to the "
                "bucket name, or set `kind` (GPUDOOR_TRANSIT) to 'local'"
            )
        if bucket.startswith("s3://"):
            raise TransitConfigError(
                f"`bucket` (GPUDOOR_S3_BUCKET) must be a bare bucket name, got {bucket!r}: "
                "drop 's3://' and put any folder part in `prefix` (GPUDOOR_S3_PREFIX)"
            )
        return S3TransitBucket(
            bucket,
            _plain(self.prefix) or "",
            endpoint_url=_plain(self.endpoint_url) or None,
            region=_plain(self.region) or "us-east-1",
            access_key_id=_plain(self.access_key_id) or None,
            secret_access_key=_plain(self.secret_access_key) or None,
        )


def bucket_from_env() -> TransitBucketResource:
    """The transit resource described by the environment (used by ``definitions.py``).

    ``GPUDOOR_TRANSIT`` ("local" default, or "s3"), ``GPUDOOR_TRANSIT_ROOT``, ``GPUDOOR_S3_BUCKET``,
    ``GPUDOOR_S3_PREFIX``, ``GPUDOOR_S3_ENDPOINT_URL``, ``GPUDOOR_S3_REGION``,
    ``GPUDOOR_S3_ACCESS_KEY_ID``, ``GPUDOOR_S3_SECRET_ACCESS_KEY``. The two credentials are bound as
    ``dg.EnvVar`` (resolved at run time, never written into run config); when they are unset the
    default AWS credential chain applies.
    """
    env = os.environ
    kind = env.get("GPUDOOR_TRANSIT", "").strip().lower() or "local"
    secrets_ = {}
    for field, var in (
        ("access_key_id", "GPUDOOR_S3_ACCESS_KEY_ID"),
        ("secret_access_key", "GPUDOOR_S3_SECRET_ACCESS_KEY"),
    ):
        if env.get(var):
            secrets_[field] = dg.EnvVar(var)
    return TransitBucketResource(
        kind=kind,
        local_root=env.get("GPUDOOR_TRANSIT_ROOT") or None,
        bucket=env.get("GPUDOOR_S3_BUCKET") or None,
        prefix=env.get("GPUDOOR_S3_PREFIX", ""),
        endpoint_url=env.get("GPUDOOR_S3_ENDPOINT_URL") or None,
        region=env.get("GPUDOOR_S3_REGION") or "us-east-1",
        **secrets_,
    )
