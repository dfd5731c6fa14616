"""The orphan reconciler: what it judges, and what the sensor and its release job do.

The judgement (:func:`plan_releases`) is pure and tested on its own. The sensor and the release job run
through Dagster (``build_sensor_context``, ``execute_in_process``) against real local jobs (processes)
on the embedded default, and against the fake SkyPilot SDK (tests/launch/fake_sky.py) for what a real
API server shows: its three listings and a job that will not die. The same sensor and job against real
managed jobs on Slurm, with a run worker killed, are in tests/slurm/test_reconciler_on_slurm.py.
"""

import json
import os
import time

import dagster as dg
import yaml

from gpudoor_pipelines.automation.reconcile import RunFacts, plan_releases
from gpudoor_pipelines.automation.reconciler import orphan_reconciler, release_held_gpus_job
from gpudoor_pipelines.launch.backends.local import LocalBackend
from gpudoor_pipelines.launch.backends.local_state import group_alive as _group_alive
from gpudoor_pipelines.launch.client import PipesSkyPilotClient
from gpudoor_pipelines.launch.job import Holding
from gpudoor_pipelines.launch.resolve.fleet import ReconcilerPolicy
from gpudoor_pipelines.launch.resolve.request import ResolvedJob
from gpudoor_pipelines.launch.resolve.routing import Route
from gpudoor_pipelines.launch.resolve.rules import identity_signature
from gpudoor_pipelines.transit.resource import TransitBucketResource
from tests.conftest import PROJECT_ROOT
from tests.launch.fake_sky import Status

POLICY = ReconcilerPolicy(grace_minutes=10, interactive_ttl_hours=12, max_interactive_ttl_hours=72)
NOW = 1_000_000.0
DOOR = {"gpudoor-pool": "h200", "gpudoor-user": "alice"}


def _job(job_id: str, run_id: str | None, age_s: float = 3600.0, kind: str = "job", **labels) -> Holding:
    own = {**DOOR, **({"dagster-run-id": run_id} if run_id else {}), **labels}
    return Holding(kind, job_id, labels=own, since=NOW - age_s, name=f"train-{job_id}")


def _plan(holdings, runs, **kwargs):
    return {r.holding.id: r.reason for r in plan_releases(holdings, runs, now=NOW, policy=POLICY, **kwargs)}


# ------------------------------------------------------------------ the judgement
def test_a_job_whose_run_ended_is_released_after_the_grace_period_and_a_live_runs_job_is_not():
    runs = {
        "failed-run": RunFacts("FAILURE", ended_at=NOW - 11 * 60),
        "just-failed": RunFacts("FAILURE", ended_at=NOW - 60),
        "live-run": RunFacts("STARTED", job_ids=frozenset({"3"})),
        "canceled": RunFacts("CANCELED", ended_at=NOW - 3600),
    }
    holdings = [_job("1", "failed-run"), _job("2", "just-failed"), _job("3", "live-run"), _job("4", "canceled")]
    plan = _plan(holdings, runs)
    assert set(plan) == {"1", "4"}
    assert "failed-run ended FAILURE 11 min ago" in plan["1"]


def test_a_job_naming_a_run_nobody_knows_waits_out_the_grace_period():
    plan = _plan([_job("1", "gone-run", age_s=3600), _job("2", "gone-run", age_s=60)], {})
    assert list(plan) == ["1"] and "unknown to this instance" in plan["1"]


def test_ad_hoc_jobs_and_jobs_outside_the_door_are_left_alone():
    adhoc = _job("1", None)  # `gpudoor launch` by an agent: no run to ask
    outside = Holding("job", "2", labels={"dagster-run-id": "gone"}, since=NOW - 7200)  # no gpudoor-pool
    assert _plan([adhoc, outside], {}) == {}


def test_a_job_claiming_a_live_run_that_never_launched_it_is_released():
    runs = {"live": RunFacts("STARTED", job_ids=frozenset({"7"}))}
    plan = _plan([_job("7", "live"), _job("8", "live"), _job("9", "live", age_s=60)], runs)
    assert list(plan) == ["8"] and "did not launch it" in plan["8"]


def test_a_warm_pool_belongs_to_the_run_it_is_named_after():
    run_id = "abcdef12-3456-7890-abcd-ef1234567890"
    runs = {run_id: RunFacts("STARTED"), "done": RunFacts("SUCCESS", ended_at=NOW - 3600)}
    mine = _job("gpudoor-eval-abcdef12", run_id, kind="pool")
    other = _job("gpudoor-eval-99999999", run_id, kind="pool")
    finished = _job("gpudoor-caption-done", "done", kind="pool")
    assert set(_plan([mine, other, finished], runs)) == {"gpudoor-eval-99999999", "gpudoor-caption-done"}


def test_with_a_key_only_signed_run_ids_count():
    signed = {**DOOR, "dagster-run-id": "gone"}
    signed["gpudoor-signature"] = identity_signature(signed, "key")
    forged = _job("2", "gone")
    plan = _plan([Holding("job", "1", labels=signed, since=NOW - 7200), forged], {}, label_key="key")
    assert list(plan) == ["1"]  # the forged one names a run it cannot prove: not the reconciler's to judge


def test_interactive_clusters_go_after_their_time_to_live_their_own_within_the_fleets_cap():
    holdings = [
        Holding("cluster", "lab-old", labels=DOOR, since=NOW - 13 * 3600),
        Holding("cluster", "lab-young", labels=DOOR, since=NOW - 11 * 3600),
        Holding("cluster", "dev-short", labels={**DOOR, "gpudoor-ttl-hours": "0.5"}, since=NOW - 3600),
        Holding("cluster", "lab-greedy", labels={**DOOR, "gpudoor-ttl-hours": "1000"}, since=NOW - 73 * 3600),
        Holding("cluster", "lab-outside", labels={}, since=NOW - 100 * 3600),
    ]
    plan = _plan(holdings, {})
    assert set(plan) == {"lab-old", "dev-short", "lab-greedy"}
    assert "time to live of 12 h" in plan["lab-old"] and "0.5 h" in plan["dev-short"] and "72 h" in plan["lab-greedy"]


def test_a_step_cluster_lives_as_long_as_its_run_not_for_a_time_to_live():
    """A step launched as a cluster (``gpudoor-step-…``) is judged like a job: by its run, whatever its age."""
    runs = {
        "live-run": RunFacts("STARTED", job_ids=frozenset({"gpudoor-step-smoke-live-ab12/1"})),
        "ended-run": RunFacts("FAILURE", ended_at=NOW - 3600),
    }
    holdings = [
        _job("gpudoor-step-smoke-live-ab12", "live-run", age_s=30 * 3600, kind="cluster"),  # older than any TTL
        _job("gpudoor-step-smoke-ended-cd34", "ended-run", age_s=120, kind="cluster"),
        _job("gpudoor-step-smoke-replayed-ef56", "live-run", kind="cluster"),  # names a live run that did not launch it
    ]
    plan = _plan(holdings, runs)
    assert set(plan) == {"gpudoor-step-smoke-ended-cd34", "gpudoor-step-smoke-replayed-ef56"}
    assert "ended-run ended FAILURE 60 min ago" in plan["gpudoor-step-smoke-ended-cd34"]
    assert "did not launch it" in plan["gpudoor-step-smoke-replayed-ef56"]


def test_a_holding_without_a_time_is_aged_from_when_the_reconciler_first_saw_it():
    pool = Holding("pool", "gpudoor-eval-x", labels={**DOOR, "dagster-run-id": "gone"})
    assert _plan([pool], {}) == {}  # first seen now
    assert list(_plan([pool], {}, first_seen={pool.key: NOW - 3600})) == ["gpudoor-eval-x"]


# ------------------------------------------------------------------ the sensor and its job, on the embedded default
def _fleet_file(tmp_path, **reconciler) -> str:
    from gpudoor_pipelines.launch.resolve.fleet import DEFAULT_FLEET_FILE

    fleet = yaml.safe_load(DEFAULT_FLEET_FILE.read_text())
    fleet["reconciler"] = {"grace_minutes": 0, **reconciler}
    path = tmp_path / "fleet.yaml"
    path.write_text(yaml.safe_dump(fleet))
    return str(path)


def _local_client(tmp_path, **reconciler) -> PipesSkyPilotClient:
    return PipesSkyPilotClient(
        local_home=str(tmp_path / "home"),
        fleet_file=_fleet_file(tmp_path, **reconciler),
        transit=TransitBucketResource(local_root=str(tmp_path / "transit")),
    )


def _submit(backend: LocalBackend, name: str, labels: dict, cluster: str | None = None) -> str:
    from gpudoor_pipelines.launch.resolve.fleet import load_fleet

    pool = load_fleet().pools["onprem"]
    job = ResolvedJob(
        name=name,
        config={"run": "sleep 600", "resources": {"labels": labels}},
        workdir=os.getcwd(),
        pool="onprem",
        route=Route(pool=pool, infra=pool.infra, accelerator=None, gpus_per_node=0, num_nodes=1, reason="test"),
        labels=labels,
        cluster_name=cluster,
    )
    if cluster:
        return backend.start_service(job).job_id
    return backend.submit(job)


def _wait_running(backend: LocalBackend, job_id: str) -> None:
    deadline = time.time() + 30
    while backend.status(job_id).state.value != "RUNNING" and time.time() < deadline:
        time.sleep(0.1)


def _run(instance: dg.DagsterInstance, status: dg.DagsterRunStatus) -> str:
    run = instance.create_run_for_job(
        release_held_gpus_job, run_config={"ops": {"release_held_gpus": {"config": {"releases": []}}}}
    )
    if status is dg.DagsterRunStatus.FAILURE:
        instance.report_run_failed(run)  # what run monitoring does once the run worker is gone
    else:
        instance.handle_run_event(
            run.run_id, dg.DagsterEvent(dg.DagsterEventType.RUN_START.value, job_name=run.job_name)
        )
    return run.run_id


def test_the_sensor_releases_an_orphan_verifies_it_and_leaves_a_live_runs_job_alone(tmp_path):
    """A dead run's job is cancelled and its processes are seen gone, a live run's job keeps running, a
    `lab-` service past its time to live is stopped; dry run first changes nothing; a second tick asks nothing again."""
    with dg.instance_for_test() as instance:
        dead, live = _run(instance, dg.DagsterRunStatus.FAILURE), _run(instance, dg.DagsterRunStatus.STARTED)
        client = _local_client(tmp_path, interactive_ttl_hours=0.0001, dry_run=True)
        backend = client.get_backend()
        orphan = _submit(backend, "orphan", {**DOOR, "dagster-run-id": dead})
        alive = _submit(backend, "alive", {**DOOR, "dagster-run-id": live})
        instance.add_run_tags(live, {"gpudoor/job-probe": f"local:{alive}"})
        demo = _submit(backend, "lab-old", DOOR, cluster="lab-old")
        for job_id in (orphan, alive, demo):
            _wait_running(backend, job_id)
        time.sleep(0.5)  # older than its 0.36 s time to live

        with dg.build_sensor_context(instance=instance, resources={"skypilot": client}) as context:
            dry = orphan_reconciler(context)
        assert not dry.run_requests and "dry run: would release 2" in dry.skip_reason.skip_message
        assert all(backend.status(j).state.value == "RUNNING" for j in (orphan, alive, demo))

        client = _local_client(tmp_path, interactive_ttl_hours=0.0001)
        with dg.build_sensor_context(instance=instance, resources={"skypilot": client}) as context:
            result = orphan_reconciler(context)
            (request,) = result.run_requests
            cursor = result.cursor
        released = {r["id"]: r["reason"] for r in request.run_config["ops"]["release_held_gpus"]["config"]["releases"]}
        assert set(released) == {orphan, "lab-old"} and dead in released[orphan]

        run = release_held_gpus_job.execute_in_process(
            run_config=request.run_config, instance=instance, resources={"skypilot": client}, tags=request.tags
        )
        assert run.success
        records = run.output_for_node("release_held_gpus")
        assert {r["id"]: r["confirmed"] for r in records} == {orphan: True, "lab-old": True}
        assert any("process group" in s and "gone" in s for r in records if r["id"] == orphan for s in r["seen"])
        assert backend.status(orphan).state.value == "CANCELLED" and not _group_alive(backend._runner(orphan)["pgid"])
        assert backend.status(alive).state.value == "RUNNING"
        assert "lab-old" not in backend.clusters()
        assert instance.get_run_by_id(dead).tags[f"gpudoor/released-job-{orphan}"].startswith("confirmed in")

        # A restart with the same cursor asks for nothing again; nothing is left to release anyway.
        with dg.build_sensor_context(instance=instance, cursor=cursor, resources={"skypilot": client}) as context:
            again = orphan_reconciler(context)
        assert not again.run_requests
        backend.cancel(alive)


# ------------------------------------------------------------------ on the fake SkyPilot SDK


def _sky_client(tmp_path, **reconciler) -> PipesSkyPilotClient:
    return PipesSkyPilotClient(
        backend="skypilot",
        api_server_endpoint="http://127.0.0.1:1",
        fleet_file=_fleet_file(tmp_path, **reconciler),
        transit=TransitBucketResource(local_root=str(tmp_path / "transit")),
    )


def test_on_skypilot_a_tick_is_three_listings_whatever_the_number_of_jobs(tmp_path, fake_sky):
    with dg.instance_for_test() as instance:
        dead = _run(instance, dg.DagsterRunStatus.FAILURE)
        for i in range(1, 301):
            fake_sky.add_job(i, Status.RUNNING, {**DOOR, "dagster-run-id": dead if i % 3 == 0 else f"unknown-{i}"})
        fake_sky.pools.append(
            {
                "name": "gpudoor-eval-0000",
                "status": "READY",
                "target_num_replicas": 2,
                "pool_yaml": yaml.safe_dump({"resources": {"labels": {**DOOR, "dagster-run-id": dead}}}),
            }
        )
        fake_sky.up.append({"name": "lab-demo", "status": "UP", "launched_at": time.time() - 13 * 3600, "handle": None})
        with dg.build_sensor_context(instance=instance, resources={"skypilot": _sky_client(tmp_path)}) as context:
            result = orphan_reconciler(context)
    assert fake_sky.requests == {"queue_v2": 1, "pool_status": 1, "status": 1}
    (request,) = result.run_requests
    ids = {r["id"] for r in request.run_config["ops"]["release_held_gpus"]["config"]["releases"]}
    # Jobs of the ended run and of unknown runs (the fake's jobs were submitted long ago), the pool; the
    # demo cluster carries no door labels here, so it is not the reconciler's.
    assert len(ids) == 301 and "gpudoor-eval-0000" in ids and "lab-demo" not in ids


def test_on_skypilot_releasing_300_jobs_is_one_cancel_and_two_requests_per_look(tmp_path, fake_sky):
    for i in range(1, 301):
        fake_sky.add_job(i, Status.RUNNING, {**DOOR, "dagster-run-id": "gone"})
    config = {"releases": [{"kind": "job", "id": str(i)} for i in range(1, 301)]}
    with dg.instance_for_test() as instance:
        result = release_held_gpus_job.execute_in_process(
            run_config={"ops": {"release_held_gpus": {"config": config}}},
            instance=instance,
            resources={"skypilot": _sky_client(tmp_path)},
        )
    assert all(r["confirmed"] for r in result.output_for_node("release_held_gpus"))
    # One cancel for all, then one look: one queue_v2 for the states, one sky.status for their clusters.
    assert fake_sky.requests == {"cancel": 1, "queue_v2": 1, "status": 1}


def test_on_skypilot_a_release_that_is_not_confirmed_fails_the_run_with_an_error_event(tmp_path, fake_sky):
    fake_sky.add_job(1, Status.RUNNING, {**DOOR, "dagster-run-id": "gone"})
    fake_sky.add_job(2, Status.RUNNING, {**DOOR, "dagster-run-id": "gone"})
    fake_sky._cancel = lambda job_ids: None  # the server accepts the cancel, and nothing happens
    fake_sky.jobs.cancel = fake_sky._cancel
    fake_sky.polls_to_finish = 10**9
    config = {"releases": [{"kind": "job", "id": "1", "reason": "test"}]}
    with dg.instance_for_test() as instance:
        client = _sky_client(tmp_path, release_timeout_minutes=0.02)
        result = release_held_gpus_job.execute_in_process(
            run_config={"ops": {"release_held_gpus": {"config": config}}},
            instance=instance,
            resources={"skypilot": client},
            raise_on_error=False,
        )
        assert not result.success
        errors = [
            e for e in instance.all_logs(result.run_id) if e.level >= 40 and "GPUs may still be held" in e.message
        ]
    (failure,) = [e for e in result.all_events if e.is_step_failure]
    assert "Release not confirmed: job 1" in failure.step_failure_data.user_failure_data.description
    assert errors and "job 1" in errors[0].message and "RUNNING" in errors[0].message


def test_on_skypilot_a_confirmed_release_names_what_was_seen(tmp_path, fake_sky):
    fake_sky.add_job(5, Status.RUNNING, {**DOOR})
    fake_sky.pools.append({"name": "gpudoor-eval-1", "status": "READY", "target_num_replicas": 1, "pool_yaml": ""})
    fake_sky.up.append({"name": "lab-demo", "status": "UP"})
    config = {
        "releases": [
            {"kind": "job", "id": "5"},
            {"kind": "pool", "id": "gpudoor-eval-1"},
            {"kind": "cluster", "id": "lab-demo"},
        ]
    }
    with dg.instance_for_test() as instance:
        result = release_held_gpus_job.execute_in_process(
            run_config={"ops": {"release_held_gpus": {"config": config}}},
            instance=instance,
            resources={"skypilot": _sky_client(tmp_path)},
        )
    seen = {r["id"]: r["seen"] for r in result.output_for_node("release_held_gpus")}
    assert seen["5"][0] == "job 5: CANCELLED" and seen["5"][1].startswith("sky.status: no cluster")
    assert seen["gpudoor-eval-1"] == ["pool gpudoor-eval-1: gone from sky.jobs.pool_status"]
    assert seen["lab-demo"] == ["sky.status: no cluster lab-demo"]
    assert json.dumps(seen)  # plain data, as the run's metadata holds it


# ------------------------------------------------------------------ a terminated batch is released, verified
def test_a_terminated_batch_has_its_jobs_and_warm_pool_released_and_verified(tmp_path, monkeypatch):
    """A run terminated while a batch runs on a warm pool: every rank is cancelled, the pool given back, and
    both are seen released (no supervisor, no rank's processes) and recorded on the run."""
    specs = tmp_path / "specs"
    specs.mkdir()
    (specs / "caption.yaml").write_text(
        yaml.safe_dump({"name": "batch", "resources": {"accelerators": "L4:1"}, "run": "echo rank-started; sleep 600"})
    )
    client = PipesSkyPilotClient(
        local_home=str(tmp_path / "home"),
        specs_dir=str(specs),
        poll_interval_s=0.1,
        transit=TransitBucketResource(local_root=str(tmp_path / "transit")),
    )
    calls = {"n": 0}
    real = LocalBackend.statuses

    def interrupted_once_running(self, job_ids):
        infos = real(self, job_ids)
        if any(i.state.value == "RUNNING" for i in infos.values()):
            calls["n"] += 1
            if calls["n"] == 2:
                raise dg.DagsterExecutionInterruptedError()
        return infos

    monkeypatch.setattr(LocalBackend, "statuses", interrupted_once_running)

    @dg.asset
    def batch(context: dg.AssetExecutionContext, skypilot: PipesSkyPilotClient) -> None:
        skypilot.run_batch(
            context=context,
            request=skypilot.request(context, "caption"),
            num_jobs=2,
            workers=2,
            pool_name="gpudoor-test-pool",
            prepare=lambda envs: {},
            on_message=lambda m: None,
        )

    with dg.instance_for_test() as instance:
        result = dg.materialize([batch], instance=instance, resources={"skypilot": client}, raise_on_error=False)
        tags = instance.get_run_by_id(result.run_id).tags
    assert not result.success
    released = {k: v for k, v in tags.items() if k.startswith("gpudoor/released-")}
    assert released["gpudoor/released-pool-gpudoor-test-pool"].startswith("confirmed in")
    assert sum(k.startswith("gpudoor/released-job-") for k in released) == 2, released
    assert all(v.startswith("confirmed in") for v in released.values())
    backend = client.get_backend()
    assert backend.pool_workers("gpudoor-test-pool") == 0


# ------------------------------------------------------------------ runs whose own process died


def test_a_process_is_gone_only_on_this_host_and_a_pid_used_again_is_not_taken_for_it():
    import socket
    import subprocess
    import sys

    from gpudoor_pipelines.launch.record.process import run_process_gone, this_run_process

    me = this_run_process()
    assert me is not None and not run_process_gone(me)
    host, pid, start = me.rsplit(":", 2)
    assert run_process_gone(f"{host}:{pid}:{int(start) + 1}")  # the same pid, another process since
    assert not run_process_gone(f"{host}-elsewhere:{pid}:{int(start) + 1}")  # another host's: never
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    assert run_process_gone(f"{socket.gethostname()}:{ended.pid}:")
    assert not run_process_gone("no-identity")


def test_a_run_killed_in_its_own_process_is_marked_failed_and_its_job_released(tmp_path, monkeypatch):
    """``gpudoor flow`` and ``dg.materialize`` run their steps in their own process: killed with ``kill -9``,
    no run worker is left for Dagster's run monitoring, and the run stayed STARTED with its job running. The
    reconciler sees the process gone, marks the run failed and releases the job (grace 0 here; the shipped
    fleet waits ``grace_minutes``). A live run of the same kind is left alone."""
    import signal
    import subprocess
    import sys
    import textwrap

    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "dagster_home"))
    (tmp_path / "dagster_home").mkdir()
    specs = tmp_path / "specs"
    specs.mkdir()
    (specs / "caption.yaml").write_text(
        yaml.safe_dump({"name": "long", "resources": {"accelerators": "L4:1"}, "run": "sleep 600"})
    )
    client = _local_client(tmp_path)
    script = tmp_path / "flow.py"
    script.write_text(
        textwrap.dedent(f"""
        import dagster as dg
        from gpudoor_pipelines.launch.client import PipesSkyPilotClient
        from gpudoor_pipelines.transit.resource import TransitBucketResource

        @dg.asset
        def long_step(context, skypilot: PipesSkyPilotClient):
            return skypilot.run(context=context, request=skypilot.request(context, "caption")).get_materialize_result()

        transit = TransitBucketResource(local_root={str(tmp_path / "transit")!r})
        client = PipesSkyPilotClient(local_home={client.local_home!r}, fleet_file={client.fleet_file!r},
                                     specs_dir={str(specs)!r}, transit=transit)
        dg.materialize([long_step], instance=dg.DagsterInstance.get(), resources={{"skypilot": client}})
    """)
    )
    with (tmp_path / "flow.log").open("w") as log:
        flow = subprocess.Popen(
            [sys.executable, str(script)],
            env={**os.environ, "PYTHONPATH": str(PROJECT_ROOT)},
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    backend = client.get_backend()
    instance = dg.DagsterInstance.get()
    job_ids: list[str] = []
    try:
        deadline = time.time() + 120
        while time.time() < deadline:
            runs = instance.get_runs()
            job_ids = [v.split(":", 1)[1] for r in runs for k, v in r.tags.items() if k.startswith("gpudoor/job-")]
            if job_ids and backend.status(job_ids[0]).state.value == "RUNNING":
                break
            time.sleep(0.2)
        assert job_ids, (tmp_path / "flow.log").read_text()[-3000:]
        (run,) = instance.get_runs()
        (job_id,) = job_ids
        assert run.tags["gpudoor/run-process"].split(":")[1] == str(flow.pid)

        # While the process lives, nothing is marked and nothing released.
        with dg.build_sensor_context(instance=instance, resources={"skypilot": client}) as context:
            alive = orphan_reconciler(context)
        assert not alive.run_requests and instance.get_run_by_id(run.run_id).status == dg.DagsterRunStatus.STARTED

        flow.send_signal(signal.SIGKILL)
        flow.wait(timeout=30)
        assert backend.status(job_id).state.value == "RUNNING"  # nothing forwarded a cancel
        with dg.build_sensor_context(instance=instance, resources={"skypilot": client}) as context:
            (request,) = orphan_reconciler(context).run_requests
        marked = instance.get_run_by_id(run.run_id)
        assert marked.status == dg.DagsterRunStatus.FAILURE
        (failure,) = instance.all_logs(run.run_id, of_type=dg.DagsterEventType.RUN_FAILURE)
        assert "orphan reconciler" in failure.message and f":{flow.pid}:" in failure.message
        releases = request.run_config["ops"]["release_held_gpus"]["config"]["releases"]
        assert [r["id"] for r in releases] == [job_id]
        result = release_held_gpus_job.execute_in_process(
            run_config=request.run_config, instance=instance, resources={"skypilot": client}, tags=request.tags
        )
        assert result.success and backend.status(job_id).state.value == "CANCELLED"
        assert not _group_alive(backend._runner(job_id)["pgid"])
    finally:
        flow.kill()
        for job_id in job_ids:
            backend.cancel(job_id)
