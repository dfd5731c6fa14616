"""Housekeeping: a plan of the transit bucket (every object, its action and why), then the plan applied.

``housekeeping_plan`` writes the plan as Parquet in the bucket and shows its totals by prefix and action, and
the bucket's size as numbers the UI plots across runs; ``housekeeping_applied`` applies it when the fleet's
``housekeeping.apply`` is on (off, it says so and changes nothing). What points at a checkpoint is read from
this Dagster instance at both steps (:func:`protected_now`).
"""

import dataclasses
from typing import Any

import dagster as dg

from gpudoor_pipelines.assets.captioning import default_caption_model
from gpudoor_pipelines.assets.training import TAG_TRAINING_ID
from gpudoor_pipelines.data.housekeeping import Protected, Retention, make_plan
from gpudoor_pipelines.data.housekeeping_apply import PlanNotApplicable, apply_plan
from gpudoor_pipelines.launch.resolve.fleet import Fleet, load_fleet
from gpudoor_pipelines.transit.io_manager import TransitRef
from gpudoor_pipelines.transit.resource import TransitBucketResource

#: A run tag that keeps checkpoints out of every plan: ``<training>.step-N`` (several: comma-separated).
TAG_KEEP = "gpudoor/keep-checkpoint"
_RANGE = ("dagster/asset_partition_range_start", "dagster/asset_partition_range_end")
GiB = 1024**3
_IN_PROGRESS = [
    dg.DagsterRunStatus.QUEUED,
    dg.DagsterRunStatus.NOT_STARTED,
    dg.DagsterRunStatus.STARTING,
    dg.DagsterRunStatus.STARTED,
    dg.DagsterRunStatus.CANCELING,
]


def retention(fleet: Fleet) -> Retention:
    """The fleet's ``housekeeping:`` as the planner takes it (the fields both have), with the current caption
    model and how long a training with no end recorded counts as running."""
    given = fleet.housekeeping.model_dump()
    return Retention(
        **{f.name: given[f.name] for f in dataclasses.fields(Retention) if f.name in given},
        caption_model=default_caption_model(),
        running_window_days=fleet.evaluation.forget_training_after_hours / 24,
    )


def protected_now(instance: dg.DagsterInstance, fleet: Fleet) -> Protected:
    """What points at a checkpoint now: the best checkpoint, the served one, those a run in progress works
    on (one checkpoint, a range, a training), those a run tag pins (:data:`TAG_KEEP`), the fleet's ``keep``."""
    found = Protected()
    for asset, why in (("best_checkpoint", "the current best checkpoint"), ("demo", "the demo serves it")):
        event = instance.get_latest_materialization_event(dg.AssetKey(asset))
        value = (
            event.asset_materialization.metadata.get("checkpoint") if event and event.asset_materialization else None
        )
        if value is not None:
            found.checkpoints[str(value.value)] = why
    for run in instance.get_runs(filters=dg.RunsFilter(statuses=_IN_PROGRESS)):
        tags = run.tags
        why = f"run {run.run_id[:8]} ({run.job_name}) is in progress"
        if TAG_TRAINING_ID in tags:
            found.trainings[tags[TAG_TRAINING_ID]] = f"its training is running ({why})"
        if ".step-" in tags.get("dagster/partition", ""):
            found.checkpoints[tags["dagster/partition"]] = why
        if all(".step-" in tags.get(t, "") for t in _RANGE):  # an eval run's checkpoints (not caption shards)
            found.ranges.append((tags[_RANGE[0]], tags[_RANGE[1]], why))
    for _, values in instance.get_run_tags(tag_keys=[TAG_KEEP]):
        for value in values:
            for checkpoint in filter(None, (v.strip() for v in value.split(","))):
                found.checkpoints[checkpoint] = f"pinned by the run tag {TAG_KEEP}"
    for name in fleet.housekeeping.keep:
        if ".step-" in name:
            found.checkpoints[name] = "named in the fleet's housekeeping.keep"
        else:
            found.ranges.append(
                (f"{name}.", f"{name}.\uffff", "its training is named in the fleet's housekeeping.keep")
            )
    return found


def _table(rows: list[dict[str, Any]]) -> str:
    lines = ["| prefix | action | objects | GiB |", "|---|---|---:|---:|"]
    lines += [f"| {r['prefix']} | {r['action']} | {r['objects']} | {r['bytes'] / GiB:.3f} |" for r in rows]
    return "\n".join(lines)


def _numbers(by_prefix: list[dict[str, Any]], actions: tuple[str, ...]) -> dict[str, float | int]:
    """Objects and GiB per action, as numbers (plotted across runs)."""
    out: dict[str, float | int] = {}
    for action in actions:
        rows = [r for r in by_prefix if r["action"] == action]
        out[f"{action}_objects"] = sum(r["objects"] for r in rows)
        out[f"{action}_gib"] = round(sum(r["bytes"] for r in rows) / GiB, 6)
    return out


@dg.asset(group_name="housekeeping", kinds={"python"})
def housekeeping_plan(context: dg.AssetExecutionContext, transit: TransitBucketResource) -> TransitRef:
    """What housekeeping would do to every object of the transit bucket, and why (Parquet in the bucket)."""
    fleet = load_fleet()
    bucket = transit.get_bucket()
    plan = make_plan(bucket, retention(fleet), protected_now(context.instance, fleet))
    summary = plan.summary()
    context.add_output_metadata(
        {
            "plan_uri": dg.MetadataValue.path(bucket.uri(plan.key)),
            "bucket_objects": plan.rows,
            "bucket_gib": round(summary["bytes"] / GiB, 6),
            **_numbers(summary["by_prefix"], ("keep", "cold", "delete", "restore", "abort")),
            "by_prefix_and_action": dg.MetadataValue.md(_table(summary["by_prefix"])),
            "scores_read": plan.scores_read,
            "seconds": round(plan.seconds, 1),
            "apply": fleet.housekeeping.apply,
        }
    )
    return TransitRef(uri=bucket.uri(plan.key), manifest={"key": plan.key, "planned_at": plan.planned_at})


@dg.asset(group_name="housekeeping", kinds={"python"})
def housekeeping_applied(
    context: dg.AssetExecutionContext, transit: TransitBucketResource, housekeeping_plan: TransitRef
) -> dg.MaterializeResult:
    """The latest plan applied: objects moved to cheaper storage, restored, deleted (only if the fleet says so)."""
    fleet = load_fleet()
    if not fleet.housekeeping.apply:
        context.log.info(f"housekeeping.apply is off in {fleet.source}: the plan was made, nothing was changed.")
        return dg.MaterializeResult(metadata={"applied": False, "why": f"housekeeping.apply is off in {fleet.source}"})
    bucket = transit.get_bucket()
    try:
        result = apply_plan(bucket, housekeeping_plan.manifest["key"], protected_now(context.instance, fleet))
    except PlanNotApplicable as e:
        raise dg.Failure(description=f"Nothing was changed: {e}.") from None
    summary = result.summary()
    return dg.MaterializeResult(
        metadata={
            "applied": True,
            "plan_uri": dg.MetadataValue.path(housekeeping_plan.uri),
            **_numbers(summary["by_prefix"], ("cold", "delete", "restore", "abort")),
            "by_prefix_and_action": dg.MetadataValue.md(_table(summary["by_prefix"])),
            "protected_since_the_plan": result.protected_since,
            "batches_resumed": result.batches_resumed,
        }
    )
