"""Task specs: the shipped ones load with SkyPilot's own parser; bad ones fail with file, field and fix."""

from __future__ import annotations

import pytest
import yaml

from gpudoor_pipelines.launch.errors import LaunchConfigError
from gpudoor_pipelines.launch.resolve.specs import load_spec, parse_accelerators, validate_with_skypilot
from tests.conftest import SPECS_DIR, given_inputs

SPECS = ["caption", "train", "eval", "smoke", "demo"]


@pytest.mark.parametrize("name", SPECS)
def test_shipped_specs_load_with_skypilot(name):
    import sky

    spec = load_spec(name)
    config = yaml.safe_load(open(spec.path))
    inputs = given_inputs(spec)
    if inputs:  # SkyPilot's own reading of `NAME: null`: it must be given (`sky launch --env NAME=...`)
        with pytest.raises(ValueError, match=f"Environment variable '{sorted(inputs)[0]}' is None|is None"):
            sky.Task.from_yaml_config(dict(config))
    task = sky.Task.from_yaml_config(config, env_overrides=list(inputs.items()))
    assert task.name == spec.name
    assert task.num_nodes == spec.num_nodes
    assert all(task.envs[k] == v for k, v in inputs.items())
    validate_with_skypilot(spec.config, spec.path)


def test_shipped_specs_hold_no_path_key_or_target():
    for name in SPECS:
        text = (SPECS_DIR / f"{name}.yaml").read_text()
        for forbidden in ("s3://", "/mnt/", "/lustre", "infra:", "AWS_", "cluster", "file_mounts"):
            assert forbidden not in text, f"{name}.yaml mentions {forbidden}"


def test_training_is_multi_node():
    assert load_spec("train").num_nodes > 1


def _write(tmp_path, body: dict, name="bad.yaml"):
    p = tmp_path / name
    p.write_text(yaml.safe_dump(body))
    return p


BASE = {"name": "t", "resources": {"accelerators": "L4:1"}, "run": "echo hi"}


@pytest.mark.parametrize(
    "body, field, fix_word",
    [
        ({**BASE, "runn": "x"}, "runn", "did you mean 'run'"),
        ({**BASE, "file_mounts": {"/data": "s3://b"}}, "file_mounts", "transit bucket"),
        ({**BASE, "volumes": {"/data": "vol"}}, "volumes", "fleet"),
        ({**BASE, "service": {"readiness_probe": "/"}}, "service", "demo"),
        ({**BASE, "workdir": {"url": "https://example.invalid/repo.git"}}, "workdir", "clone"),
        ({**BASE, "envs": {"DATA": "/mnt/data"}}, "envs.DATA", "fleet.yaml"),
        ({**BASE, "envs": {"AWS_SECRET_ACCESS_KEY": "x"}}, "envs.AWS_SECRET_ACCESS_KEY", "secrets"),
        ({**BASE, "envs": {"HF_TOKEN": "x"}}, "envs.HF_TOKEN", "secrets:"),
        ({**BASE, "resources": {"cpus": "lots"}}, "resources.cpus", "cpus: 8+"),
        ({**BASE, "resources": {"accelerators": "L4:0"}}, "resources.accelerators", "H100:1"),
        ({**BASE, "resources": {"accelerators": "L4:0.5"}}, "resources.accelerators", "positive whole number"),
    ],
)
def test_bad_spec_names_file_field_and_fix(tmp_path, body, field, fix_word):
    path = _write(tmp_path, body)
    with pytest.raises(LaunchConfigError) as err:
        load_spec(path)
    assert err.value.field == field
    assert str(path) in str(err.value)
    assert fix_word in str(err.value)


def test_skypilot_rejects_what_it_does_not_know(tmp_path):
    path = _write(tmp_path, {**BASE, "resources": {"accelerators": "L4:1", "cpuz": 4}})
    spec = load_spec(path)  # The project's own checks do not look inside resources.
    with pytest.raises(LaunchConfigError) as err:
        validate_with_skypilot(spec.config, spec.path)
    assert str(path) in str(err.value)
    assert "cpuz" in str(err.value)


def test_missing_spec_file(tmp_path):
    with pytest.raises(LaunchConfigError, match="does not exist"):
        load_spec("nope", specs_dir=tmp_path)


def test_credential_names_match_whole_parts_only(tmp_path):
    path = _write(tmp_path, {**BASE, "envs": {"MAX_TOKENS": 512, "KEYFRAMES": 8, "TOKENIZER": "bpe"}})
    assert load_spec(path).envs["MAX_TOKENS"] == "512"


def test_every_problem_of_a_file_at_once(tmp_path):
    path = _write(
        tmp_path, {**BASE, "file_mounts": {"/d": "s3://b"}, "envs": {"HF_TOKEN": "x", "DATA": "/mnt/d"}, "runn": "x"}
    )
    with pytest.raises(LaunchConfigError) as err:
        load_spec(path)
    assert sorted(p.field for p in err.value.problems) == ["envs.DATA", "envs.HF_TOKEN", "file_mounts", "runn"]
    assert all(str(path) in str(p) and p.fix for p in err.value.problems)


def test_a_pipeline_file_is_refused_as_such(tmp_path):
    path = tmp_path / "pipe.yaml"
    path.write_text("name: pipe\n---\nname: a\nrun: 'true'\n---\nname: b\nrun: 'true'\n")
    with pytest.raises(LaunchConfigError, match="pipelines and job groups are not supported yet") as err:
        load_spec(path)
    assert err.value.field == "(documents)"


@pytest.mark.parametrize(
    "value, expected",
    [
        ("H100", {"H100": 1}),
        ({"H200:8": None, "H100:8": None}, {"H200": 8, "H100": 8}),
        ("H200:8", {"H200": 8}),
        ({"L4": 1, "H100": 2}, {"L4": 1, "H100": 2}),
        (["L4:1", "A10G"], {"L4": 1, "A10G": 1}),
    ],
)
def test_parse_accelerators(value, expected):
    assert parse_accelerators(value) == expected


def test_cpu_only_spec_is_a_valid_task(tmp_path):
    """Data prep asks for CPUs and memory, no GPU: a valid SkyPilot task, and a valid spec."""
    path = _write(
        tmp_path, {"name": "prep", "resources": {"cpus": "8+", "memory": "32+"}, "run": "echo prep"}, "prep.yaml"
    )
    spec = load_spec(path, skypilot=True)
    assert spec.is_cpu_only and spec.vcpus == 8 and spec.accelerators == {}


def test_spec_is_loaded_and_checked_once_per_file_version(tmp_path, monkeypatch):
    import gpudoor_pipelines.launch.resolve.specs as specs

    calls = []
    real = specs.validate_with_skypilot
    monkeypatch.setattr(
        specs, "validate_with_skypilot", lambda config, source: (calls.append(source), real(config, source))
    )
    path = _write(tmp_path, BASE, "once.yaml")
    assert load_spec(path, skypilot=True) is load_spec(path, skypilot=True)
    assert len(calls) == 1
    import os

    os.utime(path, (1, 1))  # a new version of the file is checked again
    load_spec(path, skypilot=True)
    assert len(calls) == 2


def test_what_skypilot_read_is_kept_and_read_back_as_it_read_it(tmp_path, monkeypatch):
    """Every shipped spec and every file of the corpus (SkyPilot's examples, agents' files): the resource sets
    kept on disk come back exactly as SkyPilot's own reading gives them, and the second read imports nothing."""
    from pathlib import Path

    from gpudoor_pipelines.launch.resolve import sky_parse

    monkeypatch.setenv("GPUDOOR_HOME", str(tmp_path))
    corpus = Path(__file__).parent / "corpus"
    read_by_sky = []
    monkeypatch.setattr(sky_parse, "_read_candidates", _counting(sky_parse._read_candidates, read_by_sky))
    files = sorted(SPECS_DIR.glob("*.yaml")) + sorted(corpus.glob("*.yaml"))
    for path in files:
        for config in yaml.safe_load_all(path.read_text()):
            if isinstance(config, dict) and isinstance(config.get("resources"), dict):
                _check_kept(sky_parse, config["resources"], str(path), read_by_sky)
    assert len(read_by_sky) >= 30


def _check_kept(sky_parse, resources: dict, path: str, read_by_sky: list) -> None:
    try:
        first = sky_parse.sky_candidates(resources, path)
    except LaunchConfigError:
        return
    reads = len(read_by_sky)
    assert sky_parse.sky_candidates(resources, path) == first, path
    assert len(read_by_sky) == reads, f"{path}: read by SkyPilot again"
    assert first == tuple(sky_parse._read_candidates.__wrapped__(resources, path)), path


def _counting(fn, calls: list):
    def wrapper(*args):
        calls.append(args)
        return fn(*args)

    wrapper.__wrapped__ = fn
    return wrapper
