"""A sensor that sees each new checkpoint in the transit bucket and fans evaluations out.

Checkpoint keys are ``checkpoints/<training id>/step-NNNNNN/_manifest.json`` (the manifest is
written last, so a listed manifest means a complete checkpoint). Training ids start with their UTC
start time, so new trainings sort after old ones: the cursor keeps the last key seen overall
(listed with S3 ``StartAfter``) plus, per training still running, the last key seen under it,
because a running training keeps adding checkpoints behind the overall cursor.
"""

import json

import dagster as dg

from gpudoor_pipelines.assets.partitions import (
    CHECKPOINTS_PREFIX,
    checkpoint_from_manifest_key,
    checkpoint_partitions,
)
from gpudoor_pipelines.automation.jobs import eval_job
from gpudoor_pipelines.transit.bucket import MANIFEST_NAME
from gpudoor_pipelines.transit.resource import TransitBucketResource

MAX_KEYS_PER_TICK = 5000


def scan_checkpoints(bucket, cursor: dict) -> tuple[list[str], dict]:
    """New complete checkpoints since ``cursor``, and the next cursor. Pure apart from listing.

    Args:
        bucket: the transit bucket.
        cursor: ``{"after": last key listed, "active": {training prefix: last key under it}}``.
    """
    after = cursor.get("after")
    active: dict[str, str] = dict(cursor.get("active", {}))
    found: list[str] = []

    def visit(key: str) -> None:
        parts = key.split("/")
        if len(parts) < 3:
            return
        training = "/".join(parts[:2])
        if len(parts) == 3 and parts[2] == MANIFEST_NAME:
            active.pop(training, None)  # The training published its run manifest: it is over.
            return
        if training not in active or key > active[training]:
            active[training] = key
        ckpt = checkpoint_from_manifest_key(key)
        if ckpt:
            found.append(ckpt)

    # Trainings still running, behind the overall cursor.
    for training, last in list(active.items()):
        if after is not None and training + "/" > after:
            continue
        for key in bucket.list_keys(training + "/", start_after=last):
            visit(key)
    listed = 0
    for key in bucket.list_keys(CHECKPOINTS_PREFIX + "/", start_after=after):
        visit(key)
        after = key
        listed += 1
        if listed >= MAX_KEYS_PER_TICK:
            break
    # A training whose run manifest already exists needs no further watching.
    for training in list(active):
        if bucket.exists(f"{training}/{MANIFEST_NAME}"):
            active.pop(training)
    return sorted(set(found)), {"after": after, "active": active}


@dg.sensor(job=eval_job, minimum_interval_seconds=30, default_status=dg.DefaultSensorStatus.RUNNING)
def new_checkpoint_sensor(
    context: dg.SensorEvaluationContext, transit: TransitBucketResource
) -> dg.SensorResult:
    """Adds a partition for each new checkpoint and requests its evaluation."""
    cursor = json.loads(context.cursor) if context.cursor else {}
    found, next_cursor = scan_checkpoints(transit.get_bucket(), cursor)
    new = [k for k in found if not context.instance.has_dynamic_partition(checkpoint_partitions.name, k)]
    return dg.SensorResult(
        run_requests=[dg.RunRequest(run_key=k, partition_key=k) for k in found],
        dynamic_partitions_requests=[checkpoint_partitions.build_add_request(new)] if new else [],
        cursor=json.dumps(next_cursor),
    )
