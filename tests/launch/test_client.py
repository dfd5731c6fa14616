"""The SkyPilot Pipes client on the local backend, inside real Dagster runs: logs, metadata, failures,
bad input before launch, re-attaching to a running job, and cancellation when the run is terminated."""

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import dagster as dg
import yaml

from gpudoor_pipelines.launch.backends.local import LocalBackend
from gpudoor_pipelines.launch.client import LaunchConfig, PipesSkyPilotClient
from gpudoor_pipelines.launch.job import JobState
from gpudoor_pipelines.transit.resource import TransitBucketResource
from tests.conftest import PROJECT_ROOT


def _specs(tmp_path: Path, run: str, envs: dict | None = None) -> Path:
    specs = tmp_path / "specs"
    specs.mkdir(exist_ok=True)
    body = {"name": "probe", "resources": {"accelerators": {"RTX6000-Ada": 1, "L4": 1}}, "run": run}
    if envs:
        body["envs"] = envs
    (specs / "caption.yaml").write_text(yaml.safe_dump(body))
    return specs


def _resource(tmp_path: Path, specs: Path) -> PipesSkyPilotClient:
    return PipesSkyPilotClient(
        specs_dir=str(specs),
        local_home=str(tmp_path / "home"),
        poll_interval_s=0.2,
        transit=TransitBucketResource(local_root=str(tmp_path / "transit")),
    )


def _asset(name="probe_asset"):
    @dg.asset(name=name)
    def probe(
        context: dg.AssetExecutionContext, config: LaunchConfig, skypilot: PipesSkyPilotClient
    ) -> dg.MaterializeResult:
        request = skypilot.request(context, "caption", inputs={"OUTPUT_URI": "file:///nowhere"}, config=config)
        return skypilot.run(context=context, request=request).get_materialize_result()

    return probe


def test_launch_streams_logs_and_records_metadata(tmp_path):
    specs = _specs(tmp_path, "for i in 1 2 3; do echo probe-line-$i; done; echo pool=$GPUDOOR_POOL")
    with dg.instance_for_test() as instance:
        result = dg.materialize([_asset()], resources={"skypilot": _resource(tmp_path, specs)}, instance=instance)
        assert result.success
        logs = [e.user_message for e in instance.all_logs(result.run_id)]
        assert "probe-line-2" in logs and "pool=onprem" in logs
        md = result.asset_materializations_for_node("probe_asset")[0].metadata
        assert md["pool"].value == "onprem" and md["accelerators"].value == "RTX6000-Ada:1"
        assert md["status"].value == "SUCCEEDED" and md["backend"].value == "local"
        for key in ("job_id", "infra", "gpu_hours", "cost_usd_estimate", "running_s", "route"):
            assert key in md
        tags = instance.get_run_by_id(result.run_id).tags
        assert any(k.startswith("gpudoor/job-") and v == f"local:{md['job_id'].value}" for k, v in tags.items())


def test_failed_job_fails_the_step_with_its_log_tail(tmp_path):
    specs = _specs(tmp_path, "echo about-to-fail; echo 'bad thing happened' >&2; exit 3")
    result = dg.materialize([_asset()], resources={"skypilot": _resource(tmp_path, specs)}, raise_on_error=False)
    assert not result.success
    (failure,) = [e for e in result.all_events if e.is_step_failure]
    text = failure.step_failure_data.user_failure_data.description
    assert "ended FAILED" in text and "exited with 3" in text
    assert "bad thing happened" in text and "about-to-fail" in text


def test_undeclared_env_override_fails_before_anything_launches(tmp_path):
    specs = _specs(tmp_path, "echo hi", envs={"CAPTION_MODEL": "x"})
    result = dg.materialize(
        [_asset()],
        resources={"skypilot": _resource(tmp_path, specs)},
        run_config={"ops": {"probe_asset": {"config": {"env": {"CAPTION_MODL": "y"}}}}},
        raise_on_error=False,
    )
    assert not result.success
    (failure,) = [e for e in result.all_events if e.is_step_failure]
    text = failure.step_failure_data.user_failure_data.description
    assert text.startswith("Nothing was launched.") and "env.CAPTION_MODL" in text and "CAPTION_MODEL" in text
    assert not (tmp_path / "home" / "jobs").exists() or not any((tmp_path / "home" / "jobs").iterdir())


def test_unknown_pool_tag_fails_before_anything_launches(tmp_path):
    specs = _specs(tmp_path, "echo hi")
    result = dg.materialize(
        [_asset()],
        resources={"skypilot": _resource(tmp_path, specs)},
        tags={"gpudoor/pool": "nowhere"},
        raise_on_error=False,
    )
    assert not result.success
    (failure,) = [e for e in result.all_events if e.is_step_failure]
    assert "unknown pool 'nowhere'" in failure.step_failure_data.user_failure_data.description
    assert not (tmp_path / "home" / "jobs").exists()


def test_retried_step_reattaches_to_the_running_job(tmp_path):
    specs = _specs(tmp_path, "echo should-not-run-twice")
    backend = LocalBackend(home=tmp_path / "home")
    # A job from an earlier attempt of the same step, still running: it ends once the step said it re-attached
    # (a fixed sleep could end before a loaded machine starts the step).
    from gpudoor_pipelines.launch.resolve.request import ResolvedJob

    reattached = tmp_path / "reattached"
    until_reattached = f"for i in $(seq 600); do [ -e {reattached} ] && break; sleep 0.2; done"
    earlier = backend.submit(
        ResolvedJob(
            name="earlier",
            config={
                "name": "earlier",
                "resources": {"accelerators": "L4:1"},
                "run": f"{until_reattached}; echo earlier-attempt-done",
            },
            workdir=str(PROJECT_ROOT),
            pool="onprem",
        )
    )
    with dg.instance_for_test() as instance:

        def mark_when_reattached() -> None:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                for run in instance.get_runs():
                    if any("Re-attaching to job" in (e.user_message or "") for e in instance.all_logs(run.run_id)):
                        reattached.touch()
                        return
                time.sleep(0.2)

        watcher = threading.Thread(target=mark_when_reattached, daemon=True)
        watcher.start()
        result = dg.materialize(
            [_asset()],
            resources={"skypilot": _resource(tmp_path, specs)},
            instance=instance,
            tags={"gpudoor/job-probe-asset-caption": f"local:{earlier}"},
        )
        watcher.join(timeout=5)
        assert result.success
        logs = [e.user_message for e in instance.all_logs(result.run_id)]
        assert any("Re-attaching to job" in m for m in logs)
        assert "earlier-attempt-done" in logs and "should-not-run-twice" not in logs
    assert len(list((tmp_path / "home" / "jobs").iterdir())) == 1


def test_terminating_the_run_cancels_the_job_and_its_processes(tmp_path):
    pidfile = tmp_path / "pids"
    specs = _specs(tmp_path, f"sleep 600 & echo $! >> {pidfile}; echo $$ >> {pidfile}; echo job-started; wait")
    script = tmp_path / "run.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import dagster as dg
            from tests.launch.test_client import _asset, _resource
            from pathlib import Path
            skypilot = _resource(Path({str(tmp_path)!r}), Path({str(specs)!r}))
            dg.materialize([_asset()], resources={{"skypilot": skypilot}})
            """
        )
    )
    proc = subprocess.Popen(
        [sys.executable, str(script)],
        cwd=PROJECT_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONPATH": str(PROJECT_ROOT)},
    )
    try:
        deadline = time.time() + 600  # a bound, not a timing: a loaded runner starts Dagster slowly
        while time.time() < deadline and (not pidfile.exists() or len(pidfile.read_text().split()) < 2):
            time.sleep(0.2)
        pids = [int(p) for p in pidfile.read_text().split()]
        proc.send_signal(signal.SIGINT)  # What Dagster sends a step when its run is terminated.
        out, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    text = out.decode(errors="replace")
    assert "cancelling job" in text
    backend = LocalBackend(home=tmp_path / "home")
    (job_dir,) = list(backend.jobs_root.iterdir())
    assert backend.status(job_dir.name).state == JobState.CANCELLED
    alive = [p for p in pids if Path(f"/proc/{p}").exists() and " Z " not in Path(f"/proc/{p}/stat").read_text()]
    assert alive == []


def test_job_env_json_has_no_secrets(tmp_path, monkeypatch):
    """Transit credentials reach the job as secrets: never in the job's stored task nor in the run log."""
    specs = _specs(tmp_path, 'test -n "$AWS_SECRET_ACCESS_KEY" && echo key-present; echo leak=$AWS_SECRET_ACCESS_KEY')
    transit = TransitBucketResource(local_root=str(tmp_path / "transit"))
    resource = _resource(tmp_path, specs)

    class _WithSecrets(type(transit.get_bucket())):
        def job_secrets(self):
            return {"AWS_SECRET_ACCESS_KEY": "TOPSECRET-abc123"}

    monkeypatch.setattr(TransitBucketResource, "get_bucket", lambda self: _WithSecrets(tmp_path / "transit"))
    with dg.instance_for_test() as instance:
        result = dg.materialize([_asset()], resources={"skypilot": resource}, instance=instance)
        logs = [e.user_message for e in instance.all_logs(result.run_id)]
    assert "key-present" in logs and "leak=****" in logs
    assert not any("TOPSECRET-abc123" in m for m in logs)
    for f in (tmp_path / "home" / "jobs").rglob("*.json"):
        assert "TOPSECRET-abc123" not in f.read_text()


def test_a_batch_reports_each_preemption_of_a_rank_once():
    """A rank seen entering RECOVERING is one preemption; a recovery count that rose between two polls
    (RECOVERING never seen) is one too; seeing it RUNNING again afterwards is none."""
    from gpudoor_pipelines.launch.job import JobInfo, JobState
    from gpudoor_pipelines.launch.record.goodput import report_preemptions as _report_preemptions

    def polls(*states: tuple[JobState, int]) -> list[tuple[int, float]]:
        seen, reported, before = [], {}, {}
        for state, recoveries in states:
            now = {"7": JobInfo(job_id="7", state=state, recoveries=recoveries)}
            _report_preemptions(
                ["7"], before, now, reported, lambda rank, info, at: seen.append((rank, info.recoveries))
            )
            before = now
        return seen

    R, RUN = JobState.RECOVERING, JobState.RUNNING
    assert polls((RUN, 0), (R, 0), (R, 1), (RUN, 1)) == [(0, 0)]
    assert polls((RUN, 0), (RUN, 1)) == [(0, 1)]  # recovered between two polls
    assert polls((RUN, 0), (R, 1), (RUN, 1), (R, 1), (RUN, 2)) == [(0, 1), (0, 1)]
    assert polls((RUN, 0), (RUN, 0), (JobState.SUCCEEDED, 0)) == []
    # A rank waiting for a new worker goes back and forth between RECOVERING and PENDING: one preemption.
    P = JobState.PENDING
    assert polls((RUN, 0), (P, 0), (R, 0), (P, 0), (R, 0), (P, 0), (R, 0), (RUN, 1)) == [(0, 0)]
