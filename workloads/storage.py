"""Byte-level access to ``file://`` and ``s3://`` URIs, the only addresses workloads use.

A ``file:///abs/dir`` URI is a local folder standing in for a bucket (the transit bucket of local
runs); ``s3://bucket/key`` goes through ``boto3.client("s3")``, which reads its endpoint and
credentials from the environment by itself. Prefixes are treated as folders on both.

A *manifest* is a JSON object at ``<prefix>/_manifest.json``, written last, so a reader that sees
the manifest sees a complete set of files.
"""

from __future__ import annotations

import functools
import os
import tempfile
import threading
from typing import Any
from urllib.parse import unquote, urlparse

MANIFEST_NAME = "_manifest.json"


def _parse(uri: str) -> tuple[str, str, str]:
    """Split a URI into (scheme, bucket, key); for file:// the key is the absolute local path."""
    parsed = urlparse(uri)
    if parsed.scheme == "file":
        if parsed.netloc not in ("", "localhost"):
            raise ValueError(f"file URIs must be file:///absolute/path, got {uri!r}")
        return "file", "", unquote(parsed.path)
    if parsed.scheme == "s3":
        if not parsed.netloc:
            raise ValueError(f"s3 URI has no bucket: {uri!r}")
        return "s3", parsed.netloc, parsed.path.lstrip("/")
    raise ValueError(f"unsupported URI {uri!r}: use file:///abs/path or s3://bucket/key")


_CLIENT_LOCK = threading.Lock()


@functools.cache
def _s3() -> Any:
    # One client per process: creating one costs far more than a small object read. Clients are
    # thread-safe but boto3's default session, which creates them, is not: hence the lock.
    import boto3  # imported here so file:// users do not need boto3

    with _CLIENT_LOCK:
        return boto3.client("s3")


def _is_missing(exc: Exception) -> bool:
    code = str(getattr(exc, "response", {}).get("Error", {}).get("Code", ""))
    return code in {"404", "NoSuchKey", "NotFound"}


def join(uri: str, *parts: str) -> str:
    """Append path parts to a URI with exactly one slash between each."""
    out = uri.rstrip("/")
    for part in parts:
        out += "/" + part.strip("/")
    return out


def read_bytes(uri: str) -> bytes:
    """Return the object's bytes.

    Raises:
        FileNotFoundError: nothing is stored at ``uri``.
    """
    scheme, bucket, key = _parse(uri)
    if scheme == "file":
        with open(key, "rb") as f:
            return f.read()
    try:
        return _s3().get_object(Bucket=bucket, Key=key)["Body"].read()
    except Exception as exc:
        if _is_missing(exc):
            raise FileNotFoundError(uri) from exc
        raise


def write_bytes(uri: str, data: bytes) -> None:
    """Store ``data`` at ``uri``; readers see either the old object or the whole new one."""
    scheme, bucket, key = _parse(uri)
    if scheme == "s3":
        _s3().put_object(Bucket=bucket, Key=key, Body=data)  # an S3 put is atomic already
        return
    folder = os.path.dirname(key)
    os.makedirs(folder, exist_ok=True)
    # Temp file in the same folder, then rename: a killed writer never leaves a half file behind.
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix="-" + os.path.basename(key))
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, key)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def exists(uri: str) -> bool:
    """Whether an object (or, for file://, any path) is stored at ``uri``."""
    scheme, bucket, key = _parse(uri)
    if scheme == "file":
        return os.path.exists(key)
    try:
        _s3().head_object(Bucket=bucket, Key=key)
        return True
    except Exception as exc:
        if _is_missing(exc):
            return False
        raise


def list_uris(prefix_uri: str) -> list[str]:
    """Every object under the folder ``prefix_uri``, recursively, as full sorted URIs.

    Temp files of in-flight local writes are left out; a missing prefix lists as empty.
    """
    scheme, bucket, key = _parse(prefix_uri)
    if scheme == "file":
        found = []
        for folder, _dirs, files in os.walk(key):
            found += [
                "file://" + os.path.join(folder, name) for name in files if not name.startswith(".tmp-")
            ]
        return sorted(found)
    folder = key.rstrip("/") + "/" if key.strip("/") else ""
    found = []
    for page in _s3().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=folder):
        found += [f"s3://{bucket}/{obj['Key']}" for obj in page.get("Contents", [])]
    return sorted(found)
