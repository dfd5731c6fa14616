"""Bring-your-own image datasets, split into stable, append-only shards in the transit bucket.

A dataset source (:mod:`.sources`) is listed once by :func:`~.sources.list_images`; :func:`register_dataset`
then assigns every new image to a shard and records the
assignment in ``datasets/<dataset>/index.parquet``: an image keeps its shard and its id forever, so a shard
whose captions exist never changes, and a re-registration only writes the shards of new images.

An image's id (``image_id`` of the captions, and what the held-out split hashes) is unique in its dataset:
its path below the source (``batch-00/nested/img 00000.webp``) or the table's own id. A dataset registered
before ids were recorded keeps the ids its captions were written with (the file name's stem): its index has
no ``image_id`` column, and those images get their stem as id when it is next registered.

No Dagster: the orchestrator's assets, the CLI and the benchmarks call these functions directly.
"""

from __future__ import annotations

import concurrent.futures
import io
import operator
import posixpath
import re
from dataclasses import dataclass

from gpudoor_pipelines.data import layout
from gpudoor_pipelines.data.sources import (
    SourceListing,
)
from gpudoor_pipelines.transit.bucket import (
    TransitBucket,
    TransitObjectMissing,
)

INDEX_COLUMNS = ("image_uri", "shard", "image_id")
DATASET_NAME = re.compile(r"[a-z0-9-]{1,40}")
PUBLISH_WORKERS = 16
"""Shards published at once: a registration of 10,000 shards on S3 costs ~10,000 / 16 round trips."""


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
    ``{"dataset", "shard", "count", "images", "ids"}`` of :func:`shard_prefix` (the images are not copied;
    ``ids`` are the images' ids, in the same order),
    concurrently; the index is written last, so a registration that fails midway registers nothing:
    the next one publishes those shard keys again, from its own listing. With no new image, nothing is
    written.

    Args:
        bucket: the transit bucket.
        dataset: the dataset's name (see :func:`check_dataset_name`).
        listing: the source's images, from :func:`list_images`.
        shard_size: images per new shard.

    Raises:
        ValueError: a bad dataset name or shard size, an index that is not this module's, or a new image
            whose id an image of the dataset already has (a table's own ids).
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
    new_ids = [listing.id_of(image) for image in new_images]
    taken = pc.is_in(pa.array(new_ids, pa.string()), value_set=index["image_id"]).to_pylist()
    if any(taken):
        clashes = [f"{i!r} ({u})" for i, u, t in zip(new_ids, new_images, taken, strict=True) if t]
        raise ValueError(
            f"dataset {dataset!r}: {len(clashes)} new images have ids an image of the dataset already has: "
            f"{', '.join(clashes[:5])}. Fix: give them ids of their own (the table's id column), or register "
            "them under a new dataset name"
        )
    id_of = dict(zip(new_images, new_ids, strict=True))
    old_shards = sorted(pc.unique(index["shard"]).to_pylist(), key=lambda s: _shard_number(dataset, s))
    first = _shard_number(dataset, old_shards[-1]) + 1 if old_shards else 0
    new = {
        shard_key(dataset, first + n): new_images[start : start + shard_size]
        for n, start in enumerate(range(0, len(new_images), shard_size))
    }
    if new:

        def publish(item: tuple[str, list[str]]) -> str:
            shard, uris = item
            ids = [id_of[uri] for uri in uris]
            manifest = {"dataset": dataset, "shard": shard, "count": len(uris), "images": uris, "ids": ids}
            return bucket.publish(shard_prefix(dataset, shard), manifest)

        with concurrent.futures.ThreadPoolExecutor(min(PUBLISH_WORKERS, len(new))) as pool:
            list(pool.map(publish, new.items()))
        added = pa.table(
            {
                "image_uri": pa.array(new_images, pa.string()),
                "shard": pa.array([s for s, uris in new.items() for _ in uris], pa.string()),
                "image_id": pa.array(new_ids, pa.string()),
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
        table = pq.read_table(pa.BufferReader(data))
        if "image_id" not in table.column_names:  # registered before ids were recorded: the stems it used
            stems = [posixpath.splitext(posixpath.basename(u))[0] for u in table.column("image_uri").to_pylist()]
            table = table.append_column("image_id", pa.array(stems, pa.string()))
        return table.select(list(INDEX_COLUMNS)).cast(schema)
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
