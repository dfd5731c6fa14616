"""What housekeeping asks of the storage itself: objects listed with their age and storage class, objects
moved to cheaper storage and back, objects deleted, unfinished uploads found and aborted.

On S3 "cheaper storage" is a storage class, set by copying an object onto itself (boto3's managed copy:
multipart for big objects); a cold object stays at its key and is read as before, so only storage classes
that are read at once are accepted (:data:`READABLE_CLASSES`). On the embedded default a cold folder beside
the transit folder (``<root>-cold``) plays the storage class: a cold object is moved there, keeps its key,
and is moved back by :func:`restore` (a job cannot read it until then). Every operation here may be repeated
and may be cut at any point: a move is a rename or a copy in place, never half done, and deleting what is
gone is not an error. No Dagster: the CLI and the benchmarks call it too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import heapq
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

from gpudoor_pipelines.transit.bucket import (
    TMP_PREFIX,
    LocalTransitBucket,
    TransitBucket,
    _atomic_write,
    _clean,
)
from gpudoor_pipelines.transit.s3 import S3TransitBucket

HOT = "STANDARD"
#: The storage class a local cold folder reports.
LOCAL_COLD = "COLD"
#: S3 classes whose objects are read at once, like the standard class (GLACIER and DEEP_ARCHIVE need a
#: restore that takes hours, which no job waits for).
READABLE_CLASSES = ("STANDARD_IA", "ONEZONE_IA", "INTELLIGENT_TIERING", "GLACIER_IR")
#: S3's limit on the keys of one DeleteObjects request.
DELETE_BATCH = 1000


@dataclasses.dataclass(frozen=True)
class Listed:
    """One object of a listing: key, size in bytes, last written (UTC seconds), storage class; an unfinished
    multipart upload has its ``upload_id`` (and size 0)."""

    key: str
    size: int
    modified: float
    storage_class: str = HOT
    upload_id: str | None = None

    @property
    def cold(self) -> bool:
        return self.storage_class != HOT and self.upload_id is None


def cold_root(bucket: LocalTransitBucket) -> Path:
    """The embedded default's cold folder: beside the transit folder."""
    return bucket.root.with_name(bucket.root.name + "-cold")


# ------------------------------------------------------------------------------------------ listing
def list_objects(bucket: TransitBucket, prefix: str = "") -> Iterator[Listed]:
    """Every object under ``prefix`` in key order, hot and cold, page by page (memory: one page)."""
    if isinstance(bucket, S3TransitBucket):
        yield from _s3_objects(bucket, prefix)
        return
    if not isinstance(bucket, LocalTransitBucket):
        raise TypeError(f"no housekeeping for {type(bucket).__name__}")
    cold = LocalTransitBucket(cold_root(bucket)) if cold_root(bucket).is_dir() else None
    streams = [_local_objects(bucket, prefix, HOT)]
    if cold is not None:
        streams.append(_local_objects(cold, prefix, LOCAL_COLD))
    yield from heapq.merge(*streams, key=lambda o: (o.key, o.storage_class != HOT))


def _local_objects(bucket: LocalTransitBucket, prefix: str, storage_class: str) -> Iterator[Listed]:
    for key in bucket.list_keys(prefix):
        try:
            st = os.stat(bucket.root / key)
        except OSError:
            continue  # deleted since the walk
        yield Listed(key, st.st_size, st.st_mtime, storage_class)


def _s3_objects(bucket: S3TransitBucket, prefix: str) -> Iterator[Listed]:
    for key, obj in bucket.listed(prefix):
        yield Listed(key, obj["Size"], obj["LastModified"].timestamp(), obj.get("StorageClass") or HOT)


def leftovers(bucket: TransitBucket) -> Iterator[Listed]:
    """What a killed write left: S3's unfinished multipart uploads; a local folder's temp files."""
    if isinstance(bucket, S3TransitBucket):
        client, root = bucket.client, len(bucket._full(""))
        kwargs = {"Bucket": bucket.bucket, "Prefix": bucket._full("")}
        while True:
            page = bucket._call(
                "listing unfinished uploads", lambda kw=dict(kwargs): client.list_multipart_uploads(**kw)
            )
            for up in page.get("Uploads", ()):
                yield Listed(up["Key"][root:], 0, up["Initiated"].timestamp(), HOT, up["UploadId"])
            if not page.get("IsTruncated"):
                return
            kwargs.update(KeyMarker=page["NextKeyMarker"], UploadIdMarker=page["NextUploadIdMarker"])
    elif isinstance(bucket, LocalTransitBucket):
        for folder, _, files in os.walk(bucket.root):
            for name in sorted(f for f in files if f.startswith(TMP_PREFIX)):
                path = Path(folder, name)
                with contextlib.suppress(OSError):
                    st = path.stat()
                    yield Listed(path.relative_to(bucket.root).as_posix(), st.st_size, st.st_mtime, HOT, "tmp")


# ------------------------------------------------------------------------------------------ changing
def move(bucket: TransitBucket, key: str, storage_class: str) -> int:
    """One object to ``storage_class`` (:data:`HOT`: back where jobs read it); 1 if it moved, 0 if it was there
    already or is gone. Again is harmless."""
    return _move(bucket, _clean(key), storage_class)


def restore(bucket: TransitBucket, keys: Iterable[str]) -> int:
    """Each cold key back to the standard class; returns how many were cold."""
    return sum(move(bucket, key, HOT) for key in keys)


def _move(bucket: TransitBucket, key: str, storage_class: str) -> int:
    if isinstance(bucket, S3TransitBucket):
        from botocore.exceptions import ClientError

        tm, full = bucket._connect()[1], bucket._full(key)
        source = {"Bucket": bucket.bucket, "Key": full}
        extra = {"StorageClass": storage_class, "MetadataDirective": "COPY"}
        try:  # one object either way: S3 swaps it whole when the copy completes
            bucket._call(
                f"moving {bucket.uri(key)} to {storage_class}",
                lambda: tm.copy(source, bucket.bucket, full, extra).result(),
                key,
            )
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") != "InvalidRequest":
                raise
            return 0  # in that class already: S3 refuses a copy onto itself that changes nothing
        except FileNotFoundError:
            return 0
        return 1
    assert isinstance(bucket, LocalTransitBucket)
    hot, cold = bucket.root / key, cold_root(bucket) / key
    src, dst = (cold, hot) if storage_class == HOT else (hot, cold)
    if not src.exists():
        return 0  # moved already (or gone)
    try:
        dst.parent.mkdir(parents=True, exist_ok=True)
        os.replace(src, dst)  # one rename: there or here, never both halves
    except OSError:  # another file system: copied whole first, then the source removed
        _atomic_write(dst, src)
        src.unlink(missing_ok=True)
    _prune(src.parent, bucket.root if src == hot else cold_root(bucket))
    return 1


def delete(bucket: TransitBucket, keys: Iterable[str]) -> None:
    """Delete ``keys`` wherever they are (hot or cold); a key already gone is not an error."""
    keys = [_clean(k) for k in keys]
    if isinstance(bucket, S3TransitBucket):
        client = bucket.client
        for i in range(0, len(keys), DELETE_BATCH):
            objs = [{"Key": bucket._full(k)} for k in keys[i : i + DELETE_BATCH]]
            answer = bucket._call(
                f"deleting under {bucket.uri('')}",
                lambda objs=objs: client.delete_objects(Bucket=bucket.bucket, Delete={"Objects": objs, "Quiet": True}),
            )
            if answer.get("Errors"):
                first = answer["Errors"][0]
                raise OSError(f"deleting {first.get('Key')}: {first.get('Code')} {first.get('Message')}")
        return
    assert isinstance(bucket, LocalTransitBucket)
    for key in keys:
        for root in (bucket.root, cold_root(bucket)):
            path = root / key
            path.unlink(missing_ok=True)
            _prune(path.parent, root)


def abort_upload(bucket: TransitBucket, item: Listed) -> None:
    """Abort an unfinished multipart upload (S3) or remove a temp file (local); gone already is fine."""
    if isinstance(bucket, S3TransitBucket):
        from botocore.exceptions import ClientError

        client = bucket.client
        with contextlib.suppress(ClientError):  # NoSuchUpload: aborted already
            bucket._call(
                f"aborting an upload to {bucket.uri(item.key)}",
                lambda: client.abort_multipart_upload(
                    Bucket=bucket.bucket, Key=bucket._full(item.key), UploadId=item.upload_id
                ),
            )
    elif isinstance(bucket, LocalTransitBucket):
        (bucket.root / item.key).unlink(missing_ok=True)


def _prune(folder: Path, root: Path) -> None:
    """Remove ``folder`` and its parents up to ``root`` while they are empty."""
    while folder != root and root in folder.parents:
        try:
            folder.rmdir()
        except OSError:
            return
        folder = folder.parent


def unreadable(bucket: TransitBucket, prefix: str) -> bool:
    """Whether a job cannot read everything under ``prefix`` until it is restored: some of it is in the
    embedded default's cold folder (an S3 storage class housekeeping uses is read at once)."""
    return isinstance(bucket, LocalTransitBucket) and (cold_root(bucket) / _clean(prefix)).exists()
