"""Housekeeping on both buckets (the local folder, and the S3 API over HTTP): what a plan keeps, and what
applying it does, once, twice, and after a run killed midway.

The bucket is a small team's: two trainings with evaluated checkpoints (one ended, one running), a smoke
output, a leftover Pipes session, the captions of an old and of the current caption model, and an unfinished
write. Ages come from the plan's "now", set 40 days after the objects were written (S3 sets an object's time
itself).
"""

from __future__ import annotations

import json
import time

import pytest
from transit_helpers import make_s3_bucket

from gpudoor_pipelines.data import housekeeping_apply as apply_mod
from gpudoor_pipelines.data.checkpoints import record_end, record_start
from gpudoor_pipelines.data.housekeeping import (
    COLD,
    DELETE,
    KEEP,
    RESTORE,
    Protected,
    Retention,
    make_plan,
    plan_rows,
)
from gpudoor_pipelines.data.housekeeping_apply import PlanNotApplicable, apply_plan
from gpudoor_pipelines.transit import tiers
from gpudoor_pipelines.transit.bucket import LocalTransitBucket

DAY = 86400.0
LATER = time.time() + 40 * DAY
ACCURACY = {2: 0.9, 3: 0.5, 4: 0.8, 5: 0.4, 6: 0.3, 7: 0.2}  # ended training: steps 1..8, step 1 not evaluated
RETENTION = Retention(keep_best=2, keep_latest=1, cold_after_days=30, delete_after_days=0, caption_model="new")


def ckpt(training: str, step: int) -> str:
    return f"{training}.step-{step:06d}"


def fill(bucket) -> Protected:
    """The team's bucket; returns what points at its checkpoints now."""
    for step in range(1, 9):
        bucket.publish(f"checkpoints/ended/step-{step:06d}", {"step": step}, {"model.pt": b"w" * 100})
        if step in ACCURACY:
            bucket.put_bytes(
                f"evals/{ckpt('ended', step)}/metrics.json", json.dumps({"accuracy": ACCURACY[step]}).encode()
            )
    start = record_start(bucket, "ended", now=LATER - 45 * DAY)
    record_end(bucket, start.ended_key, "succeeded")
    bucket.publish("checkpoints/ended", {"steps": 8})  # the run manifest: it finished
    record_start(bucket, "running", now=LATER - 0.5 * DAY)  # started, no end recorded
    for step in (1, 2, 3):
        bucket.publish(f"checkpoints/running/step-{step:06d}", {"step": step}, {"model.pt": b"r" * 100})
    bucket.put_bytes("smoke/ended/report.json", b"{}")
    bucket.put_bytes("_pipes/messages/abc123/1.json", b"{}")
    for model in ("old", "new"):
        bucket.publish(f"captions/{model}/ds-00000", {"shard": "ds-00000"}, {"part-00000.parquet": b"p" * 10})
    bucket.publish("datasets/ds/captioned/old", {"rows": 1, "missing_count": 0})
    bucket.publish("datasets/ds/captioned/new", {"rows": 1, "missing_count": 0})
    return Protected(
        checkpoints={ckpt("ended", 5): "the best checkpoint", ckpt("ended", 6): "the demo serves it"},
    )


def actions(bucket, plan_key: str) -> dict[str, tuple[str, str]]:
    return {r["key"]: (r["action"], r["reason"]) for batch in plan_rows(bucket, plan_key) for r in batch}


def snapshot(bucket) -> list[tuple[str, int, bool]]:
    return [(o.key, o.size, o.cold) for o in tiers.list_objects(bucket) if not o.key.startswith("housekeeping/")]


@pytest.fixture
def team_bucket(transit_bucket):
    return transit_bucket, fill(transit_bucket)


def test_a_plan_keeps_the_best_the_latest_the_served_and_a_running_trainings_checkpoints(team_bucket):
    bucket, protected = team_bucket
    plan = make_plan(bucket, RETENTION, protected, now=LATER)
    rows = actions(bucket, plan.key)

    def of(training: str, step: int) -> set[str]:
        return {a for k, (a, _) in rows.items() if k.startswith(f"checkpoints/{training}/step-{step:06d}/")}

    # kept: the best two by accuracy (2, 4), the latest (8), the best checkpoint (5), the served one (6)
    for step in (2, 4, 5, 6, 8):
        assert of("ended", step) == {KEEP}, step
    assert "the best checkpoint" in rows["checkpoints/ended/step-000005/model.pt"][1]
    # the rest goes cold, its manifest staying where it is
    for step in (1, 3, 7):
        assert rows[f"checkpoints/ended/step-{step:06d}/model.pt"][0] == COLD
        assert rows[f"checkpoints/ended/step-{step:06d}/_manifest.json"][0] == KEEP
    # a running training's newest, however it ranks, and nothing of it deleted
    assert of("running", 3) == {KEEP}
    assert "running" in rows["checkpoints/running/step-000003/model.pt"][1]
    assert rows["smoke/ended/report.json"][0] == DELETE
    assert rows["_pipes/messages/abc123/1.json"][0] == DELETE
    assert rows["captions/old/ds-00000/part-00000.parquet"][0] == DELETE
    assert rows["captions/new/ds-00000/part-00000.parquet"][0] == KEEP
    assert rows["evals/ended.step-000002/metrics.json"][0] == KEEP
    summary = plan.summary()
    assert summary["by_action"]["cold"] == {"objects": 3, "bytes": 300}
    assert {"prefix": "checkpoints", "action": "cold", "objects": 3, "bytes": 300} in summary["by_prefix"]


def test_applying_a_plan_twice_changes_nothing_the_second_time_and_a_new_plan_finds_nothing_to_do(team_bucket):
    bucket, protected = team_bucket
    plan = make_plan(bucket, RETENTION, protected, now=LATER)
    first = apply_plan(bucket, plan.key, protected, now=LATER)
    after_first = snapshot(bucket)
    assert first.done[("checkpoints", COLD)] == [3, 300]
    assert ("checkpoints/ended/step-000003/model.pt", 100, True) in after_first
    assert not [k for k, _, _ in after_first if k.startswith(("smoke/", "_pipes/", "captions/old/"))]
    second = apply_plan(bucket, plan.key, protected, now=LATER)
    assert snapshot(bucket) == after_first
    assert second.batches_resumed == 2 and second.done == first.done
    again = make_plan(bucket, RETENTION, protected, now=LATER + 60)
    team = {k: a for k, (a, _) in actions(bucket, again.key).items() if not k.startswith("housekeeping/")}
    assert set(team.values()) == {KEEP}


def test_a_run_killed_mid_apply_then_run_again_ends_like_an_uninterrupted_one(
    transit_bucket, tmp_path, request, monkeypatch
):
    if isinstance(transit_bucket, LocalTransitBucket):
        other = LocalTransitBucket(tmp_path / "other-root")
    else:
        other = make_s3_bucket(transit_bucket.endpoint_url, transit_bucket.bucket, prefix="other")
    snapshots = []
    for bucket, killed in ((transit_bucket, False), (other, True)):
        protected = fill(bucket)
        plan = make_plan(bucket, RETENTION, protected, now=LATER)
        if killed:
            real, calls = tiers.move, []

            def dies_on_the_second_move(b, key, storage_class, real=real, calls=calls):
                calls.append(key)
                if len(calls) == 2:
                    raise KeyboardInterrupt  # the run worker killed midway
                return real(b, key, storage_class)

            monkeypatch.setattr(tiers, "move", dies_on_the_second_move)
            with pytest.raises(KeyboardInterrupt):
                apply_plan(bucket, plan.key, protected, now=LATER, workers=1)
            monkeypatch.setattr(tiers, "move", real)
            assert 1 <= len([o for o in tiers.list_objects(bucket) if o.cold]) < 3  # cut before the end
        apply_plan(bucket, plan.key, protected, now=LATER)
        snapshots.append(snapshot(bucket))
    assert snapshots[0] == snapshots[1]


def test_a_checkpoint_that_became_protected_since_the_plan_is_left_alone_and_an_old_plan_is_refused(team_bucket):
    bucket, protected = team_bucket
    plan = make_plan(bucket, RETENTION, protected, now=LATER)
    now_protected = Protected(checkpoints={**protected.checkpoints, ckpt("ended", 3): "pinned since"})
    with pytest.raises(PlanNotApplicable, match="make a new plan"):
        apply_plan(bucket, plan.key, now_protected, now=LATER + 2 * DAY)
    result = apply_plan(bucket, plan.key, now_protected, now=LATER)
    assert result.protected_since == 1
    assert not tiers.unreadable(bucket, "checkpoints/ended/step-000003")
    assert ("checkpoints/ended/step-000003/model.pt", 100, False) in snapshot(bucket)


def test_past_delete_after_days_a_checkpoint_goes_manifest_first_and_a_cold_one_is_restored(team_bucket):
    bucket, protected = team_bucket
    plan = make_plan(bucket, RETENTION, protected, now=LATER)
    apply_plan(bucket, plan.key, protected, now=LATER)
    if isinstance(bucket, LocalTransitBucket):  # a job cannot read it until it is restored
        assert tiers.unreadable(bucket, "checkpoints/ended/step-000003")
    assert tiers.restore(bucket, ["checkpoints/ended/step-000003/model.pt"]) == 1
    assert bucket.get_bytes("checkpoints/ended/step-000003/model.pt") == b"w" * 100
    assert not tiers.unreadable(bucket, "checkpoints/ended/step-000003")
    pinned = Protected(checkpoints={**protected.checkpoints, ckpt("ended", 1): "pinned"})
    plan = make_plan(bucket, RETENTION, pinned, now=LATER + 30)  # a cold checkpoint pinned since: back
    assert actions(bucket, plan.key)["checkpoints/ended/step-000001/model.pt"] == (RESTORE, "cold, but pinned")
    apply_plan(bucket, plan.key, pinned, now=LATER + 30)
    assert ("checkpoints/ended/step-000001/model.pt", 100, False) in snapshot(bucket)
    deleting = Retention(**{**RETENTION.__dict__, "delete_after_days": 35})
    plan = make_plan(bucket, deleting, protected, now=LATER + 60)
    rows = actions(bucket, plan.key)
    assert rows["checkpoints/ended/step-000007/_manifest.json"][0] == DELETE
    assert rows["checkpoints/ended/step-000005/model.pt"][0] == KEEP
    order = [
        name
        for name, wanted in apply_mod.PASSES.items()
        if wanted({"action": DELETE, "key": "checkpoints/ended/step-000007/_manifest.json"})
    ]
    assert order == ["manifests"]
    apply_plan(bucket, plan.key, protected, now=LATER + 60)
    keys = {k for k, _, _ in snapshot(bucket)}
    assert not {k for k in keys if k.startswith("checkpoints/ended/step-000007/")}
    assert "checkpoints/ended/step-000005/model.pt" in keys


def test_an_unfinished_upload_older_than_a_day_is_aborted(transit_bucket):
    bucket = transit_bucket
    if isinstance(bucket, LocalTransitBucket):
        (bucket.root / "checkpoints").mkdir()
        (bucket.root / "checkpoints" / ".tmp-killed").write_bytes(b"half")
    else:
        bucket.client.create_multipart_upload(Bucket=bucket.bucket, Key=bucket._full("checkpoints/big.pt"))
    plan = make_plan(bucket, RETENTION, Protected(), now=LATER)
    assert [r["action"] for batch in plan_rows(bucket, plan.key, ["abort"]) for r in batch] == ["abort"]
    apply_plan(bucket, plan.key, Protected(), now=LATER)
    assert not list(tiers.leftovers(bucket))


def test_a_checkpoint_evaluated_again_is_ranked_by_its_new_score(team_bucket):
    bucket, protected = team_bucket
    plan = make_plan(bucket, RETENTION, protected, now=LATER)
    assert actions(bucket, plan.key)["checkpoints/ended/step-000007/model.pt"][0] == COLD
    if not isinstance(bucket, LocalTransitBucket):
        time.sleep(1.1)  # S3 dates an object to the second
    bucket.put_bytes(f"evals/{ckpt('ended', 7)}/metrics.json", json.dumps({"accuracy": 0.95}).encode())
    plan = make_plan(bucket, RETENTION, protected, now=LATER + 60)
    assert plan.scores_read == 1  # only the metrics written since the last plan
    rows = actions(bucket, plan.key)
    assert rows["checkpoints/ended/step-000007/model.pt"] == (KEEP, "one of the best 2 by accuracy")
    assert rows["checkpoints/ended/step-000004/model.pt"][0] == COLD  # pushed out of the best two
