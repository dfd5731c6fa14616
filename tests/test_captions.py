"""Finding finished caption shards and merging their captions (local folder bucket).

The same on S3 is in ``tests/transit/test_datasets_s3.py``.
"""

from __future__ import annotations

import io
import json

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from gpudoor_pipelines.data import captions
from gpudoor_pipelines.data.captions import MERGED_COLUMNS, captions_prefix, done_shards, merge_captions
from gpudoor_pipelines.transit.bucket import MANIFEST_NAME, LocalTransitBucket

MODEL = "color-shape-v1"


def write_caption_shard(
    bucket, model: str, shard: str, parts: list[list[tuple[str, str | None]]], *, publish: bool = True
) -> None:
    """What a caption job leaves: Parquet parts of (image_id, caption or None), then the manifest."""
    prefix = captions_prefix(model, shard)
    names, skipped_images = [], []
    for n, rows in enumerate(parts):
        name = f"part-{n:05d}.parquet"
        table = pa.table(
            {
                "image_uri": [f"s3://data/{shard}/{i}.png" for i, _ in rows],
                "image_id": [i for i, _ in rows],
                "caption": pa.array([c for _, c in rows], pa.string()),
                "model": [model] * len(rows),
                "error": pa.array([None if c else "cannot decode" for _, c in rows], pa.string()),
            }
        )
        buffer = io.BytesIO()
        pq.write_table(table, buffer)
        bucket.put_bytes(f"{prefix}/{name}", buffer.getvalue())
        names.append(name)
        skipped_images += [i for i, c in rows if c is None]
    if publish:
        count = sum(len(rows) for rows in parts)
        manifest = {
            "shard": shard,
            "model": model,
            "count": count,
            "captioned": count - len(skipped_images),
            "skipped": len(skipped_images),
            "skipped_images": skipped_images,
            "parts": names,
        }
        bucket.publish(prefix, manifest)


class _CountingBucket(LocalTransitBucket):
    """Counts the listings and the GETs, by key."""

    def __init__(self, root):
        super().__init__(root)
        self.listings: list[str] = []
        self.gets: list[str] = []

    def list_keys(self, prefix="", start_after=None):
        self.listings.append(prefix)
        return super().list_keys(prefix, start_after)

    def get_bytes(self, key):
        self.gets.append(key)
        return super().get_bytes(key)


@pytest.fixture
def bucket(tmp_path) -> _CountingBucket:
    return _CountingBucket(tmp_path / "transit")


def test_captions_prefix():
    assert captions_prefix("blip-2", "pets-00003") == "captions/blip-2/pets-00003"


def test_done_shards_from_one_listing_without_reading_manifests(bucket):
    write_caption_shard(bucket, MODEL, "s-00000", [[("a", "a cat")]])
    write_caption_shard(bucket, MODEL, "s-00001", [[("b", "a dog")], [("c", None)]])
    write_caption_shard(bucket, MODEL, "s-00002", [[("d", "a cow")]], publish=False)  # still running
    write_caption_shard(bucket, "other-model", "s-00003", [[("e", "a hen")]])
    write_caption_shard(bucket, f"{MODEL}/v2", "s-00004", [[("f", "a fox")]])  # a model named under ours
    bucket.listings.clear(), bucket.gets.clear()
    assert done_shards(bucket, MODEL) == {"s-00000", "s-00001"}
    assert bucket.listings == [f"captions/{MODEL}/"] and bucket.gets == []
    assert done_shards(bucket, "never-ran") == set()


def test_merge_streams_done_shards_into_one_parquet_file(bucket):
    write_caption_shard(bucket, MODEL, "s-00002", [[("i5", "a red circle"), ("i6", None)]])
    write_caption_shard(
        bucket,
        MODEL,
        "s-00000",
        [[("i1", "a blue square"), ("i0", "a green circle")], [("i2", None), ("i3", "a red square")]],
    )
    write_caption_shard(bucket, MODEL, "s-00003", [[("i7", "a cow")]], publish=False)  # not done
    bucket.gets.clear()

    result = merge_captions(bucket, MODEL, ["s-00003", "s-00002", "s-00000", "s-00009"], "merged/v1")
    assert (result.rows, result.skipped) == (4, 2)
    assert result.shards_merged == ["s-00000", "s-00002"]
    assert result.missing == ["s-00003", "s-00009"]
    assert result.file_key == "merged/v1/data.parquet" and result.manifest_key == "merged/v1/_manifest.json"
    # one GET per manifest and per part, none per caption
    assert sorted(bucket.gets) == sorted(
        [
            f"captions/{MODEL}/s-00000/{MANIFEST_NAME}",
            f"captions/{MODEL}/s-00000/part-00000.parquet",
            f"captions/{MODEL}/s-00000/part-00001.parquet",
            f"captions/{MODEL}/s-00002/{MANIFEST_NAME}",
            f"captions/{MODEL}/s-00002/part-00000.parquet",
        ]
    )

    frame = pd.read_parquet(bucket.path_of(result.file_key))
    assert list(frame.columns) == ["image_id", "image_uri", "caption", "shard"] == list(MERGED_COLUMNS)
    # by shard, then part, then row; rows without a caption left out
    assert frame.to_dict("records") == [
        {
            "image_id": "i1",
            "image_uri": "s3://data/s-00000/i1.png",
            "caption": "a blue square",
            "shard": "s-00000",
        },
        {
            "image_id": "i0",
            "image_uri": "s3://data/s-00000/i0.png",
            "caption": "a green circle",
            "shard": "s-00000",
        },
        {
            "image_id": "i3",
            "image_uri": "s3://data/s-00000/i3.png",
            "caption": "a red square",
            "shard": "s-00000",
        },
        {
            "image_id": "i5",
            "image_uri": "s3://data/s-00002/i5.png",
            "caption": "a red circle",
            "shard": "s-00002",
        },
    ]
    assert result.bytes == bucket.path_of(result.file_key).stat().st_size
    assert json.loads(bucket.get_bytes(result.manifest_key)) == {
        "rows": 4,
        "file": "data.parquet",
        "model": MODEL,
        "shards": 2,
        "missing": ["s-00003", "s-00009"],
        "missing_count": 2,
        "skipped": 2,
    }


def test_merge_writes_row_groups_as_parts_come(bucket, monkeypatch):
    monkeypatch.setattr(captions, "ROW_GROUP_ROWS", 10)
    expected = []
    for s in range(6):
        parts = [[(f"{s}-{p}-{r}", f"caption {s} {p} {r}") for r in range(4)] for p in range(2)]
        write_caption_shard(bucket, MODEL, f"s-{s:05d}", parts)
        expected += [row for part in parts for row in part]
    result = merge_captions(bucket, MODEL, [f"s-{s:05d}" for s in range(6)], "merged", workers=3)
    written = pq.ParquetFile(bucket.path_of(result.file_key))
    assert written.metadata.num_rows == result.rows == 48
    groups = [written.metadata.row_group(g).num_rows for g in range(written.metadata.num_row_groups)]
    assert groups == [10, 10, 10, 10, 8]  # written as the parts came, never the whole table at once
    table = written.read()
    assert list(zip(table["image_id"].to_pylist(), table["caption"].to_pylist(), strict=True)) == expected


def test_merge_with_nothing_done_publishes_an_empty_table(bucket):
    result = merge_captions(bucket, MODEL, ["s-00000"], "merged")
    assert (result.rows, result.shards_merged, result.missing) == (0, [], ["s-00000"])
    frame = pd.read_parquet(bucket.path_of(result.file_key))
    assert frame.empty and list(frame.columns) == list(MERGED_COLUMNS)


def test_merge_names_a_shard_an_older_caption_job_wrote(bucket):
    bucket.publish(captions_prefix(MODEL, "s-00000"), {"count": 1, "model": MODEL, "images": ["img-00000"]})
    with pytest.raises(ValueError, match=r"lists no 'parts'.*Fix: caption shard 's-00000'"):
        merge_captions(bucket, MODEL, ["s-00000"], "merged")
    assert not bucket.exists("merged/_manifest.json")

    prefix = captions_prefix(MODEL, "s-00001")
    bucket.put_bytes(f"{prefix}/part-00000.parquet", b"torn")
    bucket.publish(prefix, {"parts": ["part-00000.parquet"]})
    with pytest.raises(ValueError, match=r"part-00000.parquet is not a readable Parquet file"):
        merge_captions(bucket, MODEL, ["s-00001"], "merged")
