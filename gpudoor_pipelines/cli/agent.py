"""``gpudoor launch | status | logs | cancel``: the door for people and coding agents, outside Dagster.

An ad-hoc job goes through the same ``resolve`` as the assets (route, fleet rules, labels, caps
against what is held now) and the same backend (the local one by default, the team's SkyPilot API
server with ``GPUDOOR_BACKEND=skypilot``). With ``--json`` every answer, errors included, is one
JSON object on stdout with stable fields, and the exit code says what happened:

| exit | meaning |
|---|---|
| 0 | done (for ``launch --follow`` and ``logs --follow``: the job succeeded) |
| 2 | refused before launch: nothing was submitted (``file``, ``field``, ``fix`` say why) |
| 3 | the job failed, or was cancelled while followed |
| 4 | cannot reach the API server (or it refused the credentials) |
| 5 | no such job |
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from gpudoor_pipelines.launch.errors import LaunchConfigError

EXIT_OK, EXIT_REFUSED, EXIT_JOB_FAILED, EXIT_UNREACHABLE, EXIT_NO_SUCH_JOB = 0, 2, 3, 4, 5
#: Settings whose failure means the API server cannot be reached (not a problem of the task file).
_SERVER_FIELDS = {"api_server_endpoint", "service_account_token"}


class DoorError(Exception):
    """An answer that is not a success: its JSON form and its exit code."""

    def __init__(self, code: int, error: str, file: str = "", field: str = "", problem: str = "", fix: str = "", **extra: Any) -> None:
        super().__init__(problem or error)
        self.code = code
        self.payload = {"error": error, "file": file, "field": field, "problem": problem, "fix": fix, **extra}

    @classmethod
    def of(cls, e: LaunchConfigError) -> DoorError:
        """A refusal, or an unreachable API server, from the package's own error."""
        if e.source == "resource skypilot" and e.field in _SERVER_FIELDS:
            return cls(EXIT_UNREACHABLE, "cannot reach the API server", e.source, e.field, e.problem, e.fix)
        problems = [p.as_dict() for p in e.problems]
        return cls(EXIT_REFUSED, "refused before launch", **problems[0], problems=problems)


def _client():
    """The ``skypilot`` resource of the code location, configured from the environment."""
    import dagster as dg

    from gpudoor_pipelines.settings import build_resources

    resources = build_resources()
    return dg.build_resources({"skypilot": resources["skypilot"]})


def _reachable(backend) -> None:
    check = getattr(backend, "check", None)
    if check is not None:
        check()


def _job_info(info) -> dict[str, Any]:
    from gpudoor_pipelines.launch.job import FAILURE_MEANING

    out = {k: (v.value if hasattr(v, "value") else v) for k, v in dataclasses.asdict(info).items()}
    out["terminal"] = info.state.is_terminal
    out["failed"] = info.state.is_failure
    out["meaning"] = FAILURE_MEANING.get(info.state, "")
    return out


def launch(
    spec: str,
    *,
    step: str | None = None,
    pool: str | None = None,
    infra: str | None = None,
    cost_owner: str | None = None,
    env: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """Resolves and submits one task file; returns what was launched (job id, pool, GPU, labels).

    Raises:
        DoorError: refused before launch (nothing submitted), or the API server cannot be reached.
    """
    from gpudoor_pipelines.launch.client import submit_routed
    from gpudoor_pipelines.launch.resolve.request import LaunchRequest, resolve
    from gpudoor_pipelines.launch.resolve.specs import load_spec

    try:
        with _client() as resources:
            client = resources.skypilot
            backend = client.get_backend()
            _reachable(backend)
            bucket = client.transit.get_bucket()
            request = LaunchRequest(
                spec=load_spec(spec, client.specs_dir, skypilot=True, strict=False),
                inputs=bucket.job_env(),
                secrets=bucket.job_secrets(),
                env=dict(env or {}),
                pool=pool,
                infra=infra,
                cost_owner=cost_owner,
                default_cost_owner=client.cost_owner,
                user=client.launching_user(),
                step=step,
            )
            fleet = client.get_fleet()
            # Where the API server counts what is held (live_caps: server), nothing is read first.
            job = resolve(request, fleet, usage=None if fleet.live_caps == "server" else backend.usage())
            job_id, job = submit_routed(backend, job, request, fleet, lambda line: None)
    except LaunchConfigError as e:
        raise DoorError.of(e) from None
    route = job.route
    assert route is not None
    return {
        "job_id": job_id,
        "name": job.name,
        "pool": job.pool,
        "infra": route.infra,
        "accelerators": route.accelerators,
        "use_spot": route.use_spot,
        "num_nodes": route.num_nodes,
        "cost_owner": job.labels.get("gpudoor-cost-owner"),
        "user": job.labels.get("gpudoor-user"),
        "labels": job.labels,
        "secrets": sorted(job.secret_names),
        "decided_by": route.reason,
    }


def _backend_call(fn: Callable[[Any], Any]) -> Any:
    try:
        with _client() as resources:
            backend = resources.skypilot.get_backend()
            _reachable(backend)
            return fn(backend)
    except LaunchConfigError as e:
        raise DoorError.of(e) from None


def _no_such_job(job_id: str) -> DoorError:
    return DoorError(EXIT_NO_SUCH_JOB, "no such job", field="job_id", problem=f"the backend has no job {job_id}",
                     fix="use a job id `gpudoor launch` printed, or `gpudoor status` to list your jobs")  # fmt: skip


def status(job_id: str) -> dict[str, Any]:
    """One job's state, times, recoveries and, once failed, what the failure means."""

    def read(backend):
        try:
            return _job_info(backend.status(job_id))
        except KeyError:
            raise _no_such_job(job_id) from None

    return _backend_call(read)


def logs(job_id: str, *, follow: bool = False, tail: int = 100, poll_s: float = 0.5) -> Iterator[str]:
    """The job's last ``tail`` log lines, or (``follow``) every line from the start until the job ends."""
    with _client() as resources:
        try:
            backend = resources.skypilot.get_backend()
            _reachable(backend)
            backend.status(job_id)
        except KeyError:
            raise _no_such_job(job_id) from None
        except LaunchConfigError as e:
            raise DoorError.of(e) from None
        if not follow:
            yield from backend.log_tail(job_id, tail)
            return
        follower = backend.follow_logs(job_id)
        try:
            while True:
                done = backend.status(job_id).state.is_terminal
                yield from follower.poll()
                if done:
                    yield from follower.poll()
                    return
                time.sleep(poll_s)
        finally:
            follower.close()


def cancel(job_id: str, *, wait_s: float = 60.0, poll_s: float = 0.5) -> dict[str, Any]:
    """Cancels the job and waits (up to ``wait_s``) until the backend says it has ended."""

    def stop(backend):
        try:
            backend.status(job_id)
        except KeyError:
            raise _no_such_job(job_id) from None
        backend.cancel(job_id)
        deadline = time.monotonic() + wait_s
        info = backend.status(job_id)
        while not info.state.is_terminal and time.monotonic() < deadline:
            time.sleep(poll_s)
            info = backend.status(job_id)
        return {**_job_info(info), "cancel_confirmed": info.state.is_terminal}

    return _backend_call(stop)


def final_code(info: Mapping[str, Any]) -> int:
    """The exit code a followed job's end gives: 0 when it succeeded, 3 otherwise."""
    return EXIT_OK if info.get("state") == "SUCCEEDED" else EXIT_JOB_FAILED


def recent_jobs(days: float = 7.0) -> list[dict[str, Any]]:
    """The launching user's jobs of the last ``days``, newest first (read by label from the backend)."""

    def read(backend):
        with _client() as resources:
            me = resources.skypilot.launching_user()
        from gpudoor_pipelines.launch.resolve.fleet import label_value

        now = time.time()
        since = now - days * 86400
        history = backend.job_history(since, now, submitted_after=since)  # pending jobs included
        mine = [j for j in history if j.user == label_value(me)]
        mine.sort(key=lambda j: j.started_at or now, reverse=True)
        return [{**{k: (v.value if hasattr(v, "value") else v) for k, v in dataclasses.asdict(j).items()}} for j in mine]

    return _backend_call(read)
