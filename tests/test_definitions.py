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
        "training_run",
    ]
    repo = defs.get_repository_def()
    assert sorted(j for j in repo.job_names if not j.startswith("__")) == [
        "captioning_job",
        "eval_job",
        "merge_captions_job",
        "stop_demo_job",
    ]
    assert sorted(s.name for s in repo.schedule_defs) == ["morning_merge_schedule", "nightly_captioning_schedule"]
    assert sorted(s.name for s in repo.sensor_defs) == ["new_checkpoint_sensor"]
    assert sorted(defs.resources) == ["io_manager", "skypilot", "transit"]
    checks = {c.name for c in defs.resolve_asset_graph().asset_check_keys}
    assert checks == {"accuracy_above_chance"}
    dg.Definitions.validate_loadable(defs)


def test_graph_runs_from_dataset_to_demo():
    from gpudoor_pipelines.definitions import defs

    graph = defs.resolve_asset_graph()
    chain = ["dataset_shards", "caption_shards", "captioned_dataset", "training_run", "checkpoint_evals", "best_checkpoint", "demo"]
    for upstream, downstream in zip(chain, chain[1:], strict=False):
        assert dg.AssetKey(upstream) in graph.get(dg.AssetKey(downstream)).parent_keys, (upstream, downstream)


def test_defaults_are_the_embedded_default():
    from gpudoor_pipelines.settings import build_resources

    resources = build_resources()
    assert resources["skypilot"].backend == "local"
    assert resources["transit"].kind == "local"


def test_nightly_schedule_requests_every_shard_off_peak():
    from gpudoor_pipelines.assets.partitions import SHARD_KEYS
    from gpudoor_pipelines.automation.schedules import nightly_captioning_schedule

    context = dg.build_schedule_context(scheduled_execution_time=__import__("datetime").datetime(2026, 11, 30, 1, 0))
    requests = list(nightly_captioning_schedule(context))
    assert [r.partition_key for r in requests] == SHARD_KEYS
    assert nightly_captioning_schedule.cron_schedule == "0 1 * * *"
