"""The nightly captioning window and the morning merge.

Inference GPUs are idle off-peak: captioning starts after the evening traffic drops, and the
captions are merged into the dataset before people arrive.
"""

import dagster as dg

from gpudoor_pipelines.assets.partitions import SHARD_KEYS
from gpudoor_pipelines.automation.jobs import captioning_job, merge_captions_job

OFF_PEAK_TIMEZONE = "Europe/Paris"


@dg.schedule(job=captioning_job, cron_schedule="0 1 * * *", execution_timezone=OFF_PEAK_TIMEZONE)
def nightly_captioning_schedule(context: dg.ScheduleEvaluationContext):
    """At 01:00, one run per shard; preempted shards resume where they stopped."""
    night = context.scheduled_execution_time.strftime("%Y-%m-%d")
    for shard in SHARD_KEYS:
        yield dg.RunRequest(
            run_key=f"{night}-{shard}", partition_key=shard, tags={"gpudoor/window": "off-peak"}
        )


@dg.schedule(job=merge_captions_job, cron_schedule="0 6 * * *", execution_timezone=OFF_PEAK_TIMEZONE)
def morning_merge_schedule(context: dg.ScheduleEvaluationContext):
    """At 06:00, merge the night's captions into the dataset."""
    return dg.RunRequest(run_key=context.scheduled_execution_time.strftime("%Y-%m-%d"))
