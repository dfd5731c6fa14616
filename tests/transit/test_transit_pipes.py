"""Dagster Pipes through the transit bucket: context in, messages out, nothing left behind."""

import os
import subprocess
import sys

import dagster as dg
import pytest
from transit_helpers import TEST_KEY_ID, TEST_REGION, TEST_SECRET, raw_client

from gpudoor_pipelines.transit.pipes import PIPES_PREFIX, pipes_context_injector, pipes_message_reader
from gpudoor_pipelines.transit.resource import TransitBucketResource

# the "job": a plain python process with dagster_pipes and boto3, configured only by its env
JOB_SCRIPT = r"""
import os
from dagster_pipes import open_dagster_pipes

kwargs = {}
if os.environ["TEST_PIPES_KIND"] == "s3":
    import boto3
    from dagster_pipes import PipesS3ContextLoader, PipesS3MessageWriter

    client = boto3.client("s3")  # endpoint, region and credentials from the AWS_* env
    kwargs = dict(context_loader=PipesS3ContextLoader(client), message_writer=PipesS3MessageWriter(client))

with open_dagster_pipes(**kwargs) as pipes:
    greeting = pipes.get_extra("greeting")
    pipes.log.info(f"job says {greeting}")
    pipes.report_asset_materialization(
        metadata={"rows": {"raw_value": 42, "type": "int"}, "greeting": greeting, "partition": pipes.asset_key}
    )
"""


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.s3)])
def pipes_transit(request, tmp_path) -> TransitBucketResource:
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


def test_pipes_round_trip_through_the_bucket(pipes_transit: TransitBucketResource):
    @dg.asset
    def piped(context: dg.AssetExecutionContext, transit: TransitBucketResource):
        bucket = transit.get_bucket()
        with dg.open_pipes_session(
            context=context,
            context_injector=pipes_context_injector(bucket),
            message_reader=pipes_message_reader(bucket),
            extras={"greeting": "hello"},
        ) as session:
            clean = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "DAGSTER_PIPES"))}
            env = {
                **clean,
                **bucket.job_env(),
                **bucket.job_secrets(),
                **session.get_bootstrap_env_vars(),
                "TEST_PIPES_KIND": transit.kind,
            }
            proc = subprocess.run(
                [sys.executable, "-c", JOB_SCRIPT], env=env, capture_output=True, text=True, timeout=120
            )
            assert proc.returncode == 0, proc.stderr
        yield from session.get_results()

    result = dg.materialize([piped], resources={"transit": pipes_transit})
    assert result.success
    mats = result.asset_materializations_for_node("piped")
    assert len(mats) == 1
    meta = mats[0].metadata
    assert meta["rows"].value == 42
    assert meta["greeting"].value == "hello"

    bucket = pipes_transit.get_bucket()
    assert list(bucket.list_keys(f"{PIPES_PREFIX}/")) == []
    if pipes_transit.kind == "s3":
        # nothing anywhere in the S3 bucket: no context, no message chunks (not even at the root)
        client = raw_client(pipes_transit.endpoint_url)
        leftovers = client.list_objects_v2(Bucket=pipes_transit.bucket).get("Contents", [])
        assert leftovers == []
