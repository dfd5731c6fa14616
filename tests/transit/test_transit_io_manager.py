"""TransitIOManager and TransitBucketResource: materialize small assets against both bucket kinds."""

import dagster as dg
import pandas as pd
import pytest
from transit_helpers import TEST_KEY_ID, TEST_REGION, TEST_SECRET

from gpudoor_pipelines.transit.bucket import LocalTransitBucket, TransitConfigError
from gpudoor_pipelines.transit.io_manager import TransitIOManager, TransitRef
from gpudoor_pipelines.transit.resource import TransitBucketResource, bucket_from_env
from gpudoor_pipelines.transit.s3 import S3TransitBucket


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.s3)])
def transit_resource(request, tmp_path) -> TransitBucketResource:
    if request.param == "local":
        return TransitBucketResource(kind="local", local_root=str(tmp_path / "transit"))
    return TransitBucketResource(
        kind="s3",
        bucket=request.getfixturevalue("s3_bucket_name"),
        prefix="transit",
        endpoint_url=request.getfixturevalue("s3_server"),
        region=TEST_REGION,
        access_key_id=TEST_KEY_ID,
        secret_access_key=TEST_SECRET,
    )


def _resources(transit: TransitBucketResource) -> dict:
    return {"transit": transit, "io_manager": TransitIOManager(transit=transit)}


def _meta(result: dg.ExecuteInProcessResult, node: str) -> dict:
    mats = result.asset_materializations_for_node(node)
    assert len(mats) == 1
    return {k: getattr(v, "value", v) for k, v in mats[0].metadata.items()}


# ---- DataFrames ---------------------------------------------------------------------------------


@dg.asset(key_prefix=["team"])
def frames() -> pd.DataFrame:
    return pd.DataFrame({"clip": ["a", "b", "c"], "seconds": [1.5, 2.0, 3.25]})


@dg.asset(key_prefix=["team"], ins={"frames": dg.AssetIn(key=["team", "frames"])})
def frame_stats(frames: pd.DataFrame) -> pd.DataFrame:
    return pd.DataFrame({"n": [len(frames)], "total": [frames["seconds"].sum()]})


def test_dataframe_assets_round_trip(transit_resource: TransitBucketResource):
    result = dg.materialize([frames, frame_stats], resources=_resources(transit_resource))
    assert result.success
    bucket = transit_resource.get_bucket()
    uri = TransitIOManager(transit=transit_resource).uri_for(["team", "frames"])
    assert uri == bucket.uri("assets/team/frames/__all__.parquet")
    meta = _meta(result, "team__frames")
    assert meta["uri"] == uri
    assert meta["rows"] == 3 and meta["columns"] == 2
    assert meta["dagster/row_count"] == 3
    stats = pd.read_parquet(
        __import__("io").BytesIO(bucket.get_bytes(bucket.key_of(_meta(result, "team__frame_stats")["uri"])))
    )
    assert stats.to_dict("records") == [{"n": 3, "total": 6.75}]
    # the downstream asset's value is also reachable through the IO manager API
    iom = TransitIOManager(transit=transit_resource)
    assert iom.uri_for("team/frames") == uri
    assert iom.uri_for(dg.AssetKey(["team", "frames"])) == uri
    assert iom.uri_for(["team", "frames"], "2024-01-01") == bucket.uri("assets/team/frames/2024-01-01.parquet")
    assert iom.uri_for(["x"]) == bucket.uri("assets/x/__all__.parquet")


@pytest.mark.s3
def test_parquet_readable_by_standard_tools(s3_server, s3_bucket_name, monkeypatch):
    transit = TransitBucketResource(
        kind="s3",
        bucket=s3_bucket_name,
        prefix="transit",
        endpoint_url=s3_server,
        access_key_id=TEST_KEY_ID,
        secret_access_key=TEST_SECRET,
    )
    assert dg.materialize([frames], resources=_resources(transit)).success
    bucket = transit.get_bucket()
    uri = TransitIOManager(transit=transit).uri_for(["team", "frames"])
    assert uri.startswith(f"s3://{s3_bucket_name}/transit/")
    expected = frames()

    # pyarrow with an explicit S3 filesystem
    import pyarrow.fs as pafs
    import pyarrow.parquet as pq

    fs = pafs.S3FileSystem(
        endpoint_override=s3_server,
        access_key=TEST_KEY_ID,
        secret_key=TEST_SECRET,
        region=TEST_REGION,
    )
    table = pq.read_table(uri.removeprefix("s3://"), filesystem=fs)
    pd.testing.assert_frame_equal(table.to_pandas(), expected)

    # pandas straight from the s3:// URI, configured the way a job is (job_env + job_secrets)
    for k, v in {**bucket.job_env(), **bucket.job_secrets()}.items():
        monkeypatch.setenv(k, v)
    pd.testing.assert_frame_equal(pd.read_parquet(uri), expected)

    # duckdb only if its httpfs extension is already installed (tests never download anything)
    duckdb = pytest.importorskip("duckdb")
    con = duckdb.connect()
    try:
        con.execute("SET autoinstall_known_extensions=false")
        con.execute("LOAD httpfs")
    except Exception:
        return
    host = s3_server.removeprefix("http://")
    con.execute(
        f"SET s3_endpoint='{host}'; SET s3_use_ssl=false; SET s3_url_style='path'; "
        f"SET s3_access_key_id='{TEST_KEY_ID}'; SET s3_secret_access_key='{TEST_SECRET}'; "
        f"SET s3_region='{TEST_REGION}'"
    )
    assert con.execute(f"SELECT count(*) FROM read_parquet('{uri}')").fetchone()[0] == 3


# ---- partitions ---------------------------------------------------------------------------------

parts = dg.StaticPartitionsDefinition(["p1", "p2", "p3"])


@dg.asset(partitions_def=parts)
def shards(context: dg.AssetExecutionContext) -> pd.DataFrame:
    pk = context.partition_key
    return pd.DataFrame({"part": [pk, pk], "i": [1, 2]})


@dg.asset(partitions_def=parts)
def shard_sizes(shards: pd.DataFrame) -> pd.DataFrame:
    return pd.DataFrame({"rows": [len(shards)], "part": [shards["part"].iloc[0]]})


@dg.asset(ins={"shards": dg.AssetIn(metadata={"allow_missing_partitions": True})})
def all_shards(shards: dict[str, pd.DataFrame]) -> pd.DataFrame:
    return pd.concat([shards[k] for k in sorted(shards)], ignore_index=True)


def test_partitioned_dataframes(transit_resource: TransitBucketResource):
    res = _resources(transit_resource)
    for pk in ("p1", "p2"):
        r = dg.materialize([shards, shard_sizes], partition_key=pk, resources=res)
        assert r.success
        assert _meta(r, "shards")["uri"] == transit_resource.get_bucket().uri(f"assets/shards/{pk}.parquet")
    r = dg.materialize([shards, shard_sizes, all_shards], selection=["all_shards"], resources=res)
    assert r.success
    bucket = transit_resource.get_bucket()
    import io

    combined = pd.read_parquet(io.BytesIO(bucket.get_bytes("assets/all_shards/__all__.parquet")))
    assert combined["part"].tolist() == ["p1", "p1", "p2", "p2"]  # p3 never materialized: skipped
    sizes = pd.read_parquet(io.BytesIO(bucket.get_bytes("assets/shard_sizes/p2.parquet")))
    assert sizes.to_dict("records") == [{"rows": 2, "part": "p2"}]


def test_multipartition_key_path(transit_resource: TransitBucketResource):
    mp = dg.MultiPartitionsDefinition(
        {
            "date": dg.StaticPartitionsDefinition(["2024-01-01"]),
            "model": dg.StaticPartitionsDefinition(["m1"]),
        }
    )

    @dg.asset(partitions_def=mp)
    def scores() -> pd.DataFrame:
        return pd.DataFrame({"s": [0.5]})

    r = dg.materialize(
        [scores],
        partition_key=dg.MultiPartitionKey({"date": "2024-01-01", "model": "m1"}),
        resources=_resources(transit_resource),
    )
    assert r.success
    assert transit_resource.get_bucket().exists("assets/scores/2024-01-01/m1.parquet")


# ---- TransitRef, None, other values -------------------------------------------------------------


@dg.asset
def captions(transit: TransitBucketResource) -> TransitRef:
    bucket = transit.get_bucket()
    manifest = {"shards": 3, "format": "jsonl"}
    files = {f"shard-{i}.jsonl": b'{"caption": "x"}\n' for i in range(3)}
    bucket.publish("jobs/captions/run-1", manifest, files=files)
    return TransitRef(uri=bucket.uri("jobs/captions/run-1"), manifest=manifest)


@dg.asset
def caption_count(captions: TransitRef, transit: TransitBucketResource) -> int:
    bucket = transit.get_bucket()
    prefix = bucket.key_of(captions.uri)
    assert bucket.read_manifest(prefix) == captions.manifest
    return sum(1 for k in bucket.list_keys(prefix + "/") if k.endswith(".jsonl"))


@dg.asset
def side_effect_only() -> None:
    return None


def test_transit_ref_and_pickled_values(transit_resource: TransitBucketResource):
    r = dg.materialize([captions, caption_count, side_effect_only], resources=_resources(transit_resource))
    assert r.success
    bucket = transit_resource.get_bucket()
    ref = TransitRef.from_json(bucket.get_bytes("assets/captions/__all__.ref.json"))
    assert ref == TransitRef(uri=bucket.uri("jobs/captions/run-1"), manifest={"shards": 3, "format": "jsonl"})
    meta = _meta(r, "captions")
    assert meta["uri"] == bucket.uri("assets/captions/__all__.ref.json")
    assert meta["target_uri"] == ref.uri
    assert r.output_for_node("caption_count") == 3
    assert bucket.exists("assets/caption_count/__all__.pickle")
    # None stores nothing and reports no uri
    assert not [k for k in bucket.list_keys("assets/side_effect_only")]
    assert "uri" not in _meta(r, "side_effect_only")
    assert TransitRef.from_json(ref.to_json()) == ref


def test_missing_upstream_is_a_clear_error(transit_resource: TransitBucketResource):
    r = dg.materialize(
        [frames, frame_stats],
        selection=["team/frame_stats"],
        resources=_resources(transit_resource),
        raise_on_error=False,
    )
    assert not r.success
    failures = [e for e in r.all_events if e.event_type == dg.DagsterEventType.STEP_FAILURE]
    assert failures
    err = failures[0].step_failure_data.error
    text = ""
    while err is not None:
        text += err.message + "\n"
        err = err.cause
    bucket = transit_resource.get_bucket()
    assert "upstream asset 'team/frames'" in text
    assert bucket.uri("assets/team/frames/__all__.parquet") in text
    assert "Materialize 'team/frames' first" in text

    r = dg.materialize(
        [shards, shard_sizes],
        selection=["shard_sizes"],
        partition_key="p3",
        resources=_resources(transit_resource),
        raise_on_error=False,
    )
    assert not r.success
    err = [e for e in r.all_events if e.event_type == dg.DagsterEventType.STEP_FAILURE][0].step_failure_data.error
    text = ""
    while err is not None:
        text += err.message + "\n"
        err = err.cause
    assert "'shards' partition 'p3'" in text and bucket.uri("assets/shards/p3.parquet") in text


# ---- the resource -------------------------------------------------------------------------------


def test_resource_local_default_root(monkeypatch, tmp_path):
    monkeypatch.setenv("GPUDOOR_HOME", str(tmp_path / "home"))
    res = TransitBucketResource()
    monkeypatch.setenv("GPUDOOR_HOME", str(tmp_path / "later"))  # resolved at use, not at construction
    b = res.get_bucket()
    assert isinstance(b, LocalTransitBucket)
    assert b.root == (tmp_path / "later" / "transit").resolve()
    assert res.get_bucket() is b  # cached per resource instance
    monkeypatch.delenv("GPUDOOR_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "userhome"))
    assert TransitBucketResource().get_bucket().root == (tmp_path / "userhome" / ".gpudoor" / "transit").resolve()


def test_resource_invalid_settings():
    with pytest.raises(TransitConfigError, match="`bucket`.*GPUDOOR_S3_BUCKET"):
        TransitBucketResource(kind="s3").get_bucket()
    with pytest.raises(TransitConfigError, match="`kind`.*GPUDOOR_TRANSIT"):
        TransitBucketResource(kind="gcs").get_bucket()
    with pytest.raises(TransitConfigError, match="bare bucket name"):
        TransitBucketResource(kind="s3", bucket="s3://x/y").get_bucket()
    with pytest.raises(TransitConfigError, match="secret_access_key"):
        TransitBucketResource(kind="s3", bucket="bkt", access_key_id="id-only").get_bucket()


def test_bucket_from_env_binds_secrets_as_env_vars(monkeypatch, s3_server="http://127.0.0.1:1"):
    monkeypatch.setenv("GPUDOOR_TRANSIT", "s3")
    monkeypatch.setenv("GPUDOOR_S3_BUCKET", "bkt")
    monkeypatch.setenv("GPUDOOR_S3_PREFIX", "gpudoor/dev")
    monkeypatch.setenv("GPUDOOR_S3_ENDPOINT_URL", s3_server)
    monkeypatch.setenv("GPUDOOR_S3_REGION", "eu-west-1")
    monkeypatch.setenv("GPUDOOR_S3_ACCESS_KEY_ID", "env-key-id")
    monkeypatch.setenv("GPUDOOR_S3_SECRET_ACCESS_KEY", "env-secret-value")
    res = bucket_from_env()
    assert isinstance(res.access_key_id, dg.EnvVar) and res.access_key_id.env_var_name == "GPUDOOR_S3_ACCESS_KEY_ID"
    assert isinstance(res.secret_access_key, dg.EnvVar)
    shown = repr(res) + str(res)
    assert "env-secret-value" not in shown and "env-key-id" not in shown
    b = res.get_bucket()
    assert isinstance(b, S3TransitBucket)
    assert b.root_uri == "s3://bkt/gpudoor/dev" and b.region == "eu-west-1" and b.endpoint_url == s3_server
    assert b.job_secrets() == {"AWS_ACCESS_KEY_ID": "env-key-id", "AWS_SECRET_ACCESS_KEY": "env-secret-value"}
    assert "env-secret-value" not in repr(b)

    # at run time Dagster resolves the EnvVars; the run config only holds their names
    seen = {}

    @dg.asset
    def probe(transit: TransitBucketResource) -> None:
        seen["secret"] = transit.secret_access_key
        seen["repr"] = repr(transit)

    r = dg.materialize([probe], resources={"transit": res})
    assert r.success
    assert seen["secret"] == "env-secret-value" and "env-secret-value" not in seen["repr"]

    for var in (
        "GPUDOOR_TRANSIT",
        "GPUDOOR_S3_BUCKET",
        "GPUDOOR_S3_ACCESS_KEY_ID",
        "GPUDOOR_S3_SECRET_ACCESS_KEY",
    ):
        monkeypatch.delenv(var)
    monkeypatch.setenv("GPUDOOR_TRANSIT_ROOT", "/tmp/somewhere")
    res = bucket_from_env()
    assert res.kind == "local" and res.local_root == "/tmp/somewhere"
    assert res.access_key_id is None and res.secret_access_key is None
