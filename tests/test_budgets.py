"""Weekly budgets on the embedded default: real local jobs spend a cost owner's budget, and the door says what
is left, warns from 80% and refuses at 100%, for the agent door, ``gpudoor where`` and a Dagster step alike."""

import json
import time
from pathlib import Path

import dagster as dg
import pytest
import yaml

from gpudoor_pipelines.cli.main import main
from gpudoor_pipelines.launch.client import PipesSkyPilotClient
from gpudoor_pipelines.transit.resource import TransitBucketResource
from tests.conftest import SPECS_DIR

#: 7.2 GPU-seconds: one L4 job of 6 s spends 83% of it, a second of 2 s the rest.
BUDGET_GPU_HOURS = 0.002


@pytest.fixture
def tight(tmp_path: Path, monkeypatch) -> Path:
    """The shipped fleet with a budget of 7.2 GPU-seconds for product-demos, and a fresh local state."""
    monkeypatch.setenv("GPUDOOR_HOME", str(tmp_path / "home"))
    fleet = yaml.safe_load((SPECS_DIR / "fleet.yaml").read_text())
    fleet["sharing"]["budgets"]["product-demos"] = {"gpu_hours": BUDGET_GPU_HOURS}
    path = tmp_path / "fleet.yaml"
    path.write_text(yaml.safe_dump(fleet))
    return path


def _task(tmp_path: Path, seconds: float) -> str:
    path = tmp_path / f"sleep{seconds:g}.yaml"
    path.write_text(yaml.safe_dump({"name": "spend", "resources": {"accelerators": "L4:1"}, "run": f"sleep {seconds}"}))
    return str(path)


def _launch(capsys, fleet: Path, task: str, owner: str = "product-demos", *extra: str) -> tuple[int, dict]:
    code = main(["launch", task, "--cost-owner", owner, "--fleet", str(fleet), "--json", *extra])
    lines = [line for line in capsys.readouterr().out.splitlines() if line.strip()]
    return code, json.loads(lines[-1])


def _wait_ended(capsys, job_id: str) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        main(["status", job_id, "--json"])
        state = json.loads(capsys.readouterr().out.splitlines()[-1])["state"]
        if state in ("SUCCEEDED", "FAILED", "CANCELLED"):
            assert state == "SUCCEEDED"
            return
        time.sleep(0.3)
    raise AssertionError(f"job {job_id} did not end")


def test_a_budget_is_spent_by_real_jobs_warns_from_80_percent_and_refuses_at_100(tmp_path, tight, capsys):
    code, first = _launch(capsys, tight, _task(tmp_path, 6))
    assert code == 0 and first["budget"] == "0.002 of 0.002 GPU-hours left this week" and first["warning"] is None
    _wait_ended(capsys, first["job_id"])
    code, second = _launch(capsys, tight, _task(tmp_path, 2))
    assert code == 0 and "of its budget" in second["warning"], second
    assert 80 <= int(second["warning"].split("% of its budget")[0].rsplit(" ", 1)[-1]) < 100
    _wait_ended(capsys, second["job_id"])
    code, refused = _launch(capsys, tight, _task(tmp_path, 1))
    assert code != 0, refused
    text = json.dumps(refused)
    assert "sharing.budgets.product-demos" in text and "of its budget" in text
    assert "0 of 0.002 GPU-hours left this week" in text and "next week" in text
    # Another cost owner is not held to product-demos' budget.
    code, other = _launch(capsys, tight, _task(tmp_path, 1), "ml-research")
    assert code == 0 and other["warning"] is None
    # Where the fleet only warns, the spent budget is a warning.
    fleet = yaml.safe_load(tight.read_text())
    fleet["sharing"]["budget_enforce"] = "warn"
    tight.write_text(yaml.safe_dump(fleet))
    code, warned = _launch(capsys, tight, _task(tmp_path, 1))
    assert code == 0 and "over budget" in warned["warning"]
    # gpudoor where says the same, and gives the fingerprint the launch got for the same inputs.
    assert main(["where", _task(tmp_path, 1), "--cost-owner", "product-demos", "--fleet", str(tight), "--json"]) == 0
    where = json.loads(capsys.readouterr().out)
    assert "over budget" in where["warning"] and where["fingerprint"] == warned["fingerprint"]


def test_a_steps_materialization_records_its_budget_and_fingerprint_and_warns_in_the_run_log(tmp_path, tight):
    fleet = yaml.safe_load(tight.read_text())
    fleet["sharing"]["budgets"]["product-demos"] = {"gpu_hours": BUDGET_GPU_HOURS, "usd": 1000}
    fleet["sharing"]["warn_at"] = 0.000001  # any spend warns
    tight.write_text(yaml.safe_dump(fleet))
    specs = tmp_path / "specs"
    specs.mkdir()
    (specs / "spend.yaml").write_text(
        yaml.safe_dump({"name": "spend", "resources": {"accelerators": "L4:1"}, "run": "sleep 1"})
    )

    @dg.asset
    def spend(context: dg.AssetExecutionContext, skypilot: PipesSkyPilotClient) -> dg.MaterializeResult:
        return skypilot.run(
            context=context, request=skypilot.request(context, "spend", step="eval")
        ).get_materialize_result()

    client = PipesSkyPilotClient(
        fleet_file=str(tight),
        specs_dir=str(specs),
        cost_owner="product-demos",
        poll_interval_s=0.2,
        transit=TransitBucketResource(local_root=str(tmp_path / "bucket")),
    )
    with dg.DagsterInstance.ephemeral() as instance:
        runs = [dg.materialize([spend], resources={"skypilot": client}, instance=instance) for _ in range(2)]
        logs = [e.user_message for e in instance.all_logs(runs[1].run_id)]
    first, second = (r.asset_materializations_for_node("spend")[0].metadata for r in runs)
    assert first["cost_owner"].value == "product-demos" and first["budget_gpu_hours_left"].value == BUDGET_GPU_HOURS
    assert second["budget_gpu_hours_left"].value < BUDGET_GPU_HOURS and second["budget_usd_left"].value <= 1000
    assert "of its budget" in second["budget_warning"].value
    assert any("Budget of cost owner 'product-demos'" in line for line in logs)
    assert len(first["fingerprint"].value) == 16 and first["fingerprint"].value == second["fingerprint"].value
