"""train.py: checkpoints with manifests, resume after a kill, two ranks together, smoke mode."""

from __future__ import annotations

import json
import re

from workload_helpers import CHECKPOINT_EVERY, MAX_STEPS, run_workload

from gpudoor_pipelines.transit import bucket as storage


def _manifest(output: str, step: int) -> dict:
    return json.loads(storage.read_bytes(storage.join(output, f"step-{step:06d}", storage.MANIFEST_NAME)))


def _steps(output: str) -> list[int]:
    return sorted(
        int(m.group(1)) for u in storage.list_uris(output) if (m := re.search(r"step-(\d+)/model\.pt$", u))
    )


def test_checkpoints_with_manifests_every_n_steps(train_runs, final_checkpoint):
    output = train_runs["output"]
    assert _steps(output) == list(range(CHECKPOINT_EVERY, MAX_STEPS + 1, CHECKPOINT_EVERY))
    for step in _steps(output):
        manifest = _manifest(output, step)
        assert set(manifest) == {"step", "loss", "train_accuracy", "created_at"}
        assert manifest["step"] == step and 0.0 <= manifest["train_accuracy"] <= 1.0
    assert _manifest(output, MAX_STEPS)["loss"] < _manifest(output, CHECKPOINT_EVERY)["loss"]  # it learns


def test_killed_after_first_checkpoint_then_resumes_to_max_steps(train_runs, final_checkpoint):
    assert train_runs["killed_before_end"]
    for _rank, (_rc, log) in enumerate(train_runs["ranks"]):
        resumed = int(re.search(r"resuming from step (\d+)", log).group(1))
        assert 0 < resumed < MAX_STEPS
        assert f"step {resumed + 1}/{MAX_STEPS} " in log  # carries on right after the checkpoint
        assert f"finished at step {MAX_STEPS}" in log


def test_two_ranks_train_together(train_runs, final_checkpoint):
    for _rank, (_rc, log) in enumerate(train_runs["ranks"]):
        assert "joined process group of 2" in log
    # Only rank 0 writes checkpoints, so rank 1 never says it wrote one.
    assert (
        "checkpoint step" in train_runs["ranks"][0][1] and "checkpoint step" not in train_runs["ranks"][1][1]
    )


def test_restart_when_already_done_exits_at_once(train_runs):
    again = train_runs["again"]
    assert again.returncode == 0, again.stderr
    assert "nothing to do" in again.stdout and "loaded" not in again.stdout


def test_smoke_test_mode(train_runs):
    rc, log = train_runs["smoke"]
    assert rc == 0, log
    assert "smoke: forward/backward ok" in log and "smoke test passed" in log
    assert (train_runs["smoke_scratch"] / "step-000004" / "model.pt").exists()
    assert _steps(train_runs["smoke_output"]) == [2, 4]


def test_missing_node_ips_is_a_config_error(dataset, bucket):
    proc = run_workload(
        "train", DATASET_URI=dataset, OUTPUT_URI=storage.join(bucket, "x"), SKYPILOT_NUM_NODES="2"
    )
    assert proc.returncode == 2
    assert "SKYPILOT_NODE_IPS" in proc.stderr
