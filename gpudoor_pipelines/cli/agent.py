"""``gpudoor launch | status | logs | cancel``: the door for people and coding agents, outside Dagster.

An ad-hoc job goes through the same ``resolve`` as the assets (route, fleet rules, labels, caps against
what is held now) and the same launcher (:mod:`gpudoor_pipelines.launch.launcher`): the status hub, the
wait loop that follows a log to the job's end, and the cancel that verifies the release. It runs on the
local backend by default, on the team's SkyPilot API server with ``GPUDOOR_BACKEND=skypilot``. No Dagster
is imported. With ``--json`` every answer, errors included, is one JSON object on stdout with stable
fields, and the exit code says what happened:

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
from collections.abc import Callable, Mapping
from typing import Any

from gpudoor_pipelines.launch.errors import LaunchConfigError
from gpudoor_pipelines.launch.job import FAILURE_MEANING, JobInfo

EXIT_OK, EXIT_REFUSED, EXIT_JOB_FAILED, EXIT_UNREACHABLE, EXIT_NO_SUCH_JOB = 0, 2, 3, 4, 5
#: Settings whose failure means the API server cannot be reached (not a problem of the task file).
_SERVER_FIELDS = {"api_server_endpoint", "service_account_token"}


class DoorError(Exception):
    """An answer that is not a success: its JSON form and its exit code."""

    def __init__(
        self, code: int, error: str, file: str = "", field: str = "", problem: str = "", fix: str = "", **extra: Any
    ) -> None:
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


def _launcher(**settings: Any):
    """The launcher the environment configures (as the code location's resources are), its server checked.

    Raises:
        DoorError: the settings are wrong or the API server cannot be reached.
    """
    from gpudoor_pipelines.launch.config import settings_from_env
    from gpudoor_pipelines.launch.launcher import Launcher

    try:
        launcher = Launcher.from_settings(settings_from_env(**settings))
        launcher.backend.check()
    except LaunchConfigError as e:
        raise DoorError.of(e) from None
    return launcher


def _job_info(info: JobInfo) -> dict[str, Any]:
    out = {k: (v.value if hasattr(v, "value") else v) for k, v in dataclasses.asdict(info).items()}
    now = time.time()
    if out["ran_s"] is None and info.started_at is not None:  # a backend that does not count it: its times say
        out["ran_s"] = round((info.ended_at or now) - info.started_at, 3)
    started = info.started_at if info.started_at is not None else (None if info.state.is_terminal else now)
    out["queued_s"] = (
        round(started - info.submitted_at, 3) if info.submitted_at is not None and started is not None else None
    )
    out["terminal"] = info.state.is_terminal
    out["failed"] = info.state.is_failure
    out["meaning"] = FAILURE_MEANING.get(info.state, "")
    return out


def _no_such_job(job_id: str) -> DoorError:
    return DoorError(
        EXIT_NO_SUCH_JOB,
        "no such job",
        field="job_id",
        problem=f"the backend has no job {job_id}",
        fix="use a job id `gpudoor launch` printed, or `gpudoor status` to list your jobs",
    )


def launch(
    spec: str,
    *,
    step: str | None = None,
    pool: str | None = None,
    infra: str | None = None,
    cost_owner: str | None = None,
    env: Mapping[str, str] | None = None,
    fleet_file: str | None = None,
) -> dict[str, Any]:
    """Resolves and submits one task file; returns what was launched (job id, pool, GPU, labels).

    Raises:
        DoorError: refused before launch (nothing submitted), or the API server cannot be reached.
    """
    from gpudoor_pipelines.launch.resolve.request import LaunchRequest
    from gpudoor_pipelines.launch.resolve.specs import load_spec
    from gpudoor_pipelines.transit.uris import open_bucket, settings_from_env

    launcher = _launcher(fleet_file=fleet_file)
    try:
        bucket = open_bucket(**settings_from_env())
        request = LaunchRequest(
            spec=load_spec(spec, launcher.settings.specs_dir, skypilot=True, strict=False),
            inputs=bucket.job_env(),
            secrets=bucket.job_secrets(),
            env=dict(env or {}),
            pool=pool,
            infra=infra,
            cost_owner=cost_owner,
            default_cost_owner=launcher.settings.cost_owner,
            user=launcher.user(),
            step=step,
        )
        job = launcher.resolve(request)
        job_id, job = launcher.submit(job, request)
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
        "fingerprint": job.fingerprint,
        "borrowed": job.labels.get("gpudoor-borrowed") == "true",
        "budget": None if job.budget is None else job.budget.left(),
        "warning": None if job.budget is None else job.budget.warning,
    }


def status(job_id: str) -> dict[str, Any]:
    """One job's state, times, recoveries and, once failed, what the failure means."""
    launcher = _launcher()
    try:
        return _job_info(launcher.status(job_id))
    except KeyError:
        raise _no_such_job(job_id) from None


def logs(job_id: str, *, tail: int = 100) -> list[str]:
    """The job's last ``tail`` log lines.

    One request where the log answers: only a log of one line or none (which may be the backend saying it
    has no such job, in its own words) is followed by a look at the job, which tells "no such job" apart.
    """
    launcher = _launcher()
    try:  # an id the backend never issues is refused before any path is built or request is sent (KeyError)
        lines = launcher.backend.log_tail(job_id, tail)
        if len(lines) <= 1:
            launcher.status(job_id)
    except KeyError:
        raise _no_such_job(job_id) from None
    return lines


def follow(job_id: str, on_line: Callable[[str], None]) -> dict[str, Any]:
    """Every line of the job's log from the start, to ``on_line``, until the job ends; returns its end state."""
    from gpudoor_pipelines.launch.watch import Hooks

    launcher = _launcher()
    try:
        launcher.status(job_id)
        watched = launcher.wait([job_id], Hooks(line=on_line), forward_termination=False)
    except KeyError:
        raise _no_such_job(job_id) from None
    return _job_info(watched.infos[job_id])


def cancel(job_id: str, *, wait_s: float = 60.0) -> dict[str, Any]:
    """Cancels the job and verifies its release, as a Dagster step's cancel does: the job terminal and what
    it held gone (its processes, its cluster), looked at for up to ``wait_s``."""
    launcher = _launcher(cancel_timeout_s=wait_s)
    try:
        outcome = launcher.cancel(job_id)
        info = launcher.backend.status(job_id)
    except KeyError:
        raise _no_such_job(job_id) from None
    return {**_job_info(info), "cancel_confirmed": outcome.confirmed, "release": outcome.to_record()}


def final_code(info: Mapping[str, Any]) -> int:
    """The exit code a followed job's end gives: 0 when it succeeded, 3 otherwise."""
    return EXIT_OK if info.get("state") == "SUCCEEDED" else EXIT_JOB_FAILED


def recent_jobs(days: float = 7.0) -> list[dict[str, Any]]:
    """The launching user's jobs of the last ``days``, newest first (read by label from the backend)."""
    from gpudoor_pipelines.launch.resolve.fleet import label_value

    launcher = _launcher()
    now = time.time()
    since = now - days * 86400
    try:
        history = launcher.backend.job_history(since, now, submitted_after=since)  # pending jobs included
    except LaunchConfigError as e:
        raise DoorError.of(e) from None
    mine = [j for j in history if j.user == label_value(launcher.user())]
    mine.sort(key=lambda j: j.started_at or now, reverse=True)
    return [{k: (v.value if hasattr(v, "value") else v) for k, v in dataclasses.asdict(j).items()} for j in mine]
