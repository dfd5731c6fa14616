"""Housekeeping as the UI and the weekly schedule run it: what points at a checkpoint is read from the Dagster
instance, the plan shows its totals and the bucket's size, and applying waits for the fleet to turn it on."""

from __future__ import annotations

import json
import time

import dagster as dg

from gpudoor_pipelines.assets.evaluation import _datasets
from gpudoor_pipelines.assets.housekeeping import (
    TAG_KEEP,
    housekeeping_applied,
    housekeeping_plan,
    protected_now,
)
from gpudoor_pipelines.automation.schedules import weekly_housekeeping_schedule
from gpudoor_pipelines.launch.resolve.fleet import load_fleet
from gpudoor_pipelines.transit import tiers
from gpudoor_pipelines.transit.io_manager import TransitIOManager
from gpudoor_pipelines.transit.resource import TransitBucketResource

OLD = time.time() - 40 * 86400


def _use_fleet(monkeypatch, tmp_path, **housekeeping) -> None:
    """The team's fleet file with these housekeeping settings, as the assets read it."""
    import yaml

    from gpudoor_pipelines.assets import housekeeping as assets
    from gpudoor_pipelines.launch.resolve.fleet import DEFAULT_FLEET_FILE

    raw = yaml.safe_load(DEFAULT_FLEET_FILE.read_text())
    raw["housekeeping"] = {**raw["housekeeping"], **housekeeping}
    path = tmp_path / f"fleet-{len(housekeeping)}-{housekeeping.get('apply', False)}.yaml"
    path.write_text(yaml.safe_dump(raw))
    monkeypatch.setattr(assets, "load_fleet", lambda: load_fleet(path))


def _old_training(transit: TransitBucketResource, steps: int = 5) -> None:
    """An ended training of checkpoints written 40 days ago, the earlier the better by accuracy."""
    import os

    bucket = transit.get_bucket()
    for step in range(1, steps + 1):
        bucket.publish(f"checkpoints/t1/step-{step:06d}", {"step": step}, {"model.pt": b"w" * 1000})
        score = {"accuracy": 1.0 / step}
        bucket.put_bytes(f"evals/t1.step-{step:06d}/metrics.json", json.dumps(score).encode())
    bucket.publish("checkpoints/t1", {"steps": steps})
    for path in bucket.root.rglob("*"):
        os.utime(path, (OLD, OLD))


def _run(instance, transit, *, tags=None) -> dg.ExecuteInJobResult:
    return dg.materialize(
        [housekeeping_plan, housekeeping_applied],
        instance=instance,
        resources={"transit": transit, "io_manager": TransitIOManager(transit=transit)},
        tags=tags,
    )


def test_a_pinned_and_the_best_checkpoint_stay_and_applying_waits_for_the_fleet(tmp_path, monkeypatch):
    transit = TransitBucketResource(kind="local", local_root=str(tmp_path / "bucket"))
    _old_training(transit)
    instance = dg.DagsterInstance.ephemeral()
    instance.report_runless_asset_event(
        dg.AssetMaterialization("best_checkpoint", metadata={"checkpoint": "t1.step-000002"})
    )
    _use_fleet(monkeypatch, tmp_path, keep_best=1, keep_latest=1)

    result = _run(instance, transit, tags={TAG_KEEP: "t1.step-000003"})
    assert result.success
    plan_md = {k: v.value for k, v in result.asset_materializations_for_node("housekeeping_plan")[0].metadata.items()}
    assert plan_md["cold_objects"] == 1  # step 4 only: 1 is the best, 2 the best_checkpoint, 3 pinned, 5 latest
    assert plan_md["cold_gib"] > 0 and plan_md["bucket_objects"] >= 16
    assert "| checkpoints | cold | 1 |" in plan_md["by_prefix_and_action"]
    applied_md = result.asset_materializations_for_node("housekeeping_applied")[0].metadata
    assert applied_md["applied"].value is False
    bucket = transit.get_bucket()
    assert not tiers.unreadable(bucket, "checkpoints/t1/step-000004")

    _use_fleet(monkeypatch, tmp_path, keep_best=1, keep_latest=1, apply=True)
    result = _run(instance, transit)
    applied_md = result.asset_materializations_for_node("housekeeping_applied")[0].metadata
    assert applied_md["applied"].value is True and applied_md["cold_objects"].value == 1
    assert tiers.unreadable(bucket, "checkpoints/t1/step-000004")
    problems = _datasets(bucket, ["t1.step-000004"])[1]  # an eval of it: refused before any launch
    assert "gpudoor housekeeping --restore t1.step-000004" in problems["t1.step-000004"]
    for kept in (1, 2, 3, 5):  # the pin of the first run still holds
        assert not tiers.unreadable(bucket, f"checkpoints/t1/step-{kept:06d}")
    assert protected_now(instance, load_fleet()).why("t1.step-000003") == f"pinned by the run tag {TAG_KEEP}"


def test_the_weekly_schedule_plans_every_week_and_is_on_by_default():
    assert weekly_housekeeping_schedule.cron_schedule == "0 7 * * 0"
    assert weekly_housekeeping_schedule.default_status == dg.DefaultScheduleStatus.RUNNING
    assert not load_fleet().housekeeping.apply  # plans only, until the fleet turns applying on


def test_a_person_or_an_agent_plans_applies_and_restores_from_the_terminal(capsys):
    from gpudoor_pipelines.cli.main import main
    from gpudoor_pipelines.transit.uris import open_bucket

    transit = TransitBucketResource(kind="local", local_root=str(open_bucket().root))
    _old_training(transit, steps=8)
    assert main(["housekeeping", "--plan", "--json"]) == 0  # the shipped fleet: the best 3 and the latest 2 stay
    plan = json.loads(capsys.readouterr().out)
    assert plan["by_action"]["cold"]["objects"] == 3
    assert {r["key"] for r in plan["rows"]} == {f"checkpoints/t1/step-00000{s}/model.pt" for s in (4, 5, 6)}
    assert main(["housekeeping", "--apply", plan["plan"]]) == 0
    assert "checkpoints      cold              3" in capsys.readouterr().out
    bucket = transit.get_bucket()
    assert tiers.unreadable(bucket, "checkpoints/t1/step-000004")
    assert main(["housekeeping", "--restore", "t1.step-000004", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["restored_objects"] == 1
    assert not tiers.unreadable(bucket, "checkpoints/t1/step-000004")
    assert main(["housekeeping", "--apply", "housekeeping/plans/none", "--json"]) == 2
    assert "make one first" in json.loads(capsys.readouterr().out)["problem"]
