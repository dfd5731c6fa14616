"""The API server plugin: the managed-jobs table read in the request's process, with SkyPilot's own answer.

Real SkyPilot: its managed-jobs tables in a fresh state folder, its plugin loader, and its controller's
table program run as SkyPilot runs it (a Python process). Only the API server around them is left out:
the plugin runs where the server runs it, in a request executor.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from tests.conftest import PROJECT_ROOT, python_json

_SCRIPT = """
import json, os, subprocess, sys
from sky.jobs import runner, state, utils
from sky.server import plugins

ids = []
for name, resources in (("caption-night-3", "1x[L4:1]"), ("train-h200", "2x[H200:8]")):
    job_id = state.set_job_info_without_job_id(name, "default", "gpudoor", None, None, "abcd1234")
    state.set_pending(job_id, 0, name, resources, "{}")
    ids.append(job_id)

from sky.serve import runner as pool_runner, serve_state, serve_utils
serve_state.add_service(
    "gpudoor-caption-ab12cd34", controller_job_id=ids[0], policy="fixed 2", requested_resources_str="1x[L4:1]",
    load_balancing_policy="round_robin", status=serve_state.ServiceStatus.READY, tls_encrypted=False, pool=True,
    controller_pid=1, entrypoint="gpudoor",
)
version = serve_state.add_version("gpudoor-caption-ab12cd34")
pool_yaml = serve_utils.generate_task_yaml_file_name("gpudoor-caption-ab12cd34", version)
os.makedirs(os.path.dirname(pool_yaml), exist_ok=True)
with open(pool_yaml, "w") as f:
    f.write("resources: {accelerators: L4:1}\\nservice: {pool: {workers: 2}}\\n")

plugins.load_plugins(plugins.ExtensionContext(context=plugins.PluginContext.EXECUTOR))

class NoProcess:
    def run_on_head(self, *args, **kwargs):
        raise AssertionError("the table was read by starting a process on the controller")

query = dict(
    skip_finished=False, accessible_workspaces=["default"], job_ids=ids[1:], workspace_match=None,
    name_match=None, pool_match=None, infra_match=None, page=None, limit=None, user_hashes=None,
    statuses=None, fields=None, sort_by=None, sort_order=None, submitted_after=None, submitted_before=None,
)
ours = runner.current().fetch_managed_job_table(handle=None, backend=NoProcess(), **query)
# What SkyPilot's default runner runs on the controller, as a process of its own.
code = utils.ManagedJobCodeGen.get_job_table(**query)
done = subprocess.run(["bash", "-c", code], capture_output=True, text=True)
assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
theirs = utils.load_managed_job_queue(done.stdout)
pools = pool_runner.current().get_service_status(handle=None, service_names=None, pool=True)
done = subprocess.run(["bash", "-c", serve_utils.ServeCodeGen.get_service_status(None, pool=True)],
                      capture_output=True, text=True)
assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
pools_theirs = serve_utils.load_service_status(done.stdout)
jobs, total = ours[0], ours[1]
print(json.dumps({
    "runner": type(runner.current()).__module__ + "." + type(runner.current()).__name__,
    "same": repr(ours) == repr(theirs),
    "names": [job["job_name"] for job in jobs],
    "statuses": [str(job["status"].value) for job in jobs],
    "total": total,
    "cancel": callable(runner.current().cancel_managed_jobs),
    "pool_runner": type(pool_runner.current()).__name__,
    "same_pools": repr(pools) == repr(pools_theirs),
    "pools": [(p["name"], str(p["status"].value), "accelerators: L4:1" in p["pool_yaml"]) for p in pools],
}))
"""


def _run(tmp_path: Path) -> dict:
    home = tmp_path / "home"
    (home / ".sky").mkdir(parents=True, exist_ok=True)
    env = dict(
        HOME=str(home),
        # The deployment's plugins file, as the server reads it.
        SKYPILOT_SERVER_PLUGINS_CONFIG=str(PROJECT_ROOT / "deploy" / "skypilot" / "plugins.yaml"),
        # The controller's table program finds this interpreter (SkyPilot's `which python3`).
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        PYTHONPATH=str(PROJECT_ROOT),
        # SkyPilot's own switch for "the jobs controller runs in this server" (consolidation mode).
        IS_SKYPILOT_JOB_CONTROLLER="1",
    )
    return python_json(_SCRIPT, env, drop=("SKYPILOT_API_SERVER", "SKYPILOT_GLOBAL_CONFIG", "SKYPILOT_CONFIG"))


def test_the_jobs_and_pools_tables_are_skypilots_own_answer_read_without_a_process_when_the_controller_is_in_the_server(
    tmp_path,
):
    result = _run(tmp_path)
    assert result["runner"] == "gpudoor_pipelines.launch.server.plugin.InProcessJobTable"
    assert result["same"], "the plugin's table differs from the one SkyPilot's controller process prints"
    assert result["names"] == ["train-h200"] and result["total"] == 1  # the query's filter applied
    assert result["statuses"] == ["PENDING"]
    assert result["cancel"]  # what the plugin does not read itself goes to SkyPilot's runner
    # The warm pools' table the same way (``sky.jobs.pool_status``).
    assert result["pool_runner"] == "InProcessPoolStatus"
    assert result["same_pools"], "the plugin's pool table differs from the one SkyPilot's controller process prints"
    assert result["pools"] == [["gpudoor-caption-ab12cd34", "READY", True]]  # with the pool's task


def test_where_the_controller_runs_apart_the_table_is_read_the_way_skypilot_reads_it(monkeypatch):
    from sky.jobs import utils as managed_job_utils

    from gpudoor_pipelines.launch.server.plugin import InProcessJobTable

    asked = []

    class SkyPilotsRunner:
        def fetch_managed_job_table(self, **kwargs):
            asked.append(kwargs)
            return "the controller's answer"

    monkeypatch.setattr(managed_job_utils, "is_consolidation_mode", lambda: False)
    table = InProcessJobTable(SkyPilotsRunner())
    answer = table.fetch_managed_job_table(handle="controller", backend="ssh", skip_finished=True)
    assert answer == "the controller's answer"
    assert asked == [{"handle": "controller", "backend": "ssh", "skip_finished": True}]
