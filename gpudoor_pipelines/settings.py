"""Configuration, in one place: which backend, which bucket, which API server.

Every setting comes from an environment variable, bound with ``dg.EnvVar`` so values are read when
a run starts (and secrets never land in run config). With nothing set, everything runs on this
machine: the local backend and a transit bucket in a local folder.

| variable | meaning |
|---|---|
| ``GPUDOOR_BACKEND`` | ``local`` (default) or ``skypilot`` |
| ``SKYPILOT_API_SERVER_ENDPOINT`` | the team's SkyPilot API server (``skypilot`` backend) |
| ``SKYPILOT_SERVICE_ACCOUNT_TOKEN`` | a SkyPilot service-account token, if the server needs one |
| ``GPUDOOR_COST_OWNER`` | cost owner label for every job (default: the fleet's default) |
| ``GPUDOOR_HOME`` | state folder of the embedded default (default ``~/.gpudoor``) |
| ``GPUDOOR_USER`` | who launches, for labels and per-user caps (an agent's or service's name; default: |
| | the service account, else the OS user) |
| ``GPUDOOR_LABEL_KEY`` | the deployment's key: jobs' run identity labels are signed with it (the API server |
| | checks them with ``GPUDOOR_POLICY_LABEL_KEY``, the orphan reconciler trusts only signed ones) |
| ``GPUDOOR_DEPLOYMENT`` | this Dagster deployment's name on its jobs (default: Dagster+'s deployment name, |
| | else ``default``); each deployment's orphan reconciler judges only its own jobs |
| ``GPUDOOR_TRANSIT`` and ``GPUDOOR_S3_*`` | the transit bucket (see ``gpudoor_pipelines.transit.resource``) |
| ``GPUDOOR_OUTAGE_TOLERANCE_S`` | how long an outage of the bucket or the API server is waited out (default 300; |
| | see ``gpudoor_pipelines.outage``) |
"""

from __future__ import annotations

import os
from typing import Any

import dagster as dg

from gpudoor_pipelines.launch.client import PipesSkyPilotClient
from gpudoor_pipelines.launch.config import ENV_SETTINGS
from gpudoor_pipelines.transit.io_manager import TransitIOManager
from gpudoor_pipelines.transit.resource import bucket_from_env


def _env(name: str) -> Any:
    # Only variables that are set are bound: an EnvVar that is unset fails the run.
    return dg.EnvVar(name) if os.environ.get(name) else None


def build_resources() -> dict[str, Any]:
    """The resources of the code location, bound to environment variables."""
    transit = bucket_from_env()
    skypilot_kwargs: dict[str, Any] = {"transit": transit}
    for field, var in ENV_SETTINGS.items():
        value = _env(var)
        if value is not None:
            skypilot_kwargs[field] = value
    return {
        "transit": transit,
        "skypilot": PipesSkyPilotClient(**skypilot_kwargs),
        "io_manager": TransitIOManager(transit=transit),
    }
