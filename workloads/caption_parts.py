"""The Parquet part files of a captioned shard: their names, their rows, reading what is done.

A shard's captions are stored as ``part-00000.parquet``, ``part-00001.parquet``, ... next to its
``_manifest.json``; each part is one object, written whole, so a part either exists with all its rows
or not at all. Every image of the shard is in at most one part.
"""

from __future__ import annotations

import io
import posixpath
import re
from collections.abc import Iterable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.parquet as pq

from gpudoor_pipelines.transit.uris import join, list_uris, read_bytes

PART_SCHEMA = pa.schema(
    [
        ("image_uri", pa.string()),
        ("image_id", pa.string()),
        ("caption", pa.string()),
        ("model", pa.string()),
        ("error", pa.string()),
    ]
)
_PART_NAME = re.compile(r"part-(\d{5,})\.parquet")


@dataclass(frozen=True)
class CaptionRow:
    """One image's row in a part: its caption, or (skipped) the reason it has none."""

    image_uri: str
    caption: str | None
    model: str
    error: str | None = None
    image_id: str | None = None
    """The image's id in its dataset (the shard's manifest gives it); None: the file stem (:func:`image_id_of`),
    as for a shard registered before ids were recorded."""


@dataclass
class DoneImages:
    """What the parts already written hold, for the images of one shard."""

    parts: list[str]
    """Names of every part in the folder, in order."""
    captioned: set[str]
    """URIs of the images with a caption."""
    skipped: dict[str, str]
    """URI -> reason, for the images skipped, in part order."""

    @property
    def uris(self) -> set[str]:
        """Every image URI in some part."""
        return self.captioned | self.skipped.keys()


def image_id_of(uri: str) -> str:
    """The file stem of an image URI, the id of an image whose shard gives none (registered before ids were
    recorded): ``s3://b/x/img-00042.png`` -> ``img-00042``."""
    return posixpath.splitext(posixpath.basename(uri))[0]


def part_name(index: int) -> str:
    """The object name of part ``index``: ``part-00007.parquet``."""
    return f"part-{index:05d}.parquet"


def part_index(name: str) -> int | None:
    """The index in a part's name, or None if ``name`` is not a part."""
    match = _PART_NAME.fullmatch(name)
    return int(match.group(1)) if match else None


def list_parts(output_uri: str) -> list[str]:
    """Names of the parts directly under ``output_uri``, in index order."""
    prefix = output_uri.rstrip("/") + "/"
    names = [uri[len(prefix) :] for uri in list_uris(output_uri) if uri.startswith(prefix)]
    return sorted((n for n in names if part_index(n) is not None), key=lambda n: part_index(n) or 0)


def next_part_index(parts: Iterable[str]) -> int:
    """The index for a new part: after every existing one, so no part is ever overwritten."""
    return max((part_index(n) or 0 for n in parts), default=-1) + 1


def part_bytes(rows: Sequence[CaptionRow]) -> bytes:
    """The Parquet bytes of a part holding ``rows``."""
    table = pa.table(
        {
            "image_uri": [r.image_uri for r in rows],
            "image_id": [r.image_id or image_id_of(r.image_uri) for r in rows],
            "caption": [r.caption for r in rows],
            "model": [r.model for r in rows],
            "error": [r.error for r in rows],
        },
        schema=PART_SCHEMA,
    )
    buffer = io.BytesIO()
    pq.write_table(table, buffer)
    return buffer.getvalue()


def read_done(output_uri: str, pool: Executor) -> DoneImages:
    """Read which images the parts under ``output_uri`` hold, the parts read concurrently.

    Only the ``image_uri`` and ``error`` columns are read: a row is captioned exactly when its
    error is null, so the captions themselves never need to be loaded.
    """
    parts = list_parts(output_uri)

    def columns(name: str) -> pa.Table:
        data = read_bytes(join(output_uri, name))
        return pq.read_table(io.BytesIO(data), columns=["image_uri", "error"])

    done = DoneImages(parts=parts, captioned=set(), skipped={})
    for table in pool.map(columns, parts):
        for uri, error in zip(table.column("image_uri").to_pylist(), table.column("error").to_pylist(), strict=True):
            if error is None:
                done.captioned.add(uri)
            else:
                done.skipped[uri] = error
    return done
