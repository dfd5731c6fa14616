"""The typed records of a launch, and their one conversion to Dagster metadata.

A :class:`LaunchRecord` says what one job cost and where it ran; a :class:`BatchResult` what a batch of ranks
did; a :class:`ServiceRecord` where a service answers. Built by the launcher, read by the front ends: free of
Dagster until a record is turned into metadata (``to_metadata``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from gpudoor_pipelines.launch.errors import JobFailed
from gpudoor_pipelines.launch.job import FAILURE_MEANING, JobInfo
from gpudoor_pipelines.launch.record.goodput import PreemptionCost
from gpudoor_pipelines.launch.resolve.request import ResolvedJob


@dataclasses.dataclass(frozen=True)
class LaunchRecord:
    """What one launch cost and where it ran: turned into Dagster metadata in one place."""

    job_id: str
    job_name: str
    backend: str
    pool: str
    infra: str
    accelerators: str | None
    num_nodes: int
    route: str
    status: str
    recoveries: int
    queued_s: float | None
    running_s: float
    gpu_hours: float
    cost_usd: float
    policy: tuple[str, ...]
    task_spec: str
    preemptions: PreemptionCost | None = None
    launched_as: str = "job"
    sharing: tuple[tuple[str, Any], ...] = ()

    @classmethod
    def of(
        cls,
        job: ResolvedJob,
        info: JobInfo,
        backend: str,
        preemptions: PreemptionCost | None = None,
        launched_as: str = "job",
    ) -> LaunchRecord:
        """The record of a finished job (with what its preemptions cost, when the step watched it);
        ``launched_as``: ``job``, or ``cluster`` for a step the fleet launches as a cluster of its own."""
        assert job.route is not None
        queued = info.started_at - info.submitted_at if info.started_at and info.submitted_at else None
        running = info.ended_at - info.started_at if info.ended_at and info.started_at else 0.0
        return cls(
            job_id=info.job_id,
            job_name=info.name or job.name,
            backend=backend,
            pool=job.pool,
            infra=info.infra or job.route.infra,
            accelerators=job.route.accelerators,
            num_nodes=job.num_nodes,
            route=job.route.reason,
            status=info.state.value,
            recoveries=info.recoveries,
            queued_s=queued,
            running_s=running,
            gpu_hours=job.route.total_gpus * running / 3600.0,
            cost_usd=job.route.usd_per_hour * running / 3600.0,
            policy=job.notes,
            task_spec=job.spec_path,
            preemptions=preemptions,
            launched_as=launched_as,
            sharing=tuple(job.sharing_metadata().items()),
        )

    def to_metadata(self) -> dict[str, Any]:
        """The record as materialization metadata (names the UI and ``gpu_usage`` read)."""
        import dagster as dg

        md: dict[str, Any] = {
            "job_id": self.job_id,
            "job_name": self.job_name,
            "backend": self.backend,
            "launched_as": self.launched_as,
            "pool": self.pool,
            "infra": self.infra,
            "accelerators": self.accelerators or "none (CPU-only)",
            "num_nodes": self.num_nodes,
            "route": self.route,
            "status": self.status,
            "recoveries": self.recoveries,
            "running_s": round(self.running_s, 2),
            "gpu_hours": round(self.gpu_hours, 6),
            "cost_usd_estimate": round(self.cost_usd, 6),
            "task_spec": dg.MetadataValue.path(self.task_spec),
        }
        if self.queued_s is not None:
            md["queued_s"] = round(self.queued_s, 2)
        if self.policy:
            md["policy"] = "; ".join(self.policy)
        if self.preemptions is not None:
            md.update(self.preemptions.to_metadata())
        md.update(dict(self.sharing))
        return md


@dataclasses.dataclass(frozen=True)
class BatchPlan:
    """Where a batch would run and how many workers fit: see :meth:`PipesSkyPilotClient.plan_batch`."""

    job: ResolvedJob
    workers: int
    free_gpus: int
    reason: str


@dataclasses.dataclass(frozen=True)
class BatchResult:
    """A finished batch: every rank's final state, and what the batch cost."""

    job: ResolvedJob
    job_ids: list[str]
    infos: list[JobInfo]
    backend: str
    tails: dict[int, list[str]] = dataclasses.field(default_factory=dict)

    def failure(self, rank: int) -> JobFailed:
        """What a failed rank's job did: its end state and last log lines."""
        info = self.infos[rank]
        return JobFailed(
            info.job_id, info.state.value, info.detail or FAILURE_MEANING.get(info.state, ""), self.tails.get(rank, [])
        )

    @property
    def failed_ranks(self) -> list[int]:
        """Ranks that did not succeed."""
        return [rank for rank, info in enumerate(self.infos) if info.state.is_failure]

    def records(self) -> list[LaunchRecord]:
        """One launch record per rank."""
        return [LaunchRecord.of(self.job, info, self.backend) for info in self.infos]

    def to_metadata(self) -> dict[str, Any]:
        """Totals over the ranks, as materialization metadata."""
        records = self.records()
        assert self.job.route is not None
        return {
            "jobs": len(records),
            "jobs_failed": len(self.failed_ranks),
            "pool": self.job.pool,
            "infra": self.job.route.infra,
            "accelerators": self.job.route.accelerators or "none (CPU-only)",
            "backend": self.backend,
            "gpu_hours": round(sum(r.gpu_hours for r in records), 6),
            "cost_usd_estimate": round(sum(r.cost_usd for r in records), 6),
            "running_s": round(sum(r.running_s for r in records), 2),
            **self.job.sharing_metadata(),
        }


@dataclasses.dataclass(frozen=True)
class ServiceRecord:
    """A running service (a demo) and where it answers."""

    url: str
    cluster_name: str
    job_id: str
    backend: str
    job: ResolvedJob

    def to_metadata(self) -> dict[str, Any]:
        """The service as materialization metadata."""
        import dagster as dg

        route = self.job.route
        assert route is not None
        md: dict[str, Any] = {
            "url": dg.MetadataValue.url(self.url),
            "cluster_name": self.cluster_name,
            "job_id": self.job_id,
            "backend": self.backend,
            "pool": route.pool.name,
            "infra": route.infra,
            "accelerators": route.accelerators or "none (CPU-only)",
            "usd_per_hour_estimate": round(route.usd_per_hour, 4),
        }
        md.update(self.job.sharing_metadata())
        if self.job.notes:
            md["policy"] = "; ".join(self.job.notes)
        return md
