"""The Dagster resource that hands out the transit bucket; ``bucket_from_env()`` binds it to ``GPUDOOR_*``."""

from __future__ import annotations

import os
from pathlib import Path

import dagster as dg
from pydantic import Field, PrivateAttr

from .bucket import LocalTransitBucket, S3TransitBucket, TransitBucket, TransitConfigError

_SECRETS = {
    "access_key_id": "GPUDOOR_S3_ACCESS_KEY_ID",
    "secret_access_key": "GPUDOOR_S3_SECRET_ACCESS_KEY",
    "aws_session_token": "GPUDOOR_S3_SESSION_TOKEN",
}


def default_local_root() -> Path:
    """``$GPUDOOR_HOME/transit`` if GPUDOOR_HOME is set, else ``~/.gpudoor/transit``."""
    home = os.environ.get("GPUDOOR_HOME")
    return (Path(home).expanduser() if home else Path.home() / ".gpudoor") / "transit"


def _plain(value: object) -> object:
    """A field's value, which is still a ``dg.EnvVar`` when the resource is used outside a run."""
    return value.get_value() if isinstance(value, dg.EnvVar) else value


class TransitBucketResource(dg.ConfigurableResource):
    """The transit bucket: where data crosses between the orchestrator and the GPU clusters.

    ``kind="local"``: a folder on this machine (default: ``$GPUDOOR_HOME/transit`` or ``~/.gpudoor/transit``)
    for jobs run as local processes. ``kind="s3"``: an S3 bucket or any S3-compatible endpoint, with client
    settings named as ``dagster_aws.s3.S3Resource`` names them (``aws_session_token``, ``max_attempts``,
    ``verify``). Secrets bound with ``dg.EnvVar`` (as ``bucket_from_env()`` does) resolve at run time and
    are never in run config nor in ``repr``.
    """

    kind: str = Field(default="local", description='"local" or "s3". Env: GPUDOOR_TRANSIT.')
    local_root: str | None = Field(default=None, description="local: the folder. Env: GPUDOOR_TRANSIT_ROOT.")
    bucket: str | None = Field(default=None, description="s3: bucket name, bare. Env: GPUDOOR_S3_BUCKET.")
    prefix: str = Field(default="", description="s3: key prefix in the bucket. Env: GPUDOOR_S3_PREFIX.")
    endpoint_url: str | None = Field(default=None, description="s3: None = AWS. Env: GPUDOOR_S3_ENDPOINT_URL")
    region: str = Field(default="us-east-1", description="s3: signing region. Env: GPUDOOR_S3_REGION.")
    access_key_id: str | None = Field(default=None, repr=False, description="s3: None = AWS default chain.")
    secret_access_key: str | None = Field(default=None, repr=False, description="s3: secret access key.")
    aws_session_token: str | None = Field(default=None, repr=False, description="s3: for temporary keys.")
    max_attempts: int = Field(default=5, description="s3: attempts per request, the first one included.")
    verify: bool | None = Field(default=None, description="s3: TLS certificate check; unset = on.")

    _bucket: TransitBucket | None = PrivateAttr(default=None)

    def get_bucket(self) -> TransitBucket:
        """The bucket these settings describe (one per resource instance)."""
        if self._bucket is None:
            self._bucket = self._build()
        return self._bucket

    def _build(self) -> TransitBucket:
        kind, bucket = str(_plain(self.kind) or "local").strip().lower(), _plain(self.bucket)
        if kind == "local":
            root = _plain(self.local_root)
            return LocalTransitBucket(Path(root).expanduser() if root else default_local_root())
        if kind != "s3":
            raise TransitConfigError(
                f"unknown transit kind {kind!r}: set `kind` (GPUDOOR_TRANSIT) to local/s3"
            )
        if not bucket:
            raise TransitConfigError("transit kind is 's3' but no `bucket` (GPUDOOR_S3_BUCKET) is set")
        return S3TransitBucket(
            bucket,
            _plain(self.prefix) or "",
            endpoint_url=_plain(self.endpoint_url) or None,
            region=_plain(self.region) or "us-east-1",
            access_key_id=_plain(self.access_key_id),
            secret_access_key=_plain(self.secret_access_key),
            session_token=_plain(self.aws_session_token),
            max_attempts=_plain(self.max_attempts),
            verify=_plain(self.verify),
        )


def bucket_from_env() -> TransitBucketResource:
    """The transit resource the environment describes (``definitions.py`` binds it).

    ``GPUDOOR_TRANSIT`` ("local", the default, or "s3"), ``GPUDOOR_TRANSIT_ROOT``, ``GPUDOOR_S3_BUCKET``,
    ``GPUDOOR_S3_PREFIX``, ``GPUDOOR_S3_ENDPOINT_URL``, ``GPUDOOR_S3_REGION``; the secrets
    ``GPUDOOR_S3_ACCESS_KEY_ID``, ``GPUDOOR_S3_SECRET_ACCESS_KEY`` and ``GPUDOOR_S3_SESSION_TOKEN`` are bound
    as ``dg.EnvVar`` (resolved at run time); unset, the default AWS credential chain applies.
    """
    env = os.environ
    return TransitBucketResource(
        kind=env.get("GPUDOOR_TRANSIT", "").strip().lower() or "local",
        local_root=env.get("GPUDOOR_TRANSIT_ROOT") or None,
        bucket=env.get("GPUDOOR_S3_BUCKET") or None,
        prefix=env.get("GPUDOOR_S3_PREFIX", ""),
        endpoint_url=env.get("GPUDOOR_S3_ENDPOINT_URL") or None,
        region=env.get("GPUDOOR_S3_REGION") or "us-east-1",
        **{field: dg.EnvVar(var) for field, var in _SECRETS.items() if env.get(var)},
    )
