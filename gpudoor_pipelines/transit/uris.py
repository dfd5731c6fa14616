"""Objects of the transit bucket by URI, as jobs on the GPU nodes address them (``file:///abs/path`` or
``s3://bucket/key``), and the bucket the orchestrator's settings describe. No Dagster: GPU nodes import this.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gpudoor_pipelines.transit.bucket import (
    FileData,
    LocalTransitBucket,
    TransitBucket,
    TransitConfigError,
    _clean,
    _folder,
    gpudoor_home,
)
from gpudoor_pipelines.transit.s3 import S3TransitBucket


@functools.cache
def _bucket_for(scheme: str, name: str) -> TransitBucket:
    if scheme == "file":
        return LocalTransitBucket("/")
    # the default credential chain reads the keys from the AWS_* variables the launcher injected
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
    # a job (SkyPilot's, or the embedded launcher's) was given settings the door checked: no connection to
    # the endpoint is an outage to wait out, not a wrong setting
    job = bool(os.environ.get("SKYPILOT_TASK_ID"))
    return S3TransitBucket(name, endpoint_url=os.environ.get("AWS_ENDPOINT_URL") or None, region=region, answered=job)


def bucket_for_uri(uri: str) -> tuple[TransitBucket, str]:
    """The bucket holding ``uri`` (one per bucket and process) and the key of ``uri`` in it.

    ``file:///abs/path`` is a local folder; for ``s3://bucket/key`` the endpoint, region and credentials
    come from the AWS_* environment. Any other URI is a ValueError.
    """
    if uri.startswith("file:///"):
        return _bucket_for("file", ""), _clean(uri[len("file://") :], allow_empty=True)
    if uri.startswith("s3://") and (name := uri[5:].split("/", 1)[0]):
        return _bucket_for("s3", name), _clean(uri[5 + len(name) :], allow_empty=True)
    raise ValueError(f"unsupported URI {uri!r}: use file:///absolute/path or s3://bucket/key")


def join(uri: str, *parts: str) -> str:
    """Append path parts to a URI with exactly one slash between each."""
    return "/".join([uri.rstrip("/"), *(p.strip("/") for p in parts)])


def read_bytes(uri: str) -> bytes:
    """The bytes stored at ``uri`` (:class:`TransitObjectMissing`, a FileNotFoundError, if none)."""
    bucket, key = bucket_for_uri(uri)
    return bucket.get_bytes(key)


def write_bytes(uri: str, data: bytes) -> None:
    """Store ``data`` at ``uri``, atomically."""
    bucket, key = bucket_for_uri(uri)
    bucket.put_bytes(key, data)


def list_uris(prefix_uri: str) -> list[str]:
    """Every object under the folder ``prefix_uri``, recursively, as sorted URIs ([] if none)."""
    bucket, key = bucket_for_uri(prefix_uri)
    return [bucket.uri(k) for k in bucket.list_keys(_folder(key))]


def publish(uri: str, manifest: dict, files: Mapping[str, FileData] | None = None) -> str:
    """:meth:`TransitBucket.publish` of the folder ``uri``; returns the manifest's URI."""
    bucket, key = bucket_for_uri(uri)
    return bucket.uri(bucket.publish(key, manifest, files))


#: The transit settings and the environment variables that set them (the secrets among them are bound as
#: ``dg.EnvVar`` by the Dagster resource, read straight from the environment elsewhere).
ENV_SETTINGS = {
    "kind": "GPUDOOR_TRANSIT",
    "local_root": "GPUDOOR_TRANSIT_ROOT",
    "bucket": "GPUDOOR_S3_BUCKET",
    "prefix": "GPUDOOR_S3_PREFIX",
    "endpoint_url": "GPUDOOR_S3_ENDPOINT_URL",
    "region": "GPUDOOR_S3_REGION",
}
ENV_SECRETS = {
    "access_key_id": "GPUDOOR_S3_ACCESS_KEY_ID",
    "secret_access_key": "GPUDOOR_S3_SECRET_ACCESS_KEY",
    "aws_session_token": "GPUDOOR_S3_SESSION_TOKEN",
}


def default_local_root() -> Path:
    """``$GPUDOOR_HOME/transit`` if GPUDOOR_HOME is set, else ``~/.gpudoor/transit``."""
    return gpudoor_home() / "transit"


def settings_from_env(*, secrets: bool = True) -> dict[str, Any]:
    """The transit settings the environment describes (``secrets``: the credentials too), by field name."""
    env = os.environ
    out: dict[str, Any] = {field: env[var] for field, var in ENV_SETTINGS.items() if env.get(var)}
    out["kind"] = str(out.get("kind", "")).strip().lower() or "local"
    if secrets:
        out.update({field: env[var] for field, var in ENV_SECRETS.items() if env.get(var)})
    return out


def open_bucket(
    kind: str = "local",
    local_root: str | None = None,
    bucket: str | None = None,
    prefix: str = "",
    endpoint_url: str | None = None,
    region: str = "us-east-1",
    access_key_id: str | None = None,
    secret_access_key: str | None = None,
    aws_session_token: str | None = None,
    max_attempts: int = 5,
    verify: bool | None = None,
) -> TransitBucket:
    """The bucket these settings describe: a local folder (default ``$GPUDOOR_HOME/transit``) or S3.

    Raises:
        TransitConfigError: an unknown kind, or S3 without a bucket.
    """
    kind = str(kind or "local").strip().lower()
    if kind == "local":
        return LocalTransitBucket(Path(local_root).expanduser() if local_root else default_local_root())
    if kind != "s3":
        raise TransitConfigError(f"unknown transit kind {kind!r}: set `kind` (GPUDOOR_TRANSIT) to local/s3")
    if not bucket:
        raise TransitConfigError("transit kind is 's3' but no `bucket` (GPUDOOR_S3_BUCKET) is set")
    return S3TransitBucket(
        bucket,
        prefix or "",
        endpoint_url=endpoint_url or None,
        region=region or "us-east-1",
        access_key_id=access_key_id,
        secret_access_key=secret_access_key,
        session_token=aws_session_token,
        max_attempts=max_attempts,
        verify=verify,
    )
