"""Dagster Pipes through the transit bucket: a job's context goes in, and its messages come out, there.

Local buckets use Dagster's temp files; on S3 both live under ``<root>/_pipes/`` until the session ends.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import secrets
from typing import Any

import dagster as dg

from gpudoor_pipelines.transit.bucket import PIPES_PREFIX, TransitBucket
from gpudoor_pipelines.transit.s3 import S3TransitBucket, transient

logger = logging.getLogger(__name__)


def pipes_context_injector(bucket: TransitBucket) -> dg.PipesContextInjector:
    """A Pipes context injector through ``bucket`` (S3: ``<root>/_pipes/context/<random>/context.json``)."""
    if not isinstance(bucket, S3TransitBucket):
        return dg.PipesTempFileContextInjector()
    prefix = bucket._full(f"{PIPES_PREFIX}/context/")
    return _s3_classes()[0](bucket=bucket.bucket, client=bucket.client, key_prefix=prefix, call=bucket._call)


def pipes_message_reader(bucket: TransitBucket, interval: float = 5.0) -> dg.PipesMessageReader:
    """A Pipes message reader through ``bucket`` (S3: ``<root>/_pipes/messages/<random>/<n>.json``,
    polled every ``interval`` seconds)."""
    if not isinstance(bucket, S3TransitBucket):
        return dg.PipesTempFileMessageReader()
    prefix = bucket._full(f"{PIPES_PREFIX}/messages/")
    return _s3_classes()[1](
        bucket=bucket.bucket, client=bucket.client, key_root=prefix, interval=interval, call=bucket._call
    )


@functools.cache
def _s3_classes() -> tuple[type, type]:  # on first use: importing dagster_aws costs seconds
    from dagster_aws.pipes import PipesS3ContextInjector, PipesS3MessageReader
    from dagster_pipes import PipesBlobStoreMessageWriter

    class TransitPipesS3ContextInjector(PipesS3ContextInjector):
        """Deletes the context object however the session ends (the stock one: only on success); waits out an
        outage of the bucket while writing it."""

        def __init__(self, *, call: Any, **kwargs: Any):
            super().__init__(**kwargs)
            self.call = call  # the bucket's own: its clear errors, and an outage waited out

        @contextlib.contextmanager
        def inject_context(self, context: Any):
            key = f"{self.key_prefix}{secrets.token_hex(12)}/context.json"
            body = json.dumps(context).encode()
            self.call("writing a Pipes context", lambda: self.client.put_object(Body=body, Bucket=self.bucket, Key=key))
            try:
                yield {"bucket": self.bucket, "key": key}
            finally:
                _delete_under(self.client, self.bucket, key)

    class TransitPipesS3MessageReader(PipesS3MessageReader):
        """Under the transit root, and deleted afterwards (dagster-aws 0.29's: at the bucket root, kept).

        Done once the session has closed and one look after that found no new chunk. The session closes when
        the job has ended, so everything it wrote is in the bucket by then; the stock reader, not knowing that,
        waited ten more seconds for a job that never says goodbye (a plain script, or one that crashed).
        An outage of the bucket is waited out (the stock reader's thread dies of it, and the messages after it
        are lost; a 5xx it takes for "no chunk yet").
        """

        def __init__(self, *, key_root: str, call: Any, **kwargs: Any):
            super().__init__(include_stdio_in_messages=False, **kwargs)
            self.key_root, self.call = key_root, call
            self._closing = self._drained = False
            self.looks_after_close = 0  # downloads tried after the session closed (for tests)

        @contextlib.contextmanager
        def read_messages(self, handler: Any):
            self._closing = self._drained = False
            with super().read_messages(_DrainedHandler(handler, self)) as params:
                try:
                    yield params
                finally:  # before the stock reader tells its thread the session is closed
                    self._closing = True

        def messages_are_readable(self, params: Any) -> bool:
            return self._looked(self._first_chunk_written, params)  # False: the job wrote nothing

        def _first_chunk_written(self, params: Any) -> bool:
            from botocore.exceptions import ClientError

            if params.get("key_prefix") is None:
                return False
            try:
                self.client.head_object(Bucket=self.bucket, Key=f"{params['key_prefix']}/1.json")
            except ClientError as e:
                if transient(e):
                    raise
                return False
            return True

        def download_messages(self, cursor: Any, params: Any) -> Any:
            return self._looked(lambda p: super(TransitPipesS3MessageReader, self).download_messages(cursor, p), params)

        def download_messages_chunk(self, index: int, params: Any) -> str | None:
            from botocore.exceptions import ClientError

            try:
                obj = self.client.get_object(Bucket=self.bucket, Key=f"{params['key_prefix']}/{index}.json")
            except ClientError as e:
                if transient(e):
                    raise
                return None  # not written yet
            return obj["Body"].read().decode("utf-8")

        def _looked(self, look: Any, params: Any) -> Any:
            closing = self._closing
            result = self.call("reading a job's Pipes messages", lambda: look(params))
            if closing:
                self.looks_after_close += 1
                self._drained = self._drained or not result
            return result

        @contextlib.contextmanager
        def get_params(self):
            prefix = f"{self.key_root}{secrets.token_hex(12)}"
            try:
                yield {
                    "bucket": self.bucket,
                    "key_prefix": prefix,
                    PipesBlobStoreMessageWriter.INCLUDE_STDIO_IN_MESSAGES_KEY: self.include_stdio_in_messages,
                }
            finally:  # read_messages() has joined its reader threads by now
                _delete_under(self.client, self.bucket, prefix + "/")

    return TransitPipesS3ContextInjector, TransitPipesS3MessageReader


class _DrainedHandler:
    """A Pipes message handler as the S3 reader's thread sees it: closed once the reader has drained the
    bucket after the session closed (everything else is the session's own handler)."""

    def __init__(self, handler: Any, reader: Any) -> None:
        self._handler, self._reader = handler, reader

    @property
    def received_closed_message(self) -> bool:
        return self._handler.received_closed_message or self._reader._drained

    def __getattr__(self, name: str) -> Any:
        return getattr(self._handler, name)


def _delete_under(client: Any, bucket: str, prefix: str) -> None:
    try:
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            if objs := [{"Key": o["Key"]} for o in page.get("Contents", ())]:
                client.delete_objects(Bucket=bucket, Delete={"Objects": objs, "Quiet": True})
    except Exception as e:  # cleanup must never mask the run's own outcome
        logger.warning("could not delete pipes objects under s3://%s/%s: %s", bucket, prefix, e)
