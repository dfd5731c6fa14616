"""The code location loads, and its shape is what users and automation expect."""

from __future__ import annotations

import dagster as dg


def test_definitions_snapshot():
    from gpudoor_pipelines.definitions import defs

    assert sorted(k.to_user_string() for k in defs.resolve_all_asset_keys()) == [
        "best_checkpoint",
        "caption_shards",
        "captioned_dataset",
        "checkpoint_evals",
        "dataset_shards",
        "demo",
        "gpu_usage",
        "housekeeping_applied",
        "housekeeping_plan",
        "training_run",
    ]
    repo = defs.get_repository_def()
    assert sorted(j for j in repo.job_names if not j.startswith("__")) == [
        "captioning_job",
        "eval_job",
        "housekeeping_job",
        "merge_captions_job",
        "release_held_gpus_job",
        "stop_demo_job",
    ]
    assert sorted(s.name for s in repo.schedule_defs) == [
        "morning_merge_schedule",
        "nightly_captioning_schedule",
        "weekly_gpu_usage_schedule",
        "weekly_housekeeping_schedule",
    ]
    assert sorted(s.name for s in repo.sensor_defs) == ["new_checkpoint_sensor", "orphan_reconciler"]
    assert sorted(defs.resources) == ["io_manager", "skypilot", "transit"]
    checks = {c.name for c in defs.resolve_asset_graph().asset_check_keys}
    assert checks == {"accuracy_above_chance", "all_shards_captioned"}
    dg.Definitions.validate_loadable(defs)


def test_graph_runs_from_dataset_to_demo():
    from gpudoor_pipelines.definitions import defs

    graph = defs.resolve_asset_graph()
    chain = [
        "dataset_shards",
        "caption_shards",
        "captioned_dataset",
        "training_run",
        "checkpoint_evals",
        "best_checkpoint",
        "demo",
    ]
    for upstream, downstream in zip(chain, chain[1:], strict=False):
        assert dg.AssetKey(upstream) in graph.get(dg.AssetKey(downstream)).parent_keys, (upstream, downstream)


def test_defaults_are_the_embedded_default():
    from gpudoor_pipelines.settings import build_resources

    resources = build_resources()
    assert resources["skypilot"].backend == "local"
    assert resources["transit"].kind == "local"


def test_nightly_schedule_requests_the_shards_not_captioned_in_the_window(tmp_path):
    import datetime

    from gpudoor_pipelines.assets.partitions import SHARDS
    from gpudoor_pipelines.automation.schedules import TAG_WINDOW_END
    from gpudoor_pipelines.data.captions import captions_prefix
    from gpudoor_pipelines.definitions import build_defs
    from gpudoor_pipelines.transit.resource import TransitBucketResource

    defs = build_defs()
    schedule = defs.get_schedule_def("nightly_captioning_schedule")
    assert (schedule.cron_schedule, schedule.execution_timezone) == ("0 1 * * *", "Europe/Paris")
    assert defs.get_schedule_def("morning_merge_schedule").cron_schedule == "0 6 * * *"
    transit = TransitBucketResource(kind="local", local_root=str(tmp_path / "bucket"))
    transit.get_bucket().publish(captions_prefix("color-shape-v1", "sample-00001"), {"count": 1})
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions(SHARDS, [f"sample-{i:05d}" for i in range(4)])
        start = datetime.datetime(2026, 11, 30, 1, 0, tzinfo=datetime.timezone(datetime.timedelta(hours=1)))
        # As a context manager: its resources are built and torn down inside the instance's lifetime.
        with dg.build_schedule_context(
            instance=instance, scheduled_execution_time=start, resources={"transit": transit}
        ) as context:
            requests = list(schedule.evaluate_tick(context).run_requests or [])
    assert len(requests) == 1
    tags = requests[0].tags
    assert (tags["dagster/asset_partition_range_start"], tags["dagster/asset_partition_range_end"]) == (
        "sample-00000",
        "sample-00003",
    )
    assert tags[TAG_WINDOW_END] == "2026-11-30T06:00:00+01:00"  # the night ends at 06:00 local time
