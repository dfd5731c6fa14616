"""The transit bucket: the only way data crosses from one cluster to another.

Two backends share one interface:

* :class:`LocalTransitBucket` -- a folder on this machine (``file:///abs/root``). Used when jobs run
  as local processes; writes are atomic (temp file in the same folder + ``os.replace``).
* :class:`S3TransitBucket` -- any S3-compatible endpoint through boto3 (``s3://bucket/prefix``).
  Transfers go through boto3's transfer manager (multipart for big files, many concurrent
  submissions for many small files); retries with backoff are botocore's; bad settings fail once,
  at first use, with a :class:`TransitConfigError` that names the setting to fix.

Keys are relative to the bucket root, ``/``-separated, without ``.``/``..`` segments. A "prefix"
passed to :meth:`TransitBucket.upload_dir`, :meth:`~TransitBucket.download_dir`,
:meth:`~TransitBucket.delete_prefix`, :meth:`~TransitBucket.publish_manifest` and
:meth:`~TransitBucket.read_manifest` names a folder (``runs/7`` means ``runs/7/...``, never
``runs/70``); the ``prefix`` of :meth:`~TransitBucket.list_keys` is a raw string prefix, exactly
like S3's ``Prefix``.

This module has no Dagster imports at module level; the Pipes helpers import Dagster lazily.
"""

from __future__ import annotations

import abc
import concurrent.futures
import contextlib
import functools
import io
import json
import logging
import os
import random
import secrets
import shutil
import string
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from mypy_boto3_s3 import S3Client

logger = logging.getLogger(__name__)

MANIFEST_NAME = "_manifest.json"
"""File name of the manifest inside a published prefix; always written last."""

PIPES_PREFIX = "_pipes"
"""Folder (under the bucket root) holding Dagster Pipes context and message objects while a run lives."""

MiB = 1024 * 1024

_TMP_PREFIX = ".transit-tmp-"  # local temp files; never listed


# --------------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------------


class TransitError(Exception):
    """Base class of transit bucket errors."""


class TransitConfigError(TransitError):
    """The transit bucket is misconfigured (credentials, bucket name, endpoint, region, kind...).

    The message names the setting to fix. Raised once, at first use, instead of a stack of retries.
    """


class TransitObjectMissing(TransitError, FileNotFoundError):
    """A key that was asked for does not exist in the transit bucket."""

    def __init__(self, key: str, uri: str, message: str | None = None):
        self.key = key
        self.uri = uri
        super().__init__(message or f"transit object {key!r} does not exist (looked for {uri})")

    def __str__(self) -> str:  # FileNotFoundError would otherwise format errno/filename
        return str(self.args[0])

    def __reduce__(self):  # keep picklable across processes (Dagster serialises errors)
        return (type(self), (self.key, self.uri, str(self.args[0])))


# --------------------------------------------------------------------------------------------------
# Key helpers
# --------------------------------------------------------------------------------------------------


def clean_key(key: str, *, allow_empty: bool = False) -> str:
    """Normalise a key (strip surrounding slashes) and reject keys that could escape the root."""
    if not isinstance(key, str):
        raise TypeError(f"transit keys are str, got {type(key).__name__}")
    if "\x00" in key or "\\" in key:
        raise ValueError(f"invalid transit key {key!r}: NUL and backslash are not allowed")
    k = key.strip("/")
    if not k:
        if allow_empty:
            return ""
        raise ValueError("a transit key must not be empty")
    for seg in k.split("/"):
        if seg in ("", ".", ".."):
            raise ValueError(
                f"invalid transit key {key!r}: empty, '.' and '..' path segments are not allowed"
            )
    return k


def _clean_list_prefix(prefix: str) -> str:
    """A raw list prefix: leading slashes dropped, trailing slash kept (it matters)."""
    if not isinstance(prefix, str):
        raise TypeError(f"prefix must be str, got {type(prefix).__name__}")
    p = prefix.lstrip("/")
    if p:
        clean_key(p)  # validation only
    return p


def _dir_prefix(prefix: str) -> str:
    """'a/b' -> 'a/b/' ; '' -> '' (the root)."""
    p = clean_key(prefix, allow_empty=True)
    return f"{p}/" if p else ""


def join_key(*parts: str) -> str:
    """Join key parts with '/', skipping empty parts."""
    return "/".join(p.strip("/") for p in parts if p and p.strip("/"))


def escape_partition(partition: str) -> str:
    """Make a (multi-)partition key safe as a key path: no leading '/', no '.'/'..' segments."""
    segs = []
    for seg in partition.split("/"):
        if seg in ("", ".", ".."):
            seg = seg.replace(".", "%2E") or "%2F"
        segs.append(seg)
    return "/".join(segs)


def asset_object_key(
    asset_key_path: Sequence[str], partition: str | None = None, suffix: str = ".parquet"
) -> str:
    """Where the transit IO manager stores an asset value:
    ``assets/<asset key path>/<partition key or "__all__"><suffix>``."""
    if not asset_key_path:
        raise ValueError("asset_key_path must not be empty")
    part = escape_partition(partition) if partition is not None else "__all__"
    return join_key("assets", *[escape_partition(p) for p in asset_key_path], f"{part}{suffix}")


# --------------------------------------------------------------------------------------------------
# Interface
# --------------------------------------------------------------------------------------------------


class TransitBucket(abc.ABC):
    """A place both the orchestrator and the GPU jobs can read and write; see the module docstring."""

    root_uri: str
    """``file:///abs/root`` or ``s3://bucket/prefix`` (no trailing slash)."""

    # ---- addressing -----------------------------------------------------------------------------

    def uri(self, key: str) -> str:
        """Full URI of a key (or folder prefix) relative to the root; ``uri("")`` is the root."""
        k = clean_key(key, allow_empty=True)
        return f"{self.root_uri}/{k}" if k else self.root_uri

    def key_of(self, uri: str) -> str:
        """Inverse of :meth:`uri`. Raises ValueError if ``uri`` is not inside this bucket."""
        if uri == self.root_uri or uri == self.root_uri + "/":
            return ""
        if not uri.startswith(self.root_uri + "/"):
            raise ValueError(
                f"{uri!r} is outside the transit bucket {self.root_uri!r}; "
                f"transit URIs must start with {self.root_uri + '/'!r}"
            )
        return clean_key(uri[len(self.root_uri) + 1 :], allow_empty=True)

    def uri_for_asset(
        self, asset_key_path: Sequence[str], partition: str | None = None, suffix: str = ".parquet"
    ) -> str:
        """URI where the transit IO manager keeps an asset (partition) value."""
        return self.uri(asset_object_key(asset_key_path, partition, suffix))

    # ---- objects --------------------------------------------------------------------------------

    @abc.abstractmethod
    def put_bytes(self, key: str, data: bytes) -> None:
        """Write an object atomically: readers see the old object, no object, or all of ``data``."""

    @abc.abstractmethod
    def get_bytes(self, key: str) -> bytes:
        """Read an object. Missing -> :class:`TransitObjectMissing`."""

    @abc.abstractmethod
    def exists(self, key: str) -> bool:
        """Whether an object exists at exactly ``key``."""

    @abc.abstractmethod
    def upload_file(self, path: str | os.PathLike, key: str) -> None:
        """Upload one local file (multipart when big); atomic like :meth:`put_bytes`."""

    @abc.abstractmethod
    def download_file(self, key: str, path: str | os.PathLike) -> None:
        """Download one object to ``path`` (parents created; the file appears only when complete)."""

    @abc.abstractmethod
    def upload_dir(self, local_dir: str | os.PathLike, prefix: str) -> list[str]:
        """Upload every file under ``local_dir`` to ``<prefix>/<relative path>``, concurrently.

        Returns the uploaded keys, sorted."""

    @abc.abstractmethod
    def download_dir(self, prefix: str, local_dir: str | os.PathLike) -> list[str]:
        """Download every object under the folder ``prefix`` into ``local_dir``, concurrently.

        Returns the local file paths written (str), sorted by key. An empty/missing prefix gives []."""

    @abc.abstractmethod
    def list_keys(self, prefix: str = "", start_after: str | None = None) -> Iterator[str]:
        """Keys starting with the raw string ``prefix``, recursively, in lexicographic (UTF-8 byte)
        order; ``start_after`` is exclusive (S3 ``StartAfter``), so a sensor can keep the last key
        it saw as a cursor."""

    @abc.abstractmethod
    def delete_prefix(self, prefix: str) -> int:
        """Delete every object under the folder ``prefix``; returns how many were deleted."""

    @abc.abstractmethod
    def job_env(self) -> dict[str, str]:
        """Non-secret environment a job needs to reach the bucket."""

    @abc.abstractmethod
    def job_secrets(self) -> dict[str, str]:
        """Credentials a job needs to reach the bucket (pass as SkyPilot secrets so they're redacted)."""

    @abc.abstractmethod
    def pipes_context_injector(self) -> Any:
        """A Dagster Pipes context injector that goes through this bucket."""

    @abc.abstractmethod
    def pipes_message_reader(self, interval: float = 5.0) -> Any:
        """A Dagster Pipes message reader that goes through this bucket (and cleans up after itself)."""

    def check(self) -> None:
        """Make one cheap request; raise :class:`TransitConfigError` naming the setting to fix."""
        return None

    def abort_incomplete_uploads(self, prefix: str = "", older_than_s: float = 0.0) -> int:
        """Clean up what interrupted uploads left behind (invisible to readers); returns a count."""
        return 0

    def close(self) -> None:
        """Release threads/connections. The bucket stays usable (they are re-created on demand)."""
        return None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---- manifests ------------------------------------------------------------------------------

    def manifest_key(self, prefix: str) -> str:
        return f"{_dir_prefix(prefix)}{MANIFEST_NAME}"

    def publish_manifest(self, prefix: str, manifest: dict) -> str:
        """Write ``<prefix>/_manifest.json``. Call it after everything under ``prefix`` is written:
        the manifest's presence is the signal that the folder is complete. Returns its key."""
        key = self.manifest_key(prefix)
        data = json.dumps(manifest, indent=2, sort_keys=True, default=str).encode("utf-8")
        self.put_bytes(key, data)
        return key

    def read_manifest(self, prefix: str) -> dict | None:
        """The manifest of a published folder, or None if it is not (yet) published."""
        try:
            raw = self.get_bytes(self.manifest_key(prefix))
        except TransitObjectMissing:
            return None
        return json.loads(raw)

    # ---- helpers --------------------------------------------------------------------------------

    @staticmethod
    def _local_files(local_dir: str | os.PathLike) -> list[tuple[Path, str]]:
        """(absolute path, relative posix path) of every regular file under local_dir, sorted."""
        base = Path(local_dir)
        if not base.is_dir():
            raise NotADirectoryError(f"{base} is not a directory")
        out = []
        for dirpath, _dirnames, filenames in os.walk(base):
            for name in filenames:
                p = Path(dirpath) / name
                if p.is_file():
                    out.append((p, p.relative_to(base).as_posix()))
        out.sort(key=lambda t: t[1])
        return out


# --------------------------------------------------------------------------------------------------
# Local folder backend
# --------------------------------------------------------------------------------------------------


def _atomic_write(dest: Path, write: Callable[[IO[bytes]], None]) -> None:
    """Write through a temp file in the destination folder, then os.replace: all-or-nothing."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=_TMP_PREFIX, dir=dest.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.chmod(tmp, 0o644)
        os.replace(tmp, dest)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def _copy_into(src: Path) -> Callable[[IO[bytes]], None]:
    def write(f: IO[bytes]) -> None:
        with open(src, "rb") as s:
            shutil.copyfileobj(s, f, 8 * MiB)

    return write


class LocalTransitBucket(TransitBucket):
    """A folder on this machine used as the transit bucket (jobs run as local processes)."""

    def __init__(self, root: str | os.PathLike, *, max_workers: int = 16):
        self.root = Path(root).expanduser().resolve()
        self.root.mkdir(parents=True, exist_ok=True)
        self.root_uri = "file://" + self.root.as_posix()
        self.max_workers = max_workers

    def __repr__(self) -> str:
        return f"LocalTransitBucket(root_uri={self.root_uri!r})"

    def key_of(self, uri: str) -> str:
        if uri.startswith("/"):  # a plain absolute path is accepted too
            uri = "file://" + uri
        return super().key_of(uri)

    def path_of(self, key: str) -> Path:
        """Local filesystem path of a key."""
        k = clean_key(key, allow_empty=True)
        return self.root / k if k else self.root

    def put_bytes(self, key: str, data: bytes) -> None:
        _atomic_write(self.path_of(clean_key(key)), lambda f: f.write(data))

    def get_bytes(self, key: str) -> bytes:
        p = self.path_of(clean_key(key))
        try:
            return p.read_bytes()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise TransitObjectMissing(key, self.uri(key)) from None

    def exists(self, key: str) -> bool:
        return self.path_of(clean_key(key)).is_file()

    def upload_file(self, path: str | os.PathLike, key: str) -> None:
        _atomic_write(self.path_of(clean_key(key)), _copy_into(Path(path)))

    def download_file(self, key: str, path: str | os.PathLike) -> None:
        src = self.path_of(clean_key(key))
        if not src.is_file():
            raise TransitObjectMissing(key, self.uri(key))
        _atomic_write(Path(path), _copy_into(src))

    def _run_all(self, fn: Callable[[Any], Any], items: Iterable[Any]) -> None:
        items = list(items)
        if not items:
            return
        with concurrent.futures.ThreadPoolExecutor(max_workers=min(self.max_workers, len(items))) as ex:
            futures = [ex.submit(fn, it) for it in items]
            try:
                for f in futures:
                    f.result()
            except BaseException:
                for f in futures:
                    f.cancel()
                raise

    def upload_dir(self, local_dir: str | os.PathLike, prefix: str) -> list[str]:
        dp = _dir_prefix(prefix)
        files = self._local_files(local_dir)
        self._run_all(lambda t: self.upload_file(t[0], dp + t[1]), files)
        return [dp + rel for _, rel in files]

    def download_dir(self, prefix: str, local_dir: str | os.PathLike) -> list[str]:
        dp = _dir_prefix(prefix)
        dest = Path(local_dir)
        keys = list(self.list_keys(dp))
        pairs = [(k, dest / k[len(dp) :]) for k in keys]
        self._run_all(lambda t: self.download_file(t[0], t[1]), pairs)
        return [str(p) for _, p in pairs]

    def list_keys(self, prefix: str = "", start_after: str | None = None) -> Iterator[str]:
        prefix = _clean_list_prefix(prefix)
        base_rel = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        base = self.root / base_rel if base_rel else self.root
        keys: list[str] = []
        if base.is_dir():
            for dirpath, dirnames, filenames in os.walk(base):
                rel_dir = Path(dirpath).relative_to(self.root).as_posix()
                rel_dir = "" if rel_dir == "." else rel_dir + "/"
                # prune folders that cannot hold keys with this prefix
                dirnames[:] = [
                    d
                    for d in dirnames
                    if (rel_dir + d + "/").startswith(prefix) or prefix.startswith(rel_dir + d + "/")
                ]
                for name in filenames:
                    if name.startswith(_TMP_PREFIX):
                        continue
                    key = rel_dir + name
                    if key.startswith(prefix) and (start_after is None or key > start_after):
                        keys.append(key)
        keys.sort()
        yield from keys

    def delete_prefix(self, prefix: str) -> int:
        dp = _dir_prefix(prefix)
        if not dp:
            raise ValueError("refusing to delete the whole transit bucket; pass a non-empty prefix")
        n = 0
        for key in list(self.list_keys(dp)):
            with contextlib.suppress(FileNotFoundError):
                self.path_of(key).unlink()
                n += 1
        folder = self.path_of(dp)
        if folder.is_dir():  # drop the now-empty folders (and stale temp files) below the prefix
            shutil.rmtree(folder, ignore_errors=True)
        return n

    def abort_incomplete_uploads(self, prefix: str = "", older_than_s: float = 0.0) -> int:
        """Remove temp files left by killed writers."""
        n = 0
        now = time.time()
        base = self.path_of(_dir_prefix(prefix))
        if not base.is_dir():
            return 0
        for dirpath, _d, filenames in os.walk(base):
            for name in filenames:
                if name.startswith(_TMP_PREFIX):
                    p = Path(dirpath) / name
                    with contextlib.suppress(FileNotFoundError):
                        if now - p.stat().st_mtime >= older_than_s:
                            p.unlink()
                            n += 1
        return n

    def job_env(self) -> dict[str, str]:
        return {}

    def job_secrets(self) -> dict[str, str]:
        return {}

    def pipes_context_injector(self):
        import dagster as dg

        return dg.PipesTempFileContextInjector()

    def pipes_message_reader(self, interval: float = 5.0):
        """Messages through a temp file on this machine (``interval`` is for the S3 backend)."""
        import dagster as dg

        return dg.PipesTempFileMessageReader()


# --------------------------------------------------------------------------------------------------
# S3 backend
# --------------------------------------------------------------------------------------------------

# error code -> (setting, explanation)
_CONFIG_ERROR_CODES = {
    "InvalidAccessKeyId": (
        "access_key_id",
        "the S3 endpoint does not know this access key id; fix `access_key_id` "
        "(GPUDOOR_S3_ACCESS_KEY_ID, or AWS_ACCESS_KEY_ID when unset)",
    ),
    "SignatureDoesNotMatch": (
        "secret_access_key",
        "the request signature does not match: the secret key is wrong for this access key id; fix "
        "`secret_access_key` (GPUDOOR_S3_SECRET_ACCESS_KEY, or AWS_SECRET_ACCESS_KEY when unset)",
    ),
    "InvalidToken": ("session_token", "the session token is invalid; fix AWS_SESSION_TOKEN"),
    "ExpiredToken": ("session_token", "the session token has expired; refresh the credentials"),
    "TokenRefreshRequired": ("session_token", "the session token has expired; refresh the credentials"),
    "NoSuchBucket": (
        "bucket",
        "the bucket does not exist at this endpoint; fix `bucket` (GPUDOOR_S3_BUCKET) or create it",
    ),
    "AccessDenied": (
        "access_key_id",
        "access denied: these credentials may not list/read/write the bucket; grant s3:ListBucket, "
        "s3:GetObject, s3:PutObject, s3:DeleteObject and s3:AbortMultipartUpload, or fix "
        "`access_key_id`/`secret_access_key`",
    ),
    "AllAccessDisabled": ("bucket", "all access to this bucket is disabled; fix `bucket`"),
    "AuthorizationHeaderMalformed": (
        "region",
        "the endpoint expects a different region; fix `region` (GPUDOOR_S3_REGION)",
    ),
    "PermanentRedirect": (
        "region",
        "the bucket lives in another region or endpoint; fix `region` (GPUDOOR_S3_REGION) or "
        "`endpoint_url` (GPUDOOR_S3_ENDPOINT_URL)",
    ),
    "IllegalLocationConstraintException": ("region", "fix `region` (GPUDOOR_S3_REGION)"),
    "InvalidBucketName": ("bucket", "fix `bucket` (GPUDOOR_S3_BUCKET)"),
}

_RETRYABLE_READ_ERRORS: tuple[type[BaseException], ...] = ()


def _retryable_read_errors() -> tuple[type[BaseException], ...]:
    global _RETRYABLE_READ_ERRORS
    if not _RETRYABLE_READ_ERRORS:
        from botocore.exceptions import (
            ConnectionClosedError,
            IncompleteReadError,
            ReadTimeoutError,
            ResponseStreamingError,
        )

        _RETRYABLE_READ_ERRORS = (
            ConnectionClosedError,
            IncompleteReadError,
            ReadTimeoutError,
            ResponseStreamingError,
        )
    return _RETRYABLE_READ_ERRORS


_SESSION_LOCK = threading.RLock()
_SESSION = None


def _shared_boto3_session():
    """One boto3 Session per process: it caches the parsed service models, so making a client costs
    ~50 ms instead of ~500 ms (Dagster builds a fresh resource, hence bucket, for every run).
    Credentials are passed per client, so buckets with different credentials can share it."""
    global _SESSION
    with _SESSION_LOCK:
        if _SESSION is None:
            import boto3

            _SESSION = boto3.session.Session()
        return _SESSION


class _ProvideSize:
    """s3transfer subscriber that provides a known object size (saves one HEAD per download)."""

    def __init__(self, size: int):
        self.size = size

    def on_queued(self, future, **kwargs):
        future.meta.provide_transfer_size(self.size)

    def on_progress(self, future, bytes_transferred, **kwargs):
        pass

    def on_done(self, future, **kwargs):
        pass


class S3TransitBucket(TransitBucket):
    """The transit bucket on S3 or any S3-compatible endpoint (MinIO, Ceph, R2, moto...).

    Args:
        bucket: bucket name.
        prefix: key prefix inside the bucket ("" = the bucket root).
        endpoint_url: e.g. ``http://127.0.0.1:9000``; None = AWS (or ``AWS_ENDPOINT_URL``).
        region: signing region.
        access_key_id / secret_access_key / session_token: credentials; None = boto3's default
            chain (env, profile, instance role). Never logged, never in ``repr``.
        max_concurrency: concurrent part requests for one big file (and the pool size for it).
        small_file_concurrency: concurrent requests when moving many files (upload_dir/download_dir).
        multipart_threshold / multipart_chunksize: bytes; 64 MiB by default.
        max_attempts / retry_mode: botocore retries (5xx, throttling, dropped connections) with backoff.
        connect_timeout / read_timeout: seconds per attempt.
        check_on_first_use: run :meth:`check` once before the first operation, so bad settings fail
            with one clear :class:`TransitConfigError` rather than after a round of retries.
    """

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint_url: str | None = None,
        region: str = "us-east-1",
        access_key_id: str | None = None,
        secret_access_key: str | None = None,
        session_token: str | None = None,
        max_concurrency: int = 10,
        small_file_concurrency: int = 32,
        multipart_threshold: int = 64 * MiB,
        multipart_chunksize: int = 64 * MiB,
        max_attempts: int = 8,
        retry_mode: str = "standard",
        connect_timeout: float = 5.0,
        read_timeout: float = 60.0,
        check_on_first_use: bool = True,
    ):
        if not bucket or "/" in bucket:
            raise TransitConfigError(
                f"invalid S3 bucket name {bucket!r}: set `bucket` (GPUDOOR_S3_BUCKET) to a bucket name "
                "(no 's3://', no '/'; put folders in `prefix`)"
            )
        if bool(access_key_id) != bool(secret_access_key):
            missing = "secret_access_key" if access_key_id else "access_key_id"
            raise TransitConfigError(
                f"S3 credentials are half set: `{missing}` is missing "
                f"(GPUDOOR_S3_{missing.upper()}); set both `access_key_id` and `secret_access_key`, "
                "or neither to use the default AWS credential chain"
            )
        if retry_mode not in ("standard", "adaptive", "legacy"):
            raise TransitConfigError(f"retry_mode must be 'standard' or 'adaptive', got {retry_mode!r}")
        self.bucket = bucket
        self.prefix = clean_key(prefix, allow_empty=True)
        self.endpoint_url = endpoint_url.rstrip("/") if endpoint_url else None
        self.region = region or "us-east-1"
        self.root_uri = f"s3://{bucket}/{self.prefix}" if self.prefix else f"s3://{bucket}"
        self.max_concurrency = max(1, int(max_concurrency))
        self.small_file_concurrency = max(1, int(small_file_concurrency))
        self.multipart_threshold = int(multipart_threshold)
        self.multipart_chunksize = int(multipart_chunksize)
        self.max_attempts = int(max_attempts)
        self.retry_mode = retry_mode
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.check_on_first_use = check_on_first_use
        # credentials live in one private tuple; never formatted anywhere
        self.__creds = (access_key_id, secret_access_key, session_token)
        self._lock = threading.Lock()
        self._checked = False
        self._client_obj = None
        self._tm_big = None
        self._tm_many = None

    # ---- plumbing -------------------------------------------------------------------------------

    def __repr__(self) -> str:
        return (
            f"S3TransitBucket(root_uri={self.root_uri!r}, endpoint_url={self.endpoint_url!r}, "
            f"region={self.region!r})"
        )

    __str__ = __repr__

    def __getstate__(self):  # picklable/copyable: clients, managers and the lock are re-created
        state = self.__dict__.copy()
        for k in ("_lock", "_client_obj", "_tm_big", "_tm_many"):
            state[k] = None
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def _redact(self, text: str) -> str:
        for s in self.__creds:
            if s:
                text = text.replace(s, "***")
        return text

    def _full(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix and key else (self.prefix or key)

    def _rel(self, full_key: str) -> str:
        return full_key[len(self.prefix) + 1 :] if self.prefix else full_key

    def _get_session(self):
        return _shared_boto3_session()

    def _botocore_config(self, *, probe: bool = False):
        from botocore.config import Config

        kwargs: dict[str, Any] = dict(
            region_name=self.region,
            connect_timeout=self.connect_timeout if not probe else min(self.connect_timeout, 5.0),
            read_timeout=self.read_timeout if not probe else min(self.read_timeout, 10.0),
            retries={
                "mode": self.retry_mode if not probe else "standard",
                "max_attempts": self.max_attempts if not probe else 1,
            },
            max_pool_connections=self.max_concurrency + self.small_file_concurrency + 4,
            tcp_keepalive=True,
        )
        if self.endpoint_url:
            # third-party S3 implementations: path-style addressing, checksums only where required
            kwargs["s3"] = {"addressing_style": "path"}
            kwargs["request_checksum_calculation"] = "when_required"
            kwargs["response_checksum_validation"] = "when_required"
        return Config(**kwargs)

    def _make_client(self, *, probe: bool = False) -> S3Client:
        ak, sk, tok = self.__creds
        with _SESSION_LOCK:  # boto3 sessions are not thread-safe; the clients they make are
            return self._get_session().client(
                "s3",
                endpoint_url=self.endpoint_url,
                region_name=self.region,
                aws_access_key_id=ak or None,
                aws_secret_access_key=sk or None,
                aws_session_token=tok or None,
                config=self._botocore_config(probe=probe),
            )

    @property
    def client(self) -> S3Client:
        """The boto3 S3 client (retries, timeouts and pool sized for this bucket's concurrency)."""
        if self._client_obj is None:
            with self._lock:
                if self._client_obj is None:
                    self._client_obj = self._make_client()
        return self._client_obj

    def _transfer_config(self, concurrency: int):
        from boto3.s3.transfer import TransferConfig

        return TransferConfig(
            multipart_threshold=self.multipart_threshold,
            multipart_chunksize=self.multipart_chunksize,
            max_concurrency=concurrency,
            use_threads=True,
            preferred_transfer_client="classic",
        )

    def _tm(self, many: bool):
        """Shared transfer managers: one tuned for single big files, one for many small files."""
        from boto3.s3.transfer import create_transfer_manager

        client = self.client
        with self._lock:
            if many:
                if self._tm_many is None:
                    self._tm_many = create_transfer_manager(
                        client, self._transfer_config(self.small_file_concurrency)
                    )
                return self._tm_many
            if self._tm_big is None:
                self._tm_big = create_transfer_manager(client, self._transfer_config(self.max_concurrency))
            return self._tm_big

    def close(self) -> None:
        with self._lock:
            tms, self._tm_big, self._tm_many = (self._tm_big, self._tm_many), None, None
        for tm in tms:
            if tm is not None:
                tm.shutdown()

    def _config_error(self, exc: BaseException, *, during: str) -> TransitConfigError | None:
        """Translate a configuration-type failure into a TransitConfigError, or None."""
        from botocore.exceptions import (
            ClientError,
            ConnectTimeoutError,
            EndpointConnectionError,
            NoCredentialsError,
            PartialCredentialsError,
            ProxyConnectionError,
            SSLError,
        )

        where = f"{self.root_uri} at {self.endpoint_url or 'AWS S3'}"
        if isinstance(exc, ClientError):
            err = exc.response.get("Error", {})
            code = str(err.get("Code", ""))
            if code in ("403", "Forbidden"):
                code = "AccessDenied"
            if code in _CONFIG_ERROR_CODES:
                _setting, why = _CONFIG_ERROR_CODES[code]
                msg = self._redact(str(err.get("Message", "")))
                return TransitConfigError(
                    f"transit bucket {where}: {code} while {during}: {why}."
                    + (f" (server said: {msg})" if msg else "")
                )
            return None
        if isinstance(exc, (NoCredentialsError, PartialCredentialsError)):
            return TransitConfigError(
                f"transit bucket {where}: no usable S3 credentials while {during}; set "
                "`access_key_id` and `secret_access_key` (GPUDOOR_S3_ACCESS_KEY_ID / "
                "GPUDOOR_S3_SECRET_ACCESS_KEY, or the AWS_* variables)"
            )
        if isinstance(exc, SSLError):
            return TransitConfigError(
                f"transit bucket {where}: TLS handshake failed while {during} ({exc}); "
                "check `endpoint_url` (GPUDOOR_S3_ENDPOINT_URL): http vs https, certificate"
            )
        if isinstance(exc, (EndpointConnectionError, ConnectTimeoutError, ProxyConnectionError)):
            return TransitConfigError(
                f"transit bucket {where}: cannot connect to the S3 endpoint while {during} ({exc}); "
                "check `endpoint_url` (GPUDOOR_S3_ENDPOINT_URL) and that the server is up and reachable"
            )
        return None

    def _translate(self, exc: BaseException, *, during: str, key: str | None = None) -> BaseException:
        from botocore.exceptions import ClientError

        if isinstance(exc, ClientError) and key is not None:
            code = str(exc.response.get("Error", {}).get("Code", ""))
            if code in ("NoSuchKey", "404", "NotFound"):
                return TransitObjectMissing(key, self.uri(key))
        cfg = self._config_error(exc, during=during)
        if cfg is not None:
            return cfg
        return exc

    @contextlib.contextmanager
    def _errors(self, during: str, key: str | None = None):
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            yield
        except (ClientError, BotoCoreError) as e:
            new = self._translate(e, during=during, key=key)
            if new is e:
                raise
            raise new from None

    def check(self) -> None:
        """One cheap request (ListObjectsV2, MaxKeys=1, no retries, short timeouts).

        ListObjectsV2 rather than HeadBucket because a HEAD response carries no error code, and the
        code is what tells a wrong key id (InvalidAccessKeyId) from a wrong secret
        (SignatureDoesNotMatch) from a missing bucket (NoSuchBucket)."""
        from botocore.exceptions import ClientError

        probe = self._make_client(probe=True)
        try:
            with self._errors("checking the bucket"):
                try:
                    probe.list_objects_v2(Bucket=self.bucket, Prefix=_dir_prefix(self.prefix), MaxKeys=1)
                except ClientError as e:
                    status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
                    code = str(e.response.get("Error", {}).get("Code", ""))
                    if status in (301, 307, 400, 404, 405) and code not in _CONFIG_ERROR_CODES:
                        raise TransitConfigError(
                            f"transit bucket {self.root_uri} at {self.endpoint_url or 'AWS S3'}: the "
                            f"endpoint answered HTTP {status} ({code or 'no S3 error code'}) to a bucket "
                            "listing: check that `endpoint_url` (GPUDOOR_S3_ENDPOINT_URL) is the S3 API "
                            "endpoint, and `bucket` (GPUDOOR_S3_BUCKET) / `region` (GPUDOOR_S3_REGION)"
                        ) from None
                    raise
        finally:
            probe.close()
        self._checked = True

    def _ready(self) -> None:
        if self._checked or not self.check_on_first_use:
            return
        try:
            self.check()
        except TransitConfigError:
            raise
        except Exception as e:  # a transient failure: let the retrying client deal with it
            logger.debug("transit bucket first-use check inconclusive: %s", self._redact(str(e)))
            self._checked = True

    @staticmethod
    def _wait(futures: list) -> None:
        """Wait for s3transfer futures; on the first failure (or Ctrl-C) cancel the rest, let their
        cleanups (abort multipart upload, remove temp files) run, and re-raise."""
        try:
            for f in futures:
                f.result()
        except BaseException:
            for f in futures:
                f.cancel()
            for f in futures:
                with contextlib.suppress(BaseException):
                    f.result()
            raise

    # ---- objects --------------------------------------------------------------------------------

    def put_bytes(self, key: str, data: bytes) -> None:
        key = clean_key(key)
        self._ready()
        with self._errors(f"writing {self.uri(key)}"):
            if len(data) < self.multipart_threshold:
                self.client.put_object(Bucket=self.bucket, Key=self._full(key), Body=data)
            else:
                self._wait([self._tm(False).upload(io.BytesIO(data), self.bucket, self._full(key))])

    def get_bytes(self, key: str) -> bytes:
        key = clean_key(key)
        self._ready()
        attempts = 3
        for attempt in range(attempts):
            with self._errors(f"reading {self.uri(key)}", key=key):
                try:
                    resp = self.client.get_object(Bucket=self.bucket, Key=self._full(key))
                    return resp["Body"].read()
                except _retryable_read_errors():
                    if attempt == attempts - 1:
                        raise
            time.sleep(0.2 * 2**attempt)
        raise AssertionError("unreachable")

    def exists(self, key: str) -> bool:
        key = clean_key(key)
        self._ready()
        from botocore.exceptions import ClientError

        with self._errors(f"checking {self.uri(key)}"):
            try:
                self.client.head_object(Bucket=self.bucket, Key=self._full(key))
            except ClientError as e:
                if str(e.response.get("Error", {}).get("Code")) in ("404", "NoSuchKey", "NotFound"):
                    return False
                raise
        return True

    def upload_file(self, path: str | os.PathLike, key: str) -> None:
        key = clean_key(key)
        self._ready()
        with self._errors(f"uploading {path} to {self.uri(key)}"):
            self._wait([self._tm(False).upload(os.fspath(path), self.bucket, self._full(key))])

    def download_file(self, key: str, path: str | os.PathLike) -> None:
        key = clean_key(key)
        self._ready()
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        with self._errors(f"downloading {self.uri(key)}", key=key):
            self._wait([self._tm(False).download(self.bucket, self._full(key), os.fspath(path))])

    def upload_dir(self, local_dir: str | os.PathLike, prefix: str) -> list[str]:
        dp = _dir_prefix(prefix)
        files = self._local_files(local_dir)
        self._ready()
        if not files:
            return []
        tm = self._tm(True)
        with self._errors(f"uploading {local_dir} to {self.uri(dp)}"):
            futures = [tm.upload(os.fspath(p), self.bucket, self._full(dp + rel)) for p, rel in files]
            self._wait(futures)
        return [dp + rel for _, rel in files]

    def _list(self, prefix: str, start_after: str | None = None) -> Iterator[tuple[str, int]]:
        prefix = _clean_list_prefix(prefix)
        self._ready()
        kwargs: dict[str, Any] = {"Bucket": self.bucket, "Prefix": self._full_list_prefix(prefix)}
        if start_after:
            kwargs["StartAfter"] = self._full(start_after)
        paginator = self.client.get_paginator("list_objects_v2")
        with self._errors(f"listing {self.uri('')}/{prefix}"):
            for page in paginator.paginate(**kwargs):
                for obj in page.get("Contents", ()):
                    yield self._rel(obj["Key"]), int(obj.get("Size", 0))

    def _full_list_prefix(self, prefix: str) -> str:
        return f"{self.prefix}/{prefix}" if self.prefix else prefix

    def list_keys(self, prefix: str = "", start_after: str | None = None) -> Iterator[str]:
        for key, _size in self._list(prefix, start_after):
            yield key

    def download_dir(self, prefix: str, local_dir: str | os.PathLike) -> list[str]:
        dp = _dir_prefix(prefix)
        dest = Path(local_dir)
        entries = list(self._list(dp))
        if not entries:
            return []
        outs = [(k, size, dest / k[len(dp) :]) for k, size in entries]
        for d in sorted({o[2].parent for o in outs}):
            d.mkdir(parents=True, exist_ok=True)
        tm = self._tm(True)
        with self._errors(f"downloading {self.uri(dp)} to {dest}"):
            futures = [
                tm.download(self.bucket, self._full(k), os.fspath(p), subscribers=[_ProvideSize(size)])
                for k, size, p in outs
            ]
            self._wait(futures)
        return [str(p) for _, _, p in outs]

    def delete_prefix(self, prefix: str) -> int:
        dp = _dir_prefix(prefix)
        if not dp:
            raise ValueError("refusing to delete the whole transit bucket; pass a non-empty prefix")
        keys = [self._full(k) for k in self.list_keys(dp)]
        n = 0
        with self._errors(f"deleting {self.uri(dp)}"):
            for i in range(0, len(keys), 1000):
                batch = keys[i : i + 1000]
                resp = self.client.delete_objects(
                    Bucket=self.bucket, Delete={"Objects": [{"Key": k} for k in batch], "Quiet": True}
                )
                errors = resp.get("Errors", [])
                if errors:
                    raise TransitError(
                        f"could not delete {len(errors)} objects under {self.uri(dp)}: {errors[:3]}"
                    )
                n += len(batch)
        self.abort_incomplete_uploads(dp)
        return n

    def abort_incomplete_uploads(self, prefix: str = "", older_than_s: float = 0.0) -> int:
        """Abort multipart uploads under ``prefix`` started more than ``older_than_s`` ago.

        An upload killed with SIGKILL leaves its parts invisible but stored (and billed) until aborted
        (or until a bucket lifecycle rule ``AbortIncompleteMultipartUpload`` does it)."""
        import datetime as _dt

        dp = _clean_list_prefix(prefix)
        self._ready()
        now = _dt.datetime.now(_dt.UTC)
        n = 0
        paginator = self.client.get_paginator("list_multipart_uploads")
        with self._errors(f"aborting incomplete uploads under {self.uri('')}/{dp}"):
            for page in paginator.paginate(Bucket=self.bucket, Prefix=self._full_list_prefix(dp)):
                for up in page.get("Uploads", ()):
                    initiated = up.get("Initiated")
                    if initiated is not None and (now - initiated).total_seconds() < older_than_s:
                        continue
                    self.client.abort_multipart_upload(
                        Bucket=self.bucket, Key=up["Key"], UploadId=up["UploadId"]
                    )
                    n += 1
        return n

    # ---- jobs -----------------------------------------------------------------------------------

    def job_env(self) -> dict[str, str]:
        env = {"AWS_REGION": self.region, "AWS_DEFAULT_REGION": self.region}
        if self.endpoint_url:
            env["AWS_ENDPOINT_URL"] = self.endpoint_url
            # same checksum behaviour as ours for third-party S3 implementations
            env["AWS_REQUEST_CHECKSUM_CALCULATION"] = "when_required"
            env["AWS_RESPONSE_CHECKSUM_VALIDATION"] = "when_required"
        return env

    def job_secrets(self) -> dict[str, str]:
        ak, sk, tok = self.__creds
        if not ak:
            with _SESSION_LOCK:
                creds = self._get_session().get_credentials()
            if creds is None:
                return {}
            frozen = creds.get_frozen_credentials()
            ak, sk, tok = frozen.access_key, frozen.secret_key, frozen.token
        out = {"AWS_ACCESS_KEY_ID": ak, "AWS_SECRET_ACCESS_KEY": sk}
        if tok:
            out["AWS_SESSION_TOKEN"] = tok
        return {k: v for k, v in out.items() if v}

    def pipes_context_injector(self):
        """Context goes to ``<root>/_pipes/context/<random>/context.json``; deleted when the session ends."""
        cls = _s3_pipes_classes()[0]
        return cls(
            bucket=self.bucket, client=self.client, key_prefix=self._full(f"{PIPES_PREFIX}/context") + "/"
        )

    def pipes_message_reader(self, interval: float = 5.0):
        """Messages go to ``<root>/_pipes/messages/<random>/<n>.json``.

        The stock ``dagster_aws`` ``PipesS3MessageReader`` (0.29.27) never deletes the message chunks
        it reads and writes them at the bucket root; this subclass keeps them under the transit root
        and deletes them when the session closes (after the reader threads have finished)."""
        cls = _s3_pipes_classes()[1]
        return cls(
            bucket=self.bucket,
            client=self.client,
            key_prefix_root=self._full(f"{PIPES_PREFIX}/messages"),
            interval=interval,
            include_stdio_in_messages=False,
        )


@functools.cache
def _s3_pipes_classes():
    """Dagster-dependent Pipes classes, defined on first use so this module never imports Dagster."""
    from dagster_aws.pipes import PipesS3ContextInjector, PipesS3MessageReader
    from dagster_pipes import PipesBlobStoreMessageWriter

    def _rand() -> str:
        return "".join(random.choices(string.ascii_letters, k=24)) + secrets.token_hex(3)

    class TransitPipesS3ContextInjector(PipesS3ContextInjector):
        """PipesS3ContextInjector that also deletes the context object when the session fails."""

        @contextlib.contextmanager
        def inject_context(self, context):
            key = f"{self.key_prefix or ''}{_rand()}/context.json"
            self.client.put_object(Body=json.dumps(context).encode("utf-8"), Bucket=self.bucket, Key=key)
            try:
                yield {"bucket": self.bucket, "key": key}
            finally:
                try:
                    self.client.delete_object(Bucket=self.bucket, Key=key)
                except Exception as e:  # never mask the run's own outcome
                    logger.warning("could not delete pipes context s3://%s/%s: %s", self.bucket, key, e)

    class TransitPipesS3MessageReader(PipesS3MessageReader):
        """PipesS3MessageReader under the transit root that removes its message objects afterwards."""

        def __init__(self, *, key_prefix_root: str, **kwargs):
            super().__init__(**kwargs)
            self.key_prefix_root = key_prefix_root.strip("/")

        @contextlib.contextmanager
        def get_params(self):
            key_prefix = f"{self.key_prefix_root}/{_rand()}"
            try:
                yield {
                    "bucket": self.bucket,
                    "key_prefix": key_prefix,
                    PipesBlobStoreMessageWriter.INCLUDE_STDIO_IN_MESSAGES_KEY: self.include_stdio_in_messages,
                }
            finally:
                # read_messages() joins its reader threads before leaving this context
                try:
                    _delete_all(self.client, self.bucket, key_prefix + "/")
                except Exception as e:
                    logger.warning(
                        "could not delete pipes messages under s3://%s/%s/: %s", self.bucket, key_prefix, e
                    )

    return TransitPipesS3ContextInjector, TransitPipesS3MessageReader


def _delete_all(client, bucket: str, prefix: str) -> int:
    n = 0
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        objs = [{"Key": o["Key"]} for o in page.get("Contents", ())]
        if objs:
            client.delete_objects(Bucket=bucket, Delete={"Objects": objs, "Quiet": True})
            n += len(objs)
    return n
