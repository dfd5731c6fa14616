"""The SkyPilot backend's pure parts: the sky.Task it builds, and failing fast without a server.

Launching real managed jobs is proven on the Slurm test bed (tests/slurm); these tests need no
server and send nothing anywhere.
"""

from __future__ import annotations

import socket
import time

import pytest

from gpudoor_pipelines.launch.backends.skypilot import SkyPilotBackend
from gpudoor_pipelines.launch.errors import LaunchConfigError
from gpudoor_pipelines.launch.resolve.fleet import load_fleet
from gpudoor_pipelines.launch.resolve.request import LaunchRequest, resolve
from gpudoor_pipelines.launch.resolve.specs import load_spec
from tests.conftest import PROJECT_ROOT


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_task_carries_env_secrets_infra_labels_and_nodes():
    request = LaunchRequest(
        spec=load_spec("train"),
        inputs={"DATASET_URI": "s3://transit/datasets/d.parquet", "OUTPUT_URI": "s3://transit/checkpoints/x"},
        secrets={"AWS_SECRET_ACCESS_KEY": "secret-value"},
        cost_owner="ml-research",
        asset="training_run",
        dagster={"dagster/run-id": "0123abcd"},
    )
    job = resolve(request, load_fleet())
    task = SkyPilotBackend("http://127.0.0.1:1").build_task(job)
    (resources,) = task.resources
    assert task.name == job.name and task.num_nodes == 2
    assert (
        task.envs["OUTPUT_URI"] == "s3://transit/checkpoints/x"
        and task.envs["CHECKPOINTS_DIR"] == "/lustre/checkpoints"
    )
    assert "AWS_SECRET_ACCESS_KEY" not in task.envs
    assert task.secrets["AWS_SECRET_ACCESS_KEY"].get_secret_value() == "secret-value"
    assert resources.infra.to_str().startswith("slurm/h200-ib")
    assert resources.accelerators == {"H200": 8}
    assert resources.labels["dagster-run-id"] == "0123abcd" and resources.labels["gpudoor-cost-owner"] == "ml-research"
    assert task.workdir == str(PROJECT_ROOT)


def test_no_endpoint_is_a_clear_error():
    with pytest.raises(LaunchConfigError, match="SKYPILOT_API_SERVER_ENDPOINT"):
        SkyPilotBackend(None)


def test_unreachable_server_fails_fast_before_anything_is_submitted():
    backend = SkyPilotBackend(f"http://127.0.0.1:{_closed_port()}")
    start = time.monotonic()
    with pytest.raises(LaunchConfigError) as err:
        backend.check()
    assert time.monotonic() - start < 30
    assert err.value.field == "api_server_endpoint" and "no SkyPilot API server answers" in str(err.value)


@pytest.mark.parametrize("job_id", ["", "..", "/etc", "../3", "1/../2", "a/b", "3.0", "²", "gpudoor-step-x/1/.."])
def test_anything_but_an_issued_job_id_is_no_job_before_any_request(job_id):
    # The server does not answer: a request for the id would fail as unreachable, not as "no job".
    backend = SkyPilotBackend(f"http://127.0.0.1:{_closed_port()}")
    for ask in (backend.status, backend.log_tail, backend.follow_logs, backend.cancel):
        with pytest.raises(KeyError, match="no job"):
            ask(job_id)


def test_a_warm_pool_goes_down_once_the_controllers_of_its_last_batch_are_done(fake_sky):
    """A job that has ended may still have its controller at work on its worker (reading its log, cancelling what
    is left): the pool is taken down once that controller is done, or after a bound, never under it."""
    import threading

    from tests.launch.fake_sky import Status

    backend = SkyPilotBackend(fake_sky.endpoint)
    pools = backend._pools  # noqa: SLF001 - the batch's jobs, as submit_batch left them
    fake_sky.add_job(7, Status.SUCCEEDED)
    for wait_s, done_after_s in ((30.0, 1.0), (0.5, None)):
        fake_sky.pools = [{"name": "p", "status": "READY", "target_num_replicas": 1}]
        fake_sky.records[7].schedule_state = "ALIVE"
        pools._last_batch["p"] = ["7"]  # noqa: SLF001
        pools.cleanup_wait_s = wait_s
        if done_after_s is not None:
            threading.Timer(done_after_s, lambda: setattr(fake_sky.records[7], "schedule_state", "DONE")).start()
        started = time.monotonic()
        backend.release_pool("p")
        took = time.monotonic() - started
        assert not fake_sky.pools  # gone
        assert took >= (done_after_s or wait_s) and took < wait_s + 5, took
