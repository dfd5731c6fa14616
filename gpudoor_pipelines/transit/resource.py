"""The Dagster resource that hands out the transit bucket; ``bucket_from_env()`` binds it to ``GPUDOOR_*``."""

from __future__ import annotations

import os

import dagster as dg
from pydantic import Field, PrivateAttr

from gpudoor_pipelines.transit.bucket import TransitBucket
from gpudoor_pipelines.transit.uris import ENV_SECRETS, open_bucket, settings_from_env


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
        names = (
            "kind",
            "local_root",
            "bucket",
            "prefix",
            "endpoint_url",
            "region",
            "access_key_id",
            "secret_access_key",
            "aws_session_token",
            "max_attempts",
            "verify",
        )
        return open_bucket(**{name: _plain(getattr(self, name)) for name in names})


def bucket_from_env() -> TransitBucketResource:
    """The transit resource the environment describes (``definitions.py`` binds it).

    ``GPUDOOR_TRANSIT`` ("local", the default, or "s3"), ``GPUDOOR_TRANSIT_ROOT``, ``GPUDOOR_S3_BUCKET``,
    ``GPUDOOR_S3_PREFIX``, ``GPUDOOR_S3_ENDPOINT_URL``, ``GPUDOOR_S3_REGION``; the secrets
    ``GPUDOOR_S3_ACCESS_KEY_ID``, ``GPUDOOR_S3_SECRET_ACCESS_KEY`` and ``GPUDOOR_S3_SESSION_TOKEN`` are bound
    as ``dg.EnvVar`` (resolved at run time); unset, the default AWS credential chain applies.
    """
    env = os.environ
    return TransitBucketResource(
        **settings_from_env(secrets=False),
        **{field: dg.EnvVar(var) for field, var in ENV_SECRETS.items() if env.get(var)},
    )
