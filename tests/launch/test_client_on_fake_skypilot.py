"""The Pipes client on the SkyPilot backend, against a fake SkyPilot SDK (see fake_sky.py for what is faked).

Real managed jobs through a real API server are tested on the Slurm test bed (tests/slurm); here the
moments that a real server cannot produce on demand: an interrupt mid-wait, a job that ran one hour.
"""

import http.server
import logging
import threading
import time
from pathlib import Path

import dagster as dg
import pytest
import yaml

from gpudoor_pipelines.launch.client import LaunchConfig, PipesSkyPilotClient
from gpudoor_pipelines.transit.resource import TransitBucketResource
from tests.conftest import SPECS_DIR
from tests.launch.fake_sky import FakeSky, Status, install


class _Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - http.server's naming
        self.send_response(200 if self.path == "/api/health" else 404)
        self.end_headers()
        self.wfile.write(b'{"status": "healthy"}')

    def log_message(self, *args):
        pass


@pytest.fixture
def fake_sky(monkeypatch):
    """A fake SDK behind a real health endpoint on 127.0.0.1 (the backend checks it before launching)."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    fake = install(monkeypatch, FakeSky(f"http://127.0.0.1:{server.server_address[1]}"))
    yield fake
    server.shutdown()
    server.server_close()


def _client(tmp_path: Path, fake: FakeSky, **kwargs) -> PipesSkyPilotClient:
    specs = tmp_path / "specs"
    specs.mkdir(exist_ok=True)
    (specs / "caption.yaml").write_text(
        yaml.safe_dump({"name": "probe", "resources": {"accelerators": {"RTX6000-Ada": 1, "L4": 1}}, "run": "echo hi"})
    )
    return PipesSkyPilotClient(
        backend="skypilot",
        api_server_endpoint=fake.endpoint,
        specs_dir=str(specs),
        poll_interval_s=0.01,
        cancel_timeout_s=5,
        transit=TransitBucketResource(local_root=str(tmp_path / "transit")),
        **kwargs,
    )


@dg.asset(partitions_def=dg.StaticPartitionsDefinition(["shard-007"]))
def probe_asset(
    context: dg.AssetExecutionContext, config: LaunchConfig, skypilot: PipesSkyPilotClient
) -> dg.MaterializeResult:
    return skypilot.run(
        context=context, request=skypilot.request(context, "caption", config=config)
    ).get_materialize_result()


def test_launch_records_one_typed_record_as_metadata(tmp_path, fake_sky):
    with dg.instance_for_test() as instance:
        result = dg.materialize(
            [probe_asset],
            partition_key="shard-007",
            instance=instance,
            resources={"skypilot": _client(tmp_path, fake_sky)},
        )
        assert result.success
        md = {k: v.value for k, v in result.asset_materializations_for_node("probe_asset")[0].metadata.items()}
        logs = [e.user_message for e in instance.all_logs(result.run_id)]
    assert md["job_id"] == "1" and md["backend"] == "skypilot" and md["status"] == "SUCCEEDED"
    assert md["pool"] == "onprem" and md["accelerators"] == "RTX6000-Ada:1" and md["infra"] == "slurm/fake-cluster/part"
    # The fake job queued 10 s and ran one hour on one GPU of a $0.35/GPU-hour pool.
    assert md["queued_s"] == 10.0 and md["running_s"] == 3600.0
    assert md["gpu_hours"] == 1.0 and md["cost_usd_estimate"] == pytest.approx(0.35)
    assert "fake job 1 says hello" in logs
    # The run's identity reached SkyPilot as labels (from the Pipes session's invocation info).
    (resources,) = fake_sky.launched[0].resources
    assert resources.labels["dagster-run-id"] == result.run_id and resources.labels["dagster-partition"] == "shard-007"
    assert (
        resources.labels["dagster-asset"] == "probe_asset" and resources.labels["dagster-job"] == "ephemeral_asset_job"
    )


@pytest.mark.parametrize("forward", [True, False])
def test_termination_is_forwarded_to_the_job(tmp_path, fake_sky, forward):
    fake_sky.interrupt_after = 2
    fake_sky.interrupt = dg.DagsterExecutionInterruptedError()
    with dg.instance_for_test() as instance:
        result = dg.materialize(
            [probe_asset],
            partition_key="shard-007",
            raise_on_error=False,
            instance=instance,
            resources={"skypilot": _client(tmp_path, fake_sky, forward_termination=forward)},
        )
        tags = instance.get_run_by_id(result.run_id).tags
    assert not result.success
    assert fake_sky.cancelled == ([1] if forward else [])
    assert fake_sky.records[1].status is (Status.CANCELLED if forward else Status.RUNNING)
    # The release is verified and recorded on the run: the job terminal, and no cluster of its name left.
    assert tags.get("gpudoor/released-job-1", "").startswith("confirmed in") == forward


def test_a_preempted_job_records_what_the_preemption_cost(tmp_path, fake_sky):
    """Preempted once and recovered by SkyPilot: the materialization says how much work was lost."""
    saves: list[float] = []

    def save() -> dict:
        saves.append(time.time())
        return {"saved": "checkpoint", "durable_at": saves[-1]}

    fake_sky.polls_to_finish, fake_sky.preempt_at = 8, {4}
    fake_sky.says = {2: [save], 3: [{"note": "not a save"}]}  # saved once, then preempted two looks later
    with dg.instance_for_test() as instance:
        result = dg.materialize(
            [probe_asset],
            partition_key="shard-007",
            instance=instance,
            resources={"skypilot": _client(tmp_path, fake_sky)},
        )
        assert result.success
        md = {k: v.value for k, v in result.asset_materializations_for_node("probe_asset")[0].metadata.items()}
        warnings = [e.user_message for e in instance.all_logs(result.run_id) if e.level >= logging.WARNING]
    # SkyPilot's job_duration (what the job ran, recovering left out) is the time held: 50 min on 1 GPU.
    assert md["recoveries"] == 1 and md["gpu_hours_held"] == pytest.approx(3000 / 3600, abs=1e-6)
    # Lost: from the save to the moment the step saw the job recovering (two looks later), not the whole run.
    assert 0 < md["gpu_hours_lost_to_preemption"] < (time.time() - saves[0]) / 3600
    assert md["goodput"] == pytest.approx(1 - md["gpu_hours_lost_to_preemption"] / md["gpu_hours_held"], abs=1e-4)
    (summary,) = [w for w in warnings if "preempted" in w]
    assert summary.startswith("Job 1 was preempted 1 time(s) and recovered") and "last save" in summary


def test_a_job_never_preempted_has_a_goodput_of_one(tmp_path, fake_sky):
    with dg.instance_for_test() as instance:
        result = dg.materialize(
            [probe_asset],
            partition_key="shard-007",
            instance=instance,
            resources={"skypilot": _client(tmp_path, fake_sky)},
        )
    md = {k: v.value for k, v in result.asset_materializations_for_node("probe_asset")[0].metadata.items()}
    assert md["recoveries"] == 0 and md["gpu_hours_lost_to_preemption"] == 0 and md["goodput"] == 1.0


def _server_counted_fleet(tmp_path: Path) -> str:
    fleet = yaml.safe_load((SPECS_DIR / "fleet.yaml").read_text())
    path = tmp_path / "fleet.yaml"
    path.write_text(yaml.safe_dump({**fleet, "live_caps": "server"}))
    return str(path)


def test_when_the_server_counts_live_caps_nothing_is_read_before_the_launch(tmp_path, fake_sky):
    with dg.instance_for_test() as instance:
        result = dg.materialize(
            [probe_asset],
            partition_key="shard-007",
            instance=instance,
            resources={"skypilot": _client(tmp_path, fake_sky, fleet_file=_server_counted_fleet(tmp_path))},
        )
    assert result.success
    # Nothing of what is held is read: no warm pools, no queue of unfinished jobs. The queue is read whole once,
    # for the week's figures (budgets, queue waits), and otherwise only to watch the job.
    assert fake_sky.requests.get("pool_status", 0) == 0
    history = [q for q in fake_sky.queue_requests if q["job_ids"] is None]
    assert len(history) == 1 and history[0]["skip_finished"] is False
    assert all(q["job_ids"] == [1] for q in fake_sky.queue_requests if q["job_ids"] is not None)


def test_a_pool_the_server_says_is_full_is_routed_around(tmp_path, fake_sky):
    fake_sky.full_pools = {"onprem"}
    with dg.instance_for_test() as instance:
        result = dg.materialize(
            [probe_asset],
            partition_key="shard-007",
            instance=instance,
            resources={"skypilot": _client(tmp_path, fake_sky, fleet_file=_server_counted_fleet(tmp_path))},
        )
        logs = [e.user_message for e in instance.all_logs(result.run_id)]
    assert result.success
    md = result.asset_materializations_for_node("probe_asset")[0].metadata
    assert md["pool"].value == "inference" and fake_sky.requests["launch"] == 2
    assert any(
        "The API server says pool 'onprem' is full (at its cap (1/1 GPUs in use, 1 asked)): routing again." in m
        for m in logs
    )
    # Once every pool of the route is full, nothing is launched, and the step says why.
    fake_sky.full_pools = {"onprem", "inference"}
    result = dg.materialize(
        [probe_asset],
        partition_key="shard-007",
        raise_on_error=False,
        resources={"skypilot": _client(tmp_path, fake_sky, fleet_file=_server_counted_fleet(tmp_path))},
    )
    (failure,) = [e for e in result.all_events if e.is_step_failure]
    text = failure.step_failure_data.user_failure_data.description
    assert text.startswith("Nothing was launched.") and "at its cap" in text


def test_a_retried_step_reattaches_instead_of_launching_again(tmp_path, fake_sky):
    fake_sky.add_job(7, Status.RUNNING)
    with dg.instance_for_test() as instance:
        result = dg.materialize(
            [probe_asset],
            partition_key="shard-007",
            instance=instance,
            resources={"skypilot": _client(tmp_path, fake_sky)},
            tags={"gpudoor/job-probe-asset-shard-007-caption": "skypilot:7"},
        )
        assert result.success
        logs = [e.user_message for e in instance.all_logs(result.run_id)]
    assert fake_sky.launched == [] and any("Re-attaching to job 7" in m for m in logs)
    assert result.asset_materializations_for_node("probe_asset")[0].metadata["job_id"].value == "7"


def test_an_sdk_talking_to_another_server_is_refused_before_launch(tmp_path, fake_sky):
    fake_sky.server.common.get_server_url = lambda: "http://127.0.0.1:1"
    result = dg.materialize(
        [probe_asset],
        partition_key="shard-007",
        raise_on_error=False,
        resources={"skypilot": _client(tmp_path, fake_sky)},
    )
    (failure,) = [e for e in result.all_events if e.is_step_failure]
    text = failure.step_failure_data.user_failure_data.description
    assert text.startswith("Nothing was launched.") and "SKYPILOT_API_SERVER_ENDPOINT" in text
    assert fake_sky.launched == []


def test_warm_pool_workers_count_as_held_gpus(tmp_path, fake_sky):
    """A pool's jobs show in the queue without labels: the GPUs its workers hold are counted from the pool's task."""
    pool_yaml = "resources:\n  accelerators: {L4: 1}\n  labels: {gpudoor-pool: onprem, gpudoor-user: ana}\n"
    fake_sky.pools = [
        {"name": "gpudoor-caption-1234abcd", "status": "READY", "target_num_replicas": 3, "pool_yaml": pool_yaml},
        {"name": "gpudoor-caption-old", "status": "SHUTTING_DOWN", "target_num_replicas": 5, "pool_yaml": pool_yaml},
        {
            "name": "someone-elses",
            "status": "READY",
            "target_num_replicas": 2,
            "pool_yaml": "resources: {accelerators: L4:1}\n",
        },
    ]
    usage = _client(tmp_path, fake_sky).get_backend().usage()
    assert usage.gpus == {"onprem": 3} and usage.user_gpus == {("ana", "onprem"): 3}


def _fleet_recovering_onprem_to(tmp_path: Path, *targets: str) -> str:
    fleet = yaml.safe_load((SPECS_DIR / "fleet.yaml").read_text())
    fleet["pools"]["onprem"]["recover_to"] = list(targets)
    path = tmp_path / "fleet-recover.yaml"
    path.write_text(yaml.safe_dump(fleet))
    return str(path)


def _evicted_from_onprem(tmp_path: Path, fake: FakeSky) -> tuple[dict, list[str], dict]:
    """Materializes the probe with onprem's recover_to naming inference: its metadata, warnings and run tags."""
    with dg.instance_for_test() as instance:
        client = _client(tmp_path, fake, fleet_file=_fleet_recovering_onprem_to(tmp_path, "inference"))
        result = dg.materialize(
            [probe_asset], partition_key="shard-007", instance=instance, resources={"skypilot": client}
        )
        assert result.success
        md = {k: v.value for k, v in result.asset_materializations_for_node("probe_asset")[0].metadata.items()}
        warnings = [e.user_message for e in instance.all_logs(result.run_id) if e.level >= logging.WARNING]
        return md, warnings, dict(instance.get_run_by_id(result.run_id).tags)


def test_a_job_evicted_from_a_pool_with_recover_to_moves_to_the_next_pool(tmp_path, fake_sky):
    """Evicted from onprem (RECOVERING), whose recover_to names inference: launched there, the old one cancelled."""
    fake_sky.polls_to_finish, fake_sky.preempt_at, fake_sky.preempt_jobs = 6, {3}, {1}
    calls: list[str] = []  # the new job's log must stream before the old one's release (a short job ends meanwhile)
    tail, cancel = fake_sky.jobs.tail_logs, fake_sky.jobs.cancel
    fake_sky.jobs.tail_logs = lambda job_id, **kw: calls.append(f"follow {job_id}") or tail(job_id, **kw)
    fake_sky.jobs.cancel = lambda job_ids: calls.append(f"cancel {job_ids}") or cancel(job_ids)
    md, warnings, tags = _evicted_from_onprem(tmp_path, fake_sky)
    assert calls.index("follow 2") < calls.index("cancel [1]"), calls
    # The job launched on inference with that pool's labels and env; the one recovering on onprem cancelled.
    first, second = fake_sky.launched
    assert first.resources.copy().pop().labels["gpudoor-pool"] == "onprem"
    (resources,) = second.resources
    assert resources.labels["gpudoor-pool"] == "inference" and second.envs["GPUDOOR_POOL"] == "inference"
    assert fake_sky.cancelled == [1] and fake_sky.records[1].status is Status.CANCELLED
    assert md["job_id"] == "2" and md["pool"] == "inference" and md["status"] == "SUCCEEDED"
    assert md["recoveries"] == 1 and "goodput" in md
    assert any(
        w.startswith("Job 1 was evicted from pool 'onprem': launched again on pool 'inference' as job 2")
        for w in warnings
    )
    assert tags["gpudoor/released-job-1"].startswith("confirmed in")
    # A retried step re-attaches to the job that runs now, not the one cancelled.
    assert tags["gpudoor/job-probe-asset-shard-007-caption"] == "skypilot:2"


def test_an_evicted_job_stays_with_skypilots_recovery_when_no_pool_of_recover_to_can_take_it(tmp_path, fake_sky):
    fake_sky.polls_to_finish, fake_sky.preempt_at = 6, {3}
    fake_sky.full_pools = {"inference"}  # the server says inference is full
    md, warnings, _ = _evicted_from_onprem(tmp_path, fake_sky)
    assert len(fake_sky.launched) == 1 and fake_sky.cancelled == []
    assert md["job_id"] == "1" and md["pool"] == "onprem" and md["recoveries"] == 1
    assert any(
        "no pool of its recover_to can take it now (inference:" in w and "SkyPilot recovers it on 'onprem'" in w
        for w in warnings
    )


def test_recover_to_names_other_pools_of_the_fleet(tmp_path):
    from gpudoor_pipelines.launch.errors import LaunchConfigError
    from gpudoor_pipelines.launch.resolve.fleet import load_fleet

    with pytest.raises(LaunchConfigError) as e:
        load_fleet(_fleet_recovering_onprem_to(tmp_path, "inferense"))
    assert e.value.field == "pools.onprem.recover_to[0]" and "did you mean 'inference'" in e.value.fix
    with pytest.raises(LaunchConfigError) as e:
        load_fleet(_fleet_recovering_onprem_to(tmp_path, "onprem"))
    assert e.value.field == "pools.onprem.recover_to" and "names itself" in e.value.problem


# ---------------------------------------------------------------- outages of the API server
_OUTAGE_LOGS = {"python_logs": {"managed_python_loggers": ["gpudoor_pipelines.outage"]}}


def test_a_step_rides_through_api_server_outages_with_its_log_whole_and_nothing_launched_twice(tmp_path, fake_sky):
    """The launch takes effect but its answer is lost; the log stream breaks twice while the job runs. The step
    finds the job it launched, reopens the stream where it stopped, and says in the run what it waited for."""
    fake_sky.launch_answers_lost = 1
    # Cut off once, and once ended cleanly by a server restart that killed the log request.
    fake_sky.log_lines, fake_sky.log_breaks = 30, [(10, 1.0, "cut"), (20, 0.5, "restart")]
    fake_sky.polls_to_finish = 4
    with dg.instance_for_test(overrides=_OUTAGE_LOGS) as instance:
        result = dg.materialize(
            [probe_asset],
            partition_key="shard-007",
            instance=instance,
            resources={"skypilot": _client(tmp_path, fake_sky)},
        )
        assert result.success
        logs = [e.user_message for e in instance.all_logs(result.run_id)]
    assert len(fake_sky.launched) == 1 and list(fake_sky.records) == [1]  # launched once
    assert fake_sky.requests["refused"] >= 3  # the launch, and each broken stream's first reopening
    md = result.asset_materializations_for_node("probe_asset")[0].metadata
    assert md["job_id"].value == "1" and md["status"].value == "SUCCEEDED"
    job_lines = [m for m in logs if m.startswith("fake job 1 line ")]
    assert job_lines == [f"fake job 1 line {n}" for n in range(1, 31)]  # none lost, none repeated
    assert any("the SkyPilot API server at" in m and "did not answer while launching" in m for m in logs)
    assert any("is back after" in m for m in logs)


def test_a_step_fails_clearly_when_the_api_server_stays_away_past_the_bound(tmp_path, fake_sky, monkeypatch):
    monkeypatch.setenv("GPUDOOR_OUTAGE_TOLERANCE_S", "3")
    fake_sky.log_lines, fake_sky.log_breaks = 5, [(2, 60.0, "cut")]  # it goes away two lines into the job's log
    fake_sky.polls_to_finish = 100
    t0 = time.monotonic()
    result = dg.materialize(
        [probe_asset],
        partition_key="shard-007",
        raise_on_error=False,
        resources={"skypilot": _client(tmp_path, fake_sky)},
    )
    assert time.monotonic() - t0 < 30
    (failure,) = [e for e in result.all_events if e.is_step_failure]
    text = failure.step_failure_data.error.to_string()
    assert f"the SkyPilot API server at {fake_sky.endpoint} has not answered for" in text
    assert "GPUDOOR_OUTAGE_TOLERANCE_S=3" in text and "the next run resumes" in text
    assert len(fake_sky.launched) == 1 and fake_sky.cancelled == []


@pytest.mark.parametrize("answer_lost", [False, True])
def test_a_cancel_is_sent_again_only_if_the_first_did_not_arrive(fake_sky, answer_lost):
    from gpudoor_pipelines.launch.backends.skypilot import SkyPilotBackend

    backend = SkyPilotBackend(fake_sky.endpoint)
    backend.check()  # the server answered once
    fake_sky.add_job(7, Status.RUNNING)
    if answer_lost:
        fake_sky.cancel_answers_lost = 1  # it arrives; the answer does not
    else:
        fake_sky.outage(1.5)  # refused: it never arrives
    backend.cancel("7")
    assert fake_sky.cancelled == [7] and fake_sky.records[7].status is Status.CANCELLED
    assert fake_sky.requests["refused"] >= 1


def test_a_server_that_never_answered_is_not_waited_for(tmp_path, fake_sky):
    from gpudoor_pipelines.launch.backends import sky_sdk

    fake_sky.outage(60)
    t0 = time.monotonic()
    with pytest.raises(Exception, match="Could not connect to SkyPilot API server"):
        sky_sdk.read(lambda: fake_sky.jobs.queue_v2(refresh=False))
    assert time.monotonic() - t0 < 1
