"""The nightly captioning window and the morning merge, both from the fleet's ``night_window``; the weekly GPU usage.

Inference GPUs are idle off-peak: captioning starts when the window opens, stops starting new work
when it closes, and the morning merge then merges whatever is done. Every Monday, the GPU usage of
the week that just ended is refreshed; every Sunday, housekeeping plans (and applies, where the fleet says so).
"""

from __future__ import annotations

import dagster as dg

from gpudoor_pipelines.assets.captioning import MAX_SHARDS_PER_RUN, default_caption_model
from gpudoor_pipelines.assets.partitions import SHARDS
from gpudoor_pipelines.assets.usage import gpu_usage, last_finished_week
from gpudoor_pipelines.automation.jobs import captioning_job, housekeeping_job, merge_captions_job
from gpudoor_pipelines.data.captions import done_shards
from gpudoor_pipelines.launch.resolve.fleet import NightWindow
from gpudoor_pipelines.transit.resource import TransitBucketResource

TAG_WINDOW_END = "gpudoor/window-end"


def night_runs(
    all_shards: list[str],
    done: set[str],
    *,
    night: str,
    window_end: str,
    max_shards: int = MAX_SHARDS_PER_RUN,
) -> list[dg.RunRequest]:
    """The run requests of one night: the shards not done yet, as partition ranges of at most ``max_shards``.

    Each run covers a range of consecutive shard keys; a shard of the range that is already done is
    skipped by the run itself (and counted once, not launched), so ranges may span done shards.
    """
    todo = [s for s in all_shards if s not in done]
    requests = []
    for i in range(0, len(todo), max_shards):
        chunk = todo[i : i + max_shards]
        requests.append(
            dg.RunRequest(
                run_key=f"{night}-{i // max_shards:04d}",
                tags={
                    "dagster/asset_partition_range_start": chunk[0],
                    "dagster/asset_partition_range_end": chunk[-1],
                    TAG_WINDOW_END: window_end,
                },
                run_config={"ops": {"caption_shards": {"config": {"window_end": window_end}}}},
            )
        )
    return requests


def build_schedules(window: NightWindow) -> list[dg.ScheduleDefinition]:
    """The nightly captioning and morning merge schedules of a window."""

    @dg.schedule(
        name="nightly_captioning_schedule",
        job=captioning_job,
        cron_schedule=window.start,
        execution_timezone=window.timezone,
    )
    def nightly_captioning_schedule(context: dg.ScheduleEvaluationContext, transit: TransitBucketResource):
        """When the window opens: the shards not yet captioned by the current model, a few runs of many shards."""
        start = context.scheduled_execution_time
        shards = context.instance.get_dynamic_partitions(SHARDS)
        done = done_shards(transit.get_bucket(), default_caption_model())  # one listing
        requests = night_runs(
            shards, done, night=start.strftime("%Y-%m-%d"), window_end=window.end_after(start).isoformat()
        )
        return requests or dg.SkipReason(f"All {len(shards)} shards are captioned by {default_caption_model()}.")

    @dg.schedule(
        name="morning_merge_schedule",
        job=merge_captions_job,
        cron_schedule=window.end_cron,
        execution_timezone=window.timezone,
    )
    def morning_merge_schedule(context: dg.ScheduleEvaluationContext):
        """When the window closes: merge whatever shards are captioned into the dataset."""
        return dg.RunRequest(run_key=context.scheduled_execution_time.strftime("%Y-%m-%d"))

    return [nightly_captioning_schedule, morning_merge_schedule]


@dg.schedule(
    name="weekly_gpu_usage_schedule",
    target=dg.AssetSelection.assets(gpu_usage),
    cron_schedule="0 6 * * 1",
    execution_timezone="UTC",
)
def weekly_gpu_usage_schedule(context: dg.ScheduleEvaluationContext):
    """Monday morning: the GPU usage of the week that just ended, once it is complete."""
    week = last_finished_week(context.scheduled_execution_time)
    return dg.RunRequest(run_key=week, partition_key=week)


weekly_housekeeping_schedule = dg.ScheduleDefinition(
    name="weekly_housekeeping_schedule",
    job=housekeeping_job,
    cron_schedule="0 7 * * 0",
    execution_timezone="UTC",
    default_status=dg.DefaultScheduleStatus.RUNNING,  # plans only, until the fleet's housekeeping.apply is on
    description="Sunday morning: a housekeeping plan of the transit bucket, applied where housekeeping.apply is on.",
)
