"""train.py: checkpoints with manifests, resume after a kill, two ranks together, smoke mode, ended marker."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta

import pandas as pd
import pytest
from workload_helpers import (
    CHECKPOINT_EVERY,
    MAX_STEPS,
    PATIENCE_S,
    ROOT,
    base_env,
    exists,
    run_workload,
    start_workload,
    wait_for,
)

from gpudoor_pipelines.data.checkpoints import scan_checkpoints
from gpudoor_pipelines.transit import uris as storage
from gpudoor_pipelines.transit.bucket import MANIFEST_NAME, LocalTransitBucket


def _manifest(output: str, step: int) -> dict:
    return json.loads(storage.read_bytes(storage.join(output, f"step-{step:06d}", MANIFEST_NAME)))


def _steps(output: str) -> list[int]:
    return sorted(int(m.group(1)) for u in storage.list_uris(output) if (m := re.search(r"step-(\d+)/model\.pt$", u)))


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
    assert "checkpoint step" in train_runs["ranks"][0][1] and "checkpoint step" not in train_runs["ranks"][1][1]


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
    proc = run_workload("train", DATASET_URI=dataset, OUTPUT_URI=storage.join(bucket, "x"), SKYPILOT_NUM_NODES="2")
    assert proc.returncode == 2
    assert "SKYPILOT_NODE_IPS" in proc.stderr


# The ended marker (ENDED_MARKER_URI): written by rank 0 once a training is over, never on a signal.


OWN_TASK_ID = "sky-managed-2026-12-06-12-00-00-123456_train_7-0"


def _marker(uri: str) -> dict | None:
    return json.loads(storage.read_bytes(uri)) if exists(uri) else None


@pytest.fixture(scope="module")
def ended_runs(bucket: str, dataset: str, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Short trainings with ENDED_MARKER_URI set, each into a prefix of its own, mostly run at once.

    "ok" trains 4 steps, then "again" (the same training, a marker of its own) and "rank1" (rank 1 of
    two nodes) start once more with nothing to do; "config" has CHECKPOINT_EVERY=0; "no_data" has
    no usable caption (a TrainingError); "no_dataset" a DATASET_URI with no object (an exception);
    "smoke" is a smoke test; "sigterm" and "sigint" are throttled runs signalled after a checkpoint.

    Returns:
        name -> (exit code, log, marker URI, output URI).
    """
    root = storage.join(bucket, "ended")
    logs = tmp_path_factory.mktemp("ended")
    no_data = storage.join(root, "no-captions.parquet")
    path = no_data.removeprefix("file://")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    pd.DataFrame(
        {"image_id": ["img-0"], "image_uri": [storage.join(root, "img-0.png")], "caption": ["nothing"]}
    ).to_parquet(path)

    def env(name: str, **overrides: str) -> dict[str, str]:
        return {
            "DATASET_URI": dataset,
            "OUTPUT_URI": storage.join(root, name, "checkpoints"),
            "CHECKPOINTS_DIR": str(logs / name / "scratch"),
            "ENDED_MARKER_URI": storage.join(root, name, "ended.json"),
            "MAX_STEPS": "4",
            "CHECKPOINT_EVERY": "2",
            "BATCH_SIZE": "8",
            **overrides,
        }

    # A training nobody journaled (launched by hand, by an agent, through SkyPilot itself): its folder in a
    # transit bucket's layout, no ENDED_MARKER_URI. The checkpoint sensor's cursor is taken before it starts.
    transit = LocalTransitBucket(storage.join(root, "transit").removeprefix("file://"))
    self_id = "20261206T120000-selfjour"
    sensor_cursor = scan_checkpoints(transit, None, now=time.time() - 1).cursor
    envs = {
        "self": env("self", OUTPUT_URI=storage.join(root, "transit", "checkpoints", self_id), ENDED_MARKER_URI=""),
        # Given the checkpoints folder itself: the training names its own folder, from its SkyPilot task id.
        "own-id": env(
            "own-id",
            OUTPUT_URI=storage.join(root, "own", "checkpoints") + "/",
            ENDED_MARKER_URI="",
            SKYPILOT_TASK_ID=OWN_TASK_ID,
        ),
        "ok": env("ok"),
        "config": env("config", CHECKPOINT_EVERY="0"),
        "no_data": env("no_data", DATASET_URI=no_data),
        "no_dataset": env("no_dataset", DATASET_URI=storage.join(root, "gone.parquet")),
        "smoke": env("smoke", SMOKE_TEST="1"),
    }
    signalled = {"sigterm": signal.SIGTERM, "sigint": signal.SIGINT}
    for name in signalled:
        envs[name] = env(name, MAX_STEPS="1000", WORKLOAD_THROTTLE_S="0.05")
    procs = {}
    for name, run_env in envs.items():
        if name == "sigint":
            # Started by hand: a background shell starts its children with SIGINT ignored, and then
            # Python keeps it ignored; the job must see a ^C as a KeyboardInterrupt.
            with open(logs / f"{name}.log", "wb") as out:
                procs[name] = subprocess.Popen(
                    [sys.executable, "-m", "workloads.train"],
                    cwd=ROOT,
                    env=base_env(**run_env),
                    stdout=out,
                    stderr=out,
                    preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
                )
        else:
            procs[name] = start_workload("train", logs / f"{name}.log", **run_env)
    try:
        for name, signum in signalled.items():
            first = storage.join(envs[name]["OUTPUT_URI"], "step-000002", MANIFEST_NAME)
            wait_for(lambda uri=first: exists(uri), procs[name], "the first checkpoint", logs / f"{name}.log")
            procs[name].send_signal(signum)
        codes = {name: proc.wait(timeout=PATIENCE_S) for name, proc in procs.items()}
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    runs = {
        name: (codes[name], (logs / f"{name}.log").read_text(), e["ENDED_MARKER_URI"], e["OUTPUT_URI"])
        for name, e in envs.items()
    }
    runs["self-scan"] = (scan_checkpoints(transit, sensor_cursor), scan_checkpoints, transit, self_id)
    again = dict(envs["ok"], ENDED_MARKER_URI=storage.join(root, "ok", "ended-again.json"))
    rank1 = dict(
        again,
        ENDED_MARKER_URI=storage.join(root, "ok", "ended-rank1.json"),
        SKYPILOT_NUM_NODES="2",
        SKYPILOT_NODE_RANK="1",
        SKYPILOT_NODE_IPS="127.0.0.1\n127.0.0.1",
    )
    for name, run_env in (("again", again), ("rank1", rank1)):
        proc = run_workload("train", **run_env)
        runs[name] = (
            proc.returncode,
            proc.stdout + proc.stderr,
            run_env["ENDED_MARKER_URI"],
            run_env["OUTPUT_URI"],
        )
    return runs


def _assert_recent_utc(at: str) -> None:
    when = datetime.fromisoformat(at)
    assert when.utcoffset() == timedelta(0)
    assert timedelta(0) <= datetime.now(UTC) - when < timedelta(seconds=PATIENCE_S)


def test_ended_marker_says_succeeded_with_the_last_step(ended_runs):
    rc, log, marker_uri, output = ended_runs["ok"]
    assert rc == 0, log
    assert _steps(output) == [2, 4]
    marker = _marker(marker_uri)
    assert set(marker) == {"state", "reason", "step", "at"}
    assert (marker["state"], marker["reason"], marker["step"]) == ("succeeded", None, 4)
    _assert_recent_utc(marker["at"])


def test_a_training_nobody_journaled_journals_itself_and_the_sensor_finds_its_checkpoints(ended_runs):
    rc, log, _, output = ended_runs["self"]
    assert rc == 0, log
    assert _steps(output) == [2, 4]
    found, scan, transit, training = ended_runs["self-scan"]
    # The sensor's next tick after the training: every checkpoint it wrote, none from before it started.
    assert found.checkpoints == [f"{training}.step-000002", f"{training}.step-000004"]
    (entry,) = [k for k in transit.list_keys("trainings/") if k.endswith(f"-{training}.json")]
    (ended,) = list(transit.list_keys(f"checkpoints/{training}/_ended/"))
    assert json.loads(transit.get_bytes(ended))["state"] == "succeeded"
    # Its end marker is where the journal entry says: the tick after, the training leaves the watch list.
    assert scan(transit, found.cursor).forgotten == [(training, "ended")]
    assert entry and "journaled for the checkpoint sensor" in log


def test_given_the_checkpoints_folder_a_training_names_its_own_the_same_on_every_recovery(ended_runs, monkeypatch):
    rc, log, _, given = ended_runs["own-id"]
    assert rc == 0, log
    from workloads.train import own_training_folder

    monkeypatch.setenv("SKYPILOT_TASK_ID", OWN_TASK_ID)  # what SkyPilot sets again on a recovered job
    folder = own_training_folder(given)
    training = folder.rsplit("/", 1)[1]
    assert folder.startswith(given) and training.startswith("2026120") and len(training) == 24
    assert _steps(folder) == [2, 4]
    own = LocalTransitBucket(given.removeprefix("file://").rstrip("/").rsplit("/", 1)[0])
    assert any(k.endswith(f"-{training}.json") for k in own.list_keys("trainings/"))  # journaled for the sensor
    monkeypatch.delenv("SKYPILOT_TASK_ID")
    with pytest.raises(Exception, match="OUTPUT_URI=.*names the folder of every training.*training id"):
        own_training_folder(given)


def test_ended_marker_when_already_complete(ended_runs):
    rc, log, marker_uri, _ = ended_runs["again"]
    assert rc == 0, log
    assert "nothing to do" in log
    marker = _marker(marker_uri)
    assert (marker["state"], marker["reason"], marker["step"]) == ("succeeded", None, 4)
    rc, log, marker_uri, _ = ended_runs["rank1"]  # one marker per training: rank 0's
    assert rc == 0, log
    assert "nothing to do" in log and _marker(marker_uri) is None


def test_ended_marker_on_a_config_error(ended_runs):
    rc, log, marker_uri, output = ended_runs["config"]
    assert rc == 2, log
    assert "configuration error: MAX_STEPS, CHECKPOINT_EVERY and BATCH_SIZE must be >= 1" in log
    marker = _marker(marker_uri)
    assert marker["state"] == "failed" and marker["step"] is None
    assert marker["reason"] == "configuration error: MAX_STEPS, CHECKPOINT_EVERY and BATCH_SIZE must be >= 1"
    _assert_recent_utc(marker["at"])


def test_no_ended_marker_on_a_training_error_or_a_crash(ended_runs):
    """SkyPilot may restart a job that failed (job_recovery), and it resumes: the orchestrator, not the
    job, says the training failed, once the managed job is over."""
    rc, log, marker_uri, _ = ended_runs["no_data"]
    assert rc == 1 and "no usable training examples in " in log, log
    assert _marker(marker_uri) is None
    rc, log, marker_uri, _ = ended_runs["no_dataset"]
    assert rc == 1 and "Traceback" in log, log  # the exception still ends the program as before
    assert _marker(marker_uri) is None


@pytest.mark.parametrize("name", ["sigterm", "sigint"])
def test_no_ended_marker_on_a_signal(ended_runs, name):
    rc, log, marker_uri, output = ended_runs[name]
    if name == "sigterm":
        assert rc == -signal.SIGTERM, log
    else:  # a KeyboardInterrupt goes through main and out, as before
        assert rc != 0 and log.rstrip().endswith("KeyboardInterrupt"), log
    assert _steps(output) and max(_steps(output)) < 1000  # stopped midway: it would resume
    assert _marker(marker_uri) is None


def test_no_ended_marker_in_smoke_mode(ended_runs):
    rc, log, marker_uri, _ = ended_runs["smoke"]
    assert rc == 0, log
    assert "smoke test passed" in log
    assert _marker(marker_uri) is None


def test_a_marker_that_cannot_be_written_changes_no_exit_status(dataset, bucket, tmp_path):
    (tmp_path / "a-file").write_text("not a folder")
    unwritable = "file://" + str(tmp_path / "a-file" / "ended.json")
    proc = run_workload(
        "train",
        DATASET_URI=dataset,
        OUTPUT_URI=storage.join(bucket, "ended", "unwritable"),
        ENDED_MARKER_URI=unwritable,
        CHECKPOINT_EVERY="0",
    )
    assert proc.returncode == 2, proc.stderr
    assert f"cannot write the ended marker {unwritable}: " in proc.stderr
    assert "configuration error: MAX_STEPS, CHECKPOINT_EVERY and BATCH_SIZE must be >= 1" in proc.stderr
