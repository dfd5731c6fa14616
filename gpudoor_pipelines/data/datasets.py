"""Bring-your-own image datasets, split into stable, append-only shards in the transit bucket.

A dataset source is a folder of images (local, ``file:///...`` or an ``s3://bucket/prefix``) or a table
(``.parquet`` / ``.csv``) with a column of image URIs. :func:`list_images` lists it once, cheaply (the
sizes come with the listing; no image is read), and rejects a source that cannot work before anything
is launched. :func:`register_dataset` then assigns every new image to a shard and records the
assignment in ``datasets/<dataset>/index.parquet``: an image keeps its shard forever, so a shard whose
captions exist never changes, and a re-registration only writes the shards of new images.

No Dagster: the orchestrator's assets, the CLI and the benchmarks call these functions directly.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import io
import operator
import os
import posixpath
import re
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from gpudoor_pipelines.data import layout
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
TABLE_SUFFIXES = (".parquet", ".csv")
INDEX_COLUMNS = ("image_uri", "shard")
DATASET_NAME = re.compile(r"[a-z0-9-]{1,40}")
PUBLISH_WORKERS = 16
"""Shards published at once: a registration of 10,000 shards on S3 costs ~10,000 / 16 round trips."""

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
    """

    images: list[str]
    skipped: list[tuple[str, str]] = field(default_factory=list)
    source: str = ""

    def skipped_by_reason(self) -> dict[str, int]:
        """How many entries were skipped for each reason (extensions grouped), most frequent first."""
        return dict(Counter(_reason_kind(reason) for _, reason in self.skipped).most_common())


@dataclass(frozen=True)
class Registration:
    """The shards of a dataset after :func:`register_dataset`.

    Attributes:
        dataset: the dataset's name.
        shards: every shard key of the dataset, in order (the old ones, then the new ones).
        new_shards: the shards this registration created.
        images_total: images in all the shards (those gone from the source included).
        images_new: images this registration put into new shards.
        images_missing: images of the index no longer in the source; they stay in their shards.
        shard_size: images per new shard (the last new shard may hold fewer).
        index_uri: URI of ``index.parquet``, which maps every image to its shard.
    """

    dataset: str
    shards: list[str]
    new_shards: list[str]
    images_total: int
    images_new: int
    images_missing: int
    shard_size: int
    index_uri: str


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
    is skipped by the caption job.

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
            images, skipped = _from_table(uri, bucket, key)
        else:
            images, skipped = _from_folder(uri, bucket, key)
    if not images:
        reasons = ", ".join(f"{n} {kind}" for kind, n in SourceListing([], skipped).skipped_by_reason().items())
        raise DatasetSourceError(
            uri,
            f"no usable images: {len(skipped)} entries skipped ({reasons})",
            f"point the source at images with one of the extensions {', '.join(sorted(IMAGE_EXTENSIONS))}",
        )
    return SourceListing(images=images, skipped=skipped, source=uri)


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


def _from_table(uri: str, bucket: TransitBucket, key: str) -> tuple[list[str], list[tuple[str, str]]]:
    try:
        data = bucket.get_bytes(key)
    except TransitObjectMissing:
        raise DatasetSourceError(uri, "the table does not exist", "check the path and its extension") from None
    values = _table_column(uri, data)
    seen: set[str] = set()
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
            seen.add(image)
            images.append(image)
    return sorted(images), skipped


def _table_column(uri: str, data: bytes) -> list[str | None]:
    """The image-URI column of a Parquet or CSV table, as strings (None for a null cell)."""
    import pyarrow as pa

    try:
        if uri.lower().endswith(".parquet"):
            import pyarrow.parquet as pq

            parquet = pq.ParquetFile(pa.BufferReader(data))
            columns = parquet.schema_arrow.names
            name = next((c for c in URI_COLUMNS if c in columns), None)
            values = parquet.read(columns=[name]).column(0).cast(pa.string()) if name else None
        else:
            import pandas as pd

            frame = pd.read_csv(io.BytesIO(data), dtype=str, keep_default_na=False)
            columns = list(frame.columns)
            name = next((c for c in URI_COLUMNS if c in columns), None)
            values = pa.array(frame[name], pa.string()) if name else None
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
    return values.to_pylist()


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


def check_dataset_name(dataset: str) -> str:
    """``dataset`` if it is a valid dataset name, else a ValueError saying which names are."""
    if not DATASET_NAME.fullmatch(dataset or ""):
        raise ValueError(
            f"invalid dataset name {dataset!r}. Fix: use 1 to 40 lowercase letters, digits and '-' "
            "(it names the shards and the bucket folders)"
        )
    return dataset


def dataset_prefix(dataset: str) -> str:
    """The bucket folder of a dataset: ``datasets/<dataset>``."""
    return f"{layout.DATASETS}/{check_dataset_name(dataset)}"


def shard_prefix(dataset: str, shard: str) -> str:
    """The bucket folder of a shard: ``datasets/<dataset>/shards/<shard>``; its manifest is the shard."""
    return f"{dataset_prefix(dataset)}/shards/{shard}"


def index_key(dataset: str) -> str:
    """The key of the dataset's index (columns ``image_uri``, ``shard``)."""
    return f"{dataset_prefix(dataset)}/index.parquet"


def shard_key(dataset: str, number: int) -> str:
    """The key of shard ``number`` (from 0): ``<dataset>-00042``."""
    return f"{dataset}-{number:05d}"


def register_dataset(bucket: TransitBucket, dataset: str, listing: SourceListing, shard_size: int) -> Registration:
    """Give every image of ``listing`` not yet in the dataset a shard, and publish the new shards.

    Known images keep their shard, whether or not they are still in the source. New images go, in
    sorted order, into new shards numbered after the last one; a partly filled last shard is not
    topped up, since its captions may already exist. Each new shard is published as the manifest
    ``{"dataset", "shard", "count", "images"}`` of :func:`shard_prefix` (the images are not copied),
    concurrently; the index is written last, so a registration that fails midway registers nothing:
    the next one publishes those shard keys again, from its own listing. With no new image, nothing is
    written.

    Args:
        bucket: the transit bucket.
        dataset: the dataset's name (see :func:`check_dataset_name`).
        listing: the source's images, from :func:`list_images`.
        shard_size: images per new shard.

    Raises:
        ValueError: a bad dataset name or shard size, or an index that is not this module's.
    """
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    check_dataset_name(dataset)
    if shard_size < 1:
        raise ValueError(f"shard_size={shard_size}. Fix: give at least 1 image per shard")
    index = _read_index(bucket, dataset)
    images = listing.images
    if not all(map(operator.lt, images, images[1:])):  # list_images' are sorted and unique already
        images = sorted(set(images))
    known = pc.is_in(pa.array(images, pa.string()), value_set=index["image_uri"])
    new_images = [image for image, seen in zip(images, known.to_pylist(), strict=True) if not seen]
    still_listed = len(images) - len(new_images)  # both lists are of unique URIs
    old_shards = sorted(pc.unique(index["shard"]).to_pylist(), key=lambda s: _shard_number(dataset, s))
    first = _shard_number(dataset, old_shards[-1]) + 1 if old_shards else 0
    new = {
        shard_key(dataset, first + n): new_images[start : start + shard_size]
        for n, start in enumerate(range(0, len(new_images), shard_size))
    }
    if new:

        def publish(item: tuple[str, list[str]]) -> str:
            shard, uris = item
            manifest = {"dataset": dataset, "shard": shard, "count": len(uris), "images": uris}
            return bucket.publish(shard_prefix(dataset, shard), manifest)

        with concurrent.futures.ThreadPoolExecutor(min(PUBLISH_WORKERS, len(new))) as pool:
            list(pool.map(publish, new.items()))
        added = pa.table(
            {
                "image_uri": pa.array(new_images, pa.string()),
                "shard": pa.array([s for s, uris in new.items() for _ in uris], pa.string()),
            }
        )
        buffer = io.BytesIO()
        pq.write_table(pa.concat_tables([index, added]), buffer)
        bucket.put_bytes(index_key(dataset), buffer.getvalue())
    return Registration(
        dataset=dataset,
        shards=[*old_shards, *new],
        new_shards=list(new),
        images_total=index.num_rows + len(new_images),
        images_new=len(new_images),
        images_missing=index.num_rows - still_listed,
        shard_size=shard_size,
        index_uri=bucket.uri(index_key(dataset)),
    )


def _read_index(bucket: TransitBucket, dataset: str):  # -> pyarrow.Table (imported lazily)
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = pa.schema([(name, pa.string()) for name in INDEX_COLUMNS])
    try:
        data = bucket.get_bytes(index_key(dataset))
    except TransitObjectMissing:
        return schema.empty_table()
    try:
        return pq.read_table(pa.BufferReader(data), columns=list(INDEX_COLUMNS)).cast(schema)
    except (pa.ArrowException, KeyError) as e:  # never re-shard over an index we cannot read
        raise ValueError(
            f"the index {bucket.uri(index_key(dataset))} is unreadable ({e}). Fix: restore it, or register "
            "under a new dataset name (the shards of this one would otherwise change)"
        ) from None


def _shard_number(dataset: str, shard: str) -> int:
    prefix, _, number = shard.rpartition("-")
    if prefix != dataset or not number.isdigit():
        raise ValueError(f"the index of dataset {dataset!r} names a shard {shard!r} that is not one of its own")
    return int(number)


# ---- the synthetic sample -----------------------------------------------------------------------


def write_synthetic(bucket: TransitBucket, dataset: str, num_images: int, image_size: int) -> str:
    """Write the synthetic sample (``gpudoor_pipelines.data.synthetic``) into the bucket and return its folder's URI,
    a source for :func:`list_images`: what the project's first command captions, anywhere.

    Only the images not already there are drawn and written, so calling it again costs one listing.

    Args:
        bucket: the transit bucket.
        dataset: the dataset's name; the images go to ``datasets/<dataset>/images/<image_id>.png``.
        num_images: images 0 to ``num_images - 1``.
        image_size: their width and height in pixels (images already written keep theirs).
    """
    from gpudoor_pipelines.data.synthetic import generate_image, image_id

    if num_images < 1:
        raise ValueError(f"num_images={num_images}. Fix: ask for at least 1 image")
    folder = f"{dataset_prefix(dataset)}/images"
    present = set(bucket.list_keys(folder + "/"))
    wanted = [i for i in range(num_images) if f"{folder}/{image_id(i)}.png" not in present]

    def write(index: int) -> None:
        bucket.put_bytes(f"{folder}/{image_id(index)}.png", generate_image(index, size=image_size)[0])

    if wanted:
        with concurrent.futures.ThreadPoolExecutor(min(PUBLISH_WORKERS, len(wanted))) as pool:
            list(pool.map(write, wanted))
    return bucket.uri(folder)
