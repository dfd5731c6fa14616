"""resolve(): the one pure step from a launch request to the task that runs, shared by ``gpudoor where``."""

from __future__ import annotations

import json

import pytest

from gpudoor_pipelines.cli.main import main
from gpudoor_pipelines.launch.errors import LaunchConfigError
from gpudoor_pipelines.launch.resolve.fleet import load_fleet
from gpudoor_pipelines.launch.resolve.request import LaunchRequest, resolve
from gpudoor_pipelines.launch.resolve.specs import load_spec
from gpudoor_pipelines.launch.resolve.usage import Usage
from tests.conftest import given_inputs


def test_resolve_is_pure_and_names_the_job_after_the_run():
    request = LaunchRequest(
        spec=load_spec("caption"),
        inputs={"CAPTION_BATCH_URI": "s3://b/batch-003.json"},
        env={"CAPTION_MODEL": "color-shape-v1"},
        asset="caption_shards",
        partition="shard-003",
        dagster={"dagster/run-id": "0123abcd-ffff"},
        step="caption",
    )
    first, second = resolve(request, load_fleet()), resolve(request, load_fleet())
    assert first == second and first.name == "caption-shards-shard-003-0123abcd"
    assert (
        first.config["envs"]["CAPTION_BATCH_URI"] == "s3://b/batch-003.json"
        and first.config["envs"]["CAPTION_MODEL"] == "color-shape-v1"
    )
    assert first.labels["dagster-partition"] == "shard-003" and first.labels["gpudoor-step"] == "caption"
    assert request.spec.config["resources"]["accelerators"] == {"RTX6000-Ada": 1, "L4": 1, "H100": 1}


def test_resolve_uses_live_usage_and_refuses_undeclared_env():
    spec = load_spec("caption")
    full = Usage(gpus={"onprem": 16})
    inputs = given_inputs(spec)
    assert (
        resolve(LaunchRequest(spec=spec, inputs=inputs, step="caption"), load_fleet(), usage=full).pool == "inference"
    )
    with pytest.raises(LaunchConfigError) as err:
        resolve(LaunchRequest(spec=spec, inputs=inputs, env={"CAPTION_MODL": "x"}), load_fleet())
    assert err.value.field == "env.CAPTION_MODL" and "CAPTION_MODEL" in err.value.fix


@pytest.mark.parametrize("spec", ["caption", "train", "eval", "smoke", "demo"])
def test_where_shows_exactly_what_resolve_gives(capsys, spec):
    inputs = given_inputs(load_spec(spec))
    assert main(["where", spec, "--step", spec, "--json", *(f"--env={k}={v}" for k, v in inputs.items())]) == 0
    shown = json.loads(capsys.readouterr().out)
    request = LaunchRequest(
        spec=load_spec(spec), env=inputs, user=shown["labels"]["gpudoor-user"], asset="(gpudoor where)", step=spec
    )
    job = resolve(request, load_fleet())
    assert (shown["pool"], shown["infra"], shown["accelerators"]) == (job.pool, job.route.infra, job.route.accelerators)
    assert (
        shown["labels"] == job.labels and shown["injected_env"] == job.pool_env and shown["policy"] == list(job.notes)
    )


def test_where_explains_a_cpu_only_job(capsys, tmp_path):
    path = tmp_path / "prep.yaml"
    path.write_text("name: prep\nresources: {cpus: 8+, memory: 32+}\nrun: python -m prep\n")
    assert main(["where", str(path), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert (shown["pool"], shown["accelerators"], shown["vcpus"]) == ("inference", None, 8)
    assert (
        shown["labels"]["gpudoor-cost-owner"] == "ml-research" and shown["injected_env"]["GPUDOOR_POOL"] == "inference"
    )
    assert main(["where", str(path)]) == 0
    assert "CPUs        : 8 vCPUs x1 node(s)" in capsys.readouterr().out
