"""The TransitBucket interface, run against both backends (local folder and S3 over HTTP)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from transit_helpers import TEST_KEY_ID, TEST_SECRET

from gpudoor_pipelines.transit.bucket import (
    MANIFEST_NAME,
    TMP_PREFIX,
    LocalTransitBucket,
    TransitBucket,
    TransitObjectMissing,
)
from gpudoor_pipelines.transit.s3 import S3TransitBucket

REPO = Path(__file__).resolve().parents[2]


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


def test_missing_key_errors(transit_bucket: TransitBucket, tmp_path):
    b = transit_bucket
    with pytest.raises(TransitObjectMissing) as ei:
        b.get_bytes("no/such/key")
    err = ei.value
    assert err.key == "no/such/key" and err.uri == b.uri("no/such/key")
    assert "no/such/key" in str(err) and b.uri("no/such/key") in str(err)
    assert isinstance(err, FileNotFoundError)
    assert b.read_manifest("no/such") is None


def test_file_round_trip(transit_bucket: TransitBucket, tmp_path):
    src = tmp_path / "src.bin"
    src.write_bytes(bytes(range(256)) * 4096)  # 1 MiB
    key = transit_bucket.publish("files", {"n": 2}, files={"src.bin": src, "deep/dir/b.bin": b"bytes too"})
    assert key == f"files/{MANIFEST_NAME}"
    assert transit_bucket.get_bytes("files/src.bin") == src.read_bytes()
    assert transit_bucket.get_bytes("files/deep/dir/b.bin") == b"bytes too"
    # no temp files left behind
    assert list(transit_bucket.list_keys("files/")) == [key, "files/deep/dir/b.bin", "files/src.bin"]
    if isinstance(transit_bucket, LocalTransitBucket):
        assert sorted(p.name for p in (transit_bucket.root / "files").iterdir()) == [
            MANIFEST_NAME,
            "deep",
            "src.bin",
        ]
    with pytest.raises(ValueError, match=MANIFEST_NAME):
        transit_bucket.publish("files", {}, files={MANIFEST_NAME: b"{}"})


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


def test_manifest_published_last(transit_bucket: TransitBucket, tmp_path):
    b = transit_bucket
    files = {f"shard-{i:04d}.jsonl": b"{}\n" * 10 for i in range(60)}
    src = tmp_path / "shards"
    _write_tree(src, files)
    paths = {rel: src / rel if i % 2 else (src / rel).read_bytes() for i, rel in enumerate(files)}
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
        key = b.publish("out/captions", {"shards": len(files), "format": "jsonl"}, files=paths)
    finally:
        t.join(timeout=30)
        stop.set()
    assert key == manifest_key
    assert b.read_manifest("out/captions") == {"shards": 60, "format": "jsonl"}
    assert sightings and not violations
    assert list(b.list_keys("out/captions/"))[0] == manifest_key  # '_' sorts before 's'


def test_local_atomic_writes_leave_no_temp_files(tmp_path, monkeypatch):
    b = LocalTransitBucket(tmp_path / "root")
    assert b.root_uri == "file://" + str((tmp_path / "root").resolve())

    class Boom(Exception):
        pass

    def failing_writer(src, dst, *args):
        dst.write(b"half")
        raise Boom

    # a writer that dies midway leaves neither the object nor a visible temp file (nor a manifest)
    monkeypatch.setattr(shutil, "copyfileobj", failing_writer)
    (tmp_path / "obj").write_bytes(b"whole object")
    with pytest.raises(Boom):
        b.publish("k", {"n": 1}, files={"obj": tmp_path / "obj"})
    assert not b.exists("k/obj")
    assert list(b.list_keys()) == []
    assert [p.name for p in (b.root / "k").iterdir()] == []
    assert b.job_env() == {} and b.job_secrets() == {}


def test_publish_failed_writer_leaves_no_manifest(transit_bucket: TransitBucket, tmp_path):
    with pytest.raises(FileNotFoundError):
        transit_bucket.publish("p", {"n": 2}, files={"a.bin": b"a", "b.bin": tmp_path / "not-there.bin"})
    assert not transit_bucket.exists(f"p/{MANIFEST_NAME}") and transit_bucket.read_manifest("p") is None
    assert [k for k in transit_bucket.list_keys("p/") if k != "p/a.bin"] == []


# A writer killed (SIGKILL, as a preempted node is) while publishing a big file: it reports once that
# the big file is partly written, then stalls until it is killed.
_KILLED_PUBLISHER = r"""
import json, shutil, sys, time
args = json.loads(sys.argv[1])
sys.path.insert(0, args["repo"])
from gpudoor_pipelines.transit.bucket import LocalTransitBucket
from gpudoor_pipelines.transit.s3 import S3TransitBucket

def stall(*_, **__):
    print("PART", flush=True)
    time.sleep(600)

if args["kind"] == "local":
    b = LocalTransitBucket(args["root"])
    copy = shutil.copyfileobj
    def half_then_stall(src, dst, length=0):
        dst.write(src.read(8 << 20))
        dst.flush()
        stall()
    shutil.copyfileobj = half_then_stall
else:
    b = S3TransitBucket(args["bucket"], "transit", endpoint_url=args["endpoint"],
                        access_key_id=args["key_id"], secret_access_key=args["secret"],
                        multipart_threshold=8 << 20, multipart_chunksize=8 << 20, max_concurrency=1)
    b.client.meta.events.register("after-call.s3.UploadPart", stall)
small = {f"small-{i}.txt": f"small {i}".encode() for i in range(3)}
b.publish("out", {"n": 4}, files={**small, "big.bin": args["path"]})
print("DONE", flush=True)
"""


def test_publish_killed_writer_leaves_no_manifest_and_no_partial_object(request, transit_bucket, tmp_path):
    src = tmp_path / "big.bin"
    src.write_bytes(os.urandom(24 << 20))  # 3 parts of 8 MiB
    args = {"repo": str(REPO), "path": str(src)}
    if isinstance(transit_bucket, S3TransitBucket):
        args.update(kind="s3", bucket=transit_bucket.bucket, endpoint=request.getfixturevalue("s3_server"))
        args.update(key_id=TEST_KEY_ID, secret=TEST_SECRET)
    else:
        args.update(kind="local", root=str(transit_bucket.root))
    proc = subprocess.Popen(
        [sys.executable, "-c", _KILLED_PUBLISHER, json.dumps(args)], stdout=subprocess.PIPE, text=True
    )
    try:
        line = proc.stdout.readline().strip()  # blocks until part of the big file is written
        assert line == "PART", f"the publisher did not start writing the big file: {line!r}"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL

    # readers see no manifest, no part of the big file, and only whole objects
    assert transit_bucket.read_manifest("out") is None
    assert not transit_bucket.exists("out/big.bin")
    listed = list(transit_bucket.list_keys("out/"))
    assert set(listed) <= {f"out/small-{i}.txt" for i in range(3)}
    for key in listed:
        assert transit_bucket.get_bytes(key) == f"small {key[-5]}".encode()
    if isinstance(transit_bucket, S3TransitBucket):
        # the parts are stored but invisible; a bucket lifecycle rule (AbortIncompleteMultipartUpload)
        # removes them, and the test bucket's teardown aborts them
        uploads = transit_bucket.client.list_multipart_uploads(Bucket=transit_bucket.bucket).get("Uploads", [])
        assert [u["Key"] for u in uploads] == ["transit/out/big.bin"]
    else:  # the half-written temp file is on disk, under a name listings skip
        assert any(p.name.startswith(TMP_PREFIX) for p in (transit_bucket.root / "out").iterdir())


_IMPORTS = r"""
import sys
import gpudoor_pipelines.transit.bucket, gpudoor_pipelines.transit.uris, gpudoor_pipelines.transit.s3
import workloads.caption, workloads.checkpoints, workloads.evaluate, workloads.model, workloads.serve
import workloads.train, workloads.training
loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("dagster", "dagster_aws", "upath"))
assert not loaded, f"importing the storage layer and the workloads imported {loaded}"
import gpudoor_pipelines.transit.pipes
assert "dagster_aws" not in sys.modules, "importing pipes imported dagster_aws (seconds); import it lazily"
"""


def test_storage_layer_and_workloads_import_without_dagster():
    out = subprocess.run([sys.executable, "-c", _IMPORTS], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


# Local listings: tricky sibling names ('a' sorts before 'a-b' < 'a.b' < 'a/' < 'a0' < 'ab'), files and
# folders of those names, unicode (2- and 4-byte UTF-8) and deep paths
_TRICKY_KEYS = [
    *("a", "a-b", "a.b", "a0", "ab", "Z", "\u00e9/x", "\u00e9e", "\U0001f600"),
    *("d/a/b/c", "d/a/b-c", "d/a/b0", "d/a/x", "d/a-b", "d/a.b/x", "d/a0", "d/ab/y", "d/e", "d/\u00e9/x"),
    *("e/a/b", "e/a/b-c", "e/a/b.c", "e/a/b0/x", "e/a0/b"),
    *("deep/1/2/3/4/5/6/leaf", "deep/1/2/3/4/5/6/leaf2", "deep/1/2/x", "deep/1/2/3/4/5/y"),
]


def _tricky_bucket(tmp_path: Path) -> tuple[LocalTransitBucket, list[str]]:
    b = LocalTransitBucket(tmp_path / "root")
    _write_tree(b.root, {k: k.encode() for k in _TRICKY_KEYS})
    # temp files (writes in flight) beside the keys, at every level
    _write_tree(b.root, {f"{TMP_PREFIX}x": b"", f"d/a/{TMP_PREFIX}b": b"", f"deep/1/2/{TMP_PREFIX}z": b""})
    folders = {k.rsplit("/", i)[0] for k in _TRICKY_KEYS for i in range(1, k.count("/") + 1)}
    return b, sorted(folders)


def test_local_list_keys_matches_sorted_filter(tmp_path):
    b, folders = _tricky_bucket(tmp_path)
    keys = sorted(_TRICKY_KEYS)
    between = ["a-", "a/", "d/a/b/b", "d/a/bz", "d/a0/", "deep/1/2/3/4/5/6/leaf1", "e/a/b/", "e/a/b/x"]
    starts = [None, "", *keys, *folders, *(f + "/" for f in folders), *between, "\U0010ffff", "~"]
    starts += [k[:-1] for k in keys]  # mid-name
    prefixes = ["", "/", "a", "a/", "d", "d/", "d/a", "d/a/", "d/a/b", "d/a/b/", "d/a.", "e/a/b", "e/a/b/"]
    prefixes += ["\u00e9", "deep/1/2/3", "deep/1/2/3/", "nope/", "nope", "/d/a", "Z", "zz", "d/\u00e9/"]
    prefixes += [k[:-1] for k in keys] + keys
    for prefix in prefixes:
        for after in starts:
            expected = [k for k in keys if k.startswith(prefix.lstrip("/")) and k > (after or "")]
            assert list(b.list_keys(prefix, start_after=after)) == expected, (prefix, after)
    assert [k for k, _ in b.list_sized("d/a/", start_after="d/a/b-c")] == ["d/a/b/c", "d/a/b0", "d/a/x"]
    assert list(b.list_sized("e/a/b")) == [(k, len(k)) for k in keys if k.startswith("e/a/b")]


def test_local_list_keys_never_lists_temp_files_or_folders(tmp_path):
    b, folders = _tricky_bucket(tmp_path)
    listed = list(b.list_keys())
    assert listed == sorted(_TRICKY_KEYS)
    assert not any(k.rsplit("/", 1)[-1].startswith(TMP_PREFIX) for k in listed)
    assert not set(listed) & set(folders)
    assert [k for k, _ in b.list_sized()] == listed


def test_local_list_keys_links_as_os_walk(tmp_path):
    b = LocalTransitBucket(tmp_path / "root")
    _write_tree(b.root, {"real/x": b"x", "f": b"f"})
    (b.root / "link-dir").symlink_to(b.root / "real")  # a link to a folder: neither listed nor followed
    (b.root / "link-file").symlink_to(b.root / "f")  # to a file: listed
    (b.root / "dangling").symlink_to(b.root / "gone")  # dangling: listed, size 0
    assert list(b.list_keys()) == ["dangling", "f", "link-file", "real/x"]
    assert list(b.list_sized()) == [("dangling", 0), ("f", 1), ("link-file", 1), ("real/x", 1)]
    assert list(b.list_keys("f/")) == [] and list(b.list_keys("gone/")) == []


def test_local_list_keys_scans_only_what_it_yields(tmp_path, monkeypatch):
    import gpudoor_pipelines.transit.bucket as bucket_module

    b = LocalTransitBucket(tmp_path / "root")
    steps = [f"checkpoints/training-{t:03d}/step-{s:06d}" for t in range(100) for s in range(0, 5000, 100)]
    for step in steps:
        (b.root / step).mkdir(parents=True)
        (b.root / step / "model.pt").write_bytes(b"")
        (b.root / step / MANIFEST_NAME).write_bytes(b"{}")
    keys = sorted(f"{step}/{name}" for step in steps for name in ("model.pt", MANIFEST_NAME))
    assert len(keys) == 10_000

    scanned: list[str] = []
    scandir = os.scandir

    def counting_scandir(path):
        scanned.append(os.fspath(path))
        return scandir(path)

    monkeypatch.setattr(bucket_module.os, "scandir", counting_scandir)
    # a sensor's call with its cursor near the end: the work is that of the 9 new keys, not of 10,000
    assert list(b.list_keys("checkpoints/", start_after=keys[-10])) == keys[-9:]
    assert len(scanned) <= 10, scanned
    scanned.clear()
    listing = b.list_keys("checkpoints/")
    assert [next(listing) for _ in range(3)] == keys[:3]
    assert len(scanned) <= 5, scanned
    listing.close()
    scanned.clear()
    assert list(b.list_keys("checkpoints/", start_after=keys[4999])) == keys[5000:]
    # checkpoints/, training-049 and its last step (the cursor's path), then the 50 trainings after it
    assert len(scanned) == 3 + 50 * (1 + 50), len(scanned)
