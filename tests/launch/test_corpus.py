"""One true verdict per task file, from all three doors: `gpudoor where`, the launcher, the API server's policy.

The corpus (`tests/launch/corpus/`, see its README) holds task files in the shapes of SkyPilot's
public examples, each with its expected verdict on line 2. Each file goes through:

- `gpudoor where FILE --json` (the CLI an agent runs; its stdout must be JSON only);
- the launcher's `resolve` (what the Dagster assets launch);
- the admin policy, applied by SkyPilot's own `admin_policy_utils.apply` on the server side to the
  `sky.Task` that `sky jobs launch FILE --secret NAME` would send.

What the server cannot see is said per file: a multi-document file reaches the policy one task at a
time (SkyPilot hands its policy single tasks), and a secret's value written in the file looks, on
the server, like one passed with `--secret`. Nothing here is faked: SkyPilot parses, checks features
and applies the policy; no API server is needed for a policy's verdict.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest
import yaml

from gpudoor_pipelines.cli.main import main
from gpudoor_pipelines.launch.errors import LaunchConfigError
from gpudoor_pipelines.launch.resolve.fleet import load_fleet
from gpudoor_pipelines.launch.resolve.request import LaunchRequest, resolve
from gpudoor_pipelines.launch.resolve.specs import load_spec

CORPUS = Path(__file__).parent / "corpus"
FILES = sorted(CORPUS.glob("*.yaml"))
POLICY = "gpudoor_pipelines.launch.server.policy.GpuDoorPolicy"


@pytest.fixture(autouse=True)
def _server_counts(monkeypatch):
    """The shipped fleet has the API server count what is held (``live_caps: server``), as deploy/ runs it: its
    jobs tables are faked, holding nothing (no jobs controller runs here)."""
    from gpudoor_pipelines.launch.resolve.usage import Usage
    from gpudoor_pipelines.launch.server import policy

    monkeypatch.setattr(policy, "server_usage", Usage)
    monkeypatch.setattr(policy, "_onto_warm_pool", lambda: False)


#: Files whose refusal rests on what only the file shows; the server judges what it receives.
SERVER_CANNOT_SEE = {
    "47-secret-literal.yaml": "a secret's value in the file reaches the server like a value passed with --secret",
}
SECRET_VALUES = {"HF_TOKEN": "hf-corpus-test-value", "WANDB_API_KEY": "wandb-corpus-test-value"}


def expected(path: Path) -> str:
    line = path.read_text().splitlines()[1]
    assert line.startswith("# expect: "), f"{path.name}: line 2 must be the expected verdict"
    return line.removeprefix("# expect: ").strip()


def verdict_of_route(pool: str, accelerators: str | None, spot: bool) -> str:
    if accelerators is None:
        return f"pool={pool} cpus"
    return f"pool={pool} accelerators={accelerators}" + (" spot=true" if spot else "")


def verdict_of_refusal(fields) -> str:
    return "refused fields=" + ",".join(sorted(set(fields)))


@pytest.fixture(autouse=True)
def _secrets_in_the_launchers_environment(monkeypatch):
    for name, value in SECRET_VALUES.items():
        monkeypatch.setenv(name, value)


def where(path: Path, capsys) -> str:
    code = main(["where", str(path), "--json"])
    out = capsys.readouterr().out
    shown = json.loads(out)  # stdout is JSON only, whatever SkyPilot prints
    if code == 0:
        return verdict_of_route(shown["pool"], shown["accelerators"], shown["use_spot"])
    assert code == 2 and shown["error"] == "refused before launch"
    assert all(p["file"] and p["field"] and p["fix"] for p in shown["problems"])
    return verdict_of_refusal(p["field"] for p in shown["problems"])


def launcher(path: Path) -> str:
    try:
        job = resolve(LaunchRequest(spec=load_spec(path, skypilot=True, strict=False), user="ada"), load_fleet())
    except LaunchConfigError as e:
        return verdict_of_refusal(p.field for p in e.problems)
    return verdict_of_route(job.pool, job.route.accelerators, job.route.use_spot)


def server(config: dict) -> str:
    """The verdict of the policy on the server, for the task `sky jobs launch` sends."""
    import sky
    from sky import skypilot_config
    from sky.server.requests.request_names import AdminPolicyRequestName
    from sky.utils import admin_policy_utils

    config = copy.deepcopy(config)
    secrets = config.pop("secrets", None) or {}
    overrides = [(k, v if v is not None else SECRET_VALUES.get(k, "")) for k, v in secrets.items()]
    task = sky.Task.from_yaml_config(config, secrets_overrides=overrides or None)
    try:
        with skypilot_config.override_skypilot_config({"admin_policy": POLICY}):
            dag, _ = admin_policy_utils.apply(task, AdminPolicyRequestName.JOBS_LAUNCH, None, at_client_side=False)
    except sky.exceptions.UserRequestRejectedByPolicy as e:
        fields = re.findall(r"field '([^']+)'", str(e))
        assert fields, f"a refusal names its fields: {e}"
        return verdict_of_refusal(fields)
    (routed,) = dag.tasks
    (r,) = routed.resources
    fleet = load_fleet()
    pool = fleet.pool_for_infra(r.infra.to_str())
    assert pool is not None and r.labels["gpudoor-pool"] == pool.name
    accelerators = ":".join(f"{k}:{v}" for k, v in r.accelerators.items()) if r.accelerators else None
    return verdict_of_route(r.labels["gpudoor-pool"], accelerators, bool(r.use_spot))


def test_the_corpus_is_big_enough_and_covers_every_shape():
    assert len(FILES) >= 30
    text = "\n".join(p.read_text() for p in FILES)
    for shape in (
        "ports:",
        "service:",
        "num_nodes:",
        "any_of:",
        "ordered:",
        "use_spot:",
        "cpus:",
        "file_mounts:",
        "workdir:",
        "secrets:",
        "tpu-",
        "\n---\n",
        "image_id:",
    ):
        assert shape in text, f"no corpus file has {shape!r}"


@pytest.mark.parametrize("path", FILES, ids=[p.name for p in FILES])
def test_every_door_gives_the_same_true_verdict(path, capsys):
    want = expected(path)
    assert where(path, capsys) == want, "gpudoor where"
    assert launcher(path) == want, "the launcher's resolve"
    documents = [d for d in yaml.safe_load_all(path.read_text()) if d]
    if len(documents) > 1:
        # The server sees each task alone: each gets the verdict it gets as a file of its own.
        for i, doc in enumerate(d for d in documents if "run" in d):
            single = path.parent.parent / f".corpus-{path.stem}-{i}.yaml"
            try:
                single.write_text(yaml.safe_dump(doc))
                assert server(doc) == launcher(single), f"task {i} of {path.name} on the server"
            finally:
                single.unlink(missing_ok=True)
        return
    if path.name in SERVER_CANNOT_SEE:
        return
    assert server(documents[0]) == want, "the API server's policy"
