"""Reporting results to Dagster through Pipes, or to nobody when run by hand.

``open_reporting()`` yields an object with the Pipes calls the workloads use
(``report_asset_materialization``, ``report_asset_check``, ``report_custom_message``, ``log.info``).
Under Dagster Pipes it is the real ``PipesContext``, talking over S3 when the orchestrator passed a
bucket and over local files otherwise; outside Pipes, and on every rank but 0 of a multi-node job, it
is a no-op stand-in so the programs never need to ask.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any, Protocol

from dagster_pipes import (
    PipesContextLoader,
    PipesDefaultContextLoader,
    PipesDefaultMessageWriter,
    PipesEnvVarParamsLoader,
    PipesMessageWriter,
    PipesS3ContextLoader,
    PipesS3MessageWriter,
    PipesS3MessageWriterChannel,
    open_dagster_pipes,
)

from workloads.config import node_rank


def saved(what: str, **fields: Any) -> dict[str, Any]:
    """A custom message saying work is saved up to now (a part written, a checkpoint published).

    Send it right after the save: ``durable_at`` (this machine's UNIX time) tells the step how much
    work a preemption after it loses (``gpudoor_pipelines.launch.record.goodput``).
    """
    return {"saved": what, "durable_at": time.time(), **fields}


class Reporter(Protocol):
    """The part of ``dagster_pipes.PipesContext`` the workloads use."""

    @property
    def log(self) -> logging.Logger: ...

    def report_asset_materialization(self, metadata: Mapping[str, Any] | None = None) -> None: ...

    def report_asset_check(
        self,
        check_name: str,
        passed: bool,
        severity: str = "ERROR",
        metadata: Mapping[str, Any] | None = None,
    ) -> None: ...

    def report_custom_message(self, payload: Any) -> None: ...


class NoOpReporter:
    """Accepts every report and drops it: used outside Pipes and on ranks other than 0."""

    def __init__(self) -> None:
        self._log = logging.getLogger("workloads.reporting.noop")
        self._log.addHandler(logging.NullHandler())
        self._log.propagate = False

    @property
    def log(self) -> logging.Logger:
        return self._log

    def report_asset_materialization(self, metadata: Mapping[str, Any] | None = None) -> None:
        """Drop a materialization report."""

    def report_asset_check(
        self,
        check_name: str,
        passed: bool,
        severity: str = "ERROR",
        metadata: Mapping[str, Any] | None = None,
    ) -> None:
        """Drop an asset check report."""

    def report_custom_message(self, payload: Any) -> None:
        """Drop a custom message."""


class ResumingS3MessageWriter(PipesS3MessageWriter):
    """Dagster's S3 message writer, numbering its chunks after those already under its prefix.

    The orchestrator reads chunks ``1.json``, ``2.json``, ... in order. A managed job that SkyPilot
    recovers after a preemption runs again with the same Pipes params: the stock writer would start
    again at ``1.json``, overwrite the first attempt's chunks, and every message until it passed the
    first attempt's count would never be read. This one carries on from the highest chunk there.
    Chunks go up every 3-5 s (Dagster's default: 10-12 s) so a preempted job loses fewer of its last messages.
    """

    def __init__(self, client: Any, *, interval: float = 3.0) -> None:
        super().__init__(client, interval=interval)

    def make_channel(self, params: Any) -> PipesS3MessageWriterChannel:
        channel = super().make_channel(params)
        prefix = params.get("key_prefix")
        listing = self._client.get_paginator("list_objects_v2").paginate(
            Bucket=params["bucket"], Prefix=f"{prefix}/" if prefix else ""
        )
        indices = [
            int(name.removesuffix(".json"))
            for page in listing
            for obj in page.get("Contents", ())
            if (name := obj["Key"].rsplit("/", 1)[-1]).removesuffix(".json").isdigit()
        ]
        channel._counter = max(indices, default=0) + 1  # dagster-pipes' own counter, pinned with dagster
        return channel


def _s3_client() -> Any:
    import boto3  # only needed when Pipes goes through S3

    return boto3.client("s3")


@contextmanager
def open_reporting() -> Iterator[Reporter]:
    """Open Dagster Pipes when this process was launched by it (and is rank 0), else a no-op.

    Yields:
        The Pipes context, or a :class:`NoOpReporter`.
    """
    params = PipesEnvVarParamsLoader()
    # Only one process may speak for the job: rank 0 owns the Pipes channel in multi-node runs.
    if node_rank() != 0 or not params.is_dagster_pipes_process():
        yield NoOpReporter()
        return
    # A "bucket" key means the orchestrator exchanges context and messages through S3 (a remote
    # node shares no filesystem with it); otherwise the params carry local file paths.
    context_loader: PipesContextLoader = (
        PipesS3ContextLoader(client=_s3_client())
        if "bucket" in params.load_context_params()
        else PipesDefaultContextLoader()
    )
    message_writer: PipesMessageWriter = (
        ResumingS3MessageWriter(client=_s3_client())
        if "bucket" in params.load_messages_params()
        else PipesDefaultMessageWriter()
    )
    with open_dagster_pipes(
        context_loader=context_loader, message_writer=message_writer, params_loader=params
    ) as pipes:
        yield pipes
