"""The transit bucket, the one storage layer of the orchestrator and of the jobs on the GPU nodes.

A :class:`LocalTransitBucket` (``file:///abs/root``) or an :class:`S3TransitBucket` (``s3://bucket/prefix``:
boto3's transfer manager, botocore's retries). Keys are ``/``-separated and relative to the root. A folder is
complete once :meth:`TransitBucket.publish` has written its ``_manifest.json``, always last. Jobs address
objects by URI (:func:`bucket_for_uri` and the functions after it). No Dagster: GPU nodes import this.
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
import shutil
import tempfile
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

MANIFEST_NAME = "_manifest.json"
"""File name of the manifest of a published folder; written last, so its presence means complete."""
TMP_PREFIX = ".tmp-"
"""Name prefix of local temp files (a write in flight, or killed midway); never listed."""
MiB = 1024 * 1024
FileData = bytes | str | os.PathLike
"""What :meth:`TransitBucket.publish` stores per file: the bytes, or the path of a local file."""


class TransitError(Exception):
    """Base class of transit bucket errors."""


class TransitConfigError(TransitError):
    """The bucket is misconfigured (credentials, bucket, endpoint...); the message names the setting."""


class TransitObjectMissing(TransitError, FileNotFoundError):
    """No object at ``key`` (full address: ``uri``)."""

    def __init__(self, key: str, uri: str, message: str | None = None):
        self.key, self.uri = key, uri
        super().__init__(message or f"transit object {key!r} does not exist (looked for {uri})")


def _clean(key: str, *, allow_empty: bool = False) -> str:
    """Strip surrounding slashes; reject keys that could leave the root or that S3 would mangle."""
    k = key.strip("/")
    if "\x00" in k or "\\" in k or (not k and not allow_empty) or (k and {"", ".", ".."} & set(k.split("/"))):
        raise ValueError(f"invalid transit key {key!r}: no empty, '.' or '..' segments, no NUL or backslash")
    return k


def _folder(prefix: str) -> str:
    """``'a/b'`` -> ``'a/b/'``, so that ``runs/7`` never matches ``runs/70``; ``''`` stays ``''``."""
    return _clean(prefix, allow_empty=True) + "/" if prefix.strip("/") else ""


class TransitBucket(abc.ABC):
    """A place both the orchestrator and the jobs read and write; see the module docstring."""

    root_uri: str
    """``file:///abs/root`` or ``s3://bucket/prefix``, without a trailing slash."""

    def uri(self, key: str) -> str:
        """Full URI of ``key``; ``uri("")`` is the root."""
        k = _clean(key, allow_empty=True)
        return f"{self.root_uri}/{k}" if k else self.root_uri

    def key_of(self, uri: str) -> str:
        """Inverse of :meth:`uri`; a ValueError if ``uri`` is outside this bucket."""
        if uri.rstrip("/") == self.root_uri:
            return ""
        if not uri.startswith(self.root_uri + "/"):
            raise ValueError(f"{uri!r} is outside the transit bucket {self.root_uri!r}")
        return _clean(uri[len(self.root_uri) + 1 :], allow_empty=True)

    def put_bytes(self, key: str, data: bytes) -> None:
        """Write an object atomically: readers see the old object, none, or all of ``data``."""
        self._put_many({_clean(key): data})

    @abc.abstractmethod
    def get_bytes(self, key: str) -> bytes:
        """Read an object (:class:`TransitObjectMissing` when there is none)."""

    @abc.abstractmethod
    def exists(self, key: str) -> bool:
        """Whether an object exists at exactly ``key``."""

    @abc.abstractmethod
    def list_keys(self, prefix: str = "", start_after: str | None = None) -> Iterator[str]:
        """Keys starting with the raw string ``prefix``, recursively, in UTF-8 byte order; ``start_after``
        is exclusive, like S3's ``StartAfter``, so a sensor can keep the last key it saw as its cursor."""

    @abc.abstractmethod
    def list_sized(self, prefix: str = "", start_after: str | None = None) -> Iterator[tuple[str, int]]:
        """(key, size in bytes) of the keys :meth:`list_keys` lists, in the same order: the sizes come
        with the listing (S3's ``Size``), so telling empty objects apart costs no request per object."""

    @abc.abstractmethod
    def _put_many(self, items: Mapping[str, FileData]) -> None:
        """Store every (key, bytes or local path) at once, each atomically; raise on the first failure."""

    def publish(self, prefix: str, manifest: dict, files: Mapping[str, FileData] | None = None) -> str:
        """Upload ``files`` (relative name -> bytes or local path) concurrently, then write
        ``<prefix>/_manifest.json`` last: a reader that sees the manifest sees every file, and a writer that
        fails or is killed leaves no manifest and no partial object. Returns the manifest's key."""
        folder = _folder(prefix)
        items = {folder + _clean(rel): data for rel, data in (files or {}).items()}
        if folder + MANIFEST_NAME in items:
            raise ValueError(f"{MANIFEST_NAME} is written by publish() itself; pass it as `manifest`")
        if items:
            self._put_many(items)
        self.put_bytes(folder + MANIFEST_NAME, json.dumps(manifest, indent=1, default=str).encode())
        return folder + MANIFEST_NAME

    def read_manifest(self, prefix: str) -> dict | None:
        """The manifest of a published folder, or None while it is not published."""
        try:
            return json.loads(self.get_bytes(_folder(prefix) + MANIFEST_NAME))
        except TransitObjectMissing:
            return None

    def job_env(self) -> dict[str, str]:
        """Non-secret environment a job needs to reach the bucket."""
        return {}

    def job_secrets(self) -> dict[str, str]:
        """Credentials a job needs (pass them as SkyPilot secrets, so they are redacted)."""
        return {}

    def check(self) -> None:  # noqa: B027 (nothing to check on a folder)
        """Make one cheap request; raise :class:`TransitConfigError` naming the setting to fix."""

    def close(self) -> None:  # noqa: B027
        """Release threads and connections; the bucket stays usable (they come back on demand)."""


def _atomic_write(dest: Path, data: FileData) -> None:
    """Write through a temp file in the destination folder, then rename: all or nothing."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=TMP_PREFIX, dir=dest.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            if isinstance(data, bytes):
                f.write(data)
            else:
                with open(data, "rb") as src:
                    shutil.copyfileobj(src, f, 8 * MiB)
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide the object from the folder's other users
        os.replace(tmp, dest)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


class LocalTransitBucket(TransitBucket):
    """The folder ``root`` (created if missing) as the transit bucket, for jobs run as local processes."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root).expanduser().resolve()
        self.root.mkdir(parents=True, exist_ok=True)
        self.root_uri = "file://" + self.root.as_posix().rstrip("/")

    def path_of(self, key: str) -> Path:
        """Local path of a key."""
        return self.root / _clean(key, allow_empty=True)

    def get_bytes(self, key: str) -> bytes:
        try:
            return self.path_of(_clean(key)).read_bytes()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise TransitObjectMissing(key, self.uri(key)) from None

    def exists(self, key: str) -> bool:
        return self.path_of(_clean(key)).is_file()

    def _put_many(self, items: Mapping[str, FileData]) -> None:
        with concurrent.futures.ThreadPoolExecutor(min(16, len(items))) as pool:
            list(pool.map(lambda item: _atomic_write(self.path_of(item[0]), item[1]), items.items()))

    def _listed(self, prefix: str, start_after: str | None) -> Iterator[str]:
        """Keys starting with ``prefix`` and greater than ``start_after``, sorted, lazily: from the folder
        named by ``prefix`` up to its last '/', one scandir per folder that can hold such a key."""
        prefix = prefix.lstrip("/")
        base = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        # str order is code point order, which is UTF-8 byte order, S3's
        yield from self._walk(self.path_of(base), _folder(base), prefix, start_after or "")

    def _walk(self, folder: Path, rel: str, prefix: str, after: str) -> Iterator[str]:
        """The keys of :meth:`_listed` under ``folder`` (whose keys start with ``rel``). Entries sort by
        what they put before the rest of their keys (``name/`` for a folder, ``name`` for a file), so
        the keys of one entry all sort before those of the next; entries whose keys all are at or
        before ``after``, or none of which can start with ``prefix``, are skipped unopened."""
        entries: list[tuple[str, str, bool]] = []  # (head of its keys, name, is a folder)
        try:
            with os.scandir(folder) as it:  # read whole, then closed: no folder held open while yielding
                for entry in it:
                    try:
                        is_dir = entry.is_dir()
                    except OSError:
                        is_dir = False
                    if is_dir and entry.is_symlink():  # os.walk's default: neither listed nor followed
                        continue
                    if is_dir or not entry.name.startswith(TMP_PREFIX):
                        entries.append((rel + entry.name + ("/" if is_dir else ""), entry.name, is_dir))
        except OSError:  # gone, unreadable or not a folder: no keys, as with os.walk
            return
        entries.sort()
        for head, name, is_dir in entries:
            if not is_dir:
                if head > after and head.startswith(prefix):
                    yield head
            elif (head > after or after.startswith(head)) and (
                head.startswith(prefix) or prefix.startswith(head)
            ):
                yield from self._walk(folder / name, head, prefix, after)

    def list_keys(self, prefix: str = "", start_after: str | None = None) -> Iterator[str]:
        yield from self._listed(prefix, start_after)  # no stat per file: listings of many keys stay cheap

    def list_sized(self, prefix: str = "", start_after: str | None = None) -> Iterator[tuple[str, int]]:
        for key in self._listed(prefix, start_after):
            try:
                size = os.stat(self.root / key).st_size
            except OSError:  # deleted since the walk, or a dangling link: listed, like list_keys does
                size = 0
            yield key, size


_KEYS = "`access_key_id`/`secret_access_key` (GPUDOOR_S3_ACCESS_KEY_ID/GPUDOOR_S3_SECRET_ACCESS_KEY)"
_ENDPOINT = "`endpoint_url` (GPUDOOR_S3_ENDPOINT_URL: http or https?) and that the server is up"
# S3 error code or botocore exception -> the setting to fix; any other error is not a configuration one
_FIX = {
    **dict.fromkeys(["InvalidAccessKeyId", "AccessDenied", "403", "Forbidden", "NoCredentialsError"], _KEYS),
    "PartialCredentialsError": _KEYS,
    "SignatureDoesNotMatch": "`secret_access_key` (GPUDOOR_S3_SECRET_ACCESS_KEY): wrong for this key id",
    **dict.fromkeys(["InvalidToken", "ExpiredToken"], "`aws_session_token` (GPUDOOR_S3_SESSION_TOKEN)"),
    **dict.fromkeys(["NoSuchBucket", "InvalidBucketName"], "`bucket` (GPUDOOR_S3_BUCKET)"),
    **dict.fromkeys(["AuthorizationHeaderMalformed", "PermanentRedirect"], "`region` (GPUDOOR_S3_REGION)"),
    **dict.fromkeys(["EndpointConnectionError", "ConnectTimeoutError", "SSLError"], _ENDPOINT),
}
_MISSING = ("404", "NoSuchKey", "NotFound")
_CRED_ARGS = ("aws_access_key_id", "aws_secret_access_key", "aws_session_token")
_CHECKSUMS = dict.fromkeys(["request_checksum_calculation", "response_checksum_validation"], "when_required")
# S3-compatible servers: path-style addressing, and checksums only where the API requires them
_THIRD_PARTY = {"s3": {"addressing_style": "path"}, **_CHECKSUMS}
_LOCK = threading.RLock()  # boto3 sessions are not thread-safe (the clients they make are)


@functools.cache
def _session() -> Any:  # one per process: it caches service models, so a client costs 50 ms, not 500
    import boto3

    return boto3.session.Session()


class S3TransitBucket(TransitBucket):
    """The transit bucket on S3 or an S3-compatible endpoint (MinIO, Ceph, R2, moto...).

    Args:
        bucket, prefix: where the root is (prefix "" = the bucket's root).
        endpoint_url, region: None = AWS; the signing region.
        access_key_id, secret_access_key, session_token: None = boto3's default chain (AWS_* variables,
            AWS_PROFILE, instance role). Never logged, never in ``repr``.
        verify: TLS certificate check (None = on; a CA bundle: AWS_CA_BUNDLE).
        max_concurrency, multipart_threshold, multipart_chunksize: requests in flight; bytes.
        max_attempts: botocore's attempts per request (the first counts), with backoff.
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
        verify: bool | None = None,
        max_concurrency: int = 10,
        multipart_threshold: int = 64 * MiB,
        multipart_chunksize: int = 64 * MiB,
        max_attempts: int = 5,
    ):
        if not bucket or "/" in bucket:
            raise TransitConfigError(f"`bucket` (GPUDOOR_S3_BUCKET) must be a bare bucket name: {bucket!r}")
        if bool(access_key_id) != bool(secret_access_key):
            missing = "secret_access_key" if access_key_id else "access_key_id"
            raise TransitConfigError(f"S3 keys half set: set `{missing}` (GPUDOOR_S3_{missing.upper()}) too")
        self.bucket, self.region = bucket, region or "us-east-1"
        self.prefix = _clean(prefix, allow_empty=True)
        self.endpoint_url = endpoint_url.rstrip("/") if endpoint_url else None
        self.root_uri = f"s3://{bucket}/{self.prefix}".rstrip("/")
        self.verify, self.max_attempts, self.max_concurrency = verify, max_attempts, max_concurrency
        self.threshold, self.chunksize = multipart_threshold, multipart_chunksize
        creds = (access_key_id, secret_access_key, session_token)
        self.__creds = {name: v or None for name, v in zip(_CRED_ARGS, creds, strict=True)}  # shown nowhere
        self._checked, self._client, self._tm = False, None, None

    def __getstate__(self) -> dict:  # copyable and picklable: client and transfer manager are made anew
        return {**self.__dict__, "_client": None, "_tm": None}

    def _full(self, key: str) -> str:
        return _folder(self.prefix) + key

    def _make_client(self, *, probe: bool = False) -> Any:
        from botocore.config import Config

        config = Config(
            region_name=self.region,
            # the probe answers once and fast: a round of retries is what a bad setting must not cost
            retries={"mode": "standard", "max_attempts": 1 if probe else self.max_attempts},
            connect_timeout=5 if probe else 60,
            read_timeout=10 if probe else 60,
            max_pool_connections=self.max_concurrency + 4,
            tcp_keepalive=True,
            **(_THIRD_PARTY if self.endpoint_url else {}),
        )
        with _LOCK:
            return _session().client(
                "s3", endpoint_url=self.endpoint_url, verify=self.verify, config=config, **self.__creds
            )

    def _connect(self) -> tuple[Any, Any]:
        """The client and its transfer manager (multipart for big objects, many small ones at once),
        made on first use, when the settings are also checked once: bad ones fail fast and clearly."""
        from boto3.s3.transfer import TransferConfig, create_transfer_manager

        if not self._checked:
            try:
                self.check()
            except TransitConfigError:
                raise
            except Exception as e:  # a transient failure is left to the retrying client
                logger.debug("transit bucket check inconclusive: %s", self._redact(str(e)))
                self._checked = True
        with _LOCK:
            if self._tm is None:
                self._client = self._client or self._make_client()
                config = TransferConfig(
                    multipart_threshold=self.threshold,
                    multipart_chunksize=self.chunksize,
                    max_concurrency=self.max_concurrency,
                    preferred_transfer_client="classic",
                )
                self._tm = create_transfer_manager(self._client, config)
            return self._client, self._tm

    @property
    def client(self) -> Any:
        """The boto3 S3 client (retries and connection pool sized for this bucket)."""
        return self._connect()[0]

    def close(self) -> None:
        with _LOCK:
            tm, self._tm = self._tm, None
        if tm is not None:
            tm.shutdown()

    def _redact(self, text: str) -> str:
        for secret in self.__creds.values():
            text = text.replace(secret, "***") if secret else text
        return text

    @contextlib.contextmanager
    def _errors(self, during: str, key: str | None = None) -> Iterator[None]:
        """A missing ``key`` -> TransitObjectMissing; a bad setting -> one TransitConfigError naming it."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            yield
        except (ClientError, BotoCoreError) as e:
            err = e.response.get("Error", {}) if isinstance(e, ClientError) else {}
            code = str(err.get("Code") or type(e).__name__)
            if key is not None and code in _MISSING:
                raise TransitObjectMissing(key, self.uri(key)) from None
            if code not in _FIX:
                raise
            raise TransitConfigError(
                f"transit bucket {self.root_uri} at {self.endpoint_url or 'AWS S3'}: {code} while {during}; "
                f"check {_FIX[code]} ({self._redact(str(err.get('Message') or e))})"
            ) from None

    def check(self) -> None:
        """One ListObjectsV2 without retries (not HeadBucket: its answer has no error code, and the code
        tells a wrong key id from a wrong secret from a missing bucket)."""
        from botocore.exceptions import ClientError

        probe = self._make_client(probe=True)
        try:
            with self._errors("checking the bucket"):
                probe.list_objects_v2(Bucket=self.bucket, Prefix=self._full(""), MaxKeys=1)
        except ClientError as e:  # no S3 error code we know: is it an S3 API at all?
            status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if status not in (301, 307, 400, 404, 405):
                raise
            raise TransitConfigError(
                f"transit bucket {self.root_uri}: {self.endpoint_url or 'AWS S3'} answered HTTP {status} "
                "to a bucket listing: check that `endpoint_url` (GPUDOOR_S3_ENDPOINT_URL) is an S3 API"
            ) from None
        finally:
            probe.close()
        self._checked = True

    def _put_many(self, items: Mapping[str, FileData]) -> None:
        tm = self._connect()[1]
        with self._errors(f"writing {self.uri(next(iter(items)))}"):
            sources = {k: io.BytesIO(d) if isinstance(d, bytes) else os.fspath(d) for k, d in items.items()}
            futures = [tm.upload(source, self.bucket, self._full(k)) for k, source in sources.items()]
            try:
                for f in futures:
                    f.result()
            except BaseException:  # a failure or Ctrl-C: cancelling aborts the others' multipart uploads
                for f in futures:
                    f.cancel()
                raise

    def get_bytes(self, key: str) -> bytes:
        from botocore.exceptions import ClientError

        client, key = self._connect()[0], _clean(key)

        def part(start: int) -> tuple[bytes, int]:  # one ranged GET: its bytes, and the object's size
            span = f"bytes={start}-{start + self.chunksize - 1}"
            resp = client.get_object(Bucket=self.bucket, Key=self._full(key), Range=span)
            return resp["Body"].read(), int(resp.get("ContentRange", "/0").rpartition("/")[2])

        with self._errors(f"reading {self.uri(key)}", key):
            try:  # no HEAD: the first part tells the size, and holds all of a small object
                first, size = part(0)
            except ClientError as e:
                if e.response["Error"]["Code"] != "InvalidRange":  # what an empty object answers
                    raise
                return b""
            with concurrent.futures.ThreadPoolExecutor(
                self.max_concurrency
            ) as pool:  # a big one: in parallel
                rest = pool.map(lambda start: part(start)[0], range(len(first), size, self.chunksize))
                return b"".join([first, *rest])

    def exists(self, key: str) -> bool:
        try:
            with self._errors(f"checking {self.uri(key)}", key := _clean(key)):
                self._connect()[0].head_object(Bucket=self.bucket, Key=self._full(key))
        except TransitObjectMissing:
            return False
        return True

    def list_keys(self, prefix: str = "", start_after: str | None = None) -> Iterator[str]:
        yield from (key for key, _ in self.list_sized(prefix, start_after))

    def list_sized(self, prefix: str = "", start_after: str | None = None) -> Iterator[tuple[str, int]]:
        _clean(prefix := prefix.lstrip("/"), allow_empty=True)
        kwargs = {"Bucket": self.bucket, "Prefix": self._full(prefix)}
        if start_after:
            kwargs["StartAfter"] = self._full(start_after)
        with self._errors(f"listing {self.uri('')}/{prefix}"):
            root = len(self._full(""))
            for page in self._connect()[0].get_paginator("list_objects_v2").paginate(**kwargs):
                yield from ((obj["Key"][root:], obj["Size"]) for obj in page.get("Contents", ()))

    def job_env(self) -> dict[str, str]:
        env = {"AWS_REGION": self.region, "AWS_DEFAULT_REGION": self.region}
        if self.endpoint_url:  # and the checksum behaviour of our client for third-party servers
            env["AWS_ENDPOINT_URL"] = self.endpoint_url
            env.update({f"AWS_{name.upper()}": value for name, value in _CHECKSUMS.items()})
        return env

    def job_secrets(self) -> dict[str, str]:
        creds: Any = tuple(self.__creds.values())
        if not creds[0]:  # the default chain's (profile, instance role...), which a remote job cannot reach
            with _LOCK:
                found = _session().get_credentials()
            creds = found.get_frozen_credentials() if found else (None, None, None)
        names = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")
        return {name: value for name, value in zip(names, creds, strict=True) if value}


@functools.cache
def _bucket_for(scheme: str, name: str) -> TransitBucket:
    if scheme == "file":
        return LocalTransitBucket("/")
    # the default credential chain reads the keys from the AWS_* variables the launcher injected
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
    return S3TransitBucket(name, endpoint_url=os.environ.get("AWS_ENDPOINT_URL") or None, region=region)


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
