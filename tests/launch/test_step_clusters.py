"""Steps the fleet launches as clusters of their own (``launch_as: {<step>: cluster}``), against the fake SDK.

The fake (fake_sky.py) stands in for the API server: ``sky.launch`` puts a cluster up, ``sky.tail_logs``
streams its job's lines and returns the job's exit code, or breaks off with the cluster gone (its
allocation lost, as after a preemption). The same path against a real API server and Slurm is
tests/slurm/test_client_on_slurm.py (the smoke test through the bed's fleet).
"""

import logging
import time
from pathlib import Path

import dagster as dg
import pytest
import yaml

from gpudoor_pipelines.launch.backends.sky_records import clusters_held
from gpudoor_pipelines.launch.backends.step_clusters import MAX_RELAUNCHES
from gpudoor_pipelines.launch.client import LaunchConfig, PipesSkyPilotClient
from gpudoor_pipelines.launch.errors import LaunchConfigError
from gpudoor_pipelines.launch.resolve.fleet import load_fleet
from tests.conftest import SPECS_DIR, given_inputs
from tests.launch import test_client_on_fake_skypilot as on_fake
from tests.launch.test_client_on_fake_skypilot import _client

# The fake SDK behind a real health endpoint (the client checks the API server before it launches).
sky_api = on_fake.fake_sky


def _fleet(tmp_path: Path, **launch_as: str) -> str:
    fleet = yaml.safe_load((SPECS_DIR / "fleet.yaml").read_text())
    path = tmp_path / "fleet.yaml"
    path.write_text(yaml.safe_dump({**fleet, "launch_as": launch_as}))
    return str(path)


@dg.asset(partitions_def=dg.StaticPartitionsDefinition(["shard-007"]))
def probe_asset(
    context: dg.AssetExecutionContext, config: LaunchConfig, skypilot: PipesSkyPilotClient
) -> dg.MaterializeResult:
    return skypilot.run(
        context=context, request=skypilot.request(context, "caption", config=config)
    ).get_materialize_result()


def _materialize(tmp_path, fake, **kwargs):
    instance = dg.DagsterInstance.ephemeral()
    client = _client(tmp_path, fake, fleet_file=_fleet(tmp_path, caption="cluster"), **kwargs)
    result = dg.materialize(
        [probe_asset],
        partition_key="shard-007",
        instance=instance,
        raise_on_error=False,
        resources={"skypilot": client},
    )
    logs = [(e.level, e.user_message) for e in instance.all_logs(result.run_id)]
    return result, logs, instance.get_run_by_id(result.run_id).tags


def _metadata(result) -> dict:
    return {k: v.value for k, v in result.asset_materializations_for_node("probe_asset")[0].metadata.items()}


def test_a_step_launched_as_a_cluster_runs_streams_and_tears_its_cluster_down(tmp_path, sky_api):
    result, logs, _ = _materialize(tmp_path, sky_api)
    assert result.success
    md = _metadata(result)
    ((cluster, task),) = sky_api.cluster_launches
    # A cluster of its own, no managed job; its id names the cluster and the job on it.
    assert sky_api.requests.get("launch", 0) == 0 and cluster.startswith("gpudoor-step-")
    assert md["launched_as"] == "cluster" and md["job_id"] == f"{cluster}/1" and md["status"] == "SUCCEEDED"
    assert md["pool"] == "onprem" and md["recoveries"] == 0
    (resources,) = task.resources
    assert resources.labels["dagster-run-id"] == result.run_id and resources.labels["gpudoor-pool"] == "onprem"
    messages = [m for _, m in logs]
    assert f"cluster {cluster} job 1 is done" in messages
    # Torn down once the job ended: nothing is left up.
    assert sky_api.up == [] and any(m.startswith(f"Tearing down cluster {cluster}") for m in messages)


def test_a_failed_job_on_its_cluster_fails_the_step_with_its_log_tail_and_the_cluster_goes(tmp_path, sky_api):
    sky_api.cluster_exit = 100
    result, _, _ = _materialize(tmp_path, sky_api)
    assert not result.success
    (failure,) = [e for e in result.all_events if e.is_step_failure]
    text = failure.step_failure_data.user_failure_data.description
    assert "ended FAILED" in text and "says hello" in text
    assert sky_api.up == [] and len(sky_api.cluster_launches) == 1


def test_a_preempted_step_cluster_is_launched_again_and_says_what_it_cost(tmp_path, sky_api):
    sky_api.lose_clusters, sky_api.cluster_run_s = 1, 1.0  # the job on the relaunched cluster runs 1 s
    result, logs, _ = _materialize(tmp_path, sky_api)
    assert result.success
    md = _metadata(result)
    (first, _), (second, _) = sky_api.cluster_launches
    assert first == second and md["job_id"] == f"{first}/1" and md["recoveries"] == 1
    # The second run was useful work; the first (nothing saved) was lost.
    assert 0 < md["gpu_hours_lost_to_preemption"] < md["gpu_hours_held"] and 0 < md["goodput"] < 1
    warnings = [m for level, m in logs if level >= logging.WARNING]
    assert any("was preempted 1 time(s) and recovered" in w for w in warnings), warnings
    assert any(f"cluster {first} was lost (preempted): launching it again" in m for _, m in logs)
    assert sky_api.up == []


def test_the_time_a_lost_cluster_takes_to_come_back_is_not_counted_as_held(tmp_path, sky_api):
    sky_api.lose_clusters, sky_api.cluster_run_s, sky_api.relaunch_s = 1, 1.0, 3.0
    began = time.time()
    result, _, _ = _materialize(tmp_path, sky_api)
    took = time.time() - began
    assert result.success
    held_s = _metadata(result)["gpu_hours_held"] * 3600  # one GPU
    # Both runs count (the second ran 1 s); the 3 s without a cluster do not.
    assert 1.0 <= held_s <= took - 3.0


def test_a_step_cluster_preempted_too_often_fails_the_step_and_nothing_stays_up(tmp_path, sky_api):
    sky_api.lose_clusters = MAX_RELAUNCHES + 1
    result, _, _ = _materialize(tmp_path, sky_api)
    assert not result.success and len(sky_api.cluster_launches) == MAX_RELAUNCHES + 1
    (failure,) = [e for e in result.all_events if e.is_step_failure]
    assert f"relaunched {MAX_RELAUNCHES} times already" in failure.step_failure_data.user_failure_data.description
    assert sky_api.up == []


def test_a_terminated_run_tears_its_step_cluster_down_and_verifies_it_is_gone(tmp_path, sky_api):
    sky_api.lose_clusters = 1  # the follower is then busy relaunching: the interrupt must win over it
    sky_api.status_interrupt_after = 1
    sky_api.interrupt = dg.DagsterExecutionInterruptedError()
    result, _, tags = _materialize(tmp_path, sky_api)
    assert not result.success
    (cluster, _), *_ = sky_api.cluster_launches
    assert sky_api.up == []
    assert tags.get(f"gpudoor/released-cluster-{cluster}", "").startswith("confirmed in"), tags


def test_launches_outside_a_dagster_run_and_services_are_never_step_clusters(tmp_path):
    from gpudoor_pipelines.launch.resolve.request import LaunchRequest, resolve
    from gpudoor_pipelines.launch.resolve.specs import load_spec

    fleet = load_fleet(_fleet(tmp_path, smoke="cluster"))
    run = {"dagster/run-id": "0123abcd-run"}
    smoke, train = load_spec("smoke"), load_spec("train")
    inputs = given_inputs(smoke)

    def launch_as(spec, **request) -> str:
        return resolve(LaunchRequest(spec=spec, inputs=inputs, step=spec.kind, **request), fleet).launch_as

    assert launch_as(smoke, dagster=run) == "cluster"
    # An agent or a person launching: no step to tear the cluster down, no run for the reconciler to judge.
    assert launch_as(smoke) == "managed"
    assert launch_as(train, dagster=run) == "managed"


def test_launch_as_names_a_step_the_fleet_routes(tmp_path):
    with pytest.raises(LaunchConfigError) as e:
        load_fleet(_fleet(tmp_path, smoek="cluster"))
    assert e.value.field == "launch_as.smoek" and "did you mean 'smoke'" in e.value.fix


def test_step_clusters_up_or_starting_count_against_the_caps(tmp_path, sky_api):
    import types

    def cluster(name: str, status: str, gpus: int, nodes: int = 1, labels: dict | None = None) -> dict:
        resources = types.SimpleNamespace(
            labels=labels if labels is not None else {"gpudoor-pool": "h200", "gpudoor-user": "ana"},
            accelerators={"H200": gpus},
        )
        return {
            "name": name,
            "status": status,
            "handle": types.SimpleNamespace(launched_nodes=nodes, launched_resources=resources),
        }

    sky_api.up = [
        cluster("gpudoor-step-smoke-1-ab12", "UP", 1),
        cluster("gpudoor-step-train-2-cd34", "INIT", 8, nodes=2),
        cluster("gpudoor-step-gone-ef56", "STOPPED", 8),
        cluster("lab-demo", "UP", 1),  # a demo: not a step
        cluster("gpudoor-step-foreign-0000", "UP", 4, labels={}),  # not launched through the door
    ]
    assert [h[:4] for h in clusters_held(sky_api.up)] == [("h200", "ana", 1, 0), ("h200", "ana", 16, 0)]
    usage = _client(tmp_path, sky_api).get_backend().usage()
    assert usage.gpus == {"h200": 17} and usage.user_gpus == {("ana", "h200"): 17}


def test_a_step_whose_cluster_cannot_be_looked_at_for_a_while_looks_again_and_ends(tmp_path, sky_api, monkeypatch):
    from gpudoor_pipelines.launch.backends import step_clusters

    monkeypatch.setattr(step_clusters, "_LOOK_AGAIN_FIRST_S", 0.01)
    monkeypatch.setattr(step_clusters, "_LOOK_AGAIN_MOST_S", 0.01)
    # The job's log stream breaks off while it runs, and twice the API server then fails to answer; the third
    # look finds the job ended.
    sky_api.stream_drops, sky_api.job_status_errors = 3, 2
    result, logs, _ = _materialize(tmp_path, sky_api)
    assert result.success and _metadata(result)["status"] == "SUCCEEDED"
    messages = [m for _, m in logs]
    assert sum("could not look at cluster" in m and "ConnectionError" in m for m in messages) == 2, messages
    assert len(sky_api.cluster_launches) == 1 and sky_api.up == []


def test_a_step_whose_cluster_stays_out_of_sight_fails_with_why_instead_of_waiting_forever(
    tmp_path, sky_api, monkeypatch
):
    from gpudoor_pipelines.launch.backends import step_clusters

    monkeypatch.setattr(step_clusters, "_LOOK_AGAIN_FIRST_S", 0.01)
    monkeypatch.setattr(step_clusters, "_LOOK_AGAIN_MOST_S", 0.01)
    sky_api.stream_drops = sky_api.job_status_errors = step_clusters.MAX_LOOK_ERRORS
    result, _, _ = _materialize(tmp_path, sky_api)
    assert not result.success
    (failure,) = [e for e in result.all_events if e.is_step_failure]
    text = failure.step_failure_data.user_failure_data.description
    assert "lost track of cluster gpudoor-step-" in text and "ConnectionError" in text
    assert sky_api.up == []  # torn down, as after any end
