"""SkyPilot's own reading of a task: its resource candidates (``sky.Resources.from_yaml_config``) and the
whole task (``sky.Task.from_yaml_config``), with a failure as an error that names the file and the field.
Imports ``sky`` only when called."""

from __future__ import annotations

import copy
import dataclasses
import re
from typing import Any

from gpudoor_pipelines.launch import sky_env
from gpudoor_pipelines.launch.errors import LaunchConfigError


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One resource set a task accepts, as SkyPilot reads it (a task with a GPU set has several).

    Attributes:
        accelerator: the GPU type (None: a CPU-only candidate).
        count: GPUs per node.
        use_spot: the candidate asks for spot capacity.
        features: SkyPilot cloud features the candidate needs (``open_ports``, ``spot_instance``, ...).
        fields: the candidate's own resource fields (an ``any_of``/``ordered`` entry), pinned when chosen.
    """

    accelerator: str | None
    count: float
    use_spot: bool = False
    features: frozenset[str] = frozenset()
    fields: tuple[tuple[str, Any], ...] = ()

    def describe(self) -> str:
        """``L4:1``, ``L4:1 (spot)``, or ``CPU-only``."""
        what = f"{self.accelerator}:{_count_text(self.count)}" if self.accelerator else "CPU-only"
        return what + (" (spot)" if self.use_spot else "")


def _count_text(count: float) -> str:
    return str(int(count)) if float(count).is_integer() else str(count)


def sky_candidates(resources: dict[str, Any], source: str = "(spec)") -> tuple[Candidate, ...]:
    """The candidates of a task's ``resources``, as SkyPilot's ``Resources.from_yaml_config`` reads them.

    A set (``{L4:1, H100:1}``, ``any_of``) comes back in a fixed order (by GPU, count, spot), so the
    choice among them never depends on hashing; a list or ``ordered`` keeps the user's order.

    Raises:
        LaunchConfigError: SkyPilot cannot read the resources.
    """
    sky_env.prepare()
    import sky

    base = {k: v for k, v in resources.items() if k not in ("any_of", "ordered")}
    entries = resources.get("any_of") or resources.get("ordered") or [{}]
    out: list[Candidate] = []
    for entry in entries:
        own = {k: v for k, v in dict(entry).items() if k != "accelerators"}
        try:
            parsed = sky.Resources.from_yaml_config(copy.deepcopy({**base, **dict(entry)}))
        except Exception as e:  # SkyPilot raises ValueError and its own errors alike.
            message = " ".join(str(e).split())[:400]
            raise LaunchConfigError(
                source, "resources", f"SkyPilot cannot read the resources: {message}", "correct them as SkyPilot says"
            ) from None
        found = []
        for r in parsed:
            ((gpu, count),) = (r.accelerators or {None: 0}).items()
            features = frozenset(f.value for f in r.get_required_cloud_features())
            found.append(
                Candidate(gpu, count, bool(r.use_spot), features, tuple(sorted(own.items(), key=lambda kv: kv[0])))
            )
        if isinstance(parsed, set):
            found.sort(key=_candidate_key)
        out += found
    if "ordered" not in resources:
        is_list = isinstance(resources.get("accelerators"), list)
        if not is_list:
            out.sort(key=_candidate_key)
    unique: dict[str, Candidate] = {}
    for c in out:
        unique.setdefault(repr(c), c)
    return tuple(unique.values())


def _candidate_key(c: Candidate) -> tuple[Any, ...]:
    return ((c.accelerator or "").lower(), c.count, not c.use_spot, repr(c.fields))


def validate_with_skypilot(config: dict[str, Any], source: str) -> None:
    """Builds a ``sky.Task`` from the spec with SkyPilot's own parser (imports ``sky`` lazily).

    Raises:
        LaunchConfigError: with SkyPilot's message, naming the file.
    """
    sky_env.prepare()
    import sky

    try:
        sky.Task.from_yaml_config(copy.deepcopy(config))
    except Exception as e:  # SkyPilot raises ValueError, jsonschema and its own errors alike.
        message = str(e).strip().splitlines()
        field = _field_from_sky_message(" ".join(message))
        raise LaunchConfigError(
            source,
            field,
            f"SkyPilot rejects the task: {' '.join(message)[:500]}",
            "correct the field as SkyPilot says",
        ) from None


def _field_from_sky_message(message: str) -> str:
    match = re.search(r"'([a-zA-Z_][a-zA-Z0-9_.]*)'", message)
    return match.group(1) if match else "(task)"
