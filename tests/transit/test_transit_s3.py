"""S3-only behaviour of the transit bucket, against a real S3 API over HTTP on 127.0.0.1."""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

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

from gpudoor_pipelines.transit.bucket import TransitConfigError
from gpudoor_pipelines.transit.s3 import S3TransitBucket

pytestmark = pytest.mark.s3

MiB = 1024 * 1024
REPO = Path(__file__).resolve().parents[2]


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 * MiB):
            h.update(chunk)
    return h.hexdigest()


def _random_file(path: Path, mib: int) -> str:
    h = hashlib.sha256()
    with open(path, "wb") as f:
        for _ in range(mib):
            chunk = os.urandom(MiB)
            f.write(chunk)
            h.update(chunk)
    return h.hexdigest()


def _uploads(bucket: S3TransitBucket) -> list[dict]:
    return bucket.client.list_multipart_uploads(Bucket=bucket.bucket).get("Uploads", [])


# ---- big and many -------------------------------------------------------------------------------


def test_multipart_100mib_round_trip(s3_bucket: S3TransitBucket, tmp_path):
    src = tmp_path / "big.bin"
    digest = _random_file(src, 100)
    s3_bucket.publish("big", {}, files={"blob.bin": src})
    head = s3_bucket.client.head_object(Bucket=s3_bucket.bucket, Key="transit/big/blob.bin")
    assert head["ContentLength"] == 100 * MiB
    assert "-" in head["ETag"], "expected a multipart upload (ETag '<md5>-<parts>')"
    assert _uploads(s3_bucket) == []

    # read back whole (as a job loads a checkpoint): big objects come down in parallel ranged GETs
    assert hashlib.sha256(s3_bucket.get_bytes("big/blob.bin")).hexdigest() == digest


def test_two_thousand_small_files(s3_bucket: S3TransitBucket, tmp_path):
    src = tmp_path / "src"
    files = {}
    for i in range(2000):
        rel = f"part-{i % 20:02d}/item-{i:05d}.json"
        data = json.dumps({"i": i, "pad": "x" * (i % 700)}).encode()
        files[rel] = data
        p = src / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
    t0 = time.monotonic()
    s3_bucket.publish("many", {"count": 2000}, files={rel: src / rel for rel in files})
    t_up = time.monotonic() - t0
    keys = list(s3_bucket.list_keys("many/"))
    assert len(keys) == 2001 and keys == sorted(keys) and keys[0] == "many/_manifest.json"

    # read back the way jobs read many objects: read_bytes by URI from a thread pool
    t0 = time.monotonic()
    with ThreadPoolExecutor(16) as pool:
        got = dict(zip(files, pool.map(s3_bucket.get_bytes, [f"many/{rel}" for rel in files]), strict=True))
    t_down = time.monotonic() - t0
    assert got == files
    print(f"2000 files: upload {t_up:.1f}s, download {t_down:.1f}s")


# ---- a failing upload -----------------------------------------------------------------------------


def test_failed_part_aborts_the_upload(s3_server, s3_bucket_name, tmp_path):
    b = make_s3_bucket(
        s3_server,
        s3_bucket_name,
        multipart_threshold=8 * MiB,
        multipart_chunksize=8 * MiB,
        max_concurrency=2,
    )
    src = tmp_path / "f.bin"
    _random_file(src, 40)
    calls = []

    def fail_third_part(**kwargs):
        calls.append(kwargs["params"]["PartNumber"])
        if kwargs["params"]["PartNumber"] == 3:
            raise RuntimeError("injected failure in part 3")

    b.client.meta.events.register("before-parameter-build.s3.UploadPart", fail_third_part)
    with pytest.raises(RuntimeError, match="injected failure"):
        b.publish("f", {"n": 1}, files={"f.bin": src})
    assert not b.exists("f/f.bin")
    assert list(b.list_keys()) == []
    assert _uploads(b) == [], "the multipart upload must be aborted on failure"
    b.close()


def test_transient_errors_are_retried(s3_server, s3_bucket: S3TransitBucket):
    from botocore.awsrequest import AWSResponse
    from botocore.exceptions import ConnectionClosedError

    class _Raw:
        def __init__(self, body: bytes):
            self.body = body

        def stream(self, **kwargs):
            yield self.body

    attempts = []

    def flaky(request, **kwargs):
        attempts.append(1)
        if len(attempts) == 1:
            raise ConnectionClosedError(endpoint_url=request.url)
        if len(attempts) == 2:
            body = b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>"
            return AWSResponse(request.url, 503, {}, _Raw(body))
        if len(attempts) == 3:
            body = b"<Error><Code>InternalError</Code><Message>We encountered an internal error.</Message></Error>"
            return AWSResponse(request.url, 500, {}, _Raw(body))
        return None

    s3_bucket.check()
    s3_bucket.client.meta.events.register("before-send.s3.PutObject", flaky)
    s3_bucket.put_bytes("retried", b"made it")
    assert len(attempts) == 4
    assert s3_bucket.get_bytes("retried") == b"made it"


# ---- bad settings: one clear error, quickly -------------------------------------------------------


def _fails_fast(fn) -> TransitConfigError:
    t0 = time.monotonic()
    with pytest.raises(TransitConfigError) as ei:
        fn()
    assert time.monotonic() - t0 < 10, "a configuration error must not sit through a retry loop"
    assert ei.value.__cause__ is None  # one error, not a chain of botocore tracebacks
    return ei.value


def test_wrong_access_key_id(s3_server, s3_bucket_name):
    b = make_s3_bucket(
        s3_server, s3_bucket_name, access_key_id="AKIAWRONGWRONGWRONG1", secret_access_key="wrong-secret-xyz"
    )
    with moto_auth_enforced(s3_server):
        err = _fails_fast(lambda: b.put_bytes("x", b"1"))
    msg = str(err)
    assert "InvalidAccessKeyId" in msg
    assert "access_key_id" in msg and "GPUDOOR_S3_ACCESS_KEY_ID" in msg
    assert "AKIAWRONGWRONGWRONG1" not in msg and "wrong-secret-xyz" not in msg


def test_wrong_secret_access_key(s3_server, s3_bucket_name):
    import boto3

    iam = boto3.client(
        "iam",
        endpoint_url=s3_server,
        region_name=TEST_REGION,
        aws_access_key_id=TEST_KEY_ID,
        aws_secret_access_key=TEST_SECRET,
    )
    user = f"transit-{s3_bucket_name[-8:]}"
    iam.create_user(UserName=user)
    key = iam.create_access_key(UserName=user)["AccessKey"]
    b = make_s3_bucket(s3_server, s3_bucket_name, access_key_id=key["AccessKeyId"], secret_access_key="not-the-secret")
    with moto_auth_enforced(s3_server):
        err = _fails_fast(b.check)
    msg = str(err)
    assert "SignatureDoesNotMatch" in msg
    assert "secret_access_key" in msg and "GPUDOOR_S3_SECRET_ACCESS_KEY" in msg
    assert "not-the-secret" not in msg and key["SecretAccessKey"] not in msg


def test_missing_bucket(s3_server):
    b = make_s3_bucket(s3_server, "no-such-transit-bucket")
    err = _fails_fast(lambda: b.get_bytes("anything"))
    assert "NoSuchBucket" in str(err) and "`bucket`" in str(err) and "GPUDOOR_S3_BUCKET" in str(err)
    _fails_fast(b.check)


def test_unreachable_endpoint(tmp_path):
    port = closed_port()
    b = make_s3_bucket(f"http://127.0.0.1:{port}", "whatever-bucket")
    (tmp_path / "f").write_text("x")
    err = _fails_fast(lambda: b.publish("x", {}, files={"f": tmp_path / "f"}))
    assert "endpoint_url" in str(err) and f"127.0.0.1:{port}" in str(err)
    assert "GPUDOOR_S3_ENDPOINT_URL" in str(err)
    _fails_fast(b.check)


def test_endpoint_that_is_not_s3():
    import http.server
    import threading

    class NotS3(http.server.BaseHTTPRequestHandler):
        def _reply(self):
            body = b"<html>not an S3 API</html>"
            self.send_response(404)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        do_GET = do_HEAD = do_PUT = do_POST = _reply

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NotS3)
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    try:
        b = make_s3_bucket(f"http://127.0.0.1:{server.server_address[1]}", "some-bucket")
        err = _fails_fast(lambda: b.put_bytes("k", b"v"))
        assert "HTTP 404" in str(err) and "endpoint_url" in str(err)
    finally:
        server.shutdown()
        server.server_close()
        t.join()


def test_half_credentials_rejected_at_construction():
    with pytest.raises(TransitConfigError, match="secret_access_key"):
        S3TransitBucket("b-b-b", access_key_id="only-the-id")
    with pytest.raises(TransitConfigError, match="access_key_id"):
        S3TransitBucket("b-b-b", secret_access_key="only-the-secret")
    with pytest.raises(TransitConfigError, match="bucket"):
        S3TransitBucket("s3://b-b-b/prefix")


# ---- secrets --------------------------------------------------------------------------------------


def test_credentials_never_shown(s3_server, s3_bucket: S3TransitBucket, caplog):
    caplog.set_level(logging.DEBUG)
    b = s3_bucket
    b.put_bytes("k", b"v")
    assert b.get_bytes("k") == b"v"
    list(b.list_keys())
    env = b.job_env()
    shown = repr(b) + str(b) + json.dumps(env) + repr(copy.deepcopy(b))
    assert TEST_SECRET not in shown and TEST_KEY_ID not in shown
    assert TEST_SECRET not in caplog.text  # not even in botocore's debug logs
    ours = "\n".join(r.getMessage() for r in caplog.records if r.name.startswith("gpudoor_pipelines"))
    assert TEST_KEY_ID not in ours
    assert env == {
        "AWS_ENDPOINT_URL": s3_server,
        "AWS_REGION": TEST_REGION,
        "AWS_DEFAULT_REGION": TEST_REGION,
        "AWS_REQUEST_CHECKSUM_CALCULATION": "when_required",
        "AWS_RESPONSE_CHECKSUM_VALIDATION": "when_required",
    }
    assert b.job_secrets() == {"AWS_ACCESS_KEY_ID": TEST_KEY_ID, "AWS_SECRET_ACCESS_KEY": TEST_SECRET}
    # a deep copy (e.g. of a resource holding the bucket) still works
    assert copy.deepcopy(b).get_bytes("k") == b"v"


def test_job_env_lets_a_plain_boto3_job_reach_the_bucket(s3_bucket: S3TransitBucket):
    s3_bucket.put_bytes("for-the-job", b"hi")
    script = (
        "import boto3,sys; c=boto3.client('s3'); "
        "sys.stdout.write(c.get_object(Bucket=sys.argv[1], Key='transit/for-the-job')['Body'].read().decode())"
    )
    clean_env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    out = subprocess.run(
        [sys.executable, "-c", script, s3_bucket.bucket],
        env={**clean_env, **s3_bucket.job_env(), **s3_bucket.job_secrets()},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout == "hi"

    # and so can a workload, through the storage layer's URI functions
    script = (
        "import sys; from gpudoor_pipelines.transit.uris import read_bytes; "
        "sys.stdout.write(read_bytes(f's3://{sys.argv[1]}/transit/for-the-job').decode())"
    )
    out = subprocess.run(
        [sys.executable, "-c", script, s3_bucket.bucket],
        cwd=REPO,
        env={**clean_env, **s3_bucket.job_env(), **s3_bucket.job_secrets()},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout == "hi"


def test_the_test_server_lists_like_s3_from_its_index(s3_server, s3_bucket_name):
    """The test server answers listings from a sorted index (as S3 does, so benchmarks over big buckets
    measure the client): same keys, order and pages as S3's rules, through writes, overwrites and deletes."""
    client = raw_client(s3_server)
    names = ["a", "a-b", "a.b", "a/b", "a/b/c", "a0", "ab", "b/x", "é/x", "z/🙂", "a/c", "a/b/d"]
    for name in names:
        client.put_object(Bucket=s3_bucket_name, Key=name, Body=b"1")
    client.put_object(Bucket=s3_bucket_name, Key="a/b", Body=b"2")  # an overwrite is listed once
    client.delete_object(Bucket=s3_bucket_name, Key="a0")
    names.remove("a0")

    def listed(**kw: object) -> list[str]:
        keys, token = [], None
        while True:
            page = client.list_objects_v2(
                Bucket=s3_bucket_name, MaxKeys=2, **kw, **({"ContinuationToken": token} if token else {})
            )
            keys += [o["Key"] for o in page.get("Contents", ())]
            if not page.get("IsTruncated"):
                return keys
            token = page["NextContinuationToken"]

    for prefix in ("", "a", "a/", "a/b", "é", "zz"):
        for after in (None, "", "a", "a/b", "a/b/", "a/b/c", "a0", "b", "zzz"):
            expected = sorted(n for n in names if n.startswith(prefix) and (not after or n > after))
            kw = {"Prefix": prefix, **({"StartAfter": after} if after else {})}
            assert listed(**kw) == expected, (prefix, after)
    # A delimiter still gets moto's own answer.
    page = client.list_objects_v2(Bucket=s3_bucket_name, Delimiter="/", Prefix="a/")
    assert [p["Prefix"] for p in page["CommonPrefixes"]] == ["a/b/"]
