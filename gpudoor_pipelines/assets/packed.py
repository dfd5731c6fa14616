"""Many items (dataset shards, checkpoints) packed into a few jobs on a warm pool that fits the free GPUs.

One Dagster run covers many partitions (a partition-key range); each item still gets its own
materialization the moment its job reports it done. The items not done yet are split into jobs (a few
per worker, so a slow item does not hold the rest back) and launched as one batch on a warm pool whose
workers fit the free GPUs of the routed pool; items that fail go again in the next wave, up to
``max_attempts``. With a window, nothing new launches after its end: the rest waits for the next run.

A subclass says what an item is: how its job finds it (:meth:`PackedRun.entry`), whether it is done
already (:meth:`PackedRun.done_items`), and what its materialization records (:meth:`PackedRun.materialize`).
Its jobs read the batch file named by ``batch_env`` and report one custom Pipes message per item,
``{item_field: item, "state": "done" | "failed" | "stopped", ...}``.
"""

from __future__ import annotations

import abc
import dataclasses
import datetime
import json
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import dagster as dg

from gpudoor_pipelines.data import layout
from gpudoor_pipelines.launch.client import PipesSkyPilotClient
from gpudoor_pipelines.launch.job import JobInfo
from gpudoor_pipelines.launch.record.goodput import DURABLE_AT
from gpudoor_pipelines.launch.record.records import BatchResult
from gpudoor_pipelines.launch.resolve.request import LaunchRequest, ResolvedJob, slug
from gpudoor_pipelines.transit.bucket import TransitBucket

#: Jobs per worker when packing: enough that a slow item does not hold a worker's whole share back,
#: few enough that a 10,000-shard night is tens of jobs (and Pipes channels), not thousands.
JOBS_PER_WORKER = 4


def pack(items: Sequence[str], jobs: int) -> list[list[str]]:
    """Splits ``items`` into at most ``jobs`` contiguous groups of near-equal size (none empty)."""
    jobs = max(1, min(jobs, len(items)))
    size = math.ceil(len(items) / jobs)
    return [list(items[i : i + size]) for i in range(0, len(items), size)]


@dataclasses.dataclass
class PackedReport:
    """How a run went: which items are done, left for the next run, or failed."""

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
    #: Jobs that stopped before finishing their items (preempted, killed, failed): their items went to a
    #: later wave, resuming at their last save.
    jobs_interrupted: int = 0
    #: GPU-hours of work those jobs did after their last save, done again by the later wave.
    gpu_hours_lost: float = 0.0

    def to_metadata(self, noun: str = "items") -> dict[str, Any]:
        """A summary for the run's log and metadata."""
        return {
            f"{noun}_done": len(self.done),
            f"{noun}_already_done": len(self.already_done),
            f"{noun}_left_for_next_run": len(self.left),
            f"{noun}_failed": len(self.failed),
            "waves": self.waves,
            "jobs": self.jobs,
            "workers_max": self.max_workers,
            "gpu_hours": round(self.gpu_hours, 6),
            "cost_usd_estimate": round(self.cost_usd, 6),
            "jobs_interrupted": self.jobs_interrupted,
            "gpu_hours_lost_to_interruptions": round(self.gpu_hours_lost, 6),
            "goodput": round(1.0 - self.gpu_hours_lost / self.gpu_hours, 4) if self.gpu_hours > 0 else 1.0,
        }


class PackedRun(abc.ABC):
    """Runs the items of one Dagster run in waves of batches on one warm pool.

    Args:
        context: the asset's context (a single partition or a range).
        skypilot: the launcher.
        bucket: the transit bucket.
        request: the launch request (spec, overrides, identity).
        window_end: no job starts new work after it (None: no window, e.g. a run from the UI).
        max_workers: at most this many workers, whatever is free.
        items_per_job: pack this many items per job instead of ``JOBS_PER_WORKER`` jobs per worker.
        max_attempts: how many times an item is tried in this run before it is reported failed.
        wait_for_gpus_s: how long to wait for a free GPU when none is (until the window's end, if sooner).
        clock: the time (tests move it).
    """

    #: What the jobs read: the environment variable naming the batch file.
    batch_env: str = ""
    #: The field of a job's messages that names the item.
    item_field: str = "item"
    #: What the work is, for names (``caption``, ``eval``) and for messages (``captioning``).
    kind: str = ""
    doing: str = ""

    def __init__(
        self,
        context: dg.AssetExecutionContext,
        skypilot: PipesSkyPilotClient,
        bucket: TransitBucket,
        request: LaunchRequest,
        *,
        window_end: datetime.datetime | None = None,
        max_workers: int | None = None,
        items_per_job: int | None = None,
        max_attempts: int = 3,
        wait_for_gpus_s: float = 600.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.context = context
        self.skypilot = skypilot
        self.bucket = bucket
        # Each job's inputs are its entries of the batch file: the task's required envs are the batch's to give.
        self.request = dataclasses.replace(request, batch_input=self.batch_env)
        self.window_end = window_end
        self.max_workers = max_workers
        self.items_per_job = items_per_job
        self.max_attempts = max(1, max_attempts)
        self.wait_for_gpus_s = wait_for_gpus_s
        self.clock = clock
        self.pool_name = f"gpudoor-{self.kind}-{slug(context.run.run_id, 8)}"
        self.report = PackedReport()
        self._waited_s = 0.0
        self._waits = 0
        self._job: ResolvedJob | None = None
        self._job_ids: list[str] = []
        self._lost: dict[str, tuple[int, float]] = {}  # item -> (interruptions, seconds of work lost)

    # ------------------------------------------------------------------ what a subclass says
    @abc.abstractmethod
    def done_items(self, items: Sequence[str]) -> set[str]:
        """Which of ``items`` are done already (read with few requests, never one per item if avoidable)."""

    @abc.abstractmethod
    def entry(self, item: str) -> dict[str, Any]:
        """What the item's job reads about it in the batch file."""

    @abc.abstractmethod
    def materialize(self, item: str, message: Mapping[str, Any], rank: int | None = None) -> None:
        """Records the item's materialization (its own partition); ``message`` is its job's report, or
        ``{"state": "already done"}`` for an item done before this run."""

    def batch_fields(self) -> dict[str, Any]:
        """Fields of the batch file besides ``jobs``."""
        return {}

    # ------------------------------------------------------------------ the run
    def run(self, items: Sequence[str]) -> PackedReport:
        """Does ``items``; returns how it went (raises only when nothing could be launched)."""
        done_before = self.done_items(items)
        todo = [s for s in items if s not in done_before]
        # Items done already (a range spans them, or an earlier run died after the job finished):
        # materialized once, not again at every run.
        known = self.context.instance.get_materialized_partitions(self.context.asset_key)
        for item in items:
            if item in done_before:
                self.report.already_done.append(item)
                if item not in known:
                    self.materialize(item, {"state": "already done"})
        attempts: dict[str, int] = {}
        try:
            while todo:
                if self._window_over():
                    self.report.left = todo
                    break
                plan = self.skypilot.plan_batch(self.request, pool_name=self.pool_name, max_workers=self.max_workers)
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
        """One batch over ``todo``; returns the items still to do."""
        jobs = math.ceil(len(todo) / self.items_per_job) if self.items_per_job else workers * JOBS_PER_WORKER
        groups = pack(todo, jobs)
        self.report.waves += 1
        self.report.jobs += len(groups)
        self.report.max_workers = max(self.report.max_workers, workers)
        rank_of = {item: rank for rank, group in enumerate(groups) for item in group}
        outcome: dict[str, Mapping[str, Any]] = {}
        saved: dict[int, tuple[float, str]] = {}  # rank -> (its job's last save, the item it was on)
        field = self.item_field

        def on_message(message: Any) -> None:
            if not isinstance(message, Mapping) or message.get(field) not in rank_of:
                return
            rank = rank_of[message[field]]
            if (
                isinstance(message.get(DURABLE_AT), int | float)
                and message[DURABLE_AT] >= saved.get(rank, (0.0, ""))[0]
            ):
                saved[rank] = (float(message[DURABLE_AT]), message[field])
            state = message.get("state")
            if state == "done":
                outcome[message[field]] = message
                self._done(message[field], message, rank_of[message[field]])
            elif state in ("failed", "stopped"):
                outcome[message[field]] = message
                self.context.log.warning(f"{field} {message[field]}: {state}: {message.get('reason', '')}")

        def prepare(pipes_envs: Sequence[Mapping[str, str]]) -> dict[str, str]:
            batch = {
                **self.batch_fields(),
                "jobs": [
                    {self.item_field + "s": [self.entry(s) for s in group], "pipes_env": dict(env)}
                    for group, env in zip(groups, pipes_envs, strict=True)
                ],
            }
            key = f"{layout.BATCHES}/{self.kind}/{self.context.run.run_id}/wave-{self.report.waves:03d}.json"
            self.bucket.put_bytes(key, json.dumps(batch).encode())
            return {self.batch_env: self.bucket.uri(key)}

        self.context.log.info(
            f"Wave {self.report.waves}: {len(todo)} {field}s in {len(groups)} jobs on {workers} workers"
            + (f", until {self.window_end.isoformat()}" if self.window_end else "")
        )

        def on_submitted(job: ResolvedJob, job_ids: list[str]) -> None:
            self._job, self._job_ids = job, job_ids

        def on_preempted(rank: int, info: JobInfo, seen_at: float) -> None:
            # SkyPilot recovers the job on a new worker; it resumes at its last save: the work since is lost.
            self._charge_lost(rank, groups, outcome, saved, started_at=info.started_at, end=seen_at)

        result = self.skypilot.run_batch(
            context=self.context,
            request=self.request,
            num_jobs=len(groups),
            workers=workers,
            pool_name=self.pool_name,
            prepare=prepare,
            on_message=on_message,
            on_submitted=on_submitted,
            on_preempted=on_preempted,
        )
        for record in result.records():
            self.report.gpu_hours += record.gpu_hours
            self.report.cost_usd += record.cost_usd
        self._count_lost(result, groups, outcome, saved)
        still = []
        # A job that ended without a message for an item (a message lost, a job killed): what the job
        # published is the truth, read with few requests whatever the number of such items.
        silent = [s for s in todo if s not in outcome]
        published = self.done_items(silent) if silent else set()
        for item in todo:
            message = outcome.get(item, {})
            if message.get("state") == "done" or (not message and item in published):
                if not message:  # its job succeeded but the message was lost
                    self._done(item, {"state": "done"}, rank_of[item])
                continue
            if message.get("state") == "stopped":
                still.append(item)  # the window ended: not a failure
                continue
            attempts[item] = attempts.get(item, 0) + 1
            rank = rank_of[item]
            if rank in result.tails:
                self.report.failed[item] = str(result.failure(rank))
            else:
                self.report.failed[item] = (
                    message.get("reason") or f"its job {result.job_ids[rank]} ended without finishing it"
                )
            still.append(item)
        for item in self.report.done:
            self.report.failed.pop(item, None)
        return still

    # ------------------------------------------------------------------ pieces
    def _count_lost(
        self,
        result: BatchResult,
        groups: list[list[str]],
        outcome: Mapping[str, Mapping[str, Any]],
        saved: Mapping[int, tuple[float, str]],
    ) -> None:
        """What the jobs that stopped before finishing lost: the work since their last save (or their start),
        charged to the item they were on (the one of their last save, else their first unfinished one)."""
        for rank in result.failed_ranks:
            info = result.infos[rank]
            self._charge_lost(
                rank, groups, outcome, saved, started_at=info.started_at, end=info.ended_at or self.clock()
            )

    def _charge_lost(
        self,
        rank: int,
        groups: list[list[str]],
        outcome: Mapping[str, Mapping[str, Any]],
        saved: Mapping[int, tuple[float, str]],
        *,
        started_at: float | None,
        end: float,
    ) -> None:
        """One interruption of a rank's job at ``end``: the work since its last save (or its start) is lost,
        charged to the item it was on (the one of its last save, else its first unfinished one)."""
        if started_at is None:
            return  # never ran: nothing done, nothing lost
        gpus = self._job.route.total_gpus if self._job is not None and self._job.route else 0.0
        last, on = saved.get(rank, (0.0, ""))
        lost_s = max(0.0, end - max(last, started_at))
        unfinished = [i for i in groups[rank] if outcome.get(i, {}).get("state") != "done"]
        item = on if on in unfinished else (unfinished[0] if unfinished else "")
        self.report.jobs_interrupted += 1
        self.report.gpu_hours_lost += gpus * lost_s / 3600.0
        if item:
            count, seconds = self._lost.get(item, (0, 0.0))
            self._lost[item] = (count + 1, seconds + lost_s)

    def _done(self, item: str, message: Mapping[str, Any], rank: int) -> None:
        self.report.done.append(item)
        self.materialize(item, message, rank)

    def job_share(self, item: str, rank: int | None, seconds: float) -> dict[str, Any]:
        """Where an item ran and its share of its job's GPU time and cost (the seconds spent on it); for an item
        whose job stopped before finishing it, how often and the GPU-hours of work done again."""
        if rank is None or self._job is None or self._job.route is None:
            return {}
        route = self._job.route
        interrupted, lost_s = self._lost.get(item, (0, 0.0))
        lost = {
            "interruptions": interrupted,
            "gpu_hours_lost_to_interruptions": round(route.total_gpus * lost_s / 3600.0, 6),
        }
        return dict(
            job_id=self._job_ids[rank],
            job_rank=rank,
            worker_pool=self.pool_name,
            pool=self._job.pool,
            infra=route.infra,
            accelerators=route.accelerators or "none (CPU-only)",
            gpu_hours=round(route.total_gpus * seconds / 3600.0, 6),
            cost_usd_estimate=round(route.usd_per_hour * seconds / 3600.0, 6),
            **(lost if interrupted else {}),
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
            self.context.log.warning(f"No free GPU for {self.doing} ({reason}); giving up for now.")
            self.report.no_gpu = reason
            return False
        # Back off from 2 s to 30 s: a GPU freed soon is taken soon, and a long wait costs few requests.
        step = max(0.5, min(30.0, 2.0 * 2**self._waits, limit - waited))
        self._waits += 1
        self.context.log.info(f"No free GPU for {self.doing} ({reason}); waiting {step:.0f} s.")
        time.sleep(step)
        self._waited_s = waited + step
        return True
