"""What the team's SkyPilot API server holds and held: the weekly usage's history and the orphan
reconciler's listing, each in a few requests whatever the number of jobs."""

from __future__ import annotations

import math
import time

from gpudoor_pipelines.launch.backends import sky_records, sky_sdk
from gpudoor_pipelines.launch.job import Holding, JobState, JobUsage
from gpudoor_pipelines.launch.labels import INTERACTIVE_PREFIXES, LABEL_POOL, STEP_CLUSTER_PREFIX
from gpudoor_pipelines.launch.resolve.specs import gpus_per_node


def job_history(since: float, until: float, *, submitted_after: float | None = None) -> list[JobUsage]:
    """Every managed job with a ``gpudoor-pool`` label that ran between ``since`` and ``until``, whoever
    launched it, from one ``sky.jobs.queue_v2`` request over all users, and the clusters of the same window.

    The SDK's ``queue_v2`` has no page argument: without ``limit`` the server answers with every job, so a
    busy week is not cut short; jobs submitted after ``until`` are left out by the server. Labels and GPUs
    come from the job's cluster while it is up, else from the task it was launched with. ``ran_s`` is
    SkyPilot's ``job_duration``: the time the job ran, without the time it spent recovering after
    preemptions. Demos, dev clusters (``lab-…``, ``dev-…``) and the door's step clusters are clusters, not
    managed jobs: they come from SkyPilot's cluster history (:func:`_clusters_up`).

    With ``submitted_after`` (``gpudoor status``): the server leaves out every job submitted before it, so a
    listing does not read the whole history; jobs not started yet are kept.
    """
    sky = sky_sdk.sky()
    records, *_ = sky_sdk.read(
        lambda: sky.jobs.queue_v2(
            refresh=False,
            skip_finished=False,
            all_users=True,
            submitted_before=until,
            submitted_after=submitted_after,
            fields=sky_records.HISTORY_FIELDS,
        )
    )
    out = []
    for r in records:
        started, ended = r.start_at or None, r.end_at or None
        if submitted_after is not None:
            if (r.submitted_at or 0) <= submitted_after:
                continue
        elif started is None or started >= until or (ended is not None and ended <= since):
            continue
        # The launched task is parsed only when the queue no longer shows the job's cluster.
        task = sky_records.launched_task(r.user_yaml, r.task_id) if not (r.labels and r.accelerators) else {}
        resources = task.get("resources") if isinstance(task.get("resources"), dict) else {}
        labels = dict(r.labels or resources.get("labels") or {})
        if not labels.get(LABEL_POOL):
            continue
        gpus = sky_records.record_gpus(r, resources) * sky_records.record_nodes(r, task)
        out.append(
            JobUsage.from_labels(
                labels,
                job_id=str(r.job_id),
                name=r.job_name or "",
                gpus=gpus,
                started_at=started,
                ended_at=ended,
                state=sky_sdk.state(r.status),
                recoveries=int(r.recovery_count or 0),
                ran_s=float(r.job_duration) if r.job_duration is not None else None,
                submitted_at=float(r.submitted_at) if r.submitted_at else None,
            )
        )
    return out + _clusters_up(since, until)


def _clusters_up(since: float, until: float) -> list[JobUsage]:
    """The ``lab-…``/``dev-…`` clusters and the door's step clusters with a ``gpudoor-pool`` label that were
    up between ``since`` and ``until``, from one ``sky.cost_report`` request (its history keeps torn-down
    clusters and their launched resources, labels included), one entry per time a cluster was up. A
    cluster is never preempted and recovered: it ran all the time it was up."""
    sky = sky_sdk.sky()
    now = time.time()
    records = sky_sdk.read(lambda: sky.cost_report(days=max(1, math.ceil((now - since) / 86400.0) + 1)))
    out = []
    for rec in records or ():
        name = str(rec.get("name") or "")
        resources = rec.get("resources")
        labels = {str(k): str(v) for k, v in (getattr(resources, "labels", None) or {}).items()}
        if not name.startswith((*INTERACTIVE_PREFIXES, STEP_CLUSTER_PREFIX)) or not labels.get(LABEL_POOL):
            continue
        gpus = gpus_per_node(getattr(resources, "accelerators", None)) * int(rec.get("num_nodes") or 1)
        for start, end in rec.get("usage_intervals") or ():
            if start is None or start >= until or (end is not None and end <= since):
                continue
            out.append(
                JobUsage.from_labels(
                    labels,
                    job_id=f"{name}@{int(start)}",
                    name=name,
                    gpus=gpus,
                    started_at=float(start),
                    ended_at=None if end is None else float(end),
                    state=JobState.RUNNING if end is None else JobState.SUCCEEDED,
                    ran_s=(now if end is None else float(end)) - float(start),
                )
            )
    return out


def holdings() -> list[Holding]:
    """Three requests whatever the numbers: ``sky.jobs.queue_v2`` of every user's unfinished jobs (a pool's
    jobs are its pool's), ``sky.jobs.pool_status`` of every warm pool, and ``sky.status`` of every user's
    clusters (the ``lab-…``/``dev-…`` ones and the door's step clusters)."""
    sky = sky_sdk.sky()
    records, *_ = sky_sdk.read(
        lambda: sky.jobs.queue_v2(refresh=False, skip_finished=True, all_users=True, fields=sky_records.HOLDING_FIELDS)
    )
    out = []
    for r in records:
        state = sky_sdk.state(r.status)
        if r.pool or state.is_terminal:
            continue
        out.append(
            Holding(
                "job",
                str(r.job_id),
                labels=sky_records.launched_labels(r),
                since=r.submitted_at,
                state=state.value,
                name=r.job_name or "",
                scheduler_name=r.cluster_name_on_cloud or "",
            )
        )
    for record in sky_sdk.read(lambda: sky.jobs.pool_status(None)) or ():
        labels = {str(k): str(v) for k, v in (sky_records.pool_labels(record).get("labels") or {}).items()}
        name = str(record.get("name"))
        out.append(Holding("pool", name, labels=labels, state=sky_records.status_name(record), name=name))
    for record in sky_sdk.read(lambda: sky.status(all_users=True)) or ():
        name = str(record.get("name") or "")
        if not name.startswith((*INTERACTIVE_PREFIXES, STEP_CLUSTER_PREFIX)):
            continue
        handle = record.get("handle")
        out.append(
            Holding(
                "cluster",
                name,
                labels=sky_records.cluster_labels(record),
                since=record.get("launched_at"),
                state=sky_records.status_name(record),
                name=name,
                scheduler_name=str(getattr(handle, "cluster_name_on_cloud", "") or ""),
            )
        )
    return out
