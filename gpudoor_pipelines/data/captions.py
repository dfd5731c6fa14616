"""Finding the shards a caption model has finished, and merging their captions into one Parquet file.

A caption job writes, per shard, under ``captions/<model>/<shard>/``: Parquet parts ``part-00000.parquet``,
... (columns ``image_uri``, ``image_id``, ``caption`` (null: the image was skipped), ``model``, ``error``)
and, once the shard is complete, ``_manifest.json``: ``{"shard", "model", "count", "captioned",
"skipped", "skipped_images", "parts"}``. Captions are kept per model, so a new model does not reuse an
old model's work.

Merging streams: the orchestrator holds a few parts at a time whatever the dataset's size, one GET per
manifest and per part, never per caption. No Dagster: the assets, the CLI and the benchmarks call it.
"""

from __future__ import annotations

import collections
import concurrent.futures
import functools
import os
import tempfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from gpudoor_pipelines.data import layout
from gpudoor_pipelines.transit.bucket import MANIFEST_NAME, TransitBucket

if TYPE_CHECKING:
    import pyarrow as pa

PART_COLUMNS = ("image_uri", "image_id", "caption", "model", "error")
"""Columns of a caption job's part files."""
MERGED_COLUMNS = ("image_id", "image_uri", "caption", "shard")
"""Columns of the merged file, in order (what training and evaluation read)."""
MERGED_FILE = "data.parquet"
ROW_GROUP_ROWS = 131_072
"""Rows per row group of the merged file: parts are small, and a row group per part would make a file
of 1,000,000 captions carry 10,000 row groups' metadata and read slowly."""
MISSING_LISTED = 100
"""Missing shards named in the merged manifest (all of them are counted)."""

T = TypeVar("T")
R = TypeVar("R")


def captions_prefix(model: str, shard: str) -> str:
    """Where a shard's captions by ``model`` live: ``captions/<model>/<shard>``."""
    return f"{layout.CAPTIONS}/{model}/{shard}"


def done_shards(bucket: TransitBucket, model: str) -> set[str]:
    """The shards ``model`` has finished (their manifest is published), from one listing of
    ``captions/<model>/``: no request per shard."""
    root = f"{layout.CAPTIONS}/{model}/"
    done = set()
    for key in bucket.list_keys(root):
        shard, _, name = key[len(root) :].partition("/")
        if name == MANIFEST_NAME:  # not a deeper one: 'captions/a/' also lists a model named 'a/b'
            done.add(shard)
    return done


@dataclass(frozen=True)
class MergeResult:
    """What :func:`merge_captions` published.

    Attributes:
        rows: captions in the merged file.
        skipped: rows of the merged shards without a caption (images the job could not caption).
        shards_merged: the requested shards that were done, in the file's order.
        missing: the requested shards not done yet (not merged), sorted.
        file_key: bucket key of the merged Parquet file.
        bytes: its size.
        manifest_key: bucket key of its manifest (written last).
    """

    rows: int
    skipped: int
    shards_merged: list[str]
    missing: list[str]
    file_key: str
    bytes: int
    manifest_key: str


def merge_captions(
    bucket: TransitBucket, model: str, shards: Sequence[str], out_prefix: str, *, workers: int = 8
) -> MergeResult:
    """Merge the captions of the done ``shards`` into one Parquet file and publish it at ``out_prefix``.

    Shards not done yet are reported in ``missing``, not merged; that is not an error. Rows without a
    caption are left out and counted. Rows come by shard (sorted), then part (the manifest's order),
    then row; the columns are :data:`MERGED_COLUMNS`. Parts are fetched ``workers`` at a time and
    written as they come, in row groups of :data:`ROW_GROUP_ROWS`, through a local temp file: memory
    stays that of a few parts and one row group, whatever the number of captions.

    The folder gets ``data.parquet`` and the manifest ``{"rows", "file", "model", "shards" (count),
    "missing" (the first 100), "missing_count", "skipped"}``.

    Args:
        bucket: the transit bucket.
        model: the caption model whose captions to merge.
        shards: the shards to merge (each once, whatever the order given).
        out_prefix: the bucket folder to publish the merged file in.
        workers: GETs in flight (manifests and parts each).

    Raises:
        ValueError: a done shard's manifest or part is not what a caption job writes (the message
            names it and the fix).
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    wanted = sorted(set(shards))
    done = done_shards(bucket, model)
    merged = [s for s in wanted if s in done]
    missing = [s for s in wanted if s not in done]
    rows = skipped = 0
    with (
        tempfile.TemporaryDirectory(prefix="caption-merge-") as tmp,
        concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="manifests") as manifest_pool,
        concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="parts") as part_pool,
    ):
        path = os.path.join(tmp, MERGED_FILE)
        with pq.ParquetWriter(path, _merged_schema()) as writer:
            manifests = _prefetch(manifest_pool, lambda s: _part_keys(bucket, model, s), merged, 4 * workers)
            parts = ((shard, key) for shard, keys in zip(merged, manifests, strict=True) for key in keys)
            batch: list[pa.Table] = []
            batch_rows = 0
            for table, part_skipped in _prefetch(part_pool, lambda p: _read_part(bucket, *p), parts, workers):
                skipped += part_skipped
                rows += table.num_rows
                batch.append(table)
                batch_rows += table.num_rows
                if batch_rows >= ROW_GROUP_ROWS:
                    batch = _write_full_groups(writer, batch)
                    batch_rows = sum(t.num_rows for t in batch)
            if batch_rows:
                writer.write_table(pa.concat_tables(batch), row_group_size=ROW_GROUP_ROWS)
        manifest = {
            "rows": rows,
            "file": MERGED_FILE,
            "model": model,
            "shards": len(merged),
            "missing": missing[:MISSING_LISTED],
            "missing_count": len(missing),
            "skipped": skipped,
        }
        size = os.path.getsize(path)
        manifest_key = bucket.publish(out_prefix, manifest, files={MERGED_FILE: path})
    return MergeResult(
        rows=rows,
        skipped=skipped,
        shards_merged=merged,
        missing=missing,
        file_key=f"{out_prefix.strip('/')}/{MERGED_FILE}",
        bytes=size,
        manifest_key=manifest_key,
    )


@functools.cache
def _merged_schema() -> pa.Schema:
    import pyarrow as pa

    return pa.schema([(name, pa.string()) for name in MERGED_COLUMNS])


def _write_full_groups(writer: Any, batch: list[pa.Table]) -> list[pa.Table]:
    """Write the whole row groups ``batch`` holds; return the rest, which starts the next one."""
    import pyarrow as pa

    table = pa.concat_tables(batch)
    whole = table.num_rows - table.num_rows % ROW_GROUP_ROWS
    writer.write_table(table.slice(0, whole), row_group_size=ROW_GROUP_ROWS)
    return [table.slice(whole)]


def _part_keys(bucket: TransitBucket, model: str, shard: str) -> list[str]:
    """The keys of a done shard's parts, from its manifest."""
    prefix = captions_prefix(model, shard)
    manifest = bucket.read_manifest(prefix)
    parts = (manifest or {}).get("parts")
    if not isinstance(parts, list) or not all(isinstance(p, str) and p for p in parts):
        raise ValueError(
            f"the caption manifest {bucket.uri(prefix + '/' + MANIFEST_NAME)} lists no 'parts' (written by "
            f"an older caption job, or damaged). Fix: caption shard {shard!r} with model {model!r} again"
        )
    return [f"{prefix}/{part}" for part in parts]


def _read_part(bucket: TransitBucket, shard: str, key: str) -> tuple[pa.Table, int]:
    """A part's captioned rows, with their shard, in the merged file's schema; and its rows without one."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    wanted = ["image_id", "image_uri", "caption"]
    try:
        # no pre-buffering and no Arrow threads: parts are small and already read `workers` at once,
        # and both halve the speed of a part of 100 rows
        part = pq.ParquetFile(pa.BufferReader(bucket.get_bytes(key)), pre_buffer=False)
        names = part.schema_arrow.names
        lacking = [c for c in wanted if c not in names]
        problem = f"has no column {', '.join(lacking)}" if lacking else ""
        table = None if lacking else part.read(columns=wanted, use_threads=False)
    except pa.ArrowException as e:
        problem, table = f"is not a readable Parquet file ({type(e).__name__})", None
    if table is None:
        raise ValueError(f"the caption part {bucket.uri(key)} {problem}. Fix: caption shard {shard!r} again")
    captioned = table.filter(pc.is_valid(table["caption"]))
    shard_column = pa.repeat(pa.scalar(shard, pa.string()), captioned.num_rows)
    merged = captioned.append_column("shard", shard_column).select(list(MERGED_COLUMNS))
    schema = _merged_schema()
    return merged if merged.schema == schema else merged.cast(schema), table.num_rows - captioned.num_rows


def _prefetch(pool: concurrent.futures.Executor, fn: Callable[[T], R], items: Iterable[T], window: int) -> Iterator[R]:
    """``map(fn, items)`` run on ``pool`` with at most ``window`` calls ahead of the consumer, in order:
    the reads overlap, and no more than ``window`` results wait in memory."""
    pending: collections.deque[concurrent.futures.Future[R]] = collections.deque()
    try:
        for item in items:
            pending.append(pool.submit(fn, item))
            if len(pending) >= window:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:  # a failure or an abandoned merge: do not start the reads still queued
        for future in pending:
            future.cancel()
