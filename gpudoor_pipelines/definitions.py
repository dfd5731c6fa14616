"""The code location: assets, checks, jobs, schedules and sensors, with resources bound from the environment."""

from __future__ import annotations

import dagster as dg

from gpudoor_pipelines.assets import captioning, demo, evaluation, housekeeping, training, usage
from gpudoor_pipelines.automation.jobs import captioning_job, eval_job, housekeeping_job, merge_captions_job
from gpudoor_pipelines.automation.reconciler import orphan_reconciler, release_held_gpus_job
from gpudoor_pipelines.automation.schedules import (
    build_schedules,
    weekly_gpu_usage_schedule,
    weekly_housekeeping_schedule,
)
from gpudoor_pipelines.automation.sensors import new_checkpoint_sensor
from gpudoor_pipelines.launch.resolve.fleet import load_fleet
from gpudoor_pipelines.settings import build_resources

ASSET_MODULES = [captioning, training, evaluation, demo, usage, housekeeping]


def build_defs() -> dg.Definitions:
    """The definitions, with resources bound to the environment variables that are set now."""
    return dg.Definitions(
        assets=dg.load_assets_from_modules(ASSET_MODULES),
        asset_checks=dg.load_asset_checks_from_modules(ASSET_MODULES),
        jobs=[
            captioning_job,
            merge_captions_job,
            eval_job,
            housekeeping_job,
            demo.stop_demo_job,
            release_held_gpus_job,
        ],
        schedules=[
            *build_schedules(load_fleet().night_window),
            weekly_gpu_usage_schedule,
            weekly_housekeeping_schedule,
        ],
        sensors=[new_checkpoint_sensor, orphan_reconciler],
        resources=build_resources(),
    )


defs = build_defs()
