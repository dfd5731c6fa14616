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


@pytest.mark.parametrize("given", ["0", "-3", "many"])
def test_flow_refuses_an_image_count_that_makes_no_dataset(capsys, given):
    """``--images 0`` used to run the 96-image sample without a word."""
    with pytest.raises(SystemExit) as refused:
        main(["flow", "--images", given])
    assert refused.value.code == 2
    err = capsys.readouterr().err
    assert "--images" in err and (given in err) and ("at least 1" in err or "whole number" in err)


def test_caption_a_folder_now_from_the_shell(tmp_path, capsys):
    """``gpudoor caption SOURCE --name NAME``: registers the folder, captions its shards now in one run, merges;
    run again after a new image, it captions only the new shard. A folder that cannot be read fails first."""
    import pandas as pd

    from gpudoor_pipelines.data.synthetic import generate_image

    assert main(["caption", str(tmp_path / "nowhere"), "--name", "mine"]) == 1
    err = capsys.readouterr().err
    assert "failed: dataset_shards" in err and "nowhere" in err and "Fix" in err and "Traceback" not in err

    folder = tmp_path / "mine"
    for index, name in enumerate(["a/img.png", "b/a/img.png", "img.png", "c/img.png"]):
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(generate_image(index)[0])
    assert main(["caption", str(folder), "--name", "mine", "--shard-size", "3"]) == 0
    out = capsys.readouterr().out
    assert "images          : 4 (0 skipped), in 2 shards (2 captioned now)" in out, out
    assert "caption_shards[mine-00000…mine-00001]" in out  # both shards in one run, with a live line
    uri = next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("captions "))
    merged = pd.read_parquet(uri.removeprefix("file://"))
    assert sorted(merged.image_id) == ["a/img.png", "b/a/img.png", "c/img.png", "img.png"]
    assert merged.caption.notna().all()

    (folder / "d").mkdir()
    (folder / "d/img.png").write_bytes(generate_image(9)[0])
    assert main(["caption", str(folder), "--name", "mine", "--shard-size", "3"]) == 0
    out = capsys.readouterr().out
    assert "images          : 5 (0 skipped), in 3 shards (1 captioned now)" in out, out
    assert len(pd.read_parquet(uri.removeprefix("file://"))) == 5


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
