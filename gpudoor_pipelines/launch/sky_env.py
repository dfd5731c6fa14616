"""Process settings that must be in place before ``sky`` is imported.

SkyPilot reports usage to its maintainers by default; this package never lets it send anything off
the machine, so every code path that imports ``sky`` calls :func:`prepare` first.
"""

from __future__ import annotations

import os
from pathlib import Path

from gpudoor_pipelines.transit.bucket import gpudoor_home


def prepare() -> None:
    """Switches off SkyPilot's usage collection for this process (idempotent)."""
    os.environ["SKYPILOT_DISABLE_USAGE_COLLECTION"] = "1"


def reading_cache() -> Path:
    """Where SkyPilot's reading of task files is kept between processes (``$GPUDOOR_HOME/cache/skypilot``,
    else ``~/.gpudoor/cache/skypilot``): a command that reads a task file it read before needs no ``sky``."""
    return gpudoor_home() / "cache" / "skypilot"
