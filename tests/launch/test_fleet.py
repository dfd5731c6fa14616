"""The fleet file, parsed by pydantic models; every mistake names the file, the field and the fix."""

from __future__ import annotations

import copy

import pytest
import yaml

from gpudoor_pipelines.launch.errors import LaunchConfigError
from gpudoor_pipelines.launch.resolve.fleet import load_fleet, parse_fleet
from tests.conftest import SPECS_DIR

RAW = yaml.safe_load((SPECS_DIR / "fleet.yaml").read_text())


def _broken(edit) -> LaunchConfigError:
    raw = copy.deepcopy(RAW)
    edit(raw)
    with pytest.raises(LaunchConfigError) as err:
        parse_fleet(raw, "team-fleet.yaml")
    assert err.value.source == "team-fleet.yaml" and "Fix:" in str(err.value)
    return err.value


def test_shipped_fleet_loads():
    fleet = load_fleet()
    assert fleet.pools["onprem"].name == "onprem" and fleet.pools["onprem"].user_gpu_cap == 8
    assert fleet.pools["h200"].multi_node and fleet.cpu_route == ("inference", "ondemand")
    assert fleet.default_cost_owner == "ml-research"
    assert fleet.evaluation.max_checkpoints_per_tick == 200 and fleet.evaluation.backlog_per_training == 1


@pytest.mark.parametrize(
    "edit, field, words",
    [
        (lambda r: r["pools"]["onprem"].update(gpu_cap="lots"), "pools.onprem.gpu_cap", "integer"),
        (lambda r: r["pools"]["onprem"].pop("infra"), "pools.onprem.infra", "add 'infra'"),
        (lambda r: r["pools"]["h200"].update(gpus="H200"), "pools.h200.gpus", "tuple"),
        (lambda r: r["pools"]["h200"].pop("gpu_cap"), "pools.h200.gpu_cap", "how many GPUs"),
        (lambda r: r.update(rootes={}), "rootes", "did you mean 'routes'"),
        (lambda r: r.update(cpu_route=["inference", "cloud"]), "cpu_route[1]", "unknown pool 'cloud'"),
        (lambda r: r["accelerator_routes"].update(H100="nowhere"), "accelerator_routes.H100", "unknown pool 'nowhere'"),
        (lambda r: r.update(default_cost_owner="marketing"), "default_cost_owner", "add it to cost_owners"),
        (
            lambda r: r["pools"]["inference"].update(vcpu_cap=0),
            "pools.inference.vcpu_cap",
            "greater than or equal to 1",
        ),
        (
            lambda r: r["evaluation"].update(max_runs_per_tick=0),
            "evaluation.max_runs_per_tick",
            "greater than or equal to 1",
        ),
        (
            lambda r: r["evaluation"].update(max_run_per_tick=3),
            "evaluation.max_run_per_tick",
            "did you mean 'max_runs_per_tick'",
        ),
        (
            lambda r: r["housekeeping"].update(storage_class="GLACIER"),
            "housekeeping.storage_class",
            "use one of ['STANDARD_IA'",
        ),
        (
            lambda r: r["housekeeping"].update(delete_after_days=7),
            "housekeeping.delete_after_days",
            "at least cold_after_days",
        ),
        (lambda r: r["housekeeping"].update(keep_latest=0), "housekeeping.keep_latest", "greater than or equal to 1"),
        (lambda r: r["housekeeping"].update(cold_days=3), "housekeeping.cold_days", "did you mean 'cold_after_days'"),
    ],
)
def test_fleet_mistakes_name_file_field_and_fix(edit, field, words):
    err = _broken(edit)
    assert err.field == field and words in str(err)


def test_fleet_file_missing_or_not_yaml(tmp_path):
    with pytest.raises(LaunchConfigError, match="does not exist"):
        load_fleet(tmp_path / "nope.yaml")
    bad = tmp_path / "fleet.yaml"
    bad.write_text("pools: [unclosed")
    with pytest.raises(LaunchConfigError, match="not valid YAML"):
        load_fleet(bad)


def test_a_pool_declares_only_features_skypilot_knows():
    from gpudoor_pipelines.launch.resolve.fleet import SKYPILOT_FEATURES

    raw = yaml.safe_load((SPECS_DIR / "fleet.yaml").read_text())
    raw["pools"]["inference"]["features"] = ["spot_instance", "spot_instanse"]
    with pytest.raises(LaunchConfigError, match="did you mean 'spot_instance'") as err:
        parse_fleet(raw, "fleet.yaml")
    assert err.value.field == "pools.inference.features[1]"
    # The names are SkyPilot's own.
    from sky.clouds import CloudImplementationFeatures

    assert SKYPILOT_FEATURES <= {f.value for f in CloudImplementationFeatures}


def test_a_declared_feature_opens_the_pool_to_jobs_that_need_it(tmp_path):
    """Spot nodes on the inference cluster, declared in the fleet: a spot job stays on the free pool."""
    from gpudoor_pipelines.launch.resolve.routing import route
    from gpudoor_pipelines.launch.resolve.specs import load_spec

    raw = yaml.safe_load((SPECS_DIR / "fleet.yaml").read_text())
    raw["pools"]["inference"]["features"] = ["spot_instance"]
    p = tmp_path / "spot.yaml"
    p.write_text(yaml.safe_dump({"name": "s", "resources": {"accelerators": "L4:1", "use_spot": True}, "run": "true"}))
    assert route(load_spec(p), parse_fleet(raw, "fleet.yaml")).pool.name == "inference"
