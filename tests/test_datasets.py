"""Bring-your-own datasets: listing a source, and stable, append-only shards (local folder bucket).

The S3 side (prefixes, bucket errors, registration on S3) is in ``tests/transit/test_datasets_s3.py``.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pandas as pd
import pytest

from gpudoor_pipelines.data.datasets import index_key, register_dataset, shard_prefix, write_synthetic
from gpudoor_pipelines.data.sources import DatasetSourceError, SourceListing, list_images, resolver_for
from gpudoor_pipelines.transit.bucket import MANIFEST_NAME, LocalTransitBucket


def _file(path: Path, data: bytes = b"\x89PNG not decoded here") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def _uri(path: Path) -> str:
    return "file://" + path.as_posix()


def _snapshot(bucket: LocalTransitBucket) -> dict[str, tuple[int, int]]:
    """Every object of the bucket with its size and modification time: what a rewrite would change."""
    return {k: (s, os.stat(bucket.path_of(k)).st_mtime_ns) for k, s in bucket.list_sized()}


@pytest.fixture
def bucket(tmp_path) -> LocalTransitBucket:
    return LocalTransitBucket(tmp_path / "transit")


@pytest.fixture
def photos(tmp_path) -> Path:
    """A user's folder: 3 images (one in a subfolder, one upper-case) and 6 things that are not."""
    root = tmp_path / "photos"
    for rel in ("b.png", "a.jpg", "sub/c.JPEG"):
        _file(root / rel)
    _file(root / "empty.png", b"")
    _file(root / "notes.txt")
    _file(root / "noextension")
    _file(root / ".DS_Store")
    _file(root / ".thumbs/d.png")
    _file(root / "sub/.e.png")
    return root


# ---- listing a source ---------------------------------------------------------------------------


def test_folder_lists_images_and_counts_what_it_skips(photos, monkeypatch):
    listing = list_images(str(photos))
    assert listing.source == _uri(photos)
    assert listing.images == [_uri(photos / "a.jpg"), _uri(photos / "b.png"), _uri(photos / "sub/c.JPEG")]
    reasons = dict(listing.skipped)
    assert reasons[_uri(photos / "empty.png")] == "empty file (0 bytes)"
    assert reasons[_uri(photos / "notes.txt")] == "not an image extension ('.txt')"
    assert reasons[_uri(photos / "noextension")] == "not an image extension ('none')"
    for hidden in (".DS_Store", ".thumbs/d.png", "sub/.e.png"):
        assert reasons[_uri(photos / hidden)] == "hidden file"
    assert listing.skipped_by_reason() == {"hidden file": 3, "not an image extension": 2, "empty file": 1}

    # the same folder as file:/// URI, and as a path relative to the current directory
    assert list_images(_uri(photos) + "/").images == listing.images
    monkeypatch.chdir(photos.parent)
    assert list_images("photos").images == listing.images


def test_parquet_table_resolves_relative_entries(tmp_path):
    tables = tmp_path / "tables"
    elsewhere = _file(tmp_path / "elsewhere/x.webp")
    _file(tables / "imgs/1.png")
    frame = pd.DataFrame(
        {
            "label": ["a", "b", "c", "d", "e", "f", "g"],
            "image_uri": [
                "imgs/1.png",  # relative to the table's folder
                "../elsewhere/x.webp",
                str(elsewhere),  # an absolute path
                "s3://team-data/raw/../imgs/9.tif",  # not checked for existence: that is the job's part
                "",
                None,
                "notes/readme.md",
            ],
        }
    )
    frame.to_parquet(tables / "list.parquet")
    listing = list_images(str(tables / "list.parquet"))
    assert listing.images == [
        _uri(elsewhere),
        _uri(tables / "imgs/1.png"),
        "s3://team-data/imgs/9.tif",
    ]
    assert [reason for _, reason in listing.skipped] == [
        "listed more than once",
        "empty cell",
        "empty cell",
        "not an image extension ('.md')",
    ]
    assert listing.skipped[1][0] == _uri(tables / "list.parquet") + "#row=4"
    # Ids: the path below the table's folder; an image outside it is known by its whole URI.
    assert [listing.id_of(u) for u in listing.images] == [_uri(elsewhere), "imgs/1.png", "s3://team-data/imgs/9.tif"]


def test_same_file_names_in_different_folders_get_ids_of_their_own(tmp_path, bucket):
    """The image's path below the source is its id: unique, and the same when the folder is registered again."""
    root = tmp_path / "mine"
    names = ["batch-00/nested/img 00000.webp", "more/batch-00/nested/img 00000.webp", "img 00000.webp"]
    for name in names:
        _file(root / name)
    listing = list_images(str(root))
    assert sorted(listing.id_of(u) for u in listing.images) == sorted(names)
    reg = register_dataset(bucket, "mine", listing, shard_size=2)
    manifests = [bucket.read_manifest(shard_prefix("mine", s)) for s in reg.shards]
    assert sorted(i for m in manifests for i in m["ids"]) == sorted(names)
    assert all(m["images"] == [_uri(root / i) for i in m["ids"]] for m in manifests)
    index = pd.read_parquet(bucket.path_of(index_key("mine")))
    assert sorted(index.image_id) == sorted(names) and index.image_id.is_unique
    _file(root / "later/img 00000.webp")  # registered again, with one new image of the same name
    again = register_dataset(bucket, "mine", list_images(str(root)), shard_size=2)
    assert bucket.read_manifest(shard_prefix("mine", again.new_shards[0]))["ids"] == ["later/img 00000.webp"]
    index = pd.read_parquet(bucket.path_of(index_key("mine")))
    assert sorted(index.image_id) == sorted([*names, "later/img 00000.webp"])


def test_a_table_gives_its_own_ids_and_an_empty_or_repeated_one_is_skipped(tmp_path, bucket):
    _file(tmp_path / "t/a.png")
    (tmp_path / "t/list.csv").write_text("image_id,path\nsku-1,a.png\n,b.png\nsku-1,c.png\nsku-4,d.png\n")
    listing = list_images(str(tmp_path / "t/list.csv"))
    assert {listing.id_of(u): u.rsplit("/", 1)[1] for u in listing.images} == {"sku-1": "a.png", "sku-4": "d.png"}
    reasons = sorted(reason for _, reason in listing.skipped)
    assert reasons == ["empty id cell (row 1)", "id 'sku-1' also given in row 0"]
    register_dataset(bucket, "skus", listing, shard_size=10)
    # A later table giving a new image an id the dataset already has is refused, naming it and the fix.
    (tmp_path / "t/list.csv").write_text("image_id,path\nsku-1,a.png\nsku-4,e.png\n")
    with pytest.raises(ValueError, match=r"1 new images have ids an image of the dataset already has: 'sku-4'.*Fix"):
        register_dataset(bucket, "skus", list_images(str(tmp_path / "t/list.csv")), shard_size=10)


def test_a_dataset_registered_before_ids_were_recorded_keeps_its_ids(bucket):
    """Its index has no image_id column and its shards no ids: its captions were written with the file stems,
    and a new registration keeps those for its images and gives the new ones their paths."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    old = [f"file:///data/old/{i}.png" for i in range(3)]
    bucket.publish(
        shard_prefix("legacy", "legacy-00000"),
        {"dataset": "legacy", "shard": "legacy-00000", "count": 3, "images": old},
    )
    table = pa.table({"image_uri": old, "shard": ["legacy-00000"] * 3})
    buffer = pa.BufferOutputStream()
    pq.write_table(table, buffer)
    bucket.put_bytes(index_key("legacy"), buffer.getvalue().to_pybytes())
    listing = SourceListing(images=[*old, "file:///data/new/0.png"], source="file:///data")
    reg = register_dataset(bucket, "legacy", listing, shard_size=3)
    assert reg.shards == ["legacy-00000", "legacy-00001"] and reg.images_new == 1
    assert bucket.read_manifest(shard_prefix("legacy", "legacy-00001"))["ids"] == ["new/0.png"]
    index = pd.read_parquet(bucket.path_of(index_key("legacy")))
    assert list(index.image_id) == ["0", "1", "2", "new/0.png"]


def test_csv_table_with_a_path_column(tmp_path):
    _file(tmp_path / "data/p/1.png")
    (tmp_path / "data/list.csv").write_text("path,caption_hint\np/1.png,cat\n,\nhttps://x.org/2.png,dog\n")
    listing = list_images(_uri(tmp_path / "data/list.csv"))
    assert listing.images == [_uri(tmp_path / "data/p/1.png")]
    assert [reason for _, reason in listing.skipped] == [
        "empty cell",
        "unsupported URI (use a path, file:///... or s3://...)",
    ]


def _error(source: str) -> DatasetSourceError:
    with pytest.raises(DatasetSourceError) as caught:
        list_images(source)
    err = caught.value
    assert str(err).startswith(f"dataset source {err.uri!r}: {err.problem}. Fix: {err.fix}")
    assert err.fix
    return err


def test_source_errors_name_the_uri_the_problem_and_the_fix(tmp_path):
    err = _error(str(tmp_path / "nope"))
    assert err.uri == _uri(tmp_path / "nope") and err.problem == "the folder does not exist"

    err = _error(str(tmp_path / "nope.parquet"))
    assert err.problem == "the table does not exist"

    pd.DataFrame({"file": ["a.png"], "label": ["x"]}).to_parquet(tmp_path / "t.parquet")
    err = _error(str(tmp_path / "t.parquet"))
    assert "no image-URI column; the columns are ['file', 'label']" in err.problem
    assert "'image_uri'" in err.fix

    (tmp_path / "bad.csv").write_bytes(b"\xff\xfe\x00garbage")
    assert "not a readable CSV file" in _error(str(tmp_path / "bad.csv")).problem
    (tmp_path / "bad.parquet").write_bytes(b"not parquet at all")
    assert "not a readable Parquet file" in _error(str(tmp_path / "bad.parquet")).problem

    (tmp_path / "empty").mkdir()
    assert _error(str(tmp_path / "empty")).problem == "no objects in this folder"

    for source in ("gs://bucket/imgs", "file://relative/path", "s3:///no-bucket", ""):
        assert _error(source).uri == source


def test_zero_usable_images_says_how_many_were_skipped_and_why(tmp_path):
    _file(tmp_path / "docs/a.txt")
    _file(tmp_path / "docs/b.txt")
    _file(tmp_path / "docs/.hidden.png")
    _file(tmp_path / "docs/c.png", b"")
    err = _error(str(tmp_path / "docs"))
    assert err.problem == (
        "no usable images: 4 entries skipped (2 not an image extension, 1 hidden file, 1 empty file)"
    )
    assert ".png" in err.fix and ".jpeg" in err.fix


# ---- stable shards ------------------------------------------------------------------------------


def _listing(images: list[str]) -> SourceListing:
    return SourceListing(images=images)


def _manifest_bytes(bucket: LocalTransitBucket, dataset: str, shard: str) -> bytes:
    return bucket.get_bytes(f"{shard_prefix(dataset, shard)}/{MANIFEST_NAME}")


def test_registration_shards_and_index(bucket):
    images = [f"s3://team-data/imgs/{i:03d}.png" for i in range(10)]
    reg = register_dataset(bucket, "pets", _listing(images[::-1]), shard_size=4)
    assert reg.shards == reg.new_shards == ["pets-00000", "pets-00001", "pets-00002"]
    assert (reg.images_total, reg.images_new, reg.images_missing, reg.shard_size) == (10, 10, 0, 4)
    assert reg.index_uri == bucket.uri("datasets/pets/index.parquet")
    manifest = bucket.read_manifest("datasets/pets/shards/pets-00001")
    # A listing without a source folder: each image is known by its whole URI.
    assert manifest == {"dataset": "pets", "shard": "pets-00001", "count": 4, "images": images[4:8], "ids": images[4:8]}
    index = pd.read_parquet(bucket.path_of(index_key("pets")))
    assert list(index.columns) == ["image_uri", "shard", "image_id"]
    assert dict(zip(index.image_uri, index.shard, strict=True))[images[9]] == "pets-00002"


def test_registering_the_same_images_again_writes_nothing(bucket):
    images = [f"file:///data/{i}.png" for i in range(7)]
    first = register_dataset(bucket, "same", _listing(images), shard_size=3)
    before = _snapshot(bucket)
    time.sleep(0.01)
    again = register_dataset(bucket, "same", _listing(images), shard_size=3)
    assert _snapshot(bucket) == before
    assert again.new_shards == [] and again.images_new == 0
    assert again.shards == first.shards and again.images_total == 7


def test_new_images_go_to_new_shards_and_old_shards_never_change(bucket):
    old = [f"file:///data/{i:02d}.png" for i in range(0, 20, 2)]  # 10 images: shards of 4, 4, 2
    register_dataset(bucket, "grow", _listing(old), shard_size=4)
    old_manifests = {s: _manifest_bytes(bucket, "grow", s) for s in ("grow-00000", "grow-00001", "grow-00002")}

    # 5 new images, some sorting between old ones, and one old image gone from the source
    new = [f"file:///data/{i:02d}.png" for i in (1, 3, 21, 22, 23)]
    reg = register_dataset(bucket, "grow", _listing(old[1:] + new), shard_size=4)
    assert reg.new_shards == ["grow-00003", "grow-00004"]  # the half-full grow-00002 is not topped up
    assert reg.shards == [f"grow-{n:05d}" for n in range(5)]
    assert (reg.images_total, reg.images_new, reg.images_missing) == (15, 5, 1)
    assert {s: _manifest_bytes(bucket, "grow", s) for s in old_manifests} == old_manifests
    assert bucket.read_manifest(shard_prefix("grow", "grow-00003"))["images"] == new[:4]
    assert bucket.read_manifest(shard_prefix("grow", "grow-00004"))["images"] == new[4:]
    index = pd.read_parquet(bucket.path_of(index_key("grow")))
    assert len(index) == 15 and old[0] in set(index.image_uri)  # the gone image keeps its shard


class _CountingBucket(LocalTransitBucket):
    """Counts publishes and the most running at once."""

    def __init__(self, root):
        super().__init__(root)
        self.lock, self.running, self.most, self.published = threading.Lock(), 0, 0, []

    def publish(self, prefix, manifest, files=None):
        with self.lock:
            self.running += 1
            self.most = max(self.most, self.running)
            self.published.append(prefix)
        time.sleep(0.02)  # a round trip to S3
        try:
            return super().publish(prefix, manifest, files)
        finally:
            with self.lock:
                self.running -= 1


def test_only_new_shards_are_published_and_concurrently(tmp_path):
    bucket = _CountingBucket(tmp_path / "transit")
    images = [f"file:///d/{i:04d}.png" for i in range(300)]
    register_dataset(bucket, "many", _listing(images[:200]), shard_size=5)
    assert len(bucket.published) == 40 and bucket.most > 1
    bucket.published.clear()
    reg = register_dataset(bucket, "many", _listing(images), shard_size=5)
    assert bucket.published == [shard_prefix("many", s) for s in reg.new_shards]
    assert len(reg.new_shards) == 20


def test_bad_dataset_name_or_shard_size(bucket):
    for name in ("Pets", "pets_2", "", "x" * 41, "a/b"):
        with pytest.raises(ValueError, match="Fix: use 1 to 40 lowercase letters"):
            register_dataset(bucket, name, _listing(["file:///a.png"]), shard_size=1)
    with pytest.raises(ValueError, match="Fix: give at least 1"):
        register_dataset(bucket, "ok", _listing(["file:///a.png"]), shard_size=0)


def test_an_unreadable_index_is_never_overwritten(bucket):
    bucket.put_bytes(index_key("broken"), b"not parquet")
    with pytest.raises(ValueError, match="unreadable"):
        register_dataset(bucket, "broken", _listing(["file:///a.png"]), shard_size=1)
    assert bucket.get_bytes(index_key("broken")) == b"not parquet"


# ---- the synthetic sample -----------------------------------------------------------------------


def test_write_synthetic_writes_only_missing_images(bucket):
    from gpudoor_pipelines.data.synthetic import generate_image

    uri = write_synthetic(bucket, "synthetic", num_images=6, image_size=16)
    assert uri == bucket.uri("datasets/synthetic/images")
    listing = list_images(uri)
    assert [u.rsplit("/", 1)[1] for u in listing.images] == [f"img-{i:05d}.png" for i in range(6)]
    assert bucket.get_bytes("datasets/synthetic/images/img-00003.png") == generate_image(3, size=16)[0]

    before = _snapshot(bucket)
    write_synthetic(bucket, "synthetic", num_images=6, image_size=16)
    assert _snapshot(bucket) == before
    write_synthetic(bucket, "synthetic", num_images=8, image_size=16)
    after = _snapshot(bucket)
    assert {k: v for k, v in after.items() if k in before} == before and len(after) == 8

    reg = register_dataset(bucket, "synthetic", list_images(uri), shard_size=3)
    assert reg.shards == ["synthetic-00000", "synthetic-00001", "synthetic-00002"]
    assert json.loads(bucket.get_bytes(f"{shard_prefix('synthetic', 'synthetic-00002')}/_manifest.json"))["count"] == 2


def test_resolver_for_reads_the_bucket_through_itself(bucket, tmp_path):
    _file(bucket.path_of("datasets/x/images/a.png"))
    resolve = resolver_for(bucket)
    assert resolve(bucket.uri("datasets/x/images")) == (bucket, "datasets/x/images")
    other, key = resolve(_uri(tmp_path / "elsewhere"))
    assert other is not bucket and key == _uri(tmp_path / "elsewhere")[len("file:///") :]
    listing = list_images(bucket.uri("datasets/x/images"), bucket_for=resolve)
    assert listing.images == [bucket.uri("datasets/x/images/a.png")]
