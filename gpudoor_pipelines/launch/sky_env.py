"""Process settings that must be in place before ``sky`` is imported.

SkyPilot reports usage to its maintainers by default; this package never lets it send anything off
the machine, so every code path that imports ``sky`` calls :func:`prepare` first.
"""

from __future__ import annotations

import os


def prepare() -> None:
    """Switches off SkyPilot's usage collection for this process (idempotent)."""
    os.environ["SKYPILOT_DISABLE_USAGE_COLLECTION"] = "1"
