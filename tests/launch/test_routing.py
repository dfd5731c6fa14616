"""Routing: by the launcher's step kind, by what the job needs, explicit overrides, caps; bad routes fail before "
"launch."""

from __future__ import annotations

import pytest
import yaml

from gpudoor_pipelines.launch.errors import LaunchConfigError
from gpudoor_pipelines.launch.resolve.fleet import load_fleet, parse_fleet
from gpudoor_pipelines.launch.resolve.routing import route
from gpudoor_pipelines.launch.resolve.specs import load_spec
from gpudoor_pipelines.launch.resolve.usage import Usage
from tests.conftest import SPECS_DIR


@pytest.fixture
def fleet():
    return load_fleet()


@pytest.mark.parametrize(
    "spec, pool, gpu",
    [
        ("caption", "onprem", "RTX6000-Ada"),
        ("train", "h200", "H200"),
        ("smoke", "h200", "H200"),
        ("eval", "inference", "L4"),
        ("demo", "inference", "L4"),
    ],
)
def test_each_step_goes_to_its_first_pool(fleet, spec, pool, gpu):
    r = route(load_spec(spec), fleet, step=spec)
    assert (r.pool.name, r.accelerator) == (pool, gpu)
    assert r.infra == fleet.pools[pool].infra


def test_caption_spills_to_inference_when_onprem_is_full(fleet):
    r = route(load_spec("caption"), fleet, step="caption", usage=Usage(gpus={"onprem": fleet.pools["onprem"].gpu_cap}))
    assert r.pool.name == "inference"
    assert r.accelerator == "L4"
    assert "onprem" in r.reason and "cap" in r.skipped[0]


def test_eval_falls_through_to_on_demand(fleet):
    full = {p: fleet.pools[p].gpu_cap for p in ("inference", "onprem")}
    assert route(load_spec("eval"), fleet, step="eval", usage=Usage(gpus=full)).pool.name == "ondemand"


def test_everything_full_is_a_clear_error(fleet):
    full = {p.name: p.gpu_cap for p in fleet.pools.values()}
    with pytest.raises(LaunchConfigError, match="cap"):
        route(load_spec("eval"), fleet, step="eval", usage=Usage(gpus=full))


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


def test_without_a_step_a_job_goes_by_its_gpu_not_its_file_name(fleet, tmp_path):
    """An ad-hoc file: every pool that offers its GPU, the GPU's own pool first, then the cheapest."""
    p = tmp_path / "train.yaml"  # named like a step, but no launcher said so
    p.write_text(yaml.safe_dump({"name": "nb", "resources": {"accelerators": "H100:1"}, "run": "true"}))
    r = route(load_spec(p), fleet)
    assert r.pool.name == "inference" and r.reason == "pools offering H100:1"
    assert route(load_spec(p), fleet, usage=Usage(gpus={"inference": 8})).pool.name == "ondemand"
    with pytest.raises(LaunchConfigError, match="no route for step 'trian'.*did you mean 'train'") as err:
        route(load_spec(p), fleet, step="trian")
    assert err.value.field == "step"


def test_a_gpu_set_is_any_of_its_gpus_and_the_choice_never_depends_on_hashing(fleet, tmp_path):
    p = tmp_path / "sweep.yaml"
    p.write_text("name: sweep\nresources:\n  accelerators: {L4:4, A100:1, L4:1}\nrun: 'true'\n")
    assert route(load_spec(p), fleet).accelerators == "L4:1"  # fewer GPUs first; A100 is nowhere
    p.write_text("name: big\nresources:\n  accelerators: {H100:8, A100-80GB:8, H200:8}\nrun: 'true'\n")
    assert (route(load_spec(p), fleet).pool.name, route(load_spec(p), fleet).accelerators) == ("h200", "H200:8")


def test_a_job_goes_only_where_skypilot_can_run_it(fleet, tmp_path):
    """Ports are not supported on Slurm: a server asking for a Slurm-only GPU is refused, naming why."""
    p = tmp_path / "serve.yaml"
    p.write_text(
        yaml.safe_dump({"name": "s", "resources": {"accelerators": "RTX6000-Ada:1", "ports": 8000}, "run": "true"})
    )
    with pytest.raises(LaunchConfigError, match="Opening ports is not supported in Slurm"):
        route(load_spec(p), fleet)
    p.write_text(yaml.safe_dump({"name": "s", "resources": {"accelerators": "L4:1", "use_spot": True}, "run": "true"}))
    r = route(load_spec(p), fleet)  # Kubernetes has no spot here; the rented pool has
    assert (r.pool.name, r.use_spot) == (
        "ondemand",
        True,
    ) and "Spot instances are not supported in Kubernetes" in r.skipped[0]


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


def _spec_file(tmp_path, name: str, body: dict):
    p = tmp_path / f"{name}.yaml"
    p.write_text(yaml.safe_dump({"name": name, "run": "true", **body}))
    return load_spec(p)


def test_size_caps_are_decided_by_routing(fleet, tmp_path):
    """Static caps (pool, per user) refuse an explicit target, and make the step route pass a pool over."""
    big = _spec_file(tmp_path, "train", {"num_nodes": 9, "resources": {"accelerators": "H200:8"}})
    with pytest.raises(LaunchConfigError, match="per-user cap of 64"):
        route(big, fleet, step="train")
    huge = _spec_file(tmp_path, "caption", {"resources": {"accelerators": {"RTX6000-Ada": 12, "L4": 4}}})
    r = route(huge, fleet, step="caption")  # 12 is over onprem's per-user cap of 8: passed over for 4 L4 on inference
    assert (r.pool.name, r.accelerators) == ("inference", "L4:4") and "per-user cap of 8" in r.skipped[0]
    with pytest.raises(LaunchConfigError, match="per-user cap of 8"):
        route(huge, fleet, pool="onprem")


def test_live_per_user_cap(fleet):
    usage = Usage(user_gpus={("ada", "onprem"): 8})
    r = route(load_spec("caption"), fleet, step="caption", user="ada", usage=usage)
    assert r.pool.name == "inference" and "user 'ada' holds 8 GPUs" in r.skipped[0]
    assert route(load_spec("caption"), fleet, step="caption", user="grace", usage=usage).pool.name == "onprem"
    # Usage comes back from job labels, where a user name is in its label form.
    labelled = Usage(user_gpus={("first.last-corp.example", "onprem"): 8})
    assert (
        route(load_spec("caption"), fleet, step="caption", user="first.last@corp.example", usage=labelled).pool.name
        == "inference"
    )


def test_cpu_only_job_goes_to_the_cpu_route(fleet, tmp_path):
    prep = _spec_file(tmp_path, "prep", {"resources": {"cpus": "8+", "memory": "32+"}})
    r = route(prep, fleet)
    assert (r.pool.name, r.accelerators, r.vcpus_per_node) == ("inference", None, 8)
    assert r.reason == "CPU-only route" and r.describe() == "8 vCPUs x1 node(s)"
    # The inference pool's vCPUs are taken: rented machines next.
    r = route(prep, fleet, usage=Usage(vcpus={"inference": 60}))
    assert r.pool.name == "ondemand" and r.usd_per_hour == pytest.approx(8 * 0.04)
    with pytest.raises(LaunchConfigError, match="does not take CPU-only jobs"):
        route(prep, fleet, pool="h200")
    too_big = _spec_file(tmp_path, "prep", {"resources": {"cpus": 512}})
    with pytest.raises(LaunchConfigError, match="vCPU cap"):
        route(too_big, fleet)


def test_cpu_only_job_without_cpu_pools_is_a_clear_error(tmp_path):
    raw = yaml.safe_load((SPECS_DIR / "fleet.yaml").read_text())
    raw.pop("cpu_route")
    prep = _spec_file(tmp_path, "prep", {"resources": {"cpus": 4}})
    with pytest.raises(LaunchConfigError, match="no pool of .* takes CPU-only jobs") as err:
        route(prep, parse_fleet(raw, "fleet.yaml"))
    assert "cpu_route" in err.value.fix


def test_pool_and_infra_overrides_must_agree(fleet):
    r = route(load_spec("caption"), fleet, pool="onprem", infra="slurm/onprem/debug")
    assert r.pool.name == "onprem" and r.infra == "slurm/onprem/debug"
    with pytest.raises(LaunchConfigError, match="does not belong to pool 'onprem'"):
        route(load_spec("caption"), fleet, pool="onprem", infra="k8s/inference-prod")


def test_an_infra_two_pools_share_goes_to_the_one_that_can_run_the_job(tmp_path):
    """On the bed's fleet ``inference`` and ``h200`` share the h200 partition; only ``h200`` is multi-node."""
    fleet = load_fleet(SPECS_DIR.parent / "testbed" / "fleet.yaml")
    infra = "slurm/gpudoor-bed/h200"

    def spec(nodes: int, gpus: int = 1):
        p = tmp_path / f"job-{nodes}-{gpus}.yaml"
        resources = {"accelerators": f"H200:{gpus}", "infra": infra}
        p.write_text(yaml.safe_dump({"name": "probe", "num_nodes": nodes, "resources": resources, "run": "true"}))
        return load_spec(p)

    two_nodes = route(spec(2), fleet, infra=infra)
    assert two_nodes.pool.name == "h200" and two_nodes.infra == infra and two_nodes.num_nodes == 2
    assert route(spec(1), fleet, infra=infra).pool.name == "h200"  # H200's own pool (accelerator_routes)
    assert route(spec(1), fleet, step="eval", infra=infra).pool.name == "inference"  # the step's route first
    # The h200 pool at its cap: a one-node job goes to the other pool on that infra, a two-node one nowhere.
    full = Usage(gpus={"h200": fleet.pools["h200"].gpu_cap})
    assert route(spec(1), fleet, infra=infra, usage=full).pool.name == "inference"
    with pytest.raises(LaunchConfigError) as refused:
        route(spec(2), fleet, infra=infra, usage=full)
    assert "h200: " in refused.value.problem and "inference: " in refused.value.problem
    # Infra outside the fleet: each infra named once, though two pools share one.
    with pytest.raises(LaunchConfigError) as refused:
        route(spec(1), fleet, infra="slurm/elsewhere")
    assert refused.value.fix.count("'slurm/gpudoor-bed/h200'") == 1
