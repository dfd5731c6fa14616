"""Task specs: plain SkyPilot task YAML files, loaded and checked before anything is launched.

A spec says what a job needs (GPUs, nodes, setup, run, inputs as ``envs``); it never says where it
runs. Paths, buckets, keys and cluster names are injected per pool by the fleet rules, so the
checks here refuse them with a message that says where they belong instead.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import re
from pathlib import Path
from typing import Any

import yaml

from gpudoor_pipelines.launch.errors import LaunchConfigError
from gpudoor_pipelines.launch.fleet import DEFAULT_SPECS_DIR

# Top-level fields of a SkyPilot task (sky/utils/schemas.py:get_task_schema, 0.14.1).
SKYPILOT_TASK_FIELDS = frozenset(
    {
        "name", "workdir", "event_callback", "num_nodes", "resources", "file_mounts", "service", "pool",
        "setup", "run", "envs", "secrets", "volumes", "config", "_user_specified_yaml",
    }
)  # fmt: skip
# Fields that would pin a spec to one cluster or carry data locations: the fleet owns them.
_TARGET_FIELDS = {
    "infra": "the route picks the pool; override it with the launch's `pool`/`infra` config or the `gpudoor/pool` run tag",
    "cloud": "the route picks the pool; override it with the launch's `pool`/`infra` config",
    "region": "the route picks the pool",
    "zone": "the route picks the pool",
}
_FORBIDDEN_TOP = {
    "file_mounts": "data crosses clusters only through the transit bucket; the launcher passes input/output URIs as env",
    "workdir": "the launcher syncs the project's workloads itself",
    "secrets": "credentials are injected by the fleet policy and never live in a task file",
    "volumes": "per-cluster volumes are injected by the fleet policy",
}
_PATHLIKE = re.compile(r"^(/|~|[a-z0-9]+://)", re.IGNORECASE)
_SECRETLIKE = re.compile(r"(KEY|SECRET|TOKEN|PASSWORD|CREDENTIAL)", re.IGNORECASE)


@dataclasses.dataclass(frozen=True)
class TaskSpec:
    """A validated task spec.

    Attributes:
        path: the YAML file.
        kind: the step kind (the file's stem: ``caption``, ``train``, ...), used for routing.
        config: the task YAML as a mapping (never mutated; copy before changing).
    """

    path: str
    kind: str
    config: dict[str, Any]

    @property
    def name(self) -> str:
        """The task's name."""
        return str(self.config.get("name") or self.kind)

    @property
    def num_nodes(self) -> int:
        """How many nodes the job spans."""
        return int(self.config.get("num_nodes") or 1)

    @property
    def envs(self) -> dict[str, str]:
        """The spec's declared inputs and their defaults."""
        return {str(k): "" if v is None else str(v) for k, v in (self.config.get("envs") or {}).items()}

    @property
    def accelerators(self) -> dict[str, int]:
        """GPU candidates: type → count per node (any one of them satisfies the job)."""
        return parse_accelerators(self.config.get("resources", {}).get("accelerators"), self.path)

    @property
    def is_cpu_only(self) -> bool:
        """A job that asks for no GPU (data prep, merges): routed to the fleet's CPU pools."""
        return not self.accelerators

    @property
    def vcpus(self) -> int:
        """The vCPUs each node asks for (the number in ``cpus: 8+``), for vCPU caps."""
        return parse_cpus((self.config.get("resources") or {}).get("cpus"), self.path)

    @property
    def ports(self) -> list[int]:
        """Ports the job serves on (demos)."""
        ports = (self.config.get("resources") or {}).get("ports")
        if ports is None:
            return []
        return [int(p) for p in (ports if isinstance(ports, list) else [ports])]


def parse_accelerators(value: Any, source: str = "(spec)") -> dict[str, int]:
    """Parses SkyPilot's ``resources.accelerators`` forms into ``{type: count}``.

    Accepts ``"H100"``, ``"H100:8"``, ``{"H100": 8, "L4": 1}`` and ``["H100:1", "L4:1"]``.
    """
    if value is None:
        return {}
    items: list[tuple[str, Any]]
    if isinstance(value, str):
        items = [_split_accel(value)]
    elif isinstance(value, dict):
        items = list(value.items())
    elif isinstance(value, list):
        items = [_split_accel(str(v)) for v in value]
    else:
        raise LaunchConfigError(
            source,
            "resources.accelerators",
            f"cannot read {value!r}",
            "write e.g. `H100:1` or `{L4: 1, H100: 1}`",
        )
    out: dict[str, int] = {}
    for name, count in items:
        try:
            n = int(count if count is not None else 1)
        except (TypeError, ValueError):
            n = -1
        if n <= 0:
            raise LaunchConfigError(
                source,
                f"resources.accelerators.{name}",
                f"count {count!r} is not a positive whole number",
                "use e.g. `H100:1`",
            )
        out[str(name)] = n
    return out


#: vCPUs counted against a cap for a task that names none: SkyPilot's default is 2 to 8 by cloud
#: (``_DEFAULT_NUM_VCPUS`` in ``sky/catalog``); counting the common largest never overshoots a cap.
DEFAULT_VCPUS = 8


def parse_cpus(value: Any, source: str = "(spec)") -> int:
    """The least number of vCPUs SkyPilot's ``resources.cpus`` asks for: ``8``, ``"8"``, ``"8+"``."""
    if value is None:
        return DEFAULT_VCPUS
    text = str(value).strip().rstrip("+")
    try:
        count = float(text)
    except ValueError:
        count = -1
    if count <= 0:
        raise LaunchConfigError(source, "resources.cpus", f"cannot read {value!r}", "write e.g. `cpus: 8+` or `cpus: 4`")
    return max(1, int(count))


def _split_accel(text: str) -> tuple[str, Any]:
    name, _, count = text.partition(":")
    return name.strip(), (count.strip() or 1)


def check_spec_config(config: Any, source: str, kind: str) -> None:
    """The project's own checks, cheap and SkyPilot-free; run at definitions load and before launch.

    Raises:
        LaunchConfigError: naming the file, the field and the fix.
    """
    if not isinstance(config, dict):
        raise LaunchConfigError(
            source, "(top level)", "a task spec must be a YAML mapping", "see task_specs/caption.yaml"
        )
    for key in config:
        if key not in SKYPILOT_TASK_FIELDS:
            close = difflib.get_close_matches(str(key), sorted(SKYPILOT_TASK_FIELDS), n=1)
            hint = (
                f"did you mean '{close[0]}'?"
                if close
                else f"known fields: {sorted(SKYPILOT_TASK_FIELDS - {'_user_specified_yaml'})}"
            )
            raise LaunchConfigError(
                source, str(key), "unknown field in a SkyPilot task", f"remove it; {hint}"
            )
        if key in _FORBIDDEN_TOP:
            raise LaunchConfigError(
                source, key, "not allowed in a task spec", f"remove it: {_FORBIDDEN_TOP[key]}"
            )
    if not config.get("run"):
        raise LaunchConfigError(source, "run", "missing", "add the command the job runs")
    resources = config.get("resources") or {}
    if not isinstance(resources, dict):
        raise LaunchConfigError(
            source, "resources", "must be a mapping", "write resources as `accelerators: H100:1` etc."
        )
    for key, why in _TARGET_FIELDS.items():
        if key in resources:
            raise LaunchConfigError(
                source, f"resources.{key}", "pins the spec to one target", f"remove it: {why}"
            )
    parse_accelerators(resources.get("accelerators"), source)
    parse_cpus(resources.get("cpus"), source)
    num_nodes = config.get("num_nodes", 1)
    if not isinstance(num_nodes, int) or num_nodes < 1:
        raise LaunchConfigError(
            source, "num_nodes", f"{num_nodes!r} is not a positive whole number", "use e.g. `num_nodes: 2`"
        )
    envs = config.get("envs") or {}
    if not isinstance(envs, dict):
        raise LaunchConfigError(source, "envs", "must be a mapping", "write `envs: {NAME: value}`")
    for name, value in envs.items():
        if _SECRETLIKE.search(str(name)):
            raise LaunchConfigError(
                source,
                f"envs.{name}",
                "looks like a credential",
                "remove it: credentials are injected as SkyPilot secrets by the fleet policy",
            )
        if value is not None and _PATHLIKE.match(str(value)):
            raise LaunchConfigError(
                source,
                f"envs.{name}",
                f"holds a path or URI ({value!r})",
                "remove it: per-cluster paths come from the pool's `env` in task_specs/fleet.yaml, data URIs from the launcher",
            )


def validate_with_skypilot(config: dict[str, Any], source: str) -> None:
    """Builds a ``sky.Task`` from the spec with SkyPilot's own parser (imports ``sky`` lazily).

    Raises:
        LaunchConfigError: with SkyPilot's message, naming the file.
    """
    from gpudoor_pipelines.launch import sky_env

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


def spec_path(name_or_path: str | Path, specs_dir: str | Path | None = None) -> Path:
    """Resolves ``caption`` or ``caption.yaml`` or a path to the spec file."""
    p = Path(name_or_path)
    if p.suffix in {".yaml", ".yml"} and (p.is_absolute() or p.exists()):
        return p
    base = Path(specs_dir) if specs_dir else DEFAULT_SPECS_DIR
    return base / (p.name if p.suffix else f"{p.name}.yaml")


@functools.lru_cache(maxsize=64)
def _load_cached(path: str, mtime: float, kind: str, skypilot: bool) -> TaskSpec:
    with open(path) as f:
        try:
            raw = yaml.safe_load(f)
        except yaml.YAMLError as e:
            raise LaunchConfigError(path, "(yaml)", f"not valid YAML: {e}", "fix the YAML syntax") from None
    check_spec_config(raw, path, kind)
    if skypilot:
        validate_with_skypilot(raw, path)
    return TaskSpec(path=path, kind=kind, config=raw)


def load_spec(
    name_or_path: str | Path, specs_dir: str | Path | None = None, kind: str | None = None, *, skypilot: bool = False
) -> TaskSpec:
    """Loads a task spec and checks it, once per file version (cached by path and modification time).

    Args:
        name_or_path: ``caption``, ``caption.yaml`` or a path.
        specs_dir: where named specs live (default ``task_specs/``).
        kind: the step kind; defaults to the file's stem.
        skypilot: also parse it with SkyPilot's own ``sky.Task`` (imports ``sky``); launches do.

    Raises:
        LaunchConfigError: the file is missing or invalid.
    """
    p = spec_path(name_or_path, specs_dir)
    if not p.is_file():
        raise LaunchConfigError(
            str(p), "(file)", "expected task spec does not exist", f"create {p.name} in {p.parent}"
        )
    return _load_cached(str(p.resolve()), p.stat().st_mtime, kind or p.stem, skypilot)
