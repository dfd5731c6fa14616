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
