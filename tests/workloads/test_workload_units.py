"""In-process checks of the torch-free pieces: storage and the synthetic data.

The captioner and the model are checked through the programs (see the other test files), which
keeps torch out of this process.
"""

from __future__ import annotations

import os

import pytest
from workload_helpers import exists

from gpudoor_pipelines.data.synthetic import COLORS, SHAPES, generate_image, image_id, is_heldout
from gpudoor_pipelines.transit import s3
from gpudoor_pipelines.transit import uris as storage


def test_file_storage_round_trip(tmp_path):
    root = "file://" + str(tmp_path)
    uri = storage.join(root + "/", "/a/", "b", "c.json")
    assert uri == root + "/a/b/c.json"
    assert not exists(uri)
    storage.write_bytes(uri, b"one")
    storage.write_bytes(uri, b"two")  # overwrite in place
    storage.write_bytes(storage.join(root, "a", "z.bin"), b"z")
    assert storage.read_bytes(uri) == b"two"
    assert exists(uri)
    assert storage.list_uris(storage.join(root, "a")) == [root + "/a/b/c.json", root + "/a/z.bin"]
    assert storage.list_uris(storage.join(root, "missing")) == []
    assert not [name for name in os.listdir(tmp_path / "a" / "b") if name.startswith(".tmp-")]
    with pytest.raises(FileNotFoundError):
        storage.read_bytes(storage.join(root, "nope"))
    with pytest.raises(ValueError):
        storage.read_bytes("http://example.invalid/x")


def test_s3_storage_round_trip(monkeypatch):
    moto = pytest.importorskip("moto")
    import boto3

    for name in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    # the buckets, and the boto3 session their clients come from, must be made under the mock
    storage._bucket_for.cache_clear()
    s3._session.cache_clear()
    try:
        with moto.mock_aws():
            boto3.client("s3").create_bucket(Bucket="transit")
            storage.write_bytes("s3://transit/run/b/c.json", b"{}")
            storage.write_bytes("s3://transit/run/a.bin", b"a")
            storage.write_bytes("s3://transit/runner/x", b"not under run/")
            assert storage.read_bytes("s3://transit/run/a.bin") == b"a"
            assert exists("s3://transit/run/b/c.json")
            assert not exists("s3://transit/run/nope")
            assert storage.list_uris("s3://transit/run") == [
                "s3://transit/run/a.bin",
                "s3://transit/run/b/c.json",
            ]
            with pytest.raises(FileNotFoundError):
                storage.read_bytes("s3://transit/run/nope")
    finally:
        storage._bucket_for.cache_clear()  # the cached clients belong to the mock
        s3._session.cache_clear()


def test_generate_image_is_deterministic_and_varied():
    assert generate_image(7) == generate_image(7)
    labels = {generate_image(i)[1:] for i in range(200)}
    assert {c for c, _ in labels} == set(COLORS)
    assert {s for _, s in labels} == set(SHAPES)
    _, color, shape = generate_image(3, color="blue", shape="square")
    assert (color, shape) == ("blue", "square")


def test_heldout_split_is_stable_and_about_a_fifth():
    ids = [image_id(i) for i in range(1000)]
    share = sum(map(is_heldout, ids)) / len(ids)
    assert 0.15 < share < 0.25
    assert [is_heldout(i) for i in ids] == [is_heldout(i) for i in ids]
    assert image_id(42) == "img-00042"
