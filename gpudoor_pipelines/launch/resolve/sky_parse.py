"""SkyPilot's own reading of a task: its resource candidates (``sky.Resources.from_yaml_config``) and the
whole task (``sky.Task.from_yaml_config``), with a failure as an error that names the file and the field.

Importing ``sky`` costs a command some two CPU-seconds, and an agent calls ``gpudoor where`` and
``gpudoor launch`` in loops: what SkyPilot read is kept on disk (:func:`.sky_env.reading_cache`), keyed
by what it read and SkyPilot's version, so the same task read again imports nothing. A task SkyPilot
refuses is not kept: it is read again, and refused again with SkyPilot's own words."""

from __future__ import annotations

import copy
import dataclasses
import functools
import hashlib
import json
import os
import re
import tempfile
from collections.abc import Callable
from importlib import metadata
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
    kept = _kept("resources", resources, lambda: [_encode(c) for c in _read_candidates(resources, source)])
    return tuple(_decode(c) for c in kept)


def _encode(c: Candidate) -> dict[str, Any]:
    return {**dataclasses.asdict(c), "features": sorted(c.features), "fields": [list(kv) for kv in c.fields]}


def _decode(d: dict[str, Any]) -> Candidate:
    return Candidate(
        d["accelerator"], d["count"], d["use_spot"], frozenset(d["features"]), tuple((k, v) for k, v in d["fields"])
    )


def _read_candidates(resources: dict[str, Any], source: str) -> list[Candidate]:
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
    return list(unique.values())


def _candidate_key(c: Candidate) -> tuple[Any, ...]:
    return ((c.accelerator or "").lower(), c.count, not c.use_spot, repr(c.fields))


def validate_with_skypilot(config: dict[str, Any], source: str) -> None:
    """Builds a ``sky.Task`` from the spec with SkyPilot's own parser (imports ``sky`` lazily).

    An input declared with no value (``envs: {NAME: null}``) is read as given: each launch gives it (and is
    refused without it, by name); SkyPilot, reading the file alone, would refuse it as unset.

    Raises:
        LaunchConfigError: with SkyPilot's message, naming the file.
    """
    envs = config.get("envs")
    if isinstance(envs, dict) and None in envs.values():
        config = {**config, "envs": {k: "" if v is None else v for k, v in envs.items()}}
    _kept("task", config, lambda: _read_task(config, source))


def _read_task(config: dict[str, Any], source: str) -> bool:
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
    return True


def _field_from_sky_message(message: str) -> str:
    match = re.search(r"'([a-zA-Z_][a-zA-Z0-9_.]*)'", message)
    return match.group(1) if match else "(task)"


@functools.cache
def _skypilot_version() -> str:
    for name in ("skypilot", "skypilot-nightly"):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return "unknown"


def _kept(kind: str, what: Any, read: Callable[[], Any]) -> Any:
    """SkyPilot's reading of ``what`` (``read()``), kept on disk by what was read and SkyPilot's version.

    A reading that raises is not kept. A cache that cannot be read or written is read past: the reading is
    then SkyPilot's own, as without a cache."""
    try:
        text = json.dumps([kind, _skypilot_version(), what], sort_keys=True)
    except (TypeError, ValueError):  # a value JSON cannot hold (a YAML date): read it, keep nothing
        return read()
    path = sky_env.reading_cache() / f"{hashlib.sha256(text.encode()).hexdigest()}.json"
    try:
        return json.loads(path.read_text())["reading"]
    except (OSError, ValueError, KeyError):
        pass
    reading = read()
    if json.loads(json.dumps(reading)) != reading:  # JSON would not give it back as it is: keep nothing
        return reading
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as f:
            json.dump({"reading": reading}, f)
        os.replace(f.name, path)
    except OSError:
        pass
    return reading
