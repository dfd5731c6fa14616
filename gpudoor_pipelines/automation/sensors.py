"""A sensor that sees each new checkpoint in the transit bucket and fans evaluations out.

Each tick lists only what is new (:func:`gpudoor_pipelines.data.checkpoints.scan_checkpoints`): trainings
that (re)started, from the journal, and each watched training from its last complete checkpoint. What
it evaluates is the fleet file's ``evaluation`` section: every checkpoint written after the sensor was
turned on, the latest few of each training from before, and at most ``max_runs_per_tick`` runs of
``checkpoints_per_run`` checkpoints per tick. New checkpoints become partitions of ``checkpoint_evals``;
one run covers a range of them, evaluated by a batch of jobs that fits the free GPUs.

Restarts lose and duplicate nothing: the cursor moves only with the tick's result, and Dagster resumes
a tick whose result it had started to apply (its runs are reserved with their run keys first).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence

import dagster as dg

from gpudoor_pipelines import outage
from gpudoor_pipelines.assets.partitions import checkpoint_partitions
from gpudoor_pipelines.automation.jobs import eval_job
from gpudoor_pipelines.data.checkpoints import ScanPolicy, scan_checkpoints
from gpudoor_pipelines.launch.client import PipesSkyPilotClient
from gpudoor_pipelines.launch.resolve.fleet import EvalPolicy
from gpudoor_pipelines.transit.resource import TransitBucketResource

#: How long one tick waits out an outage of the bucket or the API server before it skips (the next tick goes on).
TICK_WAIT_S = 20.0
RANGE_START = "dagster/asset_partition_range_start"
RANGE_END = "dagster/asset_partition_range_end"


def riding_out(tick: Callable[[], dg.SensorResult]) -> dg.SensorResult:
    """A sensor's tick that waits out an outage of a service for at most ``TICK_WAIT_S``, then skips with the
    cursor kept, so the next tick goes on where this one stopped; an outage past the tolerance fails the tick,
    naming the service and how long it has been away."""
    try:
        with outage.waiting_at_most(TICK_WAIT_S):
            return tick()
    except outage.ServiceUnavailable as e:
        if e.past_bound:
            raise
        return dg.SensorResult(skip_reason=f"{e}; the cursor is kept: the next tick goes on from it")


def scan_policy(policy: EvalPolicy) -> ScanPolicy:
    """The scan's limits from the fleet's evaluation policy."""
    return ScanPolicy(
        backlog_per_training=policy.backlog_per_training,
        max_checkpoints=policy.max_checkpoints_per_tick,
        forget_after_s=policy.forget_training_after_hours * 3600.0,
    )


def eval_run_requests(
    checkpoints: Sequence[str], per_run: int, registered: Callable[[str], bool] = lambda _: False
) -> list[dg.RunRequest]:
    """One run per ``per_run`` consecutive new checkpoints, keyed by its first and last.

    The checkpoints become partitions together, in this order, so each run is a partition range of
    exactly its own. One that was a partition already (added by hand, or by a tick that Dagster
    resumes) gets a run of its own: a range over it could span partitions added since.
    """
    requests: list[dg.RunRequest] = []
    chunk: list[str] = []

    def flush() -> None:
        if len(chunk) == 1:
            requests.append(dg.RunRequest(run_key=chunk[0], partition_key=chunk[0]))
        elif chunk:
            tags = {RANGE_START: chunk[0], RANGE_END: chunk[-1]}
            requests.append(dg.RunRequest(run_key=f"{chunk[0]}..{chunk[-1]}", tags=tags))
        chunk.clear()

    for checkpoint in checkpoints:
        if registered(checkpoint):
            flush()
            chunk.append(checkpoint)
            flush()
            continue
        chunk.append(checkpoint)
        if len(chunk) >= per_run:
            flush()
    flush()
    return requests


@dg.sensor(job=eval_job, minimum_interval_seconds=30, default_status=dg.DefaultSensorStatus.RUNNING)
def new_checkpoint_sensor(
    context: dg.SensorEvaluationContext, transit: TransitBucketResource, skypilot: PipesSkyPilotClient
) -> dg.SensorResult:
    """Adds a partition for each new checkpoint and requests its evaluation, a few per run."""
    return riding_out(lambda: _checkpoint_tick(context, transit, skypilot))


def _checkpoint_tick(
    context: dg.SensorEvaluationContext, transit: TransitBucketResource, skypilot: PipesSkyPilotClient
) -> dg.SensorResult:
    policy = skypilot.get_fleet().evaluation
    cursor = json.loads(context.cursor) if context.cursor else None
    result = scan_checkpoints(transit.get_bucket(), cursor, scan_policy(policy), now=time.time())
    for training, why in result.forgotten:
        context.log.info(f"training {training} is no longer watched: {why}")
    if result.capped:
        context.log.info(
            f"{len(result.checkpoints)} checkpoints this tick (the fleet's evaluation cap); the rest next tick"
        )
    found = result.checkpoints
    registered = {c for c in found if context.instance.has_dynamic_partition(checkpoint_partitions.name, c)}
    new = [c for c in found if c not in registered]
    return dg.SensorResult(
        run_requests=eval_run_requests(found, policy.checkpoints_per_run, registered.__contains__),
        dynamic_partitions_requests=[checkpoint_partitions.build_add_request(new)] if new else [],
        cursor=json.dumps(result.cursor, separators=(",", ":")),
    )
