"""The bed's SkyPilot API server out of reach for a while as a step follows its managed job.

The step talks to the server through a proxy on 127.0.0.1 (``tests/transit/outage_proxy.py``) that refuses
connections and cuts open ones while down, as a network outage or a server's restart does for its clients.
Only this step loses the server: the other bed lane's steps go on undisturbed. The step waits, goes on
following the job, and ends as the job ends: its log complete, nothing launched twice, nothing left held.

A restart of the server itself (``GPUDOOR_TESTBED_RESTART_SERVER=1 testbed/up.sh``: every process of it ends,
its log requests and job controllers too) also ends a log stream cleanly, with the killed request's signal
for an exit code: that case is tested with the fake SDK (``tests/launch/test_client_on_fake_skypilot.py``),
because a restart here is felt by every bed test running beside this one.
"""

import threading
import time
from pathlib import Path
from urllib.parse import urlparse

import dagster as dg
import pytest
import yaml

from gpudoor_pipelines.launch.client import LaunchConfig, PipesSkyPilotClient
from tests.slurm.conftest import allocations_of, managed_record
from tests.transit.outage_proxy import OutageProxy

pytestmark = pytest.mark.slurm

REPO_ROOT = Path(__file__).resolve().parents[2]
LINES = 30
OUTAGE_S = 15.0
OUTAGE_LOGS = {"python_logs": {"managed_python_loggers": ["gpudoor_pipelines.outage"]}}


@dg.asset
def followed(context: dg.AssetExecutionContext, config: LaunchConfig, skypilot: PipesSkyPilotClient):
    return skypilot.run(
        context=context, request=skypilot.request(context, "train", config=config)
    ).get_materialize_result()


def _point_the_sdk_at(endpoint: str, monkeypatch) -> None:
    """The SDK of this process talks to ``endpoint`` from now on."""
    from sky.server import common as server_common

    monkeypatch.setenv("SKYPILOT_API_SERVER_ENDPOINT", endpoint)
    server_common.get_server_url.cache_clear()
    server_common.is_api_server_local.cache_clear()


def test_a_step_follows_its_job_while_the_api_server_is_out_of_reach(testbed, transit, tmp_path, monkeypatch):
    specs = tmp_path / "specs"
    specs.mkdir()
    run = f"for i in $(seq 1 {LINES}); do echo outage-probe line $i; sleep 1; done"
    (specs / "train.yaml").write_text(
        yaml.safe_dump({"name": "outage-probe", "resources": {"accelerators": {"H200": 1}}, "run": run})
    )
    url = urlparse(testbed.api_endpoint)
    proxy = OutageProxy((url.hostname, url.port))
    _point_the_sdk_at(proxy.url, monkeypatch)
    skypilot = PipesSkyPilotClient(
        backend="skypilot",
        api_server_endpoint=proxy.url,
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
        with proxy.outage(OUTAGE_S):
            pass
        step.join(timeout=300)
        proxy.close()
        _point_the_sdk_at(testbed.api_endpoint, monkeypatch)
        assert not step.is_alive(), "the step did not end"
        (result,) = results
        logs = said()
    assert result.success, logs[-30:]
    md = {k: v.value for k, v in result.asset_materializations_for_node("followed")[0].metadata.items()}
    assert md["status"] == "SUCCEEDED"
    # The log is whole: every line once, in order, although the stream was cut.
    lines = [m.rsplit(") ", 1)[-1] for m in logs if "outage-probe line " in m]
    assert lines == [f"outage-probe line {i}" for i in range(1, LINES + 1)], lines
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
