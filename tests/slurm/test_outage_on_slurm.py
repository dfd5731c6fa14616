"""The bed's SkyPilot API server restarted while a step follows its managed job.

What a team's server restart does (a deploy, a crashed pod): every process of the server ends, its log
requests and job controllers included, and a new server starts on the same state. The step waits for it,
goes on following the job, and ends as the job ends: its log complete, nothing launched twice, nothing left
held. The restart is ``testbed/up.sh`` with ``GPUDOOR_TESTBED_RESTART_SERVER=1``, which first ends every
process of the old server (its request executors outlive it, and one may hold its port).
"""

import os
import subprocess
import threading
import time
from pathlib import Path

import dagster as dg
import pytest
import yaml

from gpudoor_pipelines.launch.client import LaunchConfig, PipesSkyPilotClient
from tests.slurm.conftest import TESTBED_DIR, allocations_of, managed_record

pytestmark = pytest.mark.slurm

REPO_ROOT = Path(__file__).resolve().parents[2]
LINES = 24
OUTAGE_LOGS = {"python_logs": {"managed_python_loggers": ["gpudoor_pipelines.outage"]}}


@dg.asset
def followed(context: dg.AssetExecutionContext, config: LaunchConfig, skypilot: PipesSkyPilotClient):
    return skypilot.run(
        context=context, request=skypilot.request(context, "train", config=config)
    ).get_materialize_result()


def _restart_server() -> float:
    """Restarts the bed's API server; returns how long it took."""
    if os.geteuid() != 0:
        pytest.skip("restarting the bed's API server needs root")
    started = time.monotonic()
    proc = subprocess.run(
        ["bash", str(TESTBED_DIR / "up.sh")],
        env={**os.environ, "GPUDOOR_TESTBED_RESTART_SERVER": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return time.monotonic() - started


def test_a_step_follows_its_job_across_an_api_server_restart(testbed, transit, tmp_path):
    specs = tmp_path / "specs"
    specs.mkdir()
    run = f"for i in $(seq 1 {LINES}); do echo outage-probe line $i; sleep 1; done"
    (specs / "train.yaml").write_text(
        yaml.safe_dump({"name": "outage-probe", "resources": {"accelerators": {"H200": 1}}, "run": run})
    )
    skypilot = PipesSkyPilotClient(
        backend="skypilot",
        api_server_endpoint=testbed.api_endpoint,
        fleet_file=str(REPO_ROOT / "testbed" / "fleet.yaml"),
        specs_dir=str(specs),
        poll_interval_s=2.0,
        cancel_timeout_s=180.0,
        transit=transit,
    )
    with dg.instance_for_test(overrides=OUTAGE_LOGS) as instance:
        results: list[dg.ExecuteInProcessResult] = []
        step = threading.Thread(
            target=lambda: results.append(
                dg.materialize([followed], instance=instance, resources={"skypilot": skypilot}, raise_on_error=False)
            )
        )
        step.start()

        def said() -> list[str]:
            runs = instance.get_runs()
            return [e.user_message for e in instance.all_logs(runs[0].run_id)] if runs else []

        deadline = time.monotonic() + 240
        while not any(m.endswith("outage-probe line 3") for m in said()) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert any(m.endswith("outage-probe line 3") for m in said()), "the job never ran"
        restart_s = _restart_server()
        step.join(timeout=300)
        assert not step.is_alive(), "the step did not end"
        (result,) = results
        logs = said()
    assert result.success, logs[-30:]
    md = {k: v.value for k, v in result.asset_materializations_for_node("followed")[0].metadata.items()}
    assert md["status"] == "SUCCEEDED"
    # The log is whole: every line once, in order, although the stream broke off at the restart.
    lines = [m.rsplit(") ", 1)[-1] for m in logs if "outage-probe line " in m]
    assert lines == [f"outage-probe line {i}" for i in range(1, LINES + 1)], (restart_s, lines)
    assert any("did not answer while" in m for m in logs) and any("is back after" in m for m in logs)
    # Launched once, and nothing of it is left on Slurm.
    record = managed_record(int(md["job_id"]))
    import sky

    same_name, *_ = sky.get(
        sky.jobs.queue_v2(refresh=False, all_users=True, name_match=record.job_name, fields=["job_id", "job_name"])
    )
    assert [r.job_id for r in same_name if r.job_name == record.job_name] == [int(md["job_id"])]
    deadline = time.monotonic() + 90
    while allocations_of(record.job_name, int(md["job_id"])) and time.monotonic() < deadline:
        time.sleep(2)
    assert allocations_of(record.job_name, int(md["job_id"])) == []
