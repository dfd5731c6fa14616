"""The SkyPilot SDK, reached one way: the only module that imports ``sky`` (lazily, after usage collection
is switched off), and the helpers every SkyPilot strategy shares.

Calls go through the Python SDK to the API server and return request ids, resolved with ``sky.get``; the
``sky`` command line is never used. Tests replace :func:`sky` with a fake SDK (``tests/launch/fake_sky.py``):
every caller looks it up here, at call time.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import queue
import re
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

from gpudoor_pipelines import outage
from gpudoor_pipelines.launch import sky_env
from gpudoor_pipelines.launch.backends.base import LogFollower
from gpudoor_pipelines.launch.errors import LaunchConfigError, PoolFull
from gpudoor_pipelines.launch.job import JobState
from gpudoor_pipelines.launch.resolve.request import ResolvedJob

_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def sky() -> Any:
    """The ``sky`` module, imported once usage collection is off."""
    sky_env.prepare()
    import sky as sky_module
    import sky.client.sdk  # noqa: F401 - makes `sky.client.sdk` reachable as an attribute
    import sky.server.common  # noqa: F401 - makes `sky.server.common` reachable as an attribute

    return sky_module


def server() -> outage.Service:
    """The API server this process's SDK talks to, as a service whose outages are waited out."""
    return outage.service(f"the SkyPilot API server at {sky().server.common.get_server_url()}")


def transient(error: BaseException) -> bool:
    """Whether an SDK failure is one a server that is there gives for a while: no connection, a connection
    dropped or timed out, a 5xx, a server restarting (its requests interrupted), or busy."""
    import requests
    from sky import exceptions

    waited = (
        exceptions.ApiServerConnectionError,
        exceptions.ServerTemporarilyUnavailableError,
        exceptions.RequestInterruptedError,
        requests.exceptions.ConnectionError,
        requests.exceptions.Timeout,
        requests.exceptions.ChunkedEncodingError,
        ConnectionError,  # and StreamBroken
    )
    if isinstance(error, waited):
        return True
    response = getattr(error, "response", None)
    return isinstance(error, requests.exceptions.HTTPError) and response is not None and response.status_code >= 500


def read(request: Callable[[], Any]) -> Any:
    """``sky.get`` of a read-only request (states, the queue, a pool's status), sent again while the API
    server does not answer (:mod:`gpudoor_pipelines.outage`): a busy or restarting server is not a failed step.
    Launches and cancels are never sent twice blindly (:func:`launch`, :func:`cancel`)."""
    sdk = sky()
    return server().call(lambda: sdk.get(request()), transient, "reading job states")


def launch(name: str, send: Callable[[], Any], look: Callable[[float], list[str]]) -> list[str]:
    """The job ids of one launch: ``send()`` posts it (returns its request id), ``look(since)`` finds the jobs
    of this name submitted since then (a Unix time). After a transient failure the launch is sent again only
    if a look, once the server answers, finds that the first one did not take effect. (The one case a look
    cannot tell: the server took the launch, its answer was lost, and the server has not submitted the job
    yet. A refused connection, the usual outage, never reached it.)"""
    from sky.exceptions import RequestInterruptedError

    sdk, service = sky(), server()
    while True:
        asked = time.time() - 5.0  # the server's clock, within seconds of this one
        try:
            request_id = send()
        except Exception as e:
            if not transient(e) or not service.answered:
                raise
            error: Exception = e
        else:
            try:  # the request is the server's now: wait for its answer (a restart ends it, unanswered)
                done = service.call(
                    lambda request_id=request_id: sdk.get(request_id),
                    lambda e: transient(e) and not isinstance(e, RequestInterruptedError),
                    f"waiting for the launch of {name}",
                )
                return [str(i) for i in (done[0] or ())]
            except RequestInterruptedError as e:
                error = e
        time.sleep(service.failed(error, f"launching {name}"))
        doing = f"looking whether the launch of {name} arrived"
        found = service.call(lambda asked=asked: look(asked), transient, doing)
        if found:
            return found


def cancel(name: str, send: Callable[[], Any], done: Callable[[], bool]) -> None:
    """One cancel: ``send()`` posts it; after a transient failure, ``done()`` (once the server answers) says
    whether it took effect before it is sent again."""
    sdk, service = sky(), server()
    while True:
        try:
            sdk.get(send())
            return
        except Exception as e:
            if not transient(e) or not service.answered:
                raise
            error = e
        time.sleep(service.failed(error, f"cancelling {name}"))
        if service.call(done, transient, f"looking whether the cancel of {name} arrived"):
            return


def health(endpoint: str, token: str | None, timeout_s: float = 5.0) -> dict[str, Any]:
    """The API server's ``/api/health`` answer: one plain request with a short timeout (SkyPilot's own
    client retries for tens of seconds).

    Raises:
        LaunchConfigError: nothing answers there, it is not a SkyPilot API server, or it refused the token.
    """
    request = urllib.request.Request(f"{endpoint}/api/health")
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            body = response.read()
    except urllib.error.HTTPError as e:
        if e.code in (401, 403):
            raise LaunchConfigError(
                "resource skypilot",
                "service_account_token",
                f"the API server at {endpoint} refused the credentials ({e.code})",
                "set SKYPILOT_SERVICE_ACCOUNT_TOKEN to a valid service-account token",
            ) from None
        raise LaunchConfigError(
            "resource skypilot",
            "api_server_endpoint",
            f"{endpoint}/api/health answered {e.code}",
            "check that SKYPILOT_API_SERVER_ENDPOINT points at a SkyPilot API server",
        ) from None
    except (urllib.error.URLError, OSError) as e:
        raise LaunchConfigError(
            "resource skypilot",
            "api_server_endpoint",
            f"no SkyPilot API server answers at {endpoint} ({getattr(e, 'reason', e)})",
            "start the API server or correct SKYPILOT_API_SERVER_ENDPOINT",
        ) from None
    outage.service(f"the SkyPilot API server at {endpoint}").ok()
    try:
        answer = json.loads(body or b"{}")
    except ValueError:
        return {}
    return answer if isinstance(answer, dict) else {}


def state(status: Any) -> JobState:
    """A SkyPilot managed-job status as a :class:`JobState`."""
    name = getattr(status, "value", status)
    try:
        return JobState(str(name))
    except ValueError:
        # Newer SkyPilot states map onto the closest one we know.
        return JobState.RUNNING if "RUN" in str(name) else JobState.PENDING


def cluster_job_state(status: Any) -> JobState | None:
    """The status of a job on a cluster (``sky.job_status``) as a :class:`JobState`; None when there is none."""
    if status is None:
        return None
    name = str(getattr(status, "value", status))
    if name in ("SUCCEEDED", "CANCELLED", "FAILED_SETUP"):
        return JobState(name)
    if "FAIL" in name:
        return JobState.FAILED
    return JobState.PENDING if name in ("INIT", "PENDING", "SETTING_UP") else JobState.RUNNING


def update_mode() -> Any:
    """SkyPilot's default update mode for ``pool_apply``."""
    from sky.serve import serve_utils

    return serve_utils.DEFAULT_UPDATE_MODE


def build_task(job: ResolvedJob, config: dict[str, Any] | None = None) -> Any:
    """The ``sky.Task`` of a resolved job (or of ``config``, a variant of its task): envs, secrets, resources
    with infra and labels, workdir."""
    config = copy.deepcopy(config if config is not None else {**job.config, "name": job.name})
    secrets = config.pop("secrets", None) or {}
    task = sky().Task.from_yaml_config(config, secrets_overrides=list(secrets.items()) or None)
    task.workdir = job.workdir
    return task


@contextlib.contextmanager
def refusals(job: ResolvedJob) -> Iterator[None]:
    """The server's refusals, as the same clear errors the client's own checks raise."""
    from sky import exceptions

    try:
        yield
    except exceptions.UserRequestRejectedByPolicy as e:
        full = PoolFull.from_refusal(str(e), job.spec_path or job.name)
        if full is not None:
            raise full from None
        if "is not a pool of the fleet" in str(e):  # the task routed by another fleet than the server's
            raise LaunchConfigError(
                "the API server's fleet",
                "fleet",
                f"the job was routed by a fleet file the API server's policy does not share: {e}",
                "launch with the team's fleet file, the one the API server reads: set GPUDOOR_FLEET_FILE "
                "(or `gpudoor launch --fleet FILE`)",
            ) from None
        raise LaunchConfigError(
            job.spec_path or job.name,
            "(admin policy)",
            f"rejected by the API server's policy: {e}",
            "change what the policy names, then relaunch",
        ) from None
    except (exceptions.ResourcesUnavailableError, ValueError) as e:
        raise LaunchConfigError(
            job.name,
            "resources",
            f"SkyPilot cannot place the job: {e}",
            "check the pool's infra and GPUs in task_specs/fleet.yaml",
        ) from None


def clusters(names: list[str]) -> dict[str, str]:
    """Those of ``names`` that ``sky.status`` lists (any user's), with their states."""
    sdk = sky()
    records = read(lambda: sdk.status(cluster_names=names, all_users=True)) or ()
    return {str(r.get("name")): str(getattr(r.get("status"), "value", r.get("status"))) for r in records}


def down(cluster: str, *, wait: bool = False) -> str | None:
    """``sky.down`` of the cluster; a cluster that does not exist is fine. Returns the request id."""
    sdk = sky()
    from sky import exceptions

    try:
        request_id = sdk.down(cluster)
        if wait:
            sdk.get(request_id)
        return None if request_id is None else str(request_id)
    except (exceptions.ClusterDoesNotExist, ValueError):
        return None
    except Exception:  # noqa: BLE001 - best effort here; the release check or the reconciler looks again
        return None


def cancel_request(request_id: Any) -> None:
    """Asks the API server to stop working on a request (a launch still waiting for GPUs)."""
    sdk = sky()
    with contextlib.suppress(Exception):
        sdk.get(sdk.api_cancel(request_id, silent=True))


class _Log:
    """A job's log as handed out: complete lines (colour codes removed) into a queue, each once. Each reading
    of the log from its start (the stream, a stream reopened, a last read) writes through a writer of its own
    and hands out only the lines after those already handed out, as SkyPilot's own resumable streams do; a
    newer writer retires the older ones (a stream stuck on a dead connection that wakes up writes nothing)."""

    def __init__(self) -> None:
        self.lines: queue.Queue[str] = queue.Queue()
        self.handed = 0  # lines handed out, over every reading
        self._lock = threading.Lock()
        self._current: _Writer | None = None

    def writer(self) -> _Writer:
        with self._lock:
            self._current = _Writer(self)
            return self._current

    def take(self, writer: _Writer, lines: list[str]) -> None:
        with self._lock:
            if writer is not self._current:
                return
            for line in lines:
                writer.written += 1
                if writer.written > self.handed:
                    self.handed += 1
                    self.lines.put(_ANSI.sub("", line).rstrip("\r"))


class _Writer(io.TextIOBase):
    """One reading of a job's log from its start (see :class:`_Log`)."""

    def __init__(self, log: _Log) -> None:
        self._log, self._partial, self.written = log, "", 0

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        *complete, self._partial = (self._partial + text).split("\n")
        self._log.take(self, complete)
        return len(text)

    def flush_partial(self) -> None:
        if self._partial:
            self._log.take(self, [self._partial])
            self._partial = ""


class ThreadFollower(LogFollower):
    """Runs a blocking SDK log stream (``follow=True``) in a thread; ``poll`` hands out its lines.

    A stream the API server breaks off (an outage, a restart) is reopened once the server answers again,
    from the start, and the lines already handed out are skipped: none is lost or repeated. A stream still
    open when its job has ended (stuck on a connection that went silent) is given up, and ``catch_up`` reads
    the rest of the log once, without following.
    """

    def __init__(
        self, stream_to: Callable[[io.TextIOBase], Any], catch_up: Callable[[io.TextIOBase], Any] | None = None
    ) -> None:
        self._log = _Log()
        self._catch_up = catch_up
        self._attempts = 0
        self._thread = threading.Thread(target=self._run, args=(stream_to,), daemon=True)
        self._thread.start()

    def _run(self, stream_to: Callable[[io.TextIOBase], Any]) -> None:
        out = self._log.writer()

        def attempt() -> Any:  # each from the log's start
            nonlocal out
            self._attempts += 1
            if self._attempts > 1:
                out = self._log.writer()
            return _follow_exit(stream_to(out))

        try:
            server().call(attempt, transient, "following a job's log", progress=lambda: self._log.handed)
        except Exception as e:  # The stream ends with the job or the connection; say so in the log.
            self._log.lines.put(f"[gpudoor] log stream ended: {type(e).__name__}: {e}")
        out.flush_partial()

    @property
    def ended(self) -> bool:
        """The SDK's stream returned: the job ended (or the connection dropped), and every line is handed out."""
        return not self._thread.is_alive() and self._log.lines.empty()

    def poll(self) -> list[str]:
        out = []
        while True:
            try:
                out.append(self._log.lines.get_nowait())
            except queue.Empty:
                return out

    def close(self, wait: bool = True) -> None:
        """With ``wait`` (the job ended), gives the stream a moment to end: longer for one reopened after an
        outage, which may still be catching up; then reads what a stream still open missed. The SDK call cannot
        be interrupted; the daemon thread ends with the job's log, or never, on a dead connection."""
        if not wait:
            return
        self._thread.join(timeout=2 if self._attempts <= 1 else 30)
        if self._thread.is_alive() and self._catch_up is not None:
            out = self._log.writer()
            try:
                self._catch_up(out)
                out.flush_partial()
            except Exception as e:  # noqa: BLE001 - the lines handed out stay; say what is missing
                self._log.lines.put(f"[gpudoor] could not read the end of the log: {type(e).__name__}: {e}")


class StreamBroken(ConnectionError):
    """A log stream that ended without its job's end: the API server's request was killed (a restart)."""


def _follow_exit(code: Any) -> Any:
    """What a followed ``tail_logs`` returned (the job's exit code), or :class:`StreamBroken` when that is not the
    end of the job: a negative code is the signal that killed the server's log request (SIGTERM at a restart), and
    the stream then ends cleanly, as if its job had."""
    if isinstance(code, int) and code < 0:
        raise StreamBroken(f"the API server's log request ended by signal {-code}")
    return code


def tail(read_into: Callable[[io.TextIOBase], Any], lines: int) -> list[str]:
    """The last ``lines`` lines an SDK log call writes (best effort: a failure is one line saying so)."""
    out = io.StringIO()
    try:
        read_into(out)
    except Exception as e:  # The tail is best effort: the failure itself is reported anyway.
        return [f"[gpudoor] could not fetch the log tail: {type(e).__name__}: {e}"]
    return [_ANSI.sub("", line) for line in out.getvalue().splitlines() if line.strip()][-lines:]
