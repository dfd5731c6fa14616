"""The local backend: SkyPilot's environment contract, ranks, failures, and cancellation of the whole tree."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from gpudoor_pipelines.launch.backends.local import LocalBackend
from gpudoor_pipelines.launch.job import JobState
from gpudoor_pipelines.launch.resolve.request import ResolvedJob
from tests.conftest import PROJECT_ROOT


def _job(run: str, *, setup: str | None = None, num_nodes: int = 1, envs=None, secrets=None, pool_env=None, name="t"):
    config = {
        "name": name,
        "num_nodes": num_nodes,
        "resources": {"accelerators": "H200:8"},
        "run": run,
        "envs": envs or {},
    }
    if setup:
        config["setup"] = setup
    if secrets:
        config["secrets"] = secrets
    return ResolvedJob(name=name, config=config, workdir=str(PROJECT_ROOT), pool="h200", pool_env=pool_env or {})


def _wait(backend: LocalBackend, job_id: str, timeout: float = 60) -> JobState:
    deadline = time.time() + timeout
    while time.time() < deadline:
        state = backend.status(job_id).state
        if state.is_terminal:
            return state
        time.sleep(0.1)
    raise AssertionError(f"job {job_id} still {state} after {timeout}s")


@pytest.fixture
def backend(tmp_path):
    return LocalBackend(home=tmp_path / "home")


def test_environment_contract(backend):
    job = _job(
        "echo TASK=$SKYPILOT_TASK_ID; echo NODES=$SKYPILOT_NUM_NODES; echo RANK=$SKYPILOT_NODE_RANK; "
        'echo GPUS=$SKYPILOT_NUM_GPUS_PER_NODE; echo IPS=$(echo "$SKYPILOT_NODE_IPS" | wc -l); '
        'echo INPUT=$INPUT_URI; echo CKPT=$CHECKPOINTS_DIR; test -d "$CHECKPOINTS_DIR" && echo CKPT_EXISTS; '
        "echo PWD=$(pwd)",
        envs={"INPUT_URI": "file:///tmp/x"},
        pool_env={"CHECKPOINTS_DIR": "/lustre/checkpoints"},
    )
    job_id = backend.submit(job)
    assert _wait(backend, job_id) == JobState.SUCCEEDED
    out = "\n".join(backend.log_tail(job_id, 50))
    assert "TASK=sky-" in out and job_id in out
    assert "NODES=1" in out and "RANK=0" in out and "GPUS=8" in out and "IPS=1" in out
    assert "INPUT=file:///tmp/x" in out
    # Cluster paths of the pool are mapped under the local home, never the real /lustre.
    assert f"CKPT={backend.home}/pools/h200/lustre/checkpoints" in out and "CKPT_EXISTS" in out
    assert f"PWD={PROJECT_ROOT}" in out


def test_a_step_waiting_for_its_job_wakes_when_the_job_ends_not_at_its_next_look(backend):
    """The wait loop looks at a job every ``poll_interval_s`` (here 30 s); on the local backend it also wakes the
    moment the job's runner exits, with the job's verdict and its last lines."""
    from gpudoor_pipelines.launch.config import LaunchSettings
    from gpudoor_pipelines.launch.launcher import Launcher
    from gpudoor_pipelines.launch.resolve.fleet import load_fleet
    from gpudoor_pipelines.launch.watch import Hooks

    launcher = Launcher(backend, load_fleet(), LaunchSettings(poll_interval_s=30.0, max_poll_interval_s=30.0))
    lines: list[str] = []
    job_id = backend.submit(_job("sleep 0.5; echo last line"))
    started = time.monotonic()
    watched = launcher.wait([job_id], Hooks(line=lines.append))
    waited = time.monotonic() - started
    assert watched.infos[job_id].state is JobState.SUCCEEDED and lines[-1] == "last line"
    assert waited < 15, f"the end was noticed {waited:.1f} s after the wait began: at a look, not at the job's end"


def test_one_process_per_node_rank(backend):
    job_id = backend.submit(_job("echo rank=$SKYPILOT_NODE_RANK of $SKYPILOT_NUM_NODES port=$MASTER_PORT", num_nodes=3))
    assert _wait(backend, job_id) == JobState.SUCCEEDED
    lines = backend.log_tail(job_id)
    ranks = sorted(line.split("rank=")[1].split()[0] for line in lines if "rank=" in line)
    assert ranks == ["0", "1", "2"]
    ports = {line.split("port=")[1] for line in lines if "port=" in line}
    assert len(ports) == 1 and ports.pop().isdigit()


def test_setup_runs_before_run(backend):
    job_id = backend.submit(
        _job(
            "cat $GPUDOOR_HOME_MARK",
            setup="echo from-setup > $GPUDOOR_HOME_MARK",
            envs={"GPUDOOR_HOME_MARK": str(backend.home / "mark")},
        )
    )
    assert _wait(backend, job_id) == JobState.SUCCEEDED
    assert "from-setup" in backend.log_tail(job_id)


def test_failed_run_reports_exit_code_and_tail(backend):
    job_id = backend.submit(_job("for i in 1 2 3; do echo line-$i; done; echo boom >&2; exit 7"))
    assert _wait(backend, job_id) == JobState.FAILED
    info = backend.status(job_id)
    assert "7" in info.detail
    assert backend.log_tail(job_id, 2) == ["line-3", "boom"]


def test_failed_setup(backend):
    job_id = backend.submit(_job("echo never", setup="echo setting-up; exit 3"))
    assert _wait(backend, job_id) == JobState.FAILED_SETUP
    assert "never" not in backend.log_tail(job_id)


def test_secrets_reach_the_job_but_not_the_disk(backend):
    job_id = backend.submit(_job('test "$TOKEN" = "s3cr3t"-value && echo has-token', secrets={"TOKEN": "s3cr3t-value"}))
    assert _wait(backend, job_id) == JobState.SUCCEEDED
    assert "has-token" in backend.log_tail(job_id)
    for f in backend.job_dir(job_id).iterdir():
        assert "s3cr3t-value" not in f.read_text(errors="replace"), f.name


def _pids_alive(pids):
    return [
        p
        for p in pids
        if Path(f"/proc/{p}").exists() and "Z" not in Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[0]
    ]


def test_cancel_kills_the_whole_process_tree(backend, tmp_path):
    pidfile = tmp_path / "pids"
    # Each rank starts a grandchild in the background, then waits.
    run = f"sleep 300 & echo $! >> {pidfile}; echo $$ >> {pidfile}; echo started; wait"
    job_id = backend.submit(_job(run, num_nodes=2))
    deadline = time.time() + 30
    while time.time() < deadline and (not pidfile.exists() or len(pidfile.read_text().split()) < 4):
        time.sleep(0.1)
    pids = [int(p) for p in pidfile.read_text().split()]
    assert len(_pids_alive(pids)) == 4
    backend.cancel(job_id)
    assert backend.status(job_id).state == JobState.CANCELLED
    deadline = time.time() + 10
    while time.time() < deadline and _pids_alive(pids):
        time.sleep(0.1)
    assert _pids_alive(pids) == []


def test_runner_that_dies_is_a_controller_failure(backend):
    job_id = backend.submit(_job("sleep 300"))
    deadline = time.time() + 20
    while backend.status(job_id).state != JobState.RUNNING and time.time() < deadline:
        time.sleep(0.1)
    import json
    import signal

    runner = json.loads((backend.job_dir(job_id) / "runner.json").read_text())
    os.killpg(runner["pgid"], signal.SIGKILL)
    assert _wait(backend, job_id) == JobState.FAILED_CONTROLLER


def test_usage_counts_running_jobs(backend):
    job_id = backend.submit(_job("sleep 300", num_nodes=2))
    deadline = time.time() + 20
    while backend.status(job_id).state not in (JobState.RUNNING,) and time.time() < deadline:
        time.sleep(0.1)
    assert backend.usage().gpus == {"h200": 16}
    backend.cancel(job_id)
    assert backend.usage().gpus == {}


def test_usage_counts_cpu_jobs_in_vcpus_and_gpus_per_user(backend):
    cpu = ResolvedJob(
        name="prep",
        config={"name": "prep", "resources": {"cpus": "6+"}, "num_nodes": 2, "run": "sleep 300"},
        workdir=str(PROJECT_ROOT),
        pool="ondemand",
    )
    gpu = ResolvedJob(
        name="mine",
        config={
            "name": "mine",
            "resources": {"accelerators": "L4:2", "labels": {"gpudoor-user": "ada"}},
            "run": "sleep 300",
        },
        workdir=str(PROJECT_ROOT),
        pool="inference",
    )
    ids = [backend.submit(cpu), backend.submit(gpu)]
    usage = backend.usage()
    assert usage.vcpus == {"ondemand": 12} and usage.gpus == {"inference": 2}
    assert usage.user_gpus == {("ada", "inference"): 2}
    for job_id in ids:
        backend.cancel(job_id)


def test_service_gets_a_free_loopback_port_and_stops(backend):
    job = ResolvedJob(
        name="lab-x",
        config={
            "name": "demo",
            "resources": {"accelerators": "L4:1", "ports": 8000},
            "envs": {"PORT": "8000"},
            "run": "exec python -m http.server --bind $SERVE_HOST $PORT",
        },
        workdir=str(PROJECT_ROOT),
        pool="inference",
        cluster_name="lab-x",
    )
    service = backend.start_service(job)
    job_id = service.job_id
    deadline = time.time() + 30
    url = None
    while time.time() < deadline and not url:
        url = service.url(8000)
        time.sleep(0.2)
    assert url and url.startswith("http://127.0.0.1:") and not url.endswith(":8000")
    assert backend.clusters() == {"lab-x": job_id}
    assert backend.stop_service("lab-x") is True
    assert backend.status(job_id).state == JobState.CANCELLED
    assert backend.clusters() == {}


# ----------------------------------------------------------------- warm pools
# (sky.jobs.pool_apply + launch(pool=, num_jobs=))
def _pool_job(run: str, *, setup: str | None = None, gpus: int = 1):
    job = _job(run, setup=setup)
    job.config["resources"] = {"accelerators": {"L4": gpus}, "labels": {"gpudoor-user": "ana"}}
    return ResolvedJob(
        name="batch", config=job.config, workdir=job.workdir, pool="onprem", labels={"gpudoor-user": "ana"}
    )


def _wait_all(backend: LocalBackend, ids: list[str], timeout: float = 60) -> tuple[dict[str, JobState], int]:
    """Final states, and the most jobs seen running at once."""
    deadline, most = time.time() + timeout, 0
    while time.time() < deadline:
        infos = backend.statuses(ids)
        most = max(most, sum(i.state in (JobState.STARTING, JobState.RUNNING) for i in infos.values()))
        if len(infos) == len(ids) and all(i.state.is_terminal for i in infos.values()):
            return {k: v.state for k, v in infos.items()}, most
        time.sleep(0.05)
    raise AssertionError(f"batch not finished after {timeout}s: {backend.statuses(ids)}")


def test_pool_runs_ranks_on_warm_workers(backend, tmp_path):
    marker = tmp_path / "setups"
    ids = backend.submit_batch(
        _pool_job("echo rank=$SKYPILOT_JOB_RANK of=$SKYPILOT_NUM_JOBS; sleep 0.3", setup=f"echo x >> {marker}"),
        6,
        pool_name="p",
        workers=2,
    )
    states, most = _wait_all(backend, ids)
    assert set(states.values()) == {JobState.SUCCEEDED}
    assert most <= 2  # never more jobs at once than workers
    assert [backend.log_tail(i, 5)[-1] for i in ids] == [f"rank={r} of=6" for r in range(6)]
    assert len(marker.read_text().splitlines()) == 2  # the setup ran once per worker, not once per job


def test_pool_workers_hold_their_gpus_until_released(backend):
    ids = backend.submit_batch(_pool_job("sleep 0.2", gpus=1), 2, pool_name="p", workers=3)
    assert backend.usage().gpus == {"onprem": 3} and backend.usage().user_gpus == {("ana", "onprem"): 3}
    _wait_all(backend, ids)
    backend.release_pool("p")
    deadline = time.time() + 10
    while backend.usage().gpus and time.time() < deadline:
        time.sleep(0.1)
    assert backend.usage().gpus == {}


def test_pool_rank_failure_and_cancel_leave_the_others(backend):
    ids = backend.submit_batch(
        _pool_job('[ "$SKYPILOT_JOB_RANK" = 1 ] && exit 3; [ "$SKYPILOT_JOB_RANK" = 2 ] && sleep 60; true'),
        4,
        pool_name="p",
        workers=2,
    )
    deadline = time.time() + 30
    while backend.status(ids[2]).state != JobState.RUNNING and time.time() < deadline:
        time.sleep(0.05)
    backend.cancel(ids[2])
    states, _ = _wait_all(backend, ids)
    assert [states[i] for i in ids] == [JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED, JobState.SUCCEEDED]


def test_released_pool_cancels_queued_jobs(backend):
    ids = backend.submit_batch(_pool_job("sleep 1"), 5, pool_name="p", workers=1)
    backend.release_pool("p")
    states, _ = _wait_all(backend, ids)
    assert JobState.CANCELLED in states.values() and states[ids[-1]] == JobState.CANCELLED


def test_pool_whose_supervisor_dies_fails_its_jobs(backend):
    import json
    import signal

    ids = backend.submit_batch(_pool_job("sleep 30"), 3, pool_name="p", workers=1)
    pid = json.loads((backend.pool_dir("p") / "supervisor.json").read_text())["pid"]
    os.kill(pid, signal.SIGKILL)
    states, _ = _wait_all(backend, ids)
    assert JobState.FAILED_CONTROLLER in states.values()
    for job_id in ids:  # nothing of the pool keeps running
        pgid = json.loads((backend.job_dir(job_id) / "runner.json").read_text()).get("pgid")
        if pgid:
            os.killpg(pgid, signal.SIGKILL) if _group_exists(pgid) else None


def _group_exists(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True
