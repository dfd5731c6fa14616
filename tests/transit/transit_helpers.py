"""Helpers shared by the transit tests (a uniquely named module, so it never clashes with other
test folders' conftest modules)."""

from __future__ import annotations

import contextlib
import socket
import urllib.request
from collections.abc import Iterator

from gpudoor_pipelines.transit.s3 import S3TransitBucket

TEST_KEY_ID = "testing-key-id"
TEST_SECRET = "testing-secret-key-value"
TEST_REGION = "us-east-1"


def raw_client(endpoint: str, *, key_id: str = TEST_KEY_ID, secret: str = TEST_SECRET):
    import boto3
    from botocore.config import Config

    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id=key_id,
        aws_secret_access_key=secret,
        region_name=TEST_REGION,
        config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 2, "mode": "standard"}),
    )


def empty_and_delete_bucket(client, name: str) -> None:
    with contextlib.suppress(Exception):
        for page in client.get_paginator("list_multipart_uploads").paginate(Bucket=name):
            for up in page.get("Uploads", ()):
                client.abort_multipart_upload(Bucket=name, Key=up["Key"], UploadId=up["UploadId"])
    with contextlib.suppress(Exception):
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=name):
            objs = [{"Key": o["Key"]} for o in page.get("Contents", ())]
            if objs:
                client.delete_objects(Bucket=name, Delete={"Objects": objs, "Quiet": True})
        client.delete_bucket(Bucket=name)


def make_s3_bucket(endpoint: str, name: str, prefix: str = "transit", **kwargs) -> S3TransitBucket:
    return S3TransitBucket(
        name,
        prefix,
        endpoint_url=endpoint,
        region=TEST_REGION,
        access_key_id=kwargs.pop("access_key_id", TEST_KEY_ID),
        secret_access_key=kwargs.pop("secret_access_key", TEST_SECRET),
        **kwargs,
    )


def closed_port() -> int:
    """A 127.0.0.1 port nothing listens on."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def moto_auth_enforced(endpoint: str) -> Iterator[None]:
    """Make the moto server check signatures/access keys (it accepts anything by default)."""

    def post(value: str) -> None:
        req = urllib.request.Request(
            f"{endpoint}/moto-api/reset-auth",
            data=value.encode(),
            method="POST",
            headers={"Content-Type": "text/plain"},  # not a form: moto reads the raw body
        )
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with opener.open(req, timeout=10) as r:
            r.read()

    post("0")
    try:
        yield
    finally:
        post("inf")
