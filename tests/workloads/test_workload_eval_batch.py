"""evaluate.py in batch mode: many checkpoints per job, each reported alone, scored once."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest
from workload_helpers import (
    CHECKPOINT_EVERY,
    PATIENCE_S,
    custom_messages,
    exists,
    file_pipes_env,
    run_workload,
    start_workload,
)

from gpudoor_pipelines.transit import uris as storage

MISSING = "train/step-000099"  # a checkpoint with no model file


def _mtime(uri: str) -> int:
    """When the object at a file:// URI was last written."""
    return os.stat(uri.removeprefix("file://")).st_mtime_ns


def _metrics(output_uri: str) -> dict:
    return json.loads(storage.read_bytes(storage.join(output_uri, "metrics.json")))


def write_eval_batch(
    uri: str, checkpoints_per_job: Sequence[Sequence[dict]], pipes_envs: Sequence[Mapping[str, str]] = ()
) -> str:
    """Write an evaluation batch file: one job per entry of ``checkpoints_per_job``; returns ``uri``."""
    jobs = [
        {
            "checkpoints": list(checkpoints),
            "pipes_env": dict(pipes_envs[rank]) if rank < len(pipes_envs) else {},
        }
        for rank, checkpoints in enumerate(checkpoints_per_job)
    ]
    storage.write_bytes(uri, json.dumps({"jobs": jobs}).encode())
    return uri


def _pipes_methods(messages: Path) -> set[str]:
    """The Pipes methods called in a messages file."""
    return {json.loads(line)["method"] for line in messages.read_text().splitlines() if line.strip()}


@pytest.fixture(scope="module")
def eval_batch(bucket: str, dataset: str, train_runs: dict, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A batch of two jobs run at once, two checkpoints each; rank 1's second has no model file.

    Alongside, the single-checkpoint mode scores rank 1's good checkpoint; once both jobs are over,
    rank 0's job is run again.

    Returns:
        {"entries": batch entries by checkpoint key, "codes"/"logs"/"messages"/"message_files": by
        rank, "single": (process, output URI), "before": metrics.json URI -> (bytes, mtime) of
        rank 0's checkpoints after the first run, "again": the rerun, "again_messages": its messages}.
    """
    root = storage.join(bucket, "eval-batch")
    logs = tmp_path_factory.mktemp("eval-batch")
    entries = {}
    for step in (CHECKPOINT_EVERY, 2 * CHECKPOINT_EVERY, 3 * CHECKPOINT_EVERY):
        key = f"train/step-{step:06d}"
        entries[key] = {
            "checkpoint": key,
            "checkpoint_uri": storage.join(train_runs["output"], f"step-{step:06d}"),
            "dataset_uri": dataset,
            "output_uri": storage.join(root, "metrics", key),
        }
    entries[MISSING] = {
        "checkpoint": MISSING,
        "checkpoint_uri": storage.join(root, "checkpoints", "step-000099"),
        "dataset_uri": dataset,
        "output_uri": storage.join(root, "metrics", MISSING),
    }
    keys = list(entries)
    per_job = [[entries[keys[0]], entries[keys[1]]], [entries[keys[2]], entries[MISSING]]]
    message_files = [logs / f"messages-{rank}.jsonl" for rank in (0, 1)]
    batch = write_eval_batch(
        storage.join(root, "batch.json"), per_job, pipes_envs=[file_pipes_env(m) for m in message_files]
    )
    procs = [
        start_workload(
            "evaluate",
            logs / f"rank{rank}.log",
            EVAL_BATCH_URI=batch,
            SKYPILOT_JOB_RANK=str(rank),
            SKYPILOT_NUM_JOBS="2",
            EVAL_BATCH_SIZE="8",
        )
        for rank in (0, 1)
    ]
    single_output = storage.join(root, "single")
    single = run_workload(
        "evaluate",
        CHECKPOINT_URI=entries[keys[2]]["checkpoint_uri"],
        DATASET_URI=dataset,
        OUTPUT_URI=single_output,
        EVAL_BATCH_SIZE="8",
    )
    codes = [proc.wait(timeout=PATIENCE_S) for proc in procs]
    written = [storage.join(e["output_uri"], "metrics.json") for e in per_job[0]]
    before = {uri: (storage.read_bytes(uri), _mtime(uri)) for uri in written if exists(uri)}

    again_messages = logs / "messages-again.jsonl"
    again_batch = write_eval_batch(
        storage.join(root, "again.json"), per_job, pipes_envs=[file_pipes_env(again_messages)]
    )
    again = run_workload("evaluate", EVAL_BATCH_URI=again_batch, SKYPILOT_JOB_RANK="0")
    return {
        "entries": entries,
        "per_job": per_job,
        "codes": codes,
        "logs": [(logs / f"rank{rank}.log").read_text() for rank in (0, 1)],
        "messages": [custom_messages(m) for m in message_files],
        "message_files": message_files,
        "single": (single, single_output),
        "before": before,
        "again": again,
        "again_messages": custom_messages(again_messages),
    }


def test_a_job_scores_each_of_its_checkpoints(eval_batch):
    assert eval_batch["codes"][0] == 0, eval_batch["logs"][0]
    log = eval_batch["logs"][0]
    messages = eval_batch["messages"][0]
    entries = eval_batch["per_job"][0]
    assert [m["checkpoint"] for m in messages] == [e["checkpoint"] for e in entries]
    for entry, message in zip(entries, messages, strict=True):
        metrics = _metrics(entry["output_uri"])
        # A checkpoint done is a save (its metrics are in the bucket): the message says when.
        assert set(message) == {"checkpoint", "state", "metrics", "seconds", "saved", "durable_at"}
        assert message["saved"] == "metrics" and isinstance(message["durable_at"], float)
        assert message["state"] == "done" and message["metrics"] == metrics
        assert message["seconds"] > 0
        assert metrics["checkpoint_uri"] == entry["checkpoint_uri"]
        assert metrics["checkpoint_step"] == int(entry["checkpoint"].rsplit("-", 1)[1])
        assert metrics["num_examples"] > 0 and 0.0 <= metrics["accuracy"] <= 1.0
        assert f"{entry['checkpoint']}: accuracy {metrics['accuracy']:.3f}" in log
    assert log.count("held-out images from") == 1  # the data set is read once for both checkpoints
    assert "job 1/2: 2 done, 0 failed" in log
    # The orchestrator materializes each checkpoint from the messages: the job reports nothing else.
    assert not {"report_asset_materialization", "report_asset_check"} & _pipes_methods(eval_batch["message_files"][0])


def test_batch_metrics_are_those_of_a_single_evaluation(eval_batch):
    single, output = eval_batch["single"]
    assert single.returncode == 0, single.stderr
    good = eval_batch["per_job"][1][0]
    assert _metrics(good["output_uri"]) == _metrics(output)


def test_a_missing_checkpoint_fails_alone(eval_batch):
    assert eval_batch["codes"][1] == 1, eval_batch["logs"][1]
    log = eval_batch["logs"][1]
    good, missing = eval_batch["per_job"][1]
    done, failed = eval_batch["messages"][1]
    assert done["checkpoint"] == good["checkpoint"] and done["state"] == "done"
    assert done["metrics"] == _metrics(good["output_uri"])
    assert set(failed) == {"checkpoint", "state", "reason"}
    assert failed["checkpoint"] == MISSING and failed["state"] == "failed"
    assert failed["reason"] == f"no model file at {storage.join(missing['checkpoint_uri'], 'model.pt')}"
    assert f"{MISSING}: failed: {failed['reason']}" in log
    assert "job 2/2: 1 done, 1 failed" in log
    assert not storage.list_uris(missing["output_uri"])


def test_a_scored_checkpoint_is_not_scored_again(eval_batch):
    again = eval_batch["again"]
    assert again.returncode == 0, again.stderr
    assert "evaluating step" not in again.stdout  # nothing is scored, torch not even loaded
    entries = eval_batch["per_job"][0]
    messages = eval_batch["again_messages"]
    assert [m["checkpoint"] for m in messages] == [e["checkpoint"] for e in entries]
    for entry, message in zip(entries, messages, strict=True):
        assert isinstance(message.pop("durable_at"), float)
        assert message == {
            "checkpoint": entry["checkpoint"],
            "state": "done",
            "metrics": _metrics(entry["output_uri"]),
            "seconds": 0.0,
            "reused": True,
            "saved": "metrics",
        }
        assert f"{entry['checkpoint']}: already evaluated" in again.stdout
    assert eval_batch["before"].keys() == {storage.join(e["output_uri"], "metrics.json") for e in entries}
    for uri, (data, mtime) in eval_batch["before"].items():
        assert storage.read_bytes(uri) == data and _mtime(uri) == mtime


GOOD = {
    "checkpoint": "k",
    "checkpoint_uri": "file:///nowhere/step-000001",
    "dataset_uri": "file:///nowhere/data.parquet",
    "output_uri": "file:///nowhere/eval",
}


@pytest.mark.parametrize(
    ("batch", "env", "says"),
    [
        (
            {"jobs": [{"checkpoints": [GOOD]}, {"checkpoints": []}]},
            {"SKYPILOT_JOB_RANK": "2"},
            "SKYPILOT_JOB_RANK=2 is out of range: the batch file {uri} has 2 jobs",
        ),
        (
            {"jobs": [{"checkpoints": [GOOD, {k: v for k, v in GOOD.items() if k != "checkpoint_uri"}]}]},
            {},
            "jobs[0] of {uri}: checkpoints[1] has no checkpoint_uri",
        ),
        (
            {"jobs": [{"checkpoints": [dict(GOOD, output_uri=7)]}]},
            {},
            "jobs[0] of {uri}: checkpoints[0].output_uri must be a non-empty string, got 7",
        ),
        (
            {"jobs": [{"checkpoints": [GOOD], "pipes_env": {"A": 1}}]},
            {},
            "jobs[0] of {uri}: pipes_env must map names to strings",
        ),
        ("{not json", {}, "EVAL_BATCH_URI='{uri}': "),
        (None, {}, "EVAL_BATCH_URI='{uri}': there is no batch file there"),
    ],
    ids=["rank-out-of-range", "no-checkpoint-uri", "not-a-string", "pipes-env", "not-json", "no-file"],
)
def test_bad_batch_files_exit_2_naming_the_field(bucket, tmp_path, batch, env, says):
    uri = storage.join(bucket, "eval-batch-errors", f"{tmp_path.name}.json")
    if isinstance(batch, dict):
        storage.write_bytes(uri, json.dumps(batch).encode())
    elif batch is not None:
        storage.write_bytes(uri, batch.encode())
    proc = run_workload("evaluate", EVAL_BATCH_URI=uri, **env)
    assert proc.returncode == 2, proc.stderr
    assert says.format(uri=uri) in proc.stderr
