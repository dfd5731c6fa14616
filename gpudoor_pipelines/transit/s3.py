"""The transit bucket on S3 or any S3-compatible endpoint: boto3's transfer manager, botocore's retries, and
an outage of the endpoint waited out (:mod:`gpudoor_pipelines.outage`).

No Dagster: GPU nodes import this.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import io
import logging
import os
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

from gpudoor_pipelines import outage
from gpudoor_pipelines.transit.bucket import (
    FileData,
    MiB,
    TransitBucket,
    TransitConfigError,
    TransitObjectMissing,
    _clean,
    _folder,
)

logger = logging.getLogger(__name__)

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
# What a server that is there says when it is overloaded or failing for a while (besides any 5xx)
_BUSY = {"SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "RequestLimitExceeded"}
T = TypeVar("T")
_CRED_ARGS = ("aws_access_key_id", "aws_secret_access_key", "aws_session_token")
_CHECKSUMS = dict.fromkeys(["request_checksum_calculation", "response_checksum_validation"], "when_required")
# S3-compatible servers: path-style addressing, and checksums only where the API requires them
_THIRD_PARTY = {"s3": {"addressing_style": "path"}, **_CHECKSUMS}
_LOCK = threading.RLock()  # boto3 sessions are not thread-safe (the clients they make are)


def transient(error: BaseException) -> bool:
    """Whether a botocore failure is one an S3 endpoint that is there can give for a while: no connection, a
    connection dropped or timed out, a 5xx, throttling (looked for down the exception's chain)."""
    from botocore.exceptions import ClientError, ConnectionError, HTTPClientError, SSLError

    while error is not None:
        if isinstance(error, (ConnectionError, HTTPClientError)) and not isinstance(error, SSLError):
            return True
        if isinstance(error, ClientError):
            status = error.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
            return int(status) >= 500 or error.response.get("Error", {}).get("Code") in _BUSY
        error = error.__cause__ or error.__context__
    return False


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
        max_attempts: botocore's attempts per request (the first counts), with backoff; past them, an endpoint
            that answered before is waited for as an outage (``GPUDOOR_OUTAGE_TOLERANCE_S``).
        answered: treat the endpoint as one that answered before (a job given settings the door checked).
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
        answered: bool = False,
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
        self.service = outage.service(f"the transit bucket {self.root_uri} at {self.endpoint_url or 'AWS S3'}")
        if answered:
            self.service.ok()

    def __getstate__(self) -> dict:  # copyable and picklable: client and transfer manager are made anew
        return {**self.__dict__, "_client": None, "_tm": None, "service": None}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.service = outage.service(f"the transit bucket {self.root_uri} at {self.endpoint_url or 'AWS S3'}")

    def _call(self, doing: str, fn: Callable[[], T], key: str | None = None) -> T:
        """``fn()`` with its errors made clear (:meth:`_errors`) and an outage waited out."""

        def attempt() -> T:
            with self._errors(doing, key):
                return fn()

        return self.service.call(attempt, transient, doing)

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
        """A missing ``key`` -> TransitObjectMissing; a bad setting -> one TransitConfigError naming it (no
        connection counts as one only to an endpoint that never answered: otherwise it is an outage)."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            yield
        except (ClientError, BotoCoreError) as e:
            err = e.response.get("Error", {}) if isinstance(e, ClientError) else {}
            code = str(err.get("Code") or type(e).__name__)
            if key is not None and code in _MISSING:
                raise TransitObjectMissing(key, self.uri(key)) from None
            if code not in _FIX or (transient(e) and self.service.answered):
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
            self.service.ok()
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

        def put() -> None:  # each object is one PUT (or a multipart upload): sending them again is harmless
            sources = {k: io.BytesIO(d) if isinstance(d, bytes) else os.fspath(d) for k, d in items.items()}
            futures = [tm.upload(source, self.bucket, self._full(k)) for k, source in sources.items()]
            try:
                for f in futures:
                    f.result()
            except BaseException:  # a failure or Ctrl-C: cancelling aborts the others' multipart uploads
                for f in futures:
                    f.cancel()
                raise

        self._call(f"writing {self.uri(next(iter(items)))}", put)

    def get_bytes(self, key: str) -> bytes:
        from botocore.exceptions import ClientError

        client, key = self._connect()[0], _clean(key)

        def part(start: int) -> tuple[bytes, int]:  # one ranged GET: its bytes, and the object's size
            span = f"bytes={start}-{start + self.chunksize - 1}"
            resp = client.get_object(Bucket=self.bucket, Key=self._full(key), Range=span)
            return resp["Body"].read(), int(resp.get("ContentRange", "/0").rpartition("/")[2])

        def get() -> bytes:
            try:  # no HEAD: the first part tells the size, and holds all of a small object
                first, size = part(0)
            except ClientError as e:
                if e.response["Error"]["Code"] != "InvalidRange":  # what an empty object answers
                    raise
                return b""
            with concurrent.futures.ThreadPoolExecutor(self.max_concurrency) as pool:  # a big one: in parallel
                rest = pool.map(lambda start: part(start)[0], range(len(first), size, self.chunksize))
                return b"".join([first, *rest])

        return self._call(f"reading {self.uri(key)}", get, key)

    def exists(self, key: str) -> bool:
        key = _clean(key)
        try:
            self._call(
                f"checking {self.uri(key)}",
                lambda: self._connect()[0].head_object(Bucket=self.bucket, Key=self._full(key)),
                key,
            )
        except TransitObjectMissing:
            return False
        return True

    def list_keys(self, prefix: str = "", start_after: str | None = None) -> Iterator[str]:
        yield from (key for key, _ in self.list_sized(prefix, start_after))

    def list_sized(self, prefix: str = "", start_after: str | None = None) -> Iterator[tuple[str, int]]:
        yield from ((key, obj["Size"]) for key, obj in self.listed(prefix, start_after))

    def listed(self, prefix: str = "", start_after: str | None = None) -> Iterator[tuple[str, dict]]:
        """(key, S3's entry: ``Size``, ``LastModified``, ``StorageClass``...) of the keys under ``prefix``, page
        after page, each asked from the last key seen (``StartAfter``, no continuation token): a page that fails
        in an outage is asked again, even of a restarted server, and nothing is listed twice."""
        _clean(prefix := prefix.lstrip("/"), allow_empty=True)
        client, root, after = self._connect()[0], len(self._full("")), start_after
        doing = f"listing {self.uri('')}/{prefix}"
        while True:
            kwargs = {"Bucket": self.bucket, "Prefix": self._full(prefix)}
            if after:
                kwargs["StartAfter"] = self._full(after)
            page = self._call(doing, lambda kwargs=kwargs: client.list_objects_v2(**kwargs))
            for obj in page.get("Contents", ()):
                after = obj["Key"][root:]
                yield after, obj
            if not page.get("IsTruncated") or not page.get("Contents"):
                return

    def job_env(self) -> dict[str, str]:
        env = {"AWS_REGION": self.region, "AWS_DEFAULT_REGION": self.region}
        if os.environ.get(outage.TOLERANCE_ENV):  # the jobs wait out an outage as long as the orchestrator
            env[outage.TOLERANCE_ENV] = os.environ[outage.TOLERANCE_ENV]
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
