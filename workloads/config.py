"""Reading the environment contract: every workload takes its settings from environment variables."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

# Exit status for a configuration the program cannot run with: distinct from 1 (a crash) so the
# launcher can tell "fix your settings" from "the job broke".
CONFIG_ERROR_EXIT = 2


class ConfigError(ValueError):
    """A required environment variable is missing or has an unusable value."""


def env_str(name: str, default: str | None = None) -> str:
    """Return the stripped value of ``name``, or ``default`` when unset or empty.

    Raises:
        ConfigError: the variable is unset and has no default.
    """
    value = os.environ.get(name, "").strip()
    if value:
        return value
    if default is None:
        raise ConfigError(f"{name} is required but not set")
    return default


def env_int(name: str, default: int | None = None) -> int:
    """Return ``name`` parsed as an int (see :func:`env_str`)."""
    raw = env_str(name, None if default is None else str(default))
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"{name} must be an integer, got {raw!r}") from None


def env_float(name: str, default: float | None = None) -> float:
    """Return ``name`` parsed as a float (see :func:`env_str`)."""
    raw = env_str(name, None if default is None else str(default))
    try:
        return float(raw)
    except ValueError:
        raise ConfigError(f"{name} must be a number, got {raw!r}") from None


def env_flag(name: str) -> bool:
    """Return True when ``name`` is set to 1/true/yes (case-insensitive)."""
    return os.environ.get(name, "").strip().lower() in {"1", "true", "yes"}


def node_rank() -> int:
    """This node's rank in a SkyPilot job (``SKYPILOT_NODE_RANK``; 0 for single-node jobs)."""
    return env_int("SKYPILOT_NODE_RANK", 0)


def run_main(main: Callable[[], int | None]) -> None:
    """Run a program's ``main`` and exit with its status; a ConfigError exits 2 with one clear line."""
    try:
        status = main()
    except ConfigError as exc:
        print(f"configuration error: {exc}", file=sys.stderr, flush=True)
        sys.exit(CONFIG_ERROR_EXIT)
    sys.exit(status or 0)
