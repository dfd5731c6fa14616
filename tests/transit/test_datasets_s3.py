"""Datasets and caption merges on S3, against a real S3 API over HTTP on 127.0.0.1 (moto server):
S3 prefixes and tables as sources, what a user sees when the source's bucket is wrong, and the shards
and the merged captions written to an S3 transit bucket. Also the listing with sizes on both backends."""

from __future__ import annotations

import io
import json
from collections.abc import Callable

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from transit_helpers import (
    TEST_KEY_ID,
    TEST_REGION,
    TEST_SECRET,
    closed_port,
    make_s3_bucket,
    moto_auth_enforced,
    raw_client,
)

from gpudoor_pipelines.data.captions import captions_prefix, done_shards, merge_captions
from gpudoor_pipelines.data.datasets import register_dataset, shard_prefix, write_synthetic
from gpudoor_pipelines.data.sources import DatasetSourceError, list_images, resolver_for
from gpudoor_pipelines.transit import uris as transit
from gpudoor_pipelines.transit.bucket import TransitBucket
from gpudoor_pipelines.transit.s3 import S3TransitBucket

MODEL = "color-shape-v1"


def _resolver(endpoint: str, **kwargs) -> Callable[[str], tuple[TransitBucket, str]]:
    """``bucket_for`` reaching every s3:// bucket at ``endpoint`` with the given (or the test) keys."""

    def bucket_for(uri: str) -> tuple[TransitBucket, str]:
        name, _, key = uri[len("s3://") :].partition("/")
        return make_s3_bucket(endpoint, name, prefix="", max_attempts=1, **kwargs), key.strip("/")

    return bucket_for


def _put(client, bucket: str, objects: dict[str, bytes]) -> None:
    for key, data in objects.items():
        client.put_object(Bucket=bucket, Key=key, Body=data)


def test_list_sized_matches_list_keys(transit_bucket: TransitBucket):
    files = {"a/x.bin": b"12345", "a/empty": b"", "a/y/z.bin": b"1", "b": b"22"}
    transit_bucket.publish("p", {}, files=files)
    sized = list(transit_bucket.list_sized("p/"))
    assert [k for k, _ in sized] == list(transit_bucket.list_keys("p/"))
    assert dict(sized) == {**{f"p/{k}": len(v) for k, v in files.items()}, "p/_manifest.json": 2}  # "{}"
    assert list(transit_bucket.list_sized("p/a/", start_after="p/a/x.bin")) == [("p/a/y/z.bin", 1)]


@pytest.mark.s3
def test_s3_prefix_lists_images_and_skips_the_rest(s3_server, s3_bucket_name):
    client = raw_client(s3_server)
    _put(
        client,
        s3_bucket_name,
        {
            "imgs/b.png": b"png",
            "imgs/deep/a.JPG": b"jpg",
            "imgs/empty.webp": b"",
            "imgs/.cache/c.png": b"png",
            "imgs/labels.json": b"{}",
            "imgs2/not-under-the-prefix.png": b"png",
        },
    )
    listing = list_images(f"s3://{s3_bucket_name}/imgs/", bucket_for=_resolver(s3_server))
    root = f"s3://{s3_bucket_name}/imgs"
    assert listing.source == root
    assert listing.images == [f"{root}/b.png", f"{root}/deep/a.JPG"]
    assert sorted(listing.skipped) == [
        (f"{root}/.cache/c.png", "hidden file"),
        (f"{root}/empty.webp", "empty file (0 bytes)"),
        (f"{root}/labels.json", "not an image extension ('.json')"),
    ]


@pytest.mark.s3
def test_s3_source_through_the_aws_environment(s3_server, s3_bucket_name, monkeypatch):
    """The default ``bucket_for`` is configured the way jobs are: by the AWS_* variables."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", TEST_KEY_ID)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", TEST_SECRET)
    monkeypatch.setenv("AWS_REGION", TEST_REGION)
    transit._bucket_for.cache_clear()
    try:
        _put(
            raw_client(s3_server),
            s3_bucket_name,
            {"team/a.png": b"x", "team/list.csv": b"uri\na.png\n/b.png\n"},
        )
        assert list_images(f"s3://{s3_bucket_name}/team").images == [f"s3://{s3_bucket_name}/team/a.png"]
        # a table's relative entries resolve in the table's bucket; '/b.png' is that bucket's root
        assert list_images(f"s3://{s3_bucket_name}/team/list.csv").images == [
            f"s3://{s3_bucket_name}/b.png",
            f"s3://{s3_bucket_name}/team/a.png",
        ]
    finally:
        transit._bucket_for.cache_clear()


@pytest.mark.s3
def test_s3_table_of_uris(s3_server, s3_bucket_name):
    buffer = io.BytesIO()
    pd.DataFrame({"image_uri": ["x/1.png", "../up/2.jpeg", "s3://other/3.png", None]}).to_parquet(buffer)
    _put(raw_client(s3_server), s3_bucket_name, {"tables/v1/list.parquet": buffer.getvalue()})
    listing = list_images(f"s3://{s3_bucket_name}/tables/v1/list.parquet", bucket_for=_resolver(s3_server))
    assert listing.images == [
        "s3://other/3.png",
        f"s3://{s3_bucket_name}/tables/up/2.jpeg",
        f"s3://{s3_bucket_name}/tables/v1/x/1.png",
    ]
    assert [reason for _, reason in listing.skipped] == ["empty cell"]


def _error(source: str, bucket_for) -> DatasetSourceError:
    with pytest.raises(DatasetSourceError) as caught:
        list_images(source, bucket_for=bucket_for)
    err = caught.value
    assert err.uri == source.rstrip("/") and "Fix: " in str(err)
    assert TEST_SECRET not in str(err)
    return err


@pytest.mark.s3
def test_s3_source_errors_say_what_to_fix(s3_server, s3_bucket_name):
    err = _error("s3://no-such-team-bucket/imgs", _resolver(s3_server))
    assert err.problem == f"the bucket 'no-such-team-bucket' does not exist at {s3_server} (NoSuchBucket)"
    assert "create the bucket" in err.fix

    err = _error(f"s3://{s3_bucket_name}/nothing-here/", _resolver(s3_server))
    assert err.problem == "no objects under this prefix"

    err = _error(f"s3://{s3_bucket_name}/list.parquet", _resolver(s3_server))
    assert err.problem == "the table does not exist"

    port = closed_port()
    err = _error(f"s3://{s3_bucket_name}/imgs", _resolver(f"http://127.0.0.1:{port}"))
    assert f"127.0.0.1:{port} cannot be reached" in err.problem and "AWS_ENDPOINT_URL" in err.fix


@pytest.mark.s3
def test_s3_access_denied(s3_server, s3_bucket_name):
    secret = "wrong-secret-never-shown"
    bucket_for = _resolver(s3_server, access_key_id="AKIAWRONGKEYID000000", secret_access_key=secret)
    with moto_auth_enforced(s3_server):
        err = _error(f"s3://{s3_bucket_name}/imgs", bucket_for)
    assert err.problem == "access denied listing or reading it (InvalidAccessKeyId)"
    assert "s3:ListBucket" in err.fix
    assert secret not in str(err) and "AKIAWRONGKEYID000000" not in str(err)


def _write_caption_shard(bucket: TransitBucket, shard: str, images: list[str]) -> None:
    prefix = captions_prefix(MODEL, shard)
    rows = [(uri, uri.rsplit("/", 1)[1][:-4], None if i == 0 else f"caption of {uri}") for i, uri in enumerate(images)]
    table = pa.table(
        {
            "image_uri": [r[0] for r in rows],
            "image_id": [r[1] for r in rows],
            "caption": pa.array([r[2] for r in rows], pa.string()),
            "model": [MODEL] * len(rows),
            "error": pa.array(["cannot decode"] + [None] * (len(rows) - 1), pa.string()),
        }
    )
    buffer = io.BytesIO()
    pq.write_table(table, buffer)
    manifest = {"shard": shard, "model": MODEL, "count": len(rows), "parts": ["part-00000.parquet"]}
    bucket.publish(prefix, manifest, files={"part-00000.parquet": buffer.getvalue()})


@pytest.mark.s3
def test_register_and_merge_on_an_s3_transit_bucket(s3_bucket: S3TransitBucket, tmp_path):
    source = write_synthetic(s3_bucket, "synthetic", num_images=9, image_size=16)
    assert source == f"s3://{s3_bucket.bucket}/transit/datasets/synthetic/images"
    listing = list_images(source, bucket_for=resolver_for(s3_bucket))
    reg = register_dataset(s3_bucket, "synthetic", listing, shard_size=4)
    assert reg.shards == ["synthetic-00000", "synthetic-00001", "synthetic-00002"]
    manifest = s3_bucket.read_manifest(shard_prefix("synthetic", "synthetic-00002"))
    assert manifest["images"] == [f"{source}/img-00008.png"]
    again = register_dataset(s3_bucket, "synthetic", listing, shard_size=4)
    assert again.new_shards == [] and again.shards == reg.shards

    for shard in reg.shards[:2]:  # the third is still being captioned
        _write_caption_shard(s3_bucket, shard, s3_bucket.read_manifest(shard_prefix("synthetic", shard))["images"])
    assert done_shards(s3_bucket, MODEL) == set(reg.shards[:2])

    result = merge_captions(s3_bucket, MODEL, reg.shards, "datasets/synthetic/captioned")
    assert (result.rows, result.skipped, result.missing) == (6, 2, ["synthetic-00002"])
    frame = pd.read_parquet(io.BytesIO(s3_bucket.get_bytes(result.file_key)))
    assert list(frame.columns) == ["image_id", "image_uri", "caption", "shard"]
    assert frame.image_id.tolist() == [
        "img-00001",
        "img-00002",
        "img-00003",
        "img-00005",
        "img-00006",
        "img-00007",
    ]
    published = json.loads(s3_bucket.get_bytes(result.manifest_key))
    assert published["rows"] == 6 and published["missing"] == ["synthetic-00002"]
