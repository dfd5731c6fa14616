"""Fixtures for tests that run real SkyPilot managed jobs on the local Slurm test bed.

The bed (testbed/up.sh) is a one-machine Slurm cluster reached over SSH on 127.0.0.1 plus a
SkyPilot API server whose managed-jobs controller runs in consolidation mode. ``testbed``
brings it up when it is not already answering (needs root) and loads the client settings
from testbed/.state/env into ``os.environ`` for the session. ``GPUDOOR_SKIP_SLURM=1`` skips
every test that uses it.
"""

from __future__ import annotations

import fcntl
import json
import os
import shlex
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
TESTBED_DIR = REPO_ROOT / "testbed"
ENV_FILE = TESTBED_DIR / ".state" / "env"
UP_TIMEOUT_S = float(os.environ.get("GPUDOOR_TESTBED_UP_TIMEOUT", "900"))

# Managed-job statuses after which nothing changes any more.
TERMINAL_STATUSES = frozenset(
    {
        "SUCCEEDED",
        "CANCELLED",
        "FAILED",
        "FAILED_SETUP",
        "FAILED_PRECHECKS",
        "FAILED_NO_RESOURCE",
        "FAILED_CONTROLLER",
    }
)


def parse_env_file(path: Path) -> dict[str, str]:
    """The ``export KEY=VALUE`` lines of testbed/.state/env."""
    env: dict[str, str] = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line.startswith("export "):
            continue
        key, _, value = line[len("export ") :].partition("=")
        parts = shlex.split(value) if value else [""]
        env[key.strip()] = parts[0] if parts else ""
    return env


def _server_healthy(endpoint: str) -> bool:
    try:
        with urllib.request.urlopen(f"{endpoint}/api/health", timeout=5) as resp:
            body = json.loads(resp.read() or b"{}")
        return resp.status == 200 and body.get("status", "healthy") == "healthy"
    except Exception:  # noqa: BLE001 - any failure means "not up"
        return False


def _slurm_up() -> bool:
    try:
        out = subprocess.run(["scontrol", "ping"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return "UP" in out.stdout


def _bed_is_up() -> bool:
    if not ENV_FILE.exists():
        return False
    env = parse_env_file(ENV_FILE)
    endpoint = env.get("SKYPILOT_API_SERVER_ENDPOINT")
    # up.sh leaves this marker once SkyPilot saw both partitions.
    ready = Path(env.get("GPUDOOR_TESTBED_ROOT", "/nonexistent"), "run", "api-server.ready")
    return bool(endpoint) and ready.exists() and _server_healthy(endpoint) and _slurm_up()


def squeue() -> list[dict[str, str]]:
    """Slurm's job list (pending/running/completing jobs of every user)."""
    fields = ["job_id", "name", "user", "partition", "state", "gres", "nodes"]
    out = subprocess.run(
        ["squeue", "-h", "-o", "%i|%j|%u|%P|%T|%b|%N"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    return [dict(zip(fields, line.split("|"), strict=False)) for line in out.splitlines() if line.strip()]


def allocations_of(job_name: str, job_id: int) -> list[dict[str, str]]:
    """The Slurm allocations (squeue entries, any state) of managed job ``job_id``'s cluster.

    Found by the name SkyPilot gives the job's cluster (the Slurm job is named after it, with a suffix):
    the queue's ``cluster_name_on_cloud`` can still name an earlier launch attempt's allocation, long gone.
    """
    from sky.jobs.utils import generate_managed_job_cluster_name

    prefix = generate_managed_job_cluster_name(job_name, job_id) + "-"
    return [j for j in squeue() if j["name"].startswith(prefix)]


def managed_record(job_id: int):
    """Managed job ``job_id``'s record in SkyPilot's queue (status, labels, infra, name, pool, allocation name)."""
    import sky

    records, *_ = sky.get(
        sky.jobs.queue_v2(
            refresh=False,
            all_users=True,
            job_ids=[job_id],
            fields=["job_id", "status", "labels", "infra", "job_name", "pool", "cluster_name_on_cloud"],
        )
    )
    return records[0]


def running_allocation(job_id: int) -> dict[str, str] | None:
    """The running Slurm allocation under managed job ``job_id`` (its squeue entry), or None."""
    record = managed_record(job_id)
    if record.status.value != "RUNNING":
        return None
    running = [j for j in allocations_of(record.job_name, job_id) if j["state"] == "RUNNING"]
    return running[0] if running else None


class Preempter:
    """Runs ``attempt`` about every second in a thread until it returns something (what it preempted), the
    ``with`` block ends, or ``within_s`` pass (a bound against a hang: the run it watches ends first). A failed
    attempt (the API server busy, a read racing the run) is kept, and the next one goes on: a test says why
    nothing was preempted instead of waiting for a job that was never touched."""

    def __init__(self, attempt, within_s: float) -> None:
        self.attempt, self.within_s = attempt, within_s
        self.result: dict | None = None
        self.errors: list[str] = []
        self.attempts = 0
        self._started = 0.0
        self._looked_s = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Preempter:
        self._started = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        deadline = self._started + self.within_s
        while time.monotonic() < deadline and not self._stop.is_set():
            self.attempts += 1
            try:
                result = self.attempt()
            except Exception as e:  # noqa: BLE001 - kept for the test's message; the next attempt goes on
                self.errors.append(f"{type(e).__name__}: {e}")
                result = None
            self._looked_s = time.monotonic() - self._started
            if result:
                self.result = result
                return
            self._stop.wait(1)

    def why_not(self) -> str:
        """Why nothing was preempted (for an assertion's message)."""
        return (
            f"nothing preempted in the {self._looked_s:.0f} s it looked (bound {self.within_s:.0f} s), "
            f"{self.attempts} attempts; failed attempts: {len(self.errors)} {self.errors[-3:]}"
        )


def scancel(slurm_job_id: str) -> None:
    """Cancels a Slurm allocation, as Slurm does when it takes the nodes back."""
    subprocess.run(["scancel", slurm_job_id], check=True, timeout=30)


@dataclass
class Testbed:
    api_endpoint: str
    infra_onprem: str
    infra_h200: str
    log_dir: Path
    env: dict[str, str] = field(repr=False)
    #: ``admin_policy`` of the server config (GPUDOOR_TESTBED_ADMIN_POLICY at bring-up), or None.
    admin_policy: str | None = None

    @property
    def server_log(self) -> Path:
        return self.log_dir / "api-server.log"

    def server_log_tail(self, lines: int = 80) -> str:
        try:
            text = self.server_log.read_text(errors="replace").splitlines()
        except OSError as e:
            return f"(no server log: {e})"
        return "\n".join(text[-lines:])


def _server_admin_policy(env: dict[str, str]) -> str | None:
    config = Path(env.get("GPUDOOR_TESTBED_SERVER_HOME", "/nonexistent"), ".sky", "config.yaml")
    try:
        lines = config.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        if line.startswith("admin_policy:"):
            return line.partition(":")[2].strip() or None
    return None


def _rebind_sky_client_state(mp: pytest.MonkeyPatch) -> None:
    """Make an already-imported ``sky`` use the settings that were just put in os.environ.

    SkyPilot binds a few things at import time or caches them: the catalog directory
    (SKY_RUNTIME_DIR, where the bed seeded the GPU catalogs; without them the client would try
    to download them from GitHub), the server URL, and the client config.
    """
    if "sky" not in sys.modules:
        return
    from sky import skypilot_config
    from sky.catalog import common as catalog_common
    from sky.server import common as server_common
    from sky.skylet import constants, runtime_utils

    catalog_dir = runtime_utils.get_runtime_dir_path(os.path.join(".sky/catalogs", constants.CATALOG_SCHEMA_VERSION))
    mp.setattr(catalog_common, "_ABSOLUTE_VERSIONED_CATALOG_DIR", catalog_dir)
    registry = sys.modules.get("sky.utils.accelerator_registry")
    if registry is not None:
        mp.setattr(registry, "_accelerator_df", catalog_common.read_catalog("common/accelerators.csv"))
        mp.setattr(registry, "_memory_df", catalog_common.read_catalog("common/metadata.csv"))
    server_common.get_server_url.cache_clear()
    server_common.is_api_server_local.cache_clear()
    skypilot_config.reload_config()


def _bring_up() -> None:
    """testbed/up.sh then testbed/node_env.sh (needs root: skips the test otherwise)."""
    if os.geteuid() != 0:
        pytest.skip("Slurm test bed is not up and testbed/up.sh needs root")
    started = time.time()
    # Its output goes to a file, not a pipe: the daemons it starts would hold a pipe open, and a wait for
    # the pipe's end would outlive the timeout.
    log = TESTBED_DIR / ".bring-up.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            ["bash", "-c", f"bash {TESTBED_DIR / 'up.sh'} && bash {TESTBED_DIR / 'node_env.sh'}"],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            returncode = proc.wait(timeout=UP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            returncode = f"none: cut off after {UP_TIMEOUT_S:.0f} s"
    if returncode != 0:
        pytest.fail(
            f"testbed/up.sh failed (exit {returncode}, {time.time() - started:.0f}s)\n"
            f"--- {log} (tail)\n{log.read_text(errors='replace')[-8000:]}",
            pytrace=False,
        )


@pytest.fixture(scope="session")
def testbed() -> Testbed:
    """The running test bed; brings it up first when needed."""
    if os.environ.get("GPUDOOR_SKIP_SLURM") == "1":
        pytest.skip("GPUDOOR_SKIP_SLURM=1: Slurm test bed disabled")
    # `make test` runs two Slurm lanes: the first to get here brings the bed up, the other waits for it.
    with open(TESTBED_DIR / ".bring-up.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not _bed_is_up():
            _bring_up()
    env = parse_env_file(ENV_FILE)
    with pytest.MonkeyPatch.context() as mp:
        for key, value in env.items():
            mp.setenv(key, value)
        _rebind_sky_client_state(mp)
        yield Testbed(
            api_endpoint=env["SKYPILOT_API_SERVER_ENDPOINT"],
            infra_onprem=env["GPUDOOR_TESTBED_INFRA_ONPREM"],
            infra_h200=env["GPUDOOR_TESTBED_INFRA_H200"],
            log_dir=Path(env["GPUDOOR_TESTBED_LOG_DIR"]),
            env=env,
            admin_policy=_server_admin_policy(env),
        )
    if "sky" in sys.modules:
        from sky import skypilot_config
        from sky.server import common as server_common

        server_common.get_server_url.cache_clear()
        server_common.is_api_server_local.cache_clear()
        skypilot_config.reload_config()


@pytest.fixture(autouse=True)
def _testbed_client_env(testbed: Testbed, monkeypatch: pytest.MonkeyPatch) -> None:
    """Re-apply the bed's client settings for each test.

    Function-scoped fixtures of outer conftests may reset SkyPilot settings per test (the
    project's root conftest drops SKYPILOT_API_SERVER_ENDPOINT to keep unit tests offline);
    they run before this one, so the bed's settings win inside tests/slurm.
    """
    for key, value in testbed.env.items():
        monkeypatch.setenv(key, value)
    if "sky" in sys.modules:
        from sky.server import common as server_common

        server_common.get_server_url.cache_clear()
        server_common.is_api_server_local.cache_clear()


@pytest.fixture
def slurm_queue(testbed: Testbed):
    """Callable returning squeue's job list as dicts (job_id, name, user, partition, state, gres, nodes)."""
    return squeue


# queue_v2 returns a light default field set (no zone/infra/start_at); ask for these.
RECORD_FIELDS = [
    "job_id",
    "task_id",
    "job_name",
    "task_name",
    "status",
    "schedule_state",
    "submitted_at",
    "start_at",
    "end_at",
    "job_duration",
    "recovery_count",
    "resources",
    "cluster_resources",
    "cloud",
    "region",
    "zone",
    "infra",
    "failure_reason",
    "details",
    "user_name",
    "cluster_name_on_cloud",  # = the Slurm job name of the job's cluster
]


class ManagedJobs:
    """Launch / poll / log / cancel SkyPilot managed jobs through the SDK, with bounded waits.

    Remembers every job it launched: at teardown it prints their logs and the server log
    tail when the test failed, and cancels the ones still running.
    """

    def __init__(self, bed: Testbed):
        self.bed = bed
        self.job_ids: list[int] = []

    def launch(self, task, name: str) -> int:
        import sky

        job_ids, _handle = sky.get(sky.jobs.launch(task, name=name))
        assert job_ids, f"sky.jobs.launch returned no job id for {name}"
        self.job_ids.extend(job_ids)
        return job_ids[0]

    def record(self, job_id: int):
        import sky

        records, _total, _counts, _total_no_filter = sky.get(
            sky.jobs.queue_v2(refresh=False, job_ids=[job_id], all_users=True, fields=RECORD_FIELDS)
        )
        matching = [r for r in records if r["job_id"] == job_id]
        return matching[0] if matching else None

    @staticmethod
    def status_of(record) -> str:
        status = record["status"]
        return getattr(status, "value", str(status))

    def wait_for(self, job_id: int, statuses, timeout_s: float = 240, poll_s: float = 3):
        """Poll queue_v2 until the job's status is in ``statuses``; returns the record."""
        wanted = {getattr(s, "value", s) for s in statuses}
        deadline = time.time() + timeout_s
        record, seen = None, []
        while time.time() < deadline:
            record = self.record(job_id)
            if record is not None:
                status = self.status_of(record)
                if not seen or seen[-1] != status:
                    seen.append(status)
                if status in wanted:
                    return record
                if status in TERMINAL_STATUSES:
                    break
            time.sleep(poll_s)
        raise AssertionError(
            f"managed job {job_id}: wanted {sorted(wanted)}, statuses seen {seen} "
            f"(waited up to {timeout_s:.0f}s); last record: {record}"
        )

    def logs(self, job_id: int) -> str:
        import io

        import sky

        buf = io.StringIO()
        sky.jobs.tail_logs(job_id=job_id, follow=False, output_stream=buf)
        return buf.getvalue()

    def cancel(self, job_id: int) -> None:
        import sky

        sky.get(sky.jobs.cancel(job_ids=[job_id]))

    def dump(self) -> str:
        parts = []
        for job_id in self.job_ids:
            try:
                parts.append(f"--- record of managed job {job_id}\n{self.record(job_id)}")
                parts.append(f"--- logs of managed job {job_id}\n{self.logs(job_id)}")
            except Exception as e:  # noqa: BLE001 - diagnostics only
                parts.append(f"--- managed job {job_id}: could not read logs: {e!r}")
        return "\n".join(parts)

    def cleanup(self) -> None:
        for job_id in self.job_ids:
            try:
                record = self.record(job_id)
                if record is not None and self.status_of(record) not in TERMINAL_STATUSES:
                    self.cancel(job_id)
            except Exception:  # noqa: BLE001 - best effort
                pass


def bed_state(bed: Testbed) -> str:
    """What the bed holds and what its API server is doing: printed when a test fails or times out."""
    import sky

    parts = []
    try:
        parts.append(f"--- squeue\n{squeue()}")
    except Exception as e:  # noqa: BLE001 - diagnostics only
        parts.append(f"--- squeue failed: {e!r}")
    try:
        records, *_ = sky.get(
            sky.jobs.queue_v2(
                refresh=False,
                all_users=True,
                skip_finished=True,
                fields=["job_id", "job_name", "status", "recovery_count", "labels"],
            )
        )
        parts.append(
            "--- unfinished managed jobs\n"
            + "\n".join(
                f"{r['job_id']} {r['job_name']} {ManagedJobs.status_of(r)} recoveries={r['recovery_count']} "
                f"{r.get('labels')}"
                for r in records
            )
        )
    except Exception as e:  # noqa: BLE001
        parts.append(f"--- managed jobs: {e!r}")
    try:
        clusters = sky.get(sky.status(all_users=True))
        parts.append("--- clusters\n" + "\n".join(f"{c['name']} {c['status']}" for c in clusters))
    except Exception as e:  # noqa: BLE001
        parts.append(f"--- clusters: {e!r}")
    try:
        # The requests not finished (the server's own daemons left out): what holds its workers.
        requests = [r for r in sky.api_status() if not r.request_id.endswith("-daemon")]
        parts.append(
            "--- API server requests not finished\n"
            + "\n".join(
                f"{r.request_id[:8]} {r.name} {r.schedule_type} {r.status} cluster={r.cluster_name} "
                f"created={r.created_at:.0f}"
                for r in requests
            )
        )
    except Exception as e:  # noqa: BLE001
        parts.append(f"--- API server requests: {e!r}")
    parts.append(f"--- {bed.server_log} (tail)\n{bed.server_log_tail()}")
    return "\n".join(parts)


@pytest.fixture(autouse=True)
def _bed_state_on_failure(testbed: Testbed, request):
    """A failed test (a timed-out one included) prints the bed's state: what is held, what the server is doing."""
    yield
    report = getattr(request.node, "rep_call", None)
    if report is not None and report.failed:
        print(bed_state(testbed))


@pytest.fixture
def managed_jobs(testbed: Testbed, request):
    jobs = ManagedJobs(testbed)
    yield jobs
    report = getattr(request.node, "rep_call", None)
    if report is not None and report.failed:
        print(jobs.dump())
    jobs.cleanup()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    # Lets fixtures see whether the test body failed (item.rep_call.failed) at teardown.
    outcome = yield
    report = outcome.get_result()
    setattr(item, f"rep_{report.when}", report)


@pytest.fixture
def transit(s3_server):
    """A fresh bucket of the S3 server on 127.0.0.1, with its own credentials, as the transit bucket."""
    return new_transit(s3_server)


def new_transit(s3_server: str):
    """A fresh bucket of the S3 server at ``s3_server``, with its own credentials, as the transit bucket."""
    import uuid

    import boto3

    from gpudoor_pipelines.transit.resource import TransitBucketResource

    name = f"bed-{uuid.uuid4().hex[:10]}"
    secret = f"bed-secret-{uuid.uuid4().hex}"
    boto3.client(
        "s3", endpoint_url=s3_server, region_name="us-east-1", aws_access_key_id="bed-key", aws_secret_access_key=secret
    ).create_bucket(Bucket=name)
    return TransitBucketResource(
        kind="s3", bucket=name, endpoint_url=s3_server, access_key_id="bed-key", secret_access_key=secret
    )
