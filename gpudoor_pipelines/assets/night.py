"""A night of captioning: many shards packed into a few jobs on a warm pool sized to the free GPUs.

One Dagster run covers many shards (a partition-key range); each shard still gets its own
materialization the moment its job reports it done. The shards not captioned yet for the model are
split into jobs (a few per worker, so a slow shard does not hold the rest back) and launched as one
batch on a warm pool whose workers fit the free GPUs of the routed pool; shards that fail go again in
the next wave, up to ``max_attempts``. After the window's end nothing new launches: running jobs
finish their current part and the rest waits for the next night.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import dagster as dg

from gpudoor_pipelines.captions import captions_prefix, done_shards
from gpudoor_pipelines.datasets import shard_prefix
from gpudoor_pipelines.launch.backends.base import ResolvedJob
from gpudoor_pipelines.launch.client import PipesSkyPilotClient
from gpudoor_pipelines.launch.request import LaunchRequest, slug
from gpudoor_pipelines.transit.bucket import TransitBucket

#: Jobs per worker when packing: enough that a slow shard does not hold a worker's whole share back,
#: few enough that a 10,000-shard night is tens of jobs (and Pipes channels), not thousands.
JOBS_PER_WORKER = 4


def dataset_of(shard: str) -> str:
    """The dataset a shard key belongs to (``<dataset>-<NNNNN>``)."""
    dataset, _, number = shard.rpartition("-")
    if not dataset or not number.isdigit():
        raise ValueError(f"'{shard}' is not a shard key (<dataset>-NNNNN)")
    return dataset


def pack(shards: Sequence[str], jobs: int) -> list[list[str]]:
    """Splits ``shards`` into at most ``jobs`` contiguous groups of near-equal size (none empty)."""
    jobs = max(1, min(jobs, len(shards)))
    size = math.ceil(len(shards) / jobs)
    return [list(shards[i : i + size]) for i in range(0, len(shards), size)]


@dataclasses.dataclass
class NightReport:
    """How a night went: which shards are done, left for the next night, or failed."""

    done: list[str] = dataclasses.field(default_factory=list)
    already_done: list[str] = dataclasses.field(default_factory=list)
    left: list[str] = dataclasses.field(default_factory=list)
    failed: dict[str, str] = dataclasses.field(default_factory=dict)
    waves: int = 0
    jobs: int = 0
    max_workers: int = 0
    gpu_hours: float = 0.0
    cost_usd: float = 0.0
    no_gpu: str = ""

    def to_metadata(self) -> dict[str, Any]:
        """A summary for the run's log and metadata."""
        return {
            "shards_done": len(self.done),
            "shards_already_done": len(self.already_done),
            "shards_left_for_next_night": len(self.left),
            "shards_failed": len(self.failed),
            "waves": self.waves,
            "jobs": self.jobs,
            "workers_max": self.max_workers,
            "gpu_hours": round(self.gpu_hours, 6),
            "cost_usd_estimate": round(self.cost_usd, 6),
        }


class CaptionNight:
    """Captions the shards of one run, in waves of batches on one warm pool.

    Args:
        context: the caption asset's context (a single partition or a range).
        skypilot: the launcher.
        bucket: the transit bucket.
        request: the caption launch request (spec, overrides, identity).
        window_end: no part starts after it (None: no window, e.g. a run from the UI).
        max_workers: at most this many workers, whatever is free.
        shards_per_job: pack this many shards per job instead of ``JOBS_PER_WORKER`` jobs per worker.
        max_attempts: how many times a shard is tried in this run before it is reported failed.
        wait_for_gpus_s: how long to wait for a free GPU when none is (until the window's end, if sooner).
        clock: the time (tests move it).
    """

    def __init__(
        self,
        context: dg.AssetExecutionContext,
        skypilot: PipesSkyPilotClient,
        bucket: TransitBucket,
        request: LaunchRequest,
        *,
        window_end: datetime.datetime | None = None,
        max_workers: int | None = None,
        shards_per_job: int | None = None,
        max_attempts: int = 3,
        wait_for_gpus_s: float = 600.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.context = context
        self.skypilot = skypilot
        self.bucket = bucket
        self.request = request
        self.window_end = window_end
        self.max_workers = max_workers
        self.shards_per_job = shards_per_job
        self.max_attempts = max(1, max_attempts)
        self.wait_for_gpus_s = wait_for_gpus_s
        self.clock = clock
        self.model = request.env_value("CAPTION_MODEL") or "default"
        self.pool_name = f"gpudoor-caption-{slug(context.run.run_id, 8)}"
        self.report = NightReport()
        self._waited_s = 0.0
        self._waits = 0
        self._job: ResolvedJob | None = None
        self._job_ids: list[str] = []

    # ------------------------------------------------------------------ the night
    def run(self, shards: Sequence[str]) -> NightReport:
        """Captions ``shards``; returns how it went (raises only when nothing could be launched)."""
        done_before = done_shards(self.bucket, self.model)  # one listing, not one request per shard
        todo = [s for s in shards if s not in done_before]
        # Shards captioned already (a range spans them, or an earlier run died after the job finished):
        # materialized once, not again every night.
        known = self.context.instance.get_materialized_partitions(self.context.asset_key)
        for shard in shards:
            if shard in done_before:
                self.report.already_done.append(shard)
                if shard not in known:
                    self._materialize(shard, {"state": "already captioned"})
        attempts: dict[str, int] = {}
        try:
            while todo:
                if self._window_over():
                    self.report.left = todo
                    break
                plan = self.skypilot.plan_batch(
                    self.request, pool_name=self.pool_name, max_workers=self.max_workers
                )
                if plan.workers == 0:
                    if not self._wait_for_gpus(plan.reason):
                        self.report.left = todo
                        break
                    continue
                todo = self._wave(todo, plan.workers, attempts)
                todo = [s for s in todo if attempts.get(s, 0) < self.max_attempts]
        finally:
            self.skypilot.release_pool(self.pool_name)
        return self.report

    def _wave(self, todo: list[str], workers: int, attempts: dict[str, int]) -> list[str]:
        """One batch over ``todo``; returns the shards still to do."""
        jobs = (
            math.ceil(len(todo) / self.shards_per_job) if self.shards_per_job else workers * JOBS_PER_WORKER
        )
        groups = pack(todo, jobs)
        self.report.waves += 1
        self.report.jobs += len(groups)
        self.report.max_workers = max(self.report.max_workers, workers)
        rank_of = {shard: rank for rank, group in enumerate(groups) for shard in group}
        outcome: dict[str, Mapping[str, Any]] = {}

        def on_message(message: Any) -> None:
            if not isinstance(message, Mapping) or message.get("shard") not in rank_of:
                return
            state = message.get("state")
            if state == "done":
                outcome[message["shard"]] = message
                self._materialize(message["shard"], message, rank=rank_of[message["shard"]])
            elif state in ("failed", "stopped"):
                outcome[message["shard"]] = message
                self.context.log.warning(f"shard {message['shard']}: {state}: {message.get('reason', '')}")

        def prepare(pipes_envs: Sequence[Mapping[str, str]]) -> dict[str, str]:
            batch = {
                "window_end": self.window_end.timestamp() if self.window_end else None,
                "jobs": [
                    {"shards": [self._entry(s) for s in group], "pipes_env": dict(env)}
                    for group, env in zip(groups, pipes_envs, strict=True)
                ],
            }
            key = f"batches/caption/{self.context.run.run_id}/wave-{self.report.waves:03d}.json"
            self.bucket.put_bytes(key, json.dumps(batch).encode())
            return {"CAPTION_BATCH_URI": self.bucket.uri(key)}

        self.context.log.info(
            f"Wave {self.report.waves}: {len(todo)} shards in {len(groups)} jobs on {workers} workers"
            + (f", until {self.window_end.isoformat()}" if self.window_end else "")
        )

        def on_submitted(job: ResolvedJob, job_ids: list[str]) -> None:
            self._job, self._job_ids = job, job_ids

        result = self.skypilot.run_batch(
            context=self.context, request=self.request, num_jobs=len(groups), workers=workers,
            pool_name=self.pool_name, prepare=prepare, on_message=on_message, on_submitted=on_submitted,
        )  # fmt: skip
        for record in result.records():
            self.report.gpu_hours += record.gpu_hours
            self.report.cost_usd += record.cost_usd
        still = []
        # A job that ended without a message for a shard (a message lost, a job killed): the manifest is
        # the truth, read with one listing whatever the number of such shards.
        published = done_shards(self.bucket, self.model) if any(s not in outcome for s in todo) else set()
        for shard in todo:
            message = outcome.get(shard, {})
            if message.get("state") == "done" or (not message and shard in published):
                if not message:  # its job succeeded but the message was lost: the manifest is the truth
                    self._materialize(shard, {"state": "done"}, rank=rank_of[shard])
                continue
            if message.get("state") == "stopped":
                still.append(shard)  # the window ended: not a failure
                continue
            attempts[shard] = attempts.get(shard, 0) + 1
            rank = rank_of[shard]
            if rank in result.tails:
                self.report.failed[shard] = str(result.failure(rank))
            else:
                self.report.failed[shard] = (
                    message.get("reason") or f"its job {result.job_ids[rank]} ended without finishing it"
                )
            still.append(shard)
        for shard in self.report.done:
            self.report.failed.pop(shard, None)
        return still

    # ------------------------------------------------------------------ pieces
    def _entry(self, shard: str) -> dict[str, str]:
        return {
            "shard": shard,
            "shard_uri": self.bucket.uri(shard_prefix(dataset_of(shard), shard)),
            "output_uri": self.bucket.uri(captions_prefix(self.model, shard)),
        }

    def _materialize(self, shard: str, message: Mapping[str, Any], rank: int | None = None) -> None:
        """Records the shard's materialization (its own partition) as soon as it is done."""
        metadata: dict[str, Any] = {
            "caption_model": self.model,
            "captions_uri": dg.MetadataValue.path(self.bucket.uri(captions_prefix(self.model, shard))),
        }
        for key, name in (("total", "images_total"), ("captioned", "images_captioned"),
                          ("skipped", "images_skipped"), ("parts", "parts"), ("seconds", "seconds")):  # fmt: skip
            if key in message:
                metadata[name] = message[key]
        if message.get("skipped_images"):
            metadata["skipped_images"] = dg.MetadataValue.json(list(message["skipped_images"]))
        if rank is not None and self._job is not None and self._job.route is not None:
            route = self._job.route
            seconds = float(message.get("seconds") or 0.0)
            metadata.update(
                job_id=self._job_ids[rank], job_rank=rank, worker_pool=self.pool_name, pool=self._job.pool,
                infra=route.infra, accelerators=route.accelerators or "none (CPU-only)",
                # This shard's share of its job: the seconds the job spent on it.
                gpu_hours=round(route.total_gpus * seconds / 3600.0, 6),
                cost_usd_estimate=round(route.usd_per_hour * seconds / 3600.0, 6),
            )  # fmt: skip
        if message.get("state") == "already captioned":
            metadata["note"] = f"already captioned by {self.model}"
        else:
            self.report.done.append(shard)
        self.context.log_event(
            dg.AssetMaterialization(asset_key=self.context.asset_key, partition=shard, metadata=metadata)
        )

    def _window_over(self) -> bool:
        return self.window_end is not None and self.clock() >= self.window_end.timestamp()

    def _wait_for_gpus(self, reason: str) -> bool:
        """Waits a little for a free GPU; False when the wait (or the window) is over."""
        waited = self._waited_s
        limit = self.wait_for_gpus_s
        if self.window_end is not None:
            limit = min(limit, self.window_end.timestamp() - self.clock())
        if waited >= limit:
            self.context.log.warning(f"No free GPU for captioning ({reason}); giving up for now.")
            self.report.no_gpu = reason
            return False
        # Back off from 2 s to 30 s: a GPU freed soon is taken soon, and a long wait costs few requests.
        step = max(0.5, min(30.0, 2.0 * 2 ** self._waits, limit - waited))
        self._waits += 1
        self.context.log.info(f"No free GPU for captioning ({reason}); waiting {step:.0f} s.")
        time.sleep(step)
        self._waited_s = waited + step
        return True
