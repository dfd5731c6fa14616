"""The TransitBucket interface, run against both backends (local folder and S3 over HTTP)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from gpudoor_pipelines.transit.bucket import (
    MANIFEST_NAME,
    LocalTransitBucket,
    TransitBucket,
    TransitObjectMissing,
    asset_object_key,
)


def _write_tree(root: Path, files: dict[str, bytes]) -> None:
    for rel, data in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)


def test_bytes_round_trip_and_uris(transit_bucket: TransitBucket):
    b = transit_bucket
    assert not b.root_uri.endswith("/")
    assert not b.exists("a/b.bin")
    b.put_bytes("a/b.bin", b"\x00hello")
    assert b.exists("a/b.bin")
    assert b.get_bytes("a/b.bin") == b"\x00hello"
    b.put_bytes("a/b.bin", b"v2")  # overwrite
    assert b.get_bytes("a/b.bin") == b"v2"
    b.put_bytes("empty", b"")
    assert b.get_bytes("empty") == b""

    uri = b.uri("a/b.bin")
    assert uri == f"{b.root_uri}/a/b.bin"
    assert b.key_of(uri) == "a/b.bin"
    assert b.uri("") == b.root_uri and b.key_of(b.root_uri) == ""
    with pytest.raises(ValueError, match="outside the transit bucket"):
        b.key_of("s3://some-other-bucket/a/b.bin")
    for bad in ("", "a/../b", "./a", "a//b"):
        with pytest.raises(ValueError):
            b.put_bytes(bad, b"x")
    assert b.uri_for_asset(["team", "frames"], "2024-01-01") == b.uri("assets/team/frames/2024-01-01.parquet")
    assert asset_object_key(["x"]) == "assets/x/__all__.parquet"


def test_missing_key_errors(transit_bucket: TransitBucket, tmp_path):
    b = transit_bucket
    with pytest.raises(TransitObjectMissing) as ei:
        b.get_bytes("no/such/key")
    err = ei.value
    assert err.key == "no/such/key" and err.uri == b.uri("no/such/key")
    assert "no/such/key" in str(err) and b.uri("no/such/key") in str(err)
    assert isinstance(err, FileNotFoundError)
    with pytest.raises(TransitObjectMissing):
        b.download_file("no/such/key", tmp_path / "out.bin")
    assert not (tmp_path / "out.bin").exists()
    assert b.read_manifest("no/such") is None


def test_file_round_trip(transit_bucket: TransitBucket, tmp_path):
    src = tmp_path / "src.bin"
    src.write_bytes(bytes(range(256)) * 4096)  # 1 MiB
    transit_bucket.upload_file(src, "files/src.bin")
    dst = tmp_path / "deep" / "dir" / "dst.bin"
    transit_bucket.download_file("files/src.bin", dst)
    assert dst.read_bytes() == src.read_bytes()
    assert [p.name for p in dst.parent.iterdir()] == ["dst.bin"]  # no temp files left behind


def test_list_keys_order_prefix_and_cursor(transit_bucket: TransitBucket):
    b = transit_bucket
    keys = ["a.txt", "a/b", "a/c/d", "a-b", "a0", "b", "ab/x", "z/\u00e9t\u00e9", "z/zz"]
    for k in reversed(keys):
        b.put_bytes(k, k.encode())
    expected = sorted(keys, key=lambda k: k.encode("utf-8"))
    assert list(b.list_keys()) == expected
    # raw string prefix, recursive
    assert list(b.list_keys("a/")) == ["a/b", "a/c/d"]
    assert list(b.list_keys("a")) == [k for k in expected if k.startswith("a")]
    assert list(b.list_keys("a/c")) == ["a/c/d"]
    assert list(b.list_keys("nope/")) == []
    # start_after is exclusive, like S3 StartAfter; a sensor keeps the last key as its cursor
    assert list(b.list_keys(start_after="a0")) == expected[expected.index("a0") + 1 :]
    assert list(b.list_keys("a/", start_after="a/b")) == ["a/c/d"]
    assert list(b.list_keys(start_after="a/bb")) == expected[expected.index("a/c/d") :]
    assert list(b.list_keys(start_after=expected[-1])) == []

    cursor, seen = None, []
    while True:
        batch = []
        for k in b.list_keys(start_after=cursor):
            batch.append(k)
            if len(batch) == 2:
                break
        if not batch:
            break
        seen += batch
        cursor = batch[-1]
        if len(seen) == 4:
            b.put_bytes("zzz/new", b"late")  # arrives after the cursor: picked up next time
    assert seen == expected + ["zzz/new"]


def test_upload_download_dir(transit_bucket: TransitBucket, tmp_path):
    files = {f"d{i % 3}/f{i:03d}.txt": f"payload {i}".encode() for i in range(40)}
    files["top.bin"] = b"\x01\x02"
    src = tmp_path / "src"
    _write_tree(src, files)
    keys = transit_bucket.upload_dir(src, "runs/7")
    assert keys == sorted(f"runs/7/{rel}" for rel in files)
    transit_bucket.put_bytes("runs/70/other", b"not mine")

    dst = tmp_path / "dst"
    paths = transit_bucket.download_dir("runs/7", dst)  # folder semantics: not runs/70
    assert sorted(paths) == sorted(str(dst / rel) for rel in files)
    for rel, data in files.items():
        assert (dst / rel).read_bytes() == data
    assert not (dst.parent / "dst" / "other").exists()
    assert transit_bucket.download_dir("runs/none", tmp_path / "none") == []


def test_delete_prefix(transit_bucket: TransitBucket):
    b = transit_bucket
    for i in range(5):
        b.put_bytes(f"runs/1/x{i}", b"x")
    b.put_bytes("runs/10/keep", b"k")
    b.put_bytes("runs/1x", b"k")
    assert b.delete_prefix("runs/1") == 5
    assert list(b.list_keys("runs/")) == ["runs/10/keep", "runs/1x"]
    assert b.delete_prefix("runs/1") == 0
    with pytest.raises(ValueError):
        b.delete_prefix("")


def test_manifest_published_last(transit_bucket: TransitBucket, tmp_path):
    b = transit_bucket
    files = {f"shard-{i:04d}.jsonl": b"{}\n" * 10 for i in range(60)}
    src = tmp_path / "shards"
    _write_tree(src, files)
    expected = sorted(f"out/captions/{rel}" for rel in files)
    manifest_key = f"out/captions/{MANIFEST_NAME}"

    # a reader polls the folder the way a sensor/downstream job does; whenever it sees the
    # manifest, every file must already be visible in that same listing
    violations, sightings = [], []
    stop = threading.Event()

    def reader():
        while not stop.is_set():
            listing = list(b.list_keys("out/captions/"))
            if manifest_key in listing:
                sightings.append(len(listing))
                if [k for k in listing if k != manifest_key] != expected:
                    violations.append(listing)
                return

    t = threading.Thread(target=reader)
    t.start()
    try:
        assert b.read_manifest("out/captions") is None
        b.upload_dir(src, "out/captions")
        assert b.read_manifest("out/captions") is None
        key = b.publish_manifest("out/captions", {"shards": len(files), "format": "jsonl"})
    finally:
        t.join(timeout=30)
        stop.set()
    assert key == manifest_key
    assert b.read_manifest("out/captions") == {"shards": 60, "format": "jsonl"}
    assert sightings and not violations
    assert list(b.list_keys("out/captions/"))[0] == manifest_key  # '_' sorts before 's'


def test_local_atomic_writes_leave_no_temp_files(tmp_path):
    b = LocalTransitBucket(tmp_path / "root")
    assert b.root_uri == "file://" + str((tmp_path / "root").resolve())
    assert b.key_of(str(b.root / "x" / "y")) == "x/y"

    class Boom(Exception):
        pass

    def failing_writer():
        raise Boom

    # a writer that dies midway leaves neither the object nor a visible temp file
    import gpudoor_pipelines.transit.bucket as bucket_mod

    with pytest.raises(Boom):
        bucket_mod._atomic_write(b.path_of("k/obj"), lambda f: (f.write(b"half"), failing_writer()))
    assert not b.exists("k/obj")
    assert list(b.list_keys()) == []
    assert [p.name for p in (b.root / "k").iterdir()] == []
    assert b.job_env() == {} and b.job_secrets() == {}
