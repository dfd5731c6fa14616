"""End-to-end fixtures: one real ``dagster dev`` for the session, and Debian's headless Chromium driving its UI.

The server gets its own DAGSTER_HOME and GPUDOOR_HOME (never the developer's ~/.gpudoor), listens on
127.0.0.1 only, and is stopped at the end of the session with everything it started in its process
group. Screenshots, and the server's own log, go to ``$GPUDOOR_E2E_ARTIFACTS`` (default
``artifacts/e2e/`` in the repository) so that CI can leave them behind for people to look at.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

PROJECT_ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    # Nothing but this machine: every other host name fails to resolve.
    "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
]
# How long the page may take to show a thing: a loaded CI runner renders the UI slowly.
EXPECT_TIMEOUT_MS = 60_000
RUN_TIMEOUT_S = 300
# No telemetry, no welcome modal (it covers the page and calls out); queued runs start within a second.
DAGSTER_YAML = """\
telemetry:
  enabled: false
nux:
  enabled: false
run_queue:
  dequeue_interval_seconds: 1
"""
SERVER_READY_TIMEOUT_S = 180
# A small dataset: 4 shards of 8 images.
DATASET_RUN_CONFIG = {"ops": {"dataset_shards": {"config": {"num_images": 32, "shard_size": 8}}}}
LOCATION_NAME = "gpudoor_pipelines"
REPOSITORY_NAME = "__repository__"

_WORKSPACE_QUERY = """
{
  workspaceOrError {
    __typename
    ... on Workspace {
      locationEntries {
        name
        loadStatus
        locationOrLoadError { __typename ... on PythonError { message } }
      }
    }
  }
}
"""

_SENSOR_QUERY = """
query ($selector: SensorSelector!) {
  sensorOrError(sensorSelector: $selector) {
    __typename
    ... on Sensor { sensorState { id status } }
  }
}
"""

_STOP_SENSOR = """
mutation ($id: String!) {
  stopSensor(id: $id) {
    __typename
    ... on StopSensorMutationResult { instigationState { status } }
    ... on PythonError { message }
  }
}
"""


def _in_ci() -> bool:
    return os.environ.get("CI", "").lower() == "true"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _restore_default_signals() -> None:
    # Started from a non-interactive shell, `dagster dev` inherits "ignore SIGINT" (and ignores
    # SIGTERM itself): without this it could not be stopped cleanly.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


@dataclass
class DagsterServer:
    """A running ``dagster dev``: where it listens and which homes it uses."""

    port: int
    dagster_home: Path
    gpudoor_home: Path
    log_path: Path
    process: subprocess.Popen

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def graphql(self, query: str, variables: dict | None = None, timeout: float = 30.0) -> dict:
        """POSTs a query to the server's /graphql and returns ``data`` (fails on GraphQL errors)."""
        body = json.dumps({"query": query, "variables": variables or {}}).encode()
        req = urllib.request.Request(f"{self.url}/graphql", data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            payload = json.loads(resp.read())
        if payload.get("errors"):
            raise AssertionError(f"GraphQL errors: {payload['errors']}")
        return payload["data"]

    @functools.cached_property
    def client(self):
        """The GraphQL client an agent or a script would use."""
        from dagster_graphql import DagsterGraphQLClient

        return DagsterGraphQLClient("127.0.0.1", port_number=self.port)

    @functools.cached_property
    def instance(self):
        """The server's DagsterInstance, read from its DAGSTER_HOME (not this process's)."""
        import dagster as dg

        return dg.DagsterInstance.from_config(str(self.dagster_home))

    def submit(
        self,
        assets: list[str],
        partition: str | None = None,
        run_config: dict | None = None,
        in_process: bool = True,
    ) -> str:
        """Submits an ``__ASSET_JOB`` run through the GraphQL client; returns its run id.

        ``in_process`` runs the step in the run's own process (one Python start instead of two).
        """
        config = dict(run_config or {})
        if in_process:
            config.setdefault("execution", {"config": {"in_process": {}}})
        return self.client.submit_job_execution(
            "__ASSET_JOB",
            asset_selection=assets,
            run_config=config,
            tags={"dagster/partition": partition} if partition else None,
        )

    def submit_range(self, assets: list[str], first: str, last: str) -> str:
        """Submits one run over the partition range ``first``..``last`` (how the nightly schedule runs shards)."""
        return self.client.submit_job_execution(
            "__ASSET_JOB",
            asset_selection=assets,
            run_config={"execution": {"config": {"in_process": {}}}},
            tags={"dagster/asset_partition_range_start": first, "dagster/asset_partition_range_end": last},
        )

    def wait_for_run(self, run_id: str, timeout_s: float = RUN_TIMEOUT_S):
        """Polls the run's status through GraphQL until it ends; returns the final DagsterRunStatus."""
        from dagster import DagsterRunStatus

        ended = {DagsterRunStatus.SUCCESS, DagsterRunStatus.FAILURE, DagsterRunStatus.CANCELED}
        deadline = time.monotonic() + timeout_s
        status = None
        while time.monotonic() < deadline:
            status = self.client.get_run_status(run_id)
            if status in ended:
                return status
            time.sleep(0.5)
        raise AssertionError(f"run {run_id} still {status} after {timeout_s:.0f} s")

    def run_failure_message(self, run_id: str) -> str:
        """The step failure messages of a run, for assertion messages."""
        return "\n".join(
            entry.dagster_event.event_specific_data.error.message
            for entry in self.instance.all_logs(run_id)
            if entry.dagster_event is not None and entry.dagster_event.event_type_value == "STEP_FAILURE"
        )

    def assert_success(self, run_id: str, timeout_s: float = RUN_TIMEOUT_S) -> None:
        from dagster import DagsterRunStatus

        status = self.wait_for_run(run_id, timeout_s)
        assert status == DagsterRunStatus.SUCCESS, f"run {run_id} ended {status}: {self.run_failure_message(run_id)}"

    def metadata(self, asset: str, partition: str | None = None) -> dict:
        """Metadata values of the latest materialization of an asset (or of one partition)."""
        import dagster as dg

        records = self.instance.fetch_materializations(
            dg.AssetRecordsFilter(asset_key=dg.AssetKey(asset), asset_partitions=[partition] if partition else None),
            limit=1,
        ).records
        assert records, f"{asset}{f' [{partition}]' if partition else ''} was never materialized"
        event = records[0].event_log_entry
        materialization = event.asset_materialization
        values = {k: v.value for k, v in materialization.metadata.items()}
        values["__run_id__"] = event.run_id
        return values

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no server log)"


def _location_status(server: DagsterServer) -> tuple[str | None, str | None]:
    """(loadStatus, load error message) of the project's code location, or (None, None)."""
    data = server.graphql(_WORKSPACE_QUERY, timeout=10)
    workspace = data["workspaceOrError"]
    for entry in workspace.get("locationEntries", []):
        if entry["name"] == LOCATION_NAME:
            error = entry.get("locationOrLoadError") or {}
            return entry["loadStatus"], error.get("message")
    return None, None


def _wait_until_loaded(server: DagsterServer) -> None:
    deadline = time.monotonic() + SERVER_READY_TIMEOUT_S
    last = "no answer yet"
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            pytest.fail(
                f"dagster dev exited with code {server.process.returncode} before it was ready.\n{server.log_tail()}"
            )
        try:
            status, error = _location_status(server)
        except (urllib.error.URLError, ConnectionError, TimeoutError, json.JSONDecodeError, OSError) as exc:
            last = f"{type(exc).__name__}: {exc}"
        else:
            if error:
                pytest.fail(f"code location {LOCATION_NAME} failed to load: {error}")
            if status == "LOADED":
                return
            last = f"location status {status}"
        time.sleep(0.5)
    pytest.fail(f"dagster dev not ready after {SERVER_READY_TIMEOUT_S} s ({last}).\n{server.log_tail()}")


def _stop_sensor(server: DagsterServer, name: str) -> None:
    """Stops a sensor, so that it launches nothing behind the tests' backs."""
    selector = {
        "repositoryLocationName": LOCATION_NAME,
        "repositoryName": REPOSITORY_NAME,
        "sensorName": name,
    }
    sensor = server.graphql(_SENSOR_QUERY, {"selector": selector})["sensorOrError"]
    assert sensor["__typename"] == "Sensor", sensor
    if sensor["sensorState"]["status"] != "RUNNING":
        return
    result = server.graphql(_STOP_SENSOR, {"id": sensor["sensorState"]["id"]})["stopSensor"]
    assert result["__typename"] == "StopSensorMutationResult", result
    assert result["instigationState"]["status"] == "STOPPED", result


def _stop_group(process: subprocess.Popen) -> None:
    if process.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGINT)
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pass
    # Whatever is left in the group (run workers, code server) goes too.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=10)


@pytest.fixture(scope="session")
def artifacts_dir() -> Path:
    """Where screenshots and the server log go; CI keeps this folder for people."""
    folder = Path(os.environ.get("GPUDOOR_E2E_ARTIFACTS") or PROJECT_ROOT / "artifacts" / "e2e")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@pytest.fixture(scope="session")
def dagster_server(tmp_path_factory, artifacts_dir) -> Iterator[DagsterServer]:
    """``dagster dev`` on 127.0.0.1 with its own homes; stopped, with its process group, at the end."""
    dagster_home = tmp_path_factory.mktemp("e2e_dagster_home")
    (dagster_home / "dagster.yaml").write_text(DAGSTER_YAML)
    gpudoor_home = tmp_path_factory.mktemp("e2e_gpudoor_home")
    # The embedded default only: no setting of the developer's (backend, bucket, API server) leaks in.
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("GPUDOOR_", "SKYPILOT_API_SERVER", "SKYPILOT_SERVICE_ACCOUNT"))
    }
    env.update(
        {
            "DAGSTER_HOME": str(dagster_home),
            "GPUDOOR_HOME": str(gpudoor_home),
            "SKYPILOT_DISABLE_USAGE_COLLECTION": "1",
            "DAGSTER_DISABLE_TELEMETRY": "1",
            "PYTHONUNBUFFERED": "1",
        }
    )
    port = _free_port()
    log_path = artifacts_dir / "dagster-dev.log"
    dagster = Path(sys.executable).parent / "dagster"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [str(dagster), "dev", "-h", "127.0.0.1", "-p", str(port), "-w", "workspace.yaml"],
            cwd=PROJECT_ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_restore_default_signals,
        )
    server = DagsterServer(port, dagster_home, gpudoor_home, log_path, process)
    try:
        _wait_until_loaded(server)
        # Evals are requested explicitly by the tests; the sensor would add runs of its own.
        _stop_sensor(server, "new_checkpoint_sensor")
        yield server
    finally:
        _stop_group(process)
        if "instance" in server.__dict__:
            server.instance.dispose()


@pytest.fixture
def dataset_ready(dagster_server) -> None:
    """dataset_shards is materialized (submitted through GraphQL if no earlier test did it)."""
    import dagster as dg

    if dagster_server.instance.get_latest_materialization_event(dg.AssetKey("dataset_shards")) is None:
        dagster_server.assert_success(dagster_server.submit(["dataset_shards"], run_config=DATASET_RUN_CONFIG))


@pytest.fixture(scope="session")
def browser(tmp_path_factory):
    """A persistent Chromium context (Debian's /usr/bin/chromium) with a fresh profile."""
    missing = None
    if not CHROMIUM.exists():
        missing = f"{CHROMIUM} is missing (apt-get install -y chromium chromium-driver)"
    else:
        try:
            import playwright.sync_api  # noqa: F401
        except ImportError:
            missing = "the playwright Python package is missing (pip install playwright; no `playwright install`)"
    if missing:
        if _in_ci():
            pytest.fail(f"UI tests cannot run in CI: {missing}")
        pytest.skip(f"UI tests need a browser: {missing}")

    from playwright.sync_api import expect, sync_playwright

    expect.set_options(timeout=EXPECT_TIMEOUT_MS)
    with sync_playwright() as pw:
        context = pw.chromium.launch_persistent_context(
            str(tmp_path_factory.mktemp("chromium_profile")),
            executable_path=str(CHROMIUM),
            headless=True,
            args=CHROMIUM_ARGS,
            viewport={"width": 1600, "height": 1000},
        )
        context.set_default_timeout(EXPECT_TIMEOUT_MS)
        try:
            yield context
        finally:
            context.close()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    setattr(item, f"rep_{report.when}", report)


@pytest.fixture
def page(browser, dagster_server, artifacts_dir, request):
    """A fresh tab; on a failed test its last state is saved as ``FAILED-<test>.png``."""
    tab = browser.new_page()
    try:
        yield tab
    finally:
        report = getattr(request.node, "rep_call", None)
        if report is not None and report.failed:
            with contextlib.suppress(Exception):
                tab.screenshot(path=str(artifacts_dir / f"FAILED-{request.node.name}.png"), full_page=True)
        tab.close()


def pytest_collection_modifyitems(session, config, items):
    """The UI tests run first: they caption a shard nobody captioned yet (so its progress lines show),
    and the GraphQL test then reuses what they materialized. Other tests keep their places."""
    here = Path(__file__).parent
    slots = [i for i, item in enumerate(items) if Path(str(item.path)).parent == here]
    ordered = sorted((items[i] for i in slots), key=lambda item: Path(str(item.path)).name != "test_ui.py")
    for slot, item in zip(slots, ordered, strict=True):
        items[slot] = item
