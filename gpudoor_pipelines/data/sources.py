"""Dataset sources: a folder of images (local, ``file:///...`` or ``s3://bucket/prefix``) or a table
(``.parquet`` / ``.csv``) of image URIs, listed once and cheaply (sizes come with the listing; no image is
read); a source that cannot work is refused with what is wrong and the fix, before anything is launched.
No Dagster."""

from __future__ import annotations

import contextlib
import io
import os
import posixpath
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from gpudoor_pipelines.transit.bucket import (
    LocalTransitBucket,
    TransitBucket,
    TransitConfigError,
    TransitObjectMissing,
)
from gpudoor_pipelines.transit.s3 import S3TransitBucket
from gpudoor_pipelines.transit.uris import bucket_for_uri

IMAGE_EXTENSIONS = frozenset({".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".tif", ".tiff"})
"""File name extensions listed as images (compared case-insensitively)."""
URI_COLUMNS = ("image_uri", "uri", "path")
"""Columns a table source may name its image URIs in, in order of preference."""
ID_COLUMNS = ("image_id", "id")
"""Columns a table source may give its images' own ids in, in order of preference."""
TABLE_SUFFIXES = (".parquet", ".csv")
BucketFor = Callable[[str], tuple[TransitBucket, str]]
"""Maps a URI to the bucket holding it and its key there, like :func:`bucket_for_uri`."""

_SOURCE_FORMS = "a folder (path, file:///abs/path or s3://bucket/prefix) or a .parquet/.csv table of image URIs"
_ACCESS = {
    "AccessDenied",
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "403",
    "Forbidden",
    "NoCredentialsError",
    "PartialCredentialsError",
    "InvalidToken",
    "ExpiredToken",
}
_UNREACHABLE = {"EndpointConnectionError", "ConnectTimeoutError", "ReadTimeoutError", "SSLError"}
_REGION = {"AuthorizationHeaderMalformed", "PermanentRedirect"}


class DatasetSourceError(ValueError):
    """A dataset source that cannot be used, with what is wrong and how to fix it.

    Attributes:
        uri: the source (or the part of it) at fault.
        problem: what is wrong, in a phrase.
        fix: what the user should do.
    """

    def __init__(self, uri: str, problem: str, fix: str):
        self.uri, self.problem, self.fix = uri, problem.rstrip(". "), fix
        super().__init__(f"dataset source {uri!r}: {self.problem}. Fix: {fix}")


@dataclass
class SourceListing:
    """The usable images of a source, and what was left out of it.

    Attributes:
        images: absolute image URIs (``file:///...`` or ``s3://...``), sorted, each once.
        skipped: (uri, reason) of every entry left out: hidden, empty, not an image, ...
        source: the source as an absolute URI.
        ids: image URI -> the image's id, unique in the source: its path below the source's folder
            (``batch-00/nested/img 00000.webp``; for a table, below the table's folder), or the table's
            own id column (:data:`ID_COLUMNS`) when it has one. See :meth:`id_of`.
    """

    images: list[str]
    skipped: list[tuple[str, str]] = field(default_factory=list)
    source: str = ""
    ids: dict[str, str] = field(default_factory=dict)

    def id_of(self, uri: str) -> str:
        """The id of image ``uri``: the listing's, else its path below the source's folder."""
        return self.ids.get(uri) or path_id(uri, self.source)

    def skipped_by_reason(self) -> dict[str, int]:
        """How many entries were skipped for each reason (extensions grouped), most frequent first."""
        return dict(Counter(_reason_kind(reason) for _, reason in self.skipped).most_common())


def path_id(uri: str, root: str) -> str:
    """An image's id from where it is: its path below the folder ``root`` (a folder source, or the folder of
    a table source), ``batch-00/nested/img 00000.webp``; the whole URI for an image outside it. Unique within
    a source, and the same at every registration of it."""
    root = root.rstrip("/")
    if root.lower().endswith(TABLE_SUFFIXES):
        root = posixpath.dirname(root)
    return uri[len(root) + 1 :] if root and uri.startswith(root + "/") else uri


def resolver_for(bucket: TransitBucket) -> BucketFor:
    """A ``bucket_for`` that reads URIs inside ``bucket`` through it (its own settings and credentials,
    e.g. the transit bucket's GPUDOOR_S3_* ones) and any other URI through :func:`bucket_for_uri`."""

    def bucket_for(uri: str) -> tuple[TransitBucket, str]:
        if uri.rstrip("/") == bucket.root_uri or uri.startswith(bucket.root_uri + "/"):
            return bucket, bucket.key_of(uri)
        return bucket_for_uri(uri)

    return bucket_for


# ---- listing a source ---------------------------------------------------------------------------


def list_images(source: str, *, bucket_for: BucketFor = bucket_for_uri) -> SourceListing:
    """The images of a dataset source; a :class:`DatasetSourceError` if the source cannot be used.

    A folder or S3 prefix yields every object under it, recursively, except hidden files (a path part
    under the source starting with ``.``), empty objects and names without an image extension (see
    :data:`IMAGE_EXTENSIONS`); those are reported in ``skipped``. A table (``.parquet`` or ``.csv``)
    yields the URIs of its ``image_uri`` column (or ``uri``, or ``path``); relative entries are resolved
    against the table's folder like links (``/x.png`` is the root of the table's bucket or file system),
    and empty cells, duplicates and non-image names are skipped. Images are not read: an undecodable one
    is skipped by the caption job. Each image gets an id unique in the source (``SourceListing.ids``): its
    path below the source's folder, or the table's own ``image_id`` (or ``id``) column, whose empty and
    repeated ids are skipped too.

    Args:
        source: a local path (absolute, or relative to the current directory), ``file:///abs/path``,
            ``s3://bucket/prefix``, or any of these ending in ``.parquet`` or ``.csv``.
        bucket_for: maps a URI to its bucket and key; the default reads S3 through the AWS_*
            environment (see :func:`resolver_for` to read the transit bucket with its own settings).

    Raises:
        DatasetSourceError: the folder or table does not exist; the S3 bucket is missing, denies
            access or cannot be reached; a table has no image-URI column; no usable image at all.
    """
    uri = _source_uri(source)
    try:
        bucket, key = bucket_for(uri)
    except ValueError as e:
        raise DatasetSourceError(uri, str(e), f"give {_SOURCE_FORMS}") from None
    with _s3_errors(uri, bucket):
        if uri.lower().endswith(TABLE_SUFFIXES):
            images, skipped, ids = _from_table(uri, bucket, key)
        else:
            images, skipped = _from_folder(uri, bucket, key)
            ids = {}
    if not images:
        reasons = ", ".join(f"{n} {kind}" for kind, n in SourceListing([], skipped).skipped_by_reason().items())
        raise DatasetSourceError(
            uri,
            f"no usable images: {len(skipped)} entries skipped ({reasons})",
            f"point the source at images with one of the extensions {', '.join(sorted(IMAGE_EXTENSIONS))}",
        )
    return SourceListing(images=images, skipped=skipped, source=uri, ids=ids)


def _source_uri(source: str) -> str:
    """The source as an absolute ``file:///`` or ``s3://`` URI."""
    text = source.strip()
    if text.startswith("s3://"):
        if not text[5:].split("/", 1)[0]:
            raise DatasetSourceError(source, "no bucket name", "write it as s3://bucket/prefix")
        return text.rstrip("/")
    if text.startswith("file://"):
        if not text.startswith("file:///"):
            raise DatasetSourceError(source, "a file URI must be absolute", "write it as file:///absolute/path")
        text = text[len("file://") :]
    elif "://" in text or not text:
        raise DatasetSourceError(source, "not a source this project reads", f"give {_SOURCE_FORMS}")
    path = Path(os.path.abspath(os.path.expanduser(text))).as_posix()  # not resolve(): keep the user's links
    return "file://" + path


def _from_folder(uri: str, bucket: TransitBucket, key: str) -> tuple[list[str], list[tuple[str, str]]]:
    if isinstance(bucket, LocalTransitBucket):
        path = bucket.path_of(key)
        if not path.exists():
            raise DatasetSourceError(
                uri,
                "the folder does not exist",
                f"check the path (a relative one is read from the current directory, {os.getcwd()})",
            )
        if not path.is_dir():
            raise DatasetSourceError(uri, "not a folder, nor a .parquet or .csv table", f"give {_SOURCE_FORMS}")
    prefix = key.strip("/") + "/" if key.strip("/") else ""
    images, skipped, listed = [], [], 0
    for object_key, size in bucket.list_sized(prefix):
        listed += 1
        object_uri = bucket.uri(object_key)
        reason = _skip_reason(object_key[len(prefix) :], size)
        if reason:
            skipped.append((object_uri, reason))
        else:
            images.append(object_uri)
    if not listed:
        where = "under this prefix" if isinstance(bucket, S3TransitBucket) else "in this folder"
        raise DatasetSourceError(
            uri,
            f"no objects {where}",
            "check the path (it is case-sensitive and read recursively), or put the images there",
        )
    return sorted(images), skipped


def _skip_reason(relative: str, size: int) -> str | None:
    """Why the object at ``relative`` (below the source root) is not an image to caption, or None."""
    if any(part.startswith(".") for part in relative.split("/")):
        return "hidden file"
    if reason := _extension_problem(relative):
        return reason
    if size == 0:
        return "empty file (0 bytes)"
    return None


def _extension_problem(name: str) -> str | None:
    extension = posixpath.splitext(name)[1].lower()
    if extension not in IMAGE_EXTENSIONS:
        return f"not an image extension ({extension or 'none'!r})"
    return None


def _reason_kind(reason: str) -> str:
    """``"not an image extension ('.txt')"`` -> ``"not an image extension"``: one group per kind."""
    return reason.split(" (", 1)[0]


def _from_table(uri: str, bucket: TransitBucket, key: str) -> tuple[list[str], list[tuple[str, str]], dict[str, str]]:
    try:
        data = bucket.get_bytes(key)
    except TransitObjectMissing:
        raise DatasetSourceError(uri, "the table does not exist", "check the path and its extension") from None
    values, own_ids = _table_columns(uri, data)
    seen: set[str] = set()
    ids: dict[str, str] = {}
    id_rows: dict[str, int] = {}
    images, skipped = [], []
    for row, value in enumerate(values):
        entry = (value or "").strip()
        if not entry:
            skipped.append((f"{uri}#row={row}", "empty cell"))
            continue
        image = _resolve(entry, uri)
        if image is None:
            skipped.append((entry, "unsupported URI (use a path, file:///... or s3://...)"))
        elif image in seen:
            skipped.append((image, "listed more than once"))
        elif reason := _extension_problem(image):  # listed by name: hidden or not, the user chose it
            skipped.append((image, reason))
        else:
            image_id = path_id(image, uri) if own_ids is None else (own_ids[row] or "").strip()
            if not image_id:
                skipped.append((image, f"empty id cell (row {row})"))
            elif image_id in id_rows:
                skipped.append((image, f"id {image_id!r} also given in row {id_rows[image_id]}"))
            else:
                seen.add(image)
                images.append(image)
                ids[image] = image_id
                id_rows[image_id] = row
    return sorted(images), skipped, ids


def _table_columns(uri: str, data: bytes) -> tuple[list[str | None], list[str | None] | None]:
    """The image-URI column of a Parquet or CSV table and its id column (None without one), as strings
    (None for a null cell)."""
    import pyarrow as pa

    try:
        if uri.lower().endswith(".parquet"):
            import pyarrow.parquet as pq

            parquet = pq.ParquetFile(pa.BufferReader(data))
            columns = parquet.schema_arrow.names
            name = next((c for c in URI_COLUMNS if c in columns), None)
            id_name = next((c for c in ID_COLUMNS if c in columns), None)
            table = parquet.read(columns=[c for c in (name, id_name) if c]) if name else None
            values = table.column(name).cast(pa.string()) if table is not None else None
            own_ids = table.column(id_name).cast(pa.string()).to_pylist() if table is not None and id_name else None
        else:
            import pandas as pd

            frame = pd.read_csv(io.BytesIO(data), dtype=str, keep_default_na=False)
            columns = list(frame.columns)
            name = next((c for c in URI_COLUMNS if c in columns), None)
            id_name = next((c for c in ID_COLUMNS if c in columns), None)
            values = pa.array(frame[name], pa.string()) if name else None
            own_ids = list(frame[id_name]) if name and id_name else None
    except (pa.ArrowException, ValueError, UnicodeDecodeError) as e:
        kind = "Parquet" if uri.lower().endswith(".parquet") else "CSV"
        raise DatasetSourceError(
            uri, f"not a readable {kind} file ({type(e).__name__})", f"write the table as {kind}"
        ) from None
    if values is None:
        raise DatasetSourceError(
            uri,
            f"no image-URI column; the columns are {columns}",
            f"name the column of image paths or URIs {' or '.join(repr(c) for c in URI_COLUMNS)}",
        )
    return values.to_pylist(), own_ids


def _resolve(entry: str, table_uri: str) -> str | None:
    """An absolute URI for a table entry, resolved like a link from the table's folder; None if its
    scheme is not one this project reads."""
    if "://" in entry:
        if entry.startswith("s3://") and entry[5:].split("/", 1)[0]:
            bucket_name, _, key = entry[5:].partition("/")
            return f"s3://{bucket_name}" + posixpath.normpath("/" + key)
        if entry.startswith("file:///"):
            return "file://" + posixpath.normpath(entry[len("file://") :])
        return None
    if table_uri.startswith("s3://"):
        bucket_name, _, key = table_uri[5:].partition("/")
        return f"s3://{bucket_name}" + posixpath.normpath(posixpath.join("/" + posixpath.dirname(key), entry))
    folder = posixpath.dirname(table_uri[len("file://") :])
    return "file://" + posixpath.normpath(posixpath.join(folder, entry))


def _error_code(error: BaseException) -> str | None:
    """The S3 error code (or botocore exception name) behind ``error``, searched down its chain: the
    transit bucket reports configuration errors as TransitConfigError raised from the botocore one."""
    from botocore.exceptions import BotoCoreError, ClientError

    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, ClientError):
            return str(current.response.get("Error", {}).get("Code") or "ClientError")
        if isinstance(current, BotoCoreError):
            return type(current).__name__
        current = current.__cause__ or current.__context__
    return None


@contextlib.contextmanager
def _s3_errors(uri: str, bucket: TransitBucket) -> Iterator[None]:
    """S3 failures -> a DatasetSourceError saying what to fix: never the server's message, which is not
    ours to show, and never a credential."""
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        yield
    except (TransitConfigError, ClientError, BotoCoreError) as e:
        code = _error_code(e) or type(e).__name__
        endpoint = getattr(bucket, "endpoint_url", None) or "AWS S3"
        bucket_name = getattr(bucket, "bucket", None) or uri[5:].split("/", 1)[0]
        if code in ("NoSuchBucket", "InvalidBucketName"):
            problem = f"the bucket {bucket_name!r} does not exist at {endpoint} ({code})"
            fix = "check the bucket name in the URI (and AWS_ENDPOINT_URL), or create the bucket"
        elif code in _ACCESS:
            problem = f"access denied listing or reading it ({code})"
            fix = (
                "give the orchestrator's S3 credentials (AWS_* variables or profile; GPUDOOR_S3_* for the "
                "transit bucket) s3:ListBucket and s3:GetObject on this prefix"
            )
        elif code in _UNREACHABLE:
            problem = f"the S3 endpoint {endpoint} cannot be reached ({code})"
            fix = "check AWS_ENDPOINT_URL (http or https?) and that the server is up and reachable from here"
        elif code in _REGION:
            problem = f"the bucket is in another region ({code})"
            fix = "set AWS_REGION to the bucket's region"
        else:
            problem = f"S3 answered {code}"
            fix = "check the URI and the S3 settings (AWS_ENDPOINT_URL, AWS_REGION, credentials), then retry"
        raise DatasetSourceError(uri, problem, fix) from None


# ---- stable shards ------------------------------------------------------------------------------
