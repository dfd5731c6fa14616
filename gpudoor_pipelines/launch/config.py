"""The launcher's settings: where jobs go and how they are watched, from a resource's fields or the
environment, and the backend they name. Free of Dagster."""

from __future__ import annotations

import dataclasses
import functools
import getpass
import os
from typing import Any

from gpudoor_pipelines.launch.backends.base import Backend
from gpudoor_pipelines.launch.errors import LaunchConfigError


@dataclasses.dataclass(frozen=True)
class LaunchSettings:
    """Where jobs go and how they are watched: the fields of the Pipes client resource, free of Dagster.

    Attributes:
        backend: ``local`` (embedded default) or ``skypilot``.
        api_server_endpoint: SkyPilot API server URL (``skypilot`` backend).
        service_account_token: SkyPilot service-account token; never logged.
        specs_dir: folder of task specs (default: the project's ``task_specs/``).
        fleet_file: the fleet file (default: ``task_specs/fleet.yaml``).
        local_home: state folder of the local backend (default ``$GPUDOOR_HOME`` or ``~/.gpudoor``).
        cost_owner: who pays for jobs whose task file names no cost owner (default: the fleet's).
        user: who launches (labels, per-user caps); default: the service account, else the OS user.
        poll_interval_s: seconds to a job's first status poll and after it enters recovery; also how
            often log lines are handed over.
        max_poll_interval_s: where status requests go to a server, polls back off, doubling, up to this
            (a job entering recovery starts them again at ``poll_interval_s``).
        cancel_timeout_s: how long a release is looked at before it is reported not confirmed.
        max_log_streams: how many jobs of a batch stream their logs at once.
        validate_with_skypilot: also parse every spec with ``sky.Task`` (once per file version).
    """

    backend: str = "local"
    api_server_endpoint: str | None = None
    service_account_token: str | None = dataclasses.field(default=None, repr=False)
    specs_dir: str | None = None
    fleet_file: str | None = None
    local_home: str | None = None
    cost_owner: str | None = None
    user: str | None = None
    poll_interval_s: float = 0.5
    max_poll_interval_s: float = 20.0
    cancel_timeout_s: float = 180.0
    max_log_streams: int = 4
    validate_with_skypilot: bool = True


#: The settings the environment sets, and from which variables (the Dagster resources bind the same ones).
ENV_SETTINGS = {
    "backend": "GPUDOOR_BACKEND",
    "api_server_endpoint": "SKYPILOT_API_SERVER_ENDPOINT",
    "service_account_token": "SKYPILOT_SERVICE_ACCOUNT_TOKEN",
    "cost_owner": "GPUDOOR_COST_OWNER",
    "local_home": "GPUDOOR_HOME",
    "user": "GPUDOOR_USER",
    # The same variable names the fleet file for the API server's policy: launchers and server read one file.
    "fleet_file": "GPUDOOR_FLEET_FILE",
}


def settings_from_env(**overrides: Any) -> LaunchSettings:
    """The settings the environment describes (see ``gpudoor_pipelines.settings``), with ``overrides``."""
    found = {field: os.environ[var] for field, var in ENV_SETTINGS.items() if os.environ.get(var)}
    return LaunchSettings(**{**found, **{k: v for k, v in overrides.items() if v is not None}})


def make_backend(settings: LaunchSettings) -> Backend:
    """The backend the settings name.

    Raises:
        LaunchConfigError: an unknown backend, or a SkyPilot backend without an API server.
    """
    if settings.backend == "local":
        from gpudoor_pipelines.launch.backends.local import LocalBackend

        return LocalBackend(home=settings.local_home)
    if settings.backend == "skypilot":
        from gpudoor_pipelines.launch.backends.skypilot import SkyPilotBackend

        return SkyPilotBackend(endpoint=settings.api_server_endpoint, token=settings.service_account_token)
    raise LaunchConfigError(
        "resource skypilot",
        "backend",
        f"unknown backend '{settings.backend}'",
        "use 'local' or 'skypilot' (GPUDOOR_BACKEND)",
    )


def launching_user(settings: LaunchSettings) -> str:
    """Who launches: ``user``, else the service account the API server knows the token as, else the OS user.
    The API server's policy names the user itself in any case."""
    if settings.user:
        return settings.user
    if settings.backend == "skypilot" and settings.service_account_token:
        name = _service_account(settings.api_server_endpoint, settings.service_account_token)
        if name:
            return name
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return "unknown"


@functools.lru_cache(maxsize=8)
def _service_account(endpoint: str | None, token: str) -> str | None:
    """The name the API server gives the token's service account (cached per process)."""
    if not endpoint:
        return None
    from gpudoor_pipelines.launch.backends.skypilot import SkyPilotBackend

    return SkyPilotBackend(endpoint, token).service_account()
