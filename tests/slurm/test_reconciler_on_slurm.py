"""Run workers that stop while their managed jobs run on the Slurm test bed: no GPU stays held.

Two runs, each executing in its own process (``dg.materialize``, as ``gpudoor flow`` runs), each with one
step watching a long managed job. One run is terminated (SIGINT, what Dagster sends a step): the step
cancels its job and verifies the release. The other process is killed with ``kill -9``: nothing forwards a
cancel, no run worker is left for Dagster's run monitoring, and the run would stay STARTED; the orphan
reconciler sees its process gone, marks the run failed and frees its job, while leaving the first run's job
alone as long as that run lives. Nothing is faked.
"""

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import dagster as dg
import pytest
import yaml

from gpudoor_pipelines.automation.reconciler import orphan_reconciler, release_held_gpus_job
from gpudoor_pipelines.launch.client import PipesSkyPilotClient
from tests.slurm.conftest import allocations_of, managed_record
from tests.slurm.test_client_on_slurm import BED_FLEET, REPO_ROOT, _spec_dir

#: The jobs' start is waited for within 600 s (a loaded runner), the rest within the test's own bounds.
pytestmark = [pytest.mark.slurm, pytest.mark.timeout(1500)]

#: How long after its process is killed the run's GPU must be free on Slurm: two reconciler ticks (a dry run,
#: then the one that marks the run failed and asks for the release), the cancel, and SkyPilot tearing the Slurm
#: allocation down. Measured on the 2-core bed with the run marked failed by hand: 69 s alone, up to 274 s
#: while the whole test suite loaded the machine.
RELEASE_BOUND_S = 360.0


def _allocated(record) -> bool:
    """Whether Slurm still has an allocation for the managed job's cluster."""
    return bool(allocations_of(record.job_name, record.job_id))


def _client(testbed, transit, tmp_path: Path, specs: Path, **reconciler) -> PipesSkyPilotClient:
    fleet = yaml.safe_load(BED_FLEET.read_text())
    fleet["reconciler"] = {"grace_minutes": 0, **reconciler}
    path = tmp_path / f"fleet-{len(reconciler)}.yaml"
    path.write_text(yaml.safe_dump(fleet))
    return PipesSkyPilotClient(
        backend="skypilot",
        api_server_endpoint=testbed.api_endpoint,
        fleet_file=str(path),
        specs_dir=str(specs),
        poll_interval_s=2.0,
        transit=transit,
    )


class _Worker:
    """A run worker in its own process: one step launching a long managed job, recorded in DAGSTER_HOME."""

    def __init__(self, testbed, transit, specs: Path, tmp_path: Path, name: str) -> None:
        script = tmp_path / f"{name}.py"
        script.write_text(
            textwrap.dedent(f"""
            import dagster as dg
            from pathlib import Path
            from tests.slurm.test_client_on_slurm import _probe_asset, _resource
            from gpudoor_pipelines.transit.resource import TransitBucketResource
            transit = TransitBucketResource.model_validate_json({transit.model_dump_json()!r})
            class Bed:
                api_endpoint = {testbed.api_endpoint!r}
            # On the bed's h200 pool: the other Slurm tests use onprem and inference.
            dg.materialize([_probe_asset({name!r})], instance=dg.DagsterInstance.get(),
                           run_config={{"ops": {{{name!r}: {{"config": {{"pool": "h200"}}}}}}}},
                           resources={{"skypilot": _resource(Bed, transit, Path({str(specs)!r}))}})
        """)
        )
        self.proc = subprocess.Popen(
            [sys.executable, str(script)],
            cwd=REPO_ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        )
        self.lines: list[str] = []
        self.reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True)
        self.reader.start()

    @property
    def text(self) -> str:
        return "".join(self.lines)

    def started(self) -> bool:
        assert self.proc.poll() is None, self.text[-3000:]
        return "bed-long-job-started" in self.text

    @property
    def job_id(self) -> str:
        return self.text.split("Submitted job ")[1].split(".")[0]


def test_a_terminated_run_and_a_killed_run_worker_leave_no_gpu_held(
    testbed, transit, tmp_path, slurm_queue, monkeypatch
):
    # This test's jobs are its own deployment's: the reconciler leaves any other job on the shared bed alone.
    monkeypatch.setenv("GPUDOOR_DEPLOYMENT", f"reconcile-test-{os.getpid()}")
    specs = _spec_dir(tmp_path, "echo bed-long-job-started; sleep 600")
    instance = dg.DagsterInstance.get()  # the test's own DAGSTER_HOME, shared with the workers
    t0 = time.monotonic()
    terminated, killed = (_Worker(testbed, transit, specs, tmp_path, name) for name in ("terminated", "killed"))
    try:
        deadline = time.time() + 600  # a bound, not a timing: two managed jobs started side by side
        while time.time() < deadline and not (terminated.started() and killed.started()):
            time.sleep(2)
        assert terminated.started() and killed.started(), (terminated.text[-2000:], killed.text[-2000:])
        print(f"both jobs running {time.monotonic() - t0:.0f} s into the test")
        orphan, live = managed_record(int(killed.job_id)), managed_record(int(terminated.job_id))
        # The jobs carry their runs' identity, signed by the launcher and kept by the bed's server.
        by_id = {r.run_id: r for r in instance.get_runs()}
        runs = {"killed": by_id[orphan.labels["dagster-run-id"]], "terminated": by_id[live.labels["dagster-run-id"]]}
        assert orphan.labels["dagster-asset"] == "killed" and orphan.labels["gpudoor-signature"]
        assert orphan.labels["dagster-deployment"] == os.environ["GPUDOOR_DEPLOYMENT"]
        assert orphan.labels["gpudoor-pool"] == live.labels["gpudoor-pool"] == "h200"

        killed.proc.kill()  # kill -9 of the run's process: nothing forwards a cancel, nobody marks the run
        killed.proc.wait(timeout=30)
        known_dead = time.monotonic()
        assert managed_record(int(killed.job_id)).status.value in ("RUNNING", "STARTING")
        assert instance.get_run_by_id(runs["killed"].run_id).status == dg.DagsterRunStatus.STARTED

        # Dry run: says what it would mark and release, and does neither.
        with dg.build_sensor_context(
            instance=instance, resources={"skypilot": _client(testbed, transit, tmp_path, specs, dry_run=True)}
        ) as context:
            dry = orphan_reconciler(context)
        said = dry.skip_reason.skip_message
        assert not dry.run_requests and f"job {killed.job_id}" in said and runs["killed"].run_id in said
        assert f"job {terminated.job_id}" not in said and runs["terminated"].run_id not in said
        assert managed_record(int(killed.job_id)).status.value in ("RUNNING", "STARTING")
        assert instance.get_run_by_id(runs["killed"].run_id).status == dg.DagsterRunStatus.STARTED

        client = _client(testbed, transit, tmp_path, specs)
        with dg.build_sensor_context(instance=instance, resources={"skypilot": client}) as context:
            (run_request,) = orphan_reconciler(context).run_requests
        assert instance.get_run_by_id(runs["killed"].run_id).status == dg.DagsterRunStatus.FAILURE
        assert instance.get_run_by_id(runs["terminated"].run_id).status == dg.DagsterRunStatus.STARTED
        releases = run_request.run_config["ops"]["release_held_gpus"]["config"]["releases"]
        assert {r["id"] for r in releases} == {killed.job_id}  # not the live run's job, nor other deployments'
        result = release_held_gpus_job.execute_in_process(
            run_config=run_request.run_config, instance=instance, resources={"skypilot": client}, tags=run_request.tags
        )
        assert result.success
        (record,) = result.output_for_node("release_held_gpus")
        assert record["confirmed"] and record["seen"][0] == f"job {killed.job_id}: CANCELLED"

        # The live run's job ran on through the reconciler's release; now its run is terminated (while the killed
        # run's allocation is torn down): the step cancels its job and verifies the release.
        assert managed_record(int(terminated.job_id)).status.value == "RUNNING"
        terminated.proc.send_signal(signal.SIGINT)  # what Dagster does to a step when its run is terminated

        while _allocated(orphan) and time.monotonic() - known_dead < RELEASE_BOUND_S:
            time.sleep(2)
        released_s = time.monotonic() - known_dead
        assert not _allocated(orphan), slurm_queue()
        assert released_s < RELEASE_BOUND_S
        print(f"the killed run's GPU free on Slurm {released_s:.0f} s after its process was killed")
        assert (
            instance.get_run_by_id(runs["killed"].run_id)
            .tags[f"gpudoor/released-job-{killed.job_id}"]
            .startswith("confirmed in")
        )

        terminated.proc.wait(timeout=300)
        terminated.reader.join(timeout=10)
        text = terminated.text
        assert "cancelling job" in text and "released, confirmed in" in text and ": CANCELLED" in text, text[-3000:]
        tags = instance.get_run_by_id(runs["terminated"].run_id).tags
        assert tags[f"gpudoor/released-job-{terminated.job_id}"].startswith("confirmed in")
        deadline = time.time() + 120
        while time.time() < deadline and _allocated(live):
            time.sleep(3)
        assert not _allocated(live), slurm_queue()
    finally:
        import sky

        for worker in (terminated, killed):
            worker.proc.kill()
        ids = [int(w.job_id) for w in (terminated, killed) if "Submitted job " in w.text]
        if ids:  # a failed test leaves no job running on the shared bed
            sky.get(sky.jobs.cancel(job_ids=ids))
