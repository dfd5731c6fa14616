"""Shared fixtures: every test gets its own GPUDOOR_HOME and DAGSTER_HOME, and SkyPilot stays offline."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

PROJECT_ROOT = Path(__file__).resolve().parents[1]
SPECS_DIR = PROJECT_ROOT / "task_specs"

os.environ["SKYPILOT_DISABLE_USAGE_COLLECTION"] = "1"


@pytest.fixture(autouse=True)
def _isolated_homes(tmp_path_factory, monkeypatch):
    home = tmp_path_factory.mktemp("gpudoor_home")
    monkeypatch.setenv("GPUDOOR_HOME", str(home))
    dagster_home = tmp_path_factory.mktemp("dagster_home")
    (dagster_home / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
    monkeypatch.setenv("DAGSTER_HOME", str(dagster_home))
    for var in ("GPUDOOR_BACKEND", "GPUDOOR_TRANSIT", "SKYPILOT_API_SERVER_ENDPOINT"):
        monkeypatch.delenv(var, raising=False)
    yield home
