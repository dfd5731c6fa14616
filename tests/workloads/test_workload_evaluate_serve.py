"""evaluate.py under real Dagster Pipes, and serve.py as a user would hit it."""

from __future__ import annotations

import json
import re
import signal
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from subprocess import Popen

import pytest
from workload_helpers import PATIENCE_S, free_port, run_under_pipes, start_workload, wait_for

from gpudoor_pipelines.data.synthetic import COLORS, SHAPES
from gpudoor_pipelines.transit import uris as storage


@pytest.fixture(scope="module")
def server(final_checkpoint: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Popen, int, Path]]:
    """serve.py on a free port of 127.0.0.1: (process, port, log); SIGTERMed at the end if still up."""
    port = free_port()
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    proc = start_workload("serve", log, CHECKPOINT_URI=final_checkpoint, PORT=str(port))
    yield proc, port, log
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=PATIENCE_S)


# ``server`` is requested here only to start it early: its start-up overlaps the evaluation run.
def test_evaluate_scores_above_chance_and_reports_through_pipes(final_checkpoint, dataset, bucket, server):
    output = storage.join(bucket, "eval", "final")
    env = dict(CHECKPOINT_URI=final_checkpoint, DATASET_URI=dataset, OUTPUT_URI=output, EVAL_BATCH_SIZE="8")
    result, proc = run_under_pipes("evaluate", env, check_names=["accuracy_above_chance"])
    assert proc.returncode == 0, proc.stderr
    assert result.success

    metrics = json.loads(storage.read_bytes(storage.join(output, "metrics.json")))
    assert 0.0 <= metrics["accuracy"] <= 1.0
    assert metrics["accuracy"] > 1 / (len(COLORS) * len(SHAPES))
    assert metrics["num_examples"] > 0 and metrics["checkpoint_uri"] == final_checkpoint
    for key in ("accuracy", "color_accuracy", "shape_accuracy", "num_examples"):
        assert result.asset_materializations_for_node("evaluate")[0].metadata[key].value == metrics[key]
    (check,) = result.get_asset_check_evaluations()
    assert check.check_name == "accuracy_above_chance" and check.passed


def test_serve_answers_and_stops_on_sigterm(server, final_checkpoint):
    proc, port, log = server
    wait_for(lambda: "serving on" in log.read_text(), proc, "the server to listen", log)
    base = f"http://127.0.0.1:{port}"
    assert f"serving on {base}" in log.read_text()
    with urllib.request.urlopen(f"{base}/healthz", timeout=10) as response:
        assert response.status == 200 and response.read() == b"ok"
    with urllib.request.urlopen(f"{base}/?color=red&shape=circle", timeout=10) as response:
        body = json.loads(response.read())
    assert body["input"]["color"] == "red" and body["input"]["shape"] == "circle"
    assert re.fullmatch(r"a (\w+) (\w+)", body["prediction"])
    assert body["checkpoint"] == final_checkpoint
    with urllib.request.urlopen(f"{base}/", timeout=10) as response:  # random colour and shape
        assert json.loads(response.read())["input"]["shape"] in SHAPES

    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=PATIENCE_S) == 0
    assert "stopped" in log.read_text()
