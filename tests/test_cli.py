"""The ``gpudoor`` command: ``where`` explains each spec's route, ``check``, ``pools``."""

from __future__ import annotations

import json

import dagster as dg
import pytest

from gpudoor_pipelines.cli.main import main
from gpudoor_pipelines.launch.resolve.specs import load_spec
from tests.conftest import given_inputs


def _given(spec: str) -> list[str]:
    """The ``--env`` flags that give a shipped spec its required inputs."""
    return [f"--env={name}={value}" for name, value in given_inputs(load_spec(spec)).items()]


@pytest.mark.parametrize(
    "spec, pool, infra, accel, nodes, env_key, env_value",
    [
        (
            "task_specs/caption.yaml",
            "onprem",
            "slurm/onprem",
            "RTX6000-Ada:1",
            1,
            "LOCAL_CACHE_DIR",
            "/mnt/cache/gpudoor",
        ),
        ("task_specs/train.yaml", "h200", "slurm/h200-ib", "H200:8", 2, "CHECKPOINTS_DIR", "/lustre/checkpoints"),
        ("task_specs/smoke.yaml", "h200", "slurm/h200-ib", "H200:1", 1, "CHECKPOINTS_DIR", "/lustre/checkpoints"),
        (
            "task_specs/eval.yaml",
            "inference",
            "k8s/inference-prod",
            "L4:1",
            1,
            "CHECKPOINTS_DIR",
            "/scratch/checkpoints",
        ),
        ("task_specs/demo.yaml", "inference", "k8s/inference-prod", "L4:1", 1, "HF_HOME", "/cache/huggingface"),
    ],
)
def test_where_explains_each_spec(capsys, spec, pool, infra, accel, nodes, env_key, env_value):
    assert main(["where", spec, "--step", spec.split("/")[-1].removesuffix(".yaml"), "--json", *_given(spec)]) == 0
    info = json.loads(capsys.readouterr().out)
    assert (info["pool"], info["infra"], info["accelerators"], info["num_nodes"]) == (pool, infra, accel, nodes)
    assert info["injected_env"][env_key] == env_value
    assert info["decided_by"].startswith("route for step")
    assert info["labels"]["gpudoor-cost-owner"] == "ml-research"
    if pool == "inference":
        assert "research-preemptible" in " ".join(info["policy"])


def test_where_human_output_and_override(capsys):
    assert main(["where", "eval", "--pool", "ondemand", *_given("eval")]) == 0
    out = capsys.readouterr().out
    assert "pool        : ondemand" in out and "decided by  : pool override 'ondemand'" in out
    assert "LOCAL_CACHE_DIR=/workspace/cache" in out


def test_where_redacts_secret_values(capsys, monkeypatch):
    monkeypatch.setenv("GPUDOOR_TRANSIT", "s3")
    monkeypatch.setenv("GPUDOOR_S3_BUCKET", "transit")
    monkeypatch.setenv("GPUDOOR_S3_ACCESS_KEY_ID", "AKIAEXAMPLEKEY")
    monkeypatch.setenv("GPUDOOR_S3_SECRET_ACCESS_KEY", "super-secret-value-123")
    assert main(["where", "caption", *_given("caption")]) == 0
    out = capsys.readouterr().out
    assert "AWS_SECRET_ACCESS_KEY=****" in out
    assert "super-secret-value-123" not in out and "AKIAEXAMPLEKEY" not in out


def test_where_bad_override_is_a_clear_error(capsys):
    assert main(["where", "train", "--pool", "inference", *_given("train")]) == 2
    err = capsys.readouterr().err
    assert "train.yaml" in err and "resources.accelerators" in err and "Fix:" in err


def test_check_passes_on_the_shipped_specs(capsys):
    assert main(["check"]) == 0
    out = capsys.readouterr().out
    assert out.count("ok  ") == 5


def test_pools_sets_dagster_concurrency_from_the_caps(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "home"))
    assert main(["pools"]) == 0
    with dg.DagsterInstance.get() as instance:
        info = instance.event_log_storage.get_concurrency_info("gpu-h200")
        assert info.slot_count == 8  # 128 H200 / 16 per training run
        assert instance.event_log_storage.get_concurrency_info("gpu-onprem").slot_count == 16


def test_assets_run_in_the_dagster_pool_of_their_route():
    from gpudoor_pipelines.assets.concurrency import STEP_POOLS, dagster_pool_for
    from gpudoor_pipelines.definitions import defs
    from gpudoor_pipelines.launch.resolve.fleet import load_fleet

    fleet = load_fleet()
    for step, pool in STEP_POOLS.items():
        assert dagster_pool_for(fleet, step) == pool
    graph = defs.resolve_asset_graph()
    assert graph.get(dg.AssetKey("training_run")).pools == {"gpu-h200"}
    assert graph.get(dg.AssetKey("caption_shards")).pools == {"gpu-onprem"}
