"""Dagster Pipes through the transit bucket: context in, messages out, nothing left behind."""

import os
import subprocess
import sys
from pathlib import Path

import dagster as dg
import pytest
from transit_helpers import TEST_KEY_ID, TEST_REGION, TEST_SECRET, raw_client

from gpudoor_pipelines.transit.pipes import PIPES_PREFIX, pipes_context_injector, pipes_message_reader
from gpudoor_pipelines.transit.resource import TransitBucketResource

REPO_ROOT = Path(__file__).resolve().parents[2]

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
    return _s3_transit(request.getfixturevalue("s3_server"), request.getfixturevalue("s3_bucket_name"))


def _s3_transit(endpoint: str, bucket: str) -> TransitBucketResource:
    """The transit bucket on the test S3 server, under ``transit/``."""
    return TransitBucketResource(
        kind="s3",
        bucket=bucket,
        prefix="transit",
        endpoint_url=endpoint,
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


# A job as SkyPilot recovers it: attempt 1 is preempted mid-session (no goodbye), attempt 2 runs again with
# the same Pipes params. It reports through the workloads' own reporting.
RECOVERED_JOB = r"""
import os, time
from workloads.reporting import open_reporting, saved

attempt = os.environ["ATTEMPT"]
with open_reporting() as pipes:
    pipes.report_custom_message(saved("part", attempt=attempt))
    if attempt == "1":
        time.sleep(6)  # its chunk goes up (a chunk every 3-5 s), then it is preempted
        os._exit(137)
    pipes.report_custom_message(saved("part", attempt=attempt, last=True))
"""


@pytest.mark.s3
def test_messages_of_a_job_recovered_after_preemption_all_arrive(s3_server, s3_bucket_name):
    transit = _s3_transit(s3_server, s3_bucket_name)
    received = []

    @dg.asset
    def recovered(context: dg.AssetExecutionContext):
        bucket = transit.get_bucket()
        with dg.open_pipes_session(
            context=context,
            context_injector=pipes_context_injector(bucket),
            message_reader=pipes_message_reader(bucket, interval=0.5),
        ) as session:
            clean = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "DAGSTER_PIPES"))}
            env = {
                **clean,
                **bucket.job_env(),
                **bucket.job_secrets(),
                **session.get_bootstrap_env_vars(),
                "PYTHONPATH": str(REPO_ROOT),
            }
            for attempt in ("1", "2"):
                proc = subprocess.run(
                    [sys.executable, "-c", RECOVERED_JOB],
                    env={**env, "ATTEMPT": attempt},
                    capture_output=True,
                    text=True,
                    timeout=120,
                )
                assert proc.returncode == (137 if attempt == "1" else 0), proc.stderr
        received.extend(session.get_custom_messages())
        return dg.MaterializeResult()

    assert dg.materialize([recovered]).success
    assert [(m["attempt"], m.get("last", False)) for m in received] == [("1", False), ("2", False), ("2", True)]
    assert all(isinstance(m["durable_at"], float) for m in received)


# A job that reports once and crashes before saying goodbye: its chunk goes up (a second or two), then it dies.
CRASHING_JOB = r"""
import os, time
import boto3
from dagster_pipes import PipesS3ContextLoader, PipesS3MessageWriter, open_dagster_pipes

client = boto3.client("s3")
pipes = open_dagster_pipes(
    context_loader=PipesS3ContextLoader(client), message_writer=PipesS3MessageWriter(client, interval=0.1)
)
pipes.report_custom_message({"step": 1})
time.sleep(3)
os._exit(3)
"""


@pytest.mark.s3
def test_a_job_that_never_says_goodbye_ends_its_session_at_once_with_every_message(s3_server, s3_bucket_name):
    """A plain script or a crashed job sends no closed message: once it has ended, the reader looks at the
    bucket once more and is done (the stock reader kept looking for ten seconds), and what the job wrote
    before it died still arrives."""
    transit = _s3_transit(s3_server, s3_bucket_name)
    bucket = transit.get_bucket()
    # Never looks on its own while the job runs: the message can only arrive through the look after the end.
    reader = pipes_message_reader(bucket, interval=600)
    received = []

    @dg.asset
    def crashed(context: dg.AssetExecutionContext):
        with dg.open_pipes_session(
            context=context, context_injector=pipes_context_injector(bucket), message_reader=reader
        ) as session:
            clean = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "DAGSTER_PIPES"))}
            env = {**clean, **bucket.job_env(), **bucket.job_secrets(), **session.get_bootstrap_env_vars()}
            proc = subprocess.run([sys.executable, "-c", CRASHING_JOB], env=env, capture_output=True, text=True)
            assert proc.returncode == 3, proc.stderr
        received.extend(session.get_custom_messages())
        return dg.MaterializeResult()

    assert dg.materialize([crashed]).success
    assert received == [{"step": 1}]
    # Found the chunks, then nothing more: done (the stock reader looked once a second for ten seconds).
    assert reader.looks_after_close <= 3
    assert list(bucket.list_keys(f"{PIPES_PREFIX}/")) == []
