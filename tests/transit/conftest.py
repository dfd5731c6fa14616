"""Fixtures for the transit bucket tests: a real S3 API over HTTP on 127.0.0.1 (moto server).

If ``GPUDOOR_TEST_S3_ENDPOINT`` is set (CI starts ``moto_server -H 127.0.0.1 -p <port>``, or the
faster ``python tests/transit/s3_test_server.py -H 127.0.0.1 -p <port>``), that server is used;
otherwise a ``moto.server.ThreadedMotoServer`` is started on a free 127.0.0.1 port (in a child
process) for the session and stopped at the end.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
from transit_helpers import empty_and_delete_bucket, make_s3_bucket, raw_client

from gpudoor_pipelines.transit.bucket import LocalTransitBucket
from gpudoor_pipelines.transit.s3 import S3TransitBucket


@pytest.fixture
def s3_bucket_name(s3_server: str) -> Iterator[str]:
    """A fresh, empty bucket (deleted with its contents afterwards)."""
    client = raw_client(s3_server)
    name = f"transit-test-{uuid.uuid4().hex[:12]}"
    client.create_bucket(Bucket=name)
    try:
        yield name
    finally:
        empty_and_delete_bucket(client, name)


@pytest.fixture
def s3_bucket(s3_server: str, s3_bucket_name: str) -> Iterator[S3TransitBucket]:
    """An S3TransitBucket on a fresh bucket, under the prefix 'transit'."""
    b = make_s3_bucket(s3_server, s3_bucket_name)
    try:
        yield b
    finally:
        b.close()


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.s3)])
def transit_bucket(request, tmp_path):
    """Each interface test runs against both backends."""
    if request.param == "local":
        return LocalTransitBucket(tmp_path / "transit-root")
    return request.getfixturevalue("s3_bucket")
