"""Routing: by step kind, by accelerator, explicit overrides, caps; bad routes fail before launch."""

from __future__ import annotations

import pytest
import yaml

from gpudoor_pipelines.launch.errors import LaunchConfigError
from gpudoor_pipelines.launch.fleet import load_fleet, parse_fleet
from gpudoor_pipelines.launch.routing import route
from gpudoor_pipelines.launch.specs import load_spec
from tests.conftest import SPECS_DIR


@pytest.fixture
def fleet():
    return load_fleet()


@pytest.mark.parametrize(
    "spec, pool, gpu",
    [("caption", "onprem", "RTX6000-Ada"), ("train", "h200", "H200"), ("smoke", "h200", "H200"), ("eval", "inference", "L4"), ("demo", "inference", "L4")],
)
def test_each_step_goes_to_its_first_pool(fleet, spec, pool, gpu):
    r = route(load_spec(spec), fleet)
    assert (r.pool.name, r.accelerator) == (pool, gpu)
    assert r.infra == fleet.pools[pool].infra


def test_caption_spills_to_inference_when_onprem_is_full(fleet):
    r = route(load_spec("caption"), fleet, gpus_in_use={"onprem": fleet.pools["onprem"].gpu_cap})
    assert r.pool.name == "inference"
    assert r.accelerator == "L4"
    assert "onprem" in r.reason and "cap" in r.skipped[0]


def test_eval_falls_through_to_on_demand(fleet):
    full = {p: fleet.pools[p].gpu_cap for p in ("inference", "onprem")}
    assert route(load_spec("eval"), fleet, gpus_in_use=full).pool.name == "ondemand"


def test_everything_full_is_a_clear_error(fleet):
    full = {p.name: p.gpu_cap for p in fleet.pools.values()}
    with pytest.raises(LaunchConfigError, match="cap"):
        route(load_spec("eval"), fleet, gpus_in_use=full)


def test_pool_override_wins(fleet):
    r = route(load_spec("eval"), fleet, pool="ondemand")
    assert r.pool.name == "ondemand" and "override" in r.reason


def test_infra_override_with_partition(fleet):
    r = route(load_spec("caption"), fleet, infra="slurm/onprem/debug")
    assert r.pool.name == "onprem" and r.infra == "slurm/onprem/debug"


def test_unknown_pool_override(fleet):
    with pytest.raises(LaunchConfigError) as err:
        route(load_spec("eval"), fleet, pool="inferense")
    assert "did you mean 'inference'" in str(err.value)


def test_unknown_infra_override(fleet):
    with pytest.raises(LaunchConfigError) as err:
        route(load_spec("eval"), fleet, infra="k8s/elsewhere")
    assert err.value.field == "infra"


def test_override_to_pool_without_the_gpu(fleet):
    with pytest.raises(LaunchConfigError) as err:
        route(load_spec("train"), fleet, pool="inference")
    assert err.value.field == "resources.accelerators"
    assert "H200" in str(err.value)


def test_accelerator_route_when_step_has_no_route(fleet, tmp_path):
    p = tmp_path / "notebook.yaml"
    p.write_text(yaml.safe_dump({"name": "nb", "resources": {"accelerators": "H200:1"}, "run": "true"}))
    r = route(load_spec(p), fleet)
    assert r.pool.name == "h200" and "accelerator route" in r.reason


def test_gpu_no_pool_offers(fleet, tmp_path):
    p = tmp_path / "caption.yaml"
    p.write_text(yaml.safe_dump({"name": "c", "resources": {"accelerators": "TPU-v5:1"}, "run": "true"}))
    with pytest.raises(LaunchConfigError) as err:
        route(load_spec(p), fleet)
    assert str(p) in str(err.value) and err.value.field == "resources.accelerators"
    assert "no pool of the fleet offers TPU-v5:1" in str(err.value)


def test_fleet_route_to_unknown_pool():
    raw = yaml.safe_load((SPECS_DIR / "fleet.yaml").read_text())
    raw["routes"]["caption"] = ["onprem", "nowhere"]
    with pytest.raises(LaunchConfigError) as err:
        parse_fleet(raw, "fleet.yaml")
    assert err.value.field == "routes.caption[1]"


def test_fleet_unknown_pool_field():
    raw = yaml.safe_load((SPECS_DIR / "fleet.yaml").read_text())
    raw["pools"]["onprem"]["gpu_capp"] = 3
    with pytest.raises(LaunchConfigError, match="did you mean 'gpu_cap'"):
        parse_fleet(raw, "fleet.yaml")
