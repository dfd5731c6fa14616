"""Task specs: plain SkyPilot task YAML files, loaded and checked before anything is launched.

A spec says what a job needs (GPUs, nodes, setup, run, inputs as ``envs``); it never says where it
runs. Paths, buckets, keys and cluster names are injected per pool by the fleet rules, so the
checks here refuse them with a message that says where they belong instead.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import re
from pathlib import Path
from typing import Any

import yaml

from gpudoor_pipelines.launch.errors import LaunchConfigError
from gpudoor_pipelines.launch.resolve.fleet import DEFAULT_SPECS_DIR, Fleet
from gpudoor_pipelines.launch.resolve.sky_parse import Candidate, sky_candidates, validate_with_skypilot

# Top-level fields of a SkyPilot task (sky/utils/schemas.py:get_task_schema, 0.14.1).
SKYPILOT_TASK_FIELDS = frozenset(
    {
        "name",
        "workdir",
        "event_callback",
        "num_nodes",
        "resources",
        "file_mounts",
        "service",
        "pool",
        "setup",
        "run",
        "envs",
        "secrets",
        "volumes",
        "config",
        "_user_specified_yaml",
    }
)
_FORBIDDEN_TOP = {
    "file_mounts": "data crosses clusters only through the transit bucket: the launcher passes input and output URIs "
    "as env",
    "volumes": "per-cluster paths are injected by the fleet (the pool's `env` in task_specs/fleet.yaml)",
    "service": "the door launches jobs and demos, not SkyServe services: launch the server as a demo (a cluster with "
    "`ports`)",
}
_PATHLIKE = re.compile(r"^(/|~|[a-z0-9]+://)", re.IGNORECASE)
#: Whole parts of an env name that mark a credential (``HF_TOKEN``, ``WANDB_API_KEY``; not ``MAX_TOKENS``).
CREDENTIAL_NAME_PARTS = frozenset(
    {"TOKEN", "KEY", "SECRET", "SECRETS", "PASSWORD", "PASSWD", "CREDENTIAL", "CREDENTIALS"}
)


def looks_like_credential(name: str) -> bool:
    """Whether an env name has a credential word as one of its ``_``-separated parts."""
    return any(part in CREDENTIAL_NAME_PARTS for part in str(name).upper().split("_"))


@dataclasses.dataclass(frozen=True)
class TaskSpec:
    """A validated task spec.

    Attributes:
        path: the YAML file.
        kind: the file's stem (``caption``, ``train``, ...), which names its jobs; the route comes
            from the launcher's step, never from the file's name.
        config: the task YAML as a mapping (never mutated; copy before changing).
        problems: what the door refuses in the file, when loaded without ``strict``.
    """

    path: str
    kind: str
    config: dict[str, Any]
    problems: tuple[LaunchConfigError, ...] = ()

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
    def required(self) -> tuple[str, ...]:
        """The inputs a launch must give: declared the SkyPilot way, with no value (``envs: {NAME: null}``)."""
        envs = self.config.get("envs")
        return tuple(str(k) for k, v in envs.items() if v is None) if isinstance(envs, dict) else ()

    @property
    def accelerators(self) -> dict[str, int]:
        """GPU candidates: type → count per node (any one of them satisfies the job)."""
        return parse_accelerators(self.config.get("resources", {}).get("accelerators"), self.path)

    @property
    def is_cpu_only(self) -> bool:
        """A job that asks for no GPU (data prep, merges): routed to the fleet's CPU pools."""
        return all(c.accelerator is None for c in self.candidates)

    @functools.cached_property
    def candidates(self) -> tuple[Candidate, ...]:
        """The resource sets the task accepts, read by SkyPilot's own parser (imports ``sky``)."""
        return sky_candidates(self.config.get("resources") or {}, self.path)

    @property
    def ordered(self) -> bool:
        """The candidates are in order of preference (``ordered:`` or a list of accelerators), not a set."""
        resources = self.config.get("resources") or {}
        return "ordered" in resources or isinstance(resources.get("accelerators"), list)

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


def gpus_per_node(accelerators: Any) -> int:
    """GPUs a node of a job got, from its ``resources.accelerators`` in any form: several types listed are
    alternatives, so it got one of them (the most, counted conservatively); 0 for none or an unreadable value."""
    try:
        return max(parse_accelerators(accelerators).values(), default=0)
    except LaunchConfigError:
        return 0


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
        # SkyPilot's set form `{H100:8, A100:8}` is a mapping of `TYPE:COUNT` keys with no values.
        items = [_split_accel(str(k)) if v is None and ":" in str(k) else (k, v) for k, v in value.items()]
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
        raise LaunchConfigError(
            source, "resources.cpus", f"cannot read {value!r}", "write e.g. `cpus: 8+` or `cpus: 4`"
        )
    return max(1, int(count))


def _split_accel(text: str) -> tuple[str, Any]:
    name, _, count = text.partition(":")
    return name.strip(), (count.strip() or 1)


def task_problems(
    config: Any, source: str, *, launcher_inputs: bool = False, from_file: bool = True
) -> list[LaunchConfigError]:
    """Every problem of a task file the door refuses, without SkyPilot: the same on client and server.

    Args:
        config: the task YAML mapping.
        source: the file (or task) for messages.
        launcher_inputs: the task came through the door's launcher (or was already passed by the
            policy): its env holds the input URIs the launcher filled in, and SkyPilot may have added
            file mounts for the workdir on its way to the workers; the rules on paths and mounts were
            checked on the file by the launcher.
        from_file: ``config`` is the file as written (not a task the server received, whose secrets
            always carry values: from the file or from ``--secret``, which it cannot tell apart).
    """
    if not isinstance(config, dict):
        return [
            LaunchConfigError(
                source, "(top level)", "a task spec must be a YAML mapping", "see task_specs/caption.yaml"
            )
        ]
    problems: list[LaunchConfigError] = []

    def add(field: str, problem: str, fix: str) -> None:
        problems.append(LaunchConfigError(source, field, problem, fix))

    for key in config:
        if str(key).startswith("_"):
            continue  # SkyPilot's own bookkeeping (`_metadata`, `_user_specified_yaml`), never a user's
        if key not in SKYPILOT_TASK_FIELDS:
            if from_file:  # a task the server received was already checked by SkyPilot's schema
                close = difflib.get_close_matches(str(key), sorted(SKYPILOT_TASK_FIELDS), n=1)
                hint = (
                    f"did you mean '{close[0]}'?"
                    if close
                    else f"known fields: {sorted(SKYPILOT_TASK_FIELDS - {'_user_specified_yaml'})}"
                )
                add(str(key), "unknown field in a SkyPilot task", f"remove it; {hint}")
        elif key == "service" and isinstance(config[key], dict) and set(config[key]) == {"pool"}:
            continue  # a managed-job pool: SkyPilot writes a pool's `pool:` section as `service: {pool: ...}`
        elif key in _FORBIDDEN_TOP and config[key] and not (launcher_inputs and key in ("file_mounts", "volumes")):
            # (On its way to a pool's workers, SkyPilot turns the launcher's workdir into file mounts.)
            add(key, "not taken by the door", f"remove it: {_FORBIDDEN_TOP[key]}")
    if isinstance(config.get("workdir"), dict):
        add(
            "workdir",
            "a git workdir is not synced by the door",
            "clone the repository in `setup`, or use a local folder as workdir",
        )
    resources = config.get("resources") or {}
    if not isinstance(resources, dict):
        add("resources", "must be a mapping", "write resources as `accelerators: H100:1` etc.")
        resources = {}
    entries = [("resources", resources)]
    for key in ("any_of", "ordered"):
        entries += [(f"resources.{key}[{i}]", e) for i, e in enumerate(resources.get(key) or []) if isinstance(e, dict)]
    for where, entry in entries:
        for bad in (
            _accel_problem(entry.get("accelerators"), source, f"{where}.accelerators"),
            _cpus_problem(entry.get("cpus"), source, f"{where}.cpus"),
        ):
            if bad:
                problems.append(bad)
    secrets = config.get("secrets") or {}
    if not isinstance(secrets, dict):
        add("secrets", "must be a mapping", "write `secrets: {HF_TOKEN: null}`")
    elif from_file:
        for name, value in secrets.items():
            if value not in (None, ""):
                add(
                    f"secrets.{name}",
                    "holds a value: a secret never lives in a task file",
                    f"write `{name}: null`; the value comes from the launcher's environment",
                )
    num_nodes = config.get("num_nodes", 1)
    if not isinstance(num_nodes, int) or num_nodes < 1:
        add("num_nodes", f"{num_nodes!r} is not a positive whole number", "use e.g. `num_nodes: 2`")
    envs = config.get("envs") or {}
    if not isinstance(envs, dict):
        add("envs", "must be a mapping", "write `envs: {NAME: value}`")
        envs = {}
    for name, value in envs.items():
        if looks_like_credential(name):
            add(
                f"envs.{name}",
                "looks like a credential",
                "declare it under `secrets:` with no value (`secrets: {NAME: null}`); "
                "the fleet lists the secrets a job may ask for, and the value comes from the launcher's environment",
            )
        elif (
            not launcher_inputs
            and value is not None
            and _PATHLIKE.match(str(value))
            # SkyPilot's client adds its own settings (the API server's URL) to a task it sends.
            and (from_file or not name.startswith("SKYPILOT_"))
        ):
            add(
                f"envs.{name}",
                f"holds a path or URI ({value!r})",
                "remove it: per-cluster paths come from the pool's `env` in task_specs/fleet.yaml, data URIs from the "
                "launcher",
            )
    return problems


def task_infra(resources: dict[str, Any], source: str, fleet: Fleet, problems: list[LaunchConfigError]) -> str | None:
    """The infra a task names itself (``infra``, or ``cloud``/``region``/``zone``), on its own or in every candidate.

    A task may name a pool's infra (``k8s/inference-prod``) as ``--infra`` would; routing then treats
    it as an override. One that is no pool of the fleet, or candidates naming different infras, add
    a problem to ``problems`` and route as if no infra was named (so every other problem shows too).
    The field is always ``resources.infra``: SkyPilot writes ``cloud``/``region`` and each
    candidate's infra back as ``infra``, and the server must name the same field.
    """

    def one(entry: dict[str, Any]) -> str | None:
        if entry.get("infra"):
            return str(entry["infra"])
        cloud = entry.get("cloud")
        return "/".join(str(x) for x in (cloud, entry.get("region"), entry.get("zone")) if x) if cloud else None

    base = one(resources)
    entries = [e for e in (resources.get("any_of") or resources.get("ordered") or []) if isinstance(e, dict)]
    found = sorted({str(one(e) or base) for e in entries if one(e) or base} if entries else ({base} if base else set()))
    if not found:
        return None
    if len(found) > 1:
        problems.append(
            LaunchConfigError(
                source,
                "resources.infra",
                f"the candidates name different infras {found}",
                "remove infra: the route picks the pool",
            )
        )
        return None
    infra = found[0]
    if fleet.pool_for_infra(infra) is None:
        problems.append(
            LaunchConfigError(
                source,
                "resources.infra",
                f"'{infra}' is not a pool of the fleet ({fleet.source})",
                f"remove it: the route picks the pool (or name one of {[p.infra for p in fleet.pools.values()]})",
            )
        )
        return None
    return infra


def _accel_problem(value: Any, source: str, field: str) -> LaunchConfigError | None:
    try:
        parse_accelerators(value, source)  # counts are whole numbers: the fleet lends whole GPUs
    except LaunchConfigError as e:
        return LaunchConfigError(source, field, e.problem, e.fix)
    return None


def _cpus_problem(value: Any, source: str, field: str) -> LaunchConfigError | None:
    try:
        parse_cpus(value, source)
    except LaunchConfigError as e:
        return LaunchConfigError(source, field, e.problem, e.fix)
    return None


def check_spec_config(config: Any, source: str, kind: str = "") -> None:
    """The project's own checks, cheap and SkyPilot-free; run at definitions load and before launch.

    Raises:
        LaunchConfigError: naming the file, the field and the fix (every problem, at once).
    """
    problems = task_problems(config, source)
    if problems:
        raise LaunchConfigError.combine(problems)


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
            documents = [d for d in yaml.safe_load_all(f) if d is not None]
        except yaml.YAMLError as e:
            raise LaunchConfigError(path, "(yaml)", f"not valid YAML: {e}", "fix the YAML syntax") from None
    if len(documents) > 1:
        raise LaunchConfigError(
            path,
            "(documents)",
            f"{len(documents)} YAML documents: a pipeline or job group",
            "pipelines and job groups are not supported yet; launch each task on its own",
        )
    raw = documents[0] if documents else None
    problems = task_problems(raw, path)
    if not isinstance(raw, dict):
        raise LaunchConfigError.combine(problems)
    if skypilot:
        try:
            validate_with_skypilot(raw, path)
        except LaunchConfigError as e:  # SkyPilot cannot read it: nothing can be routed, say all now
            raise LaunchConfigError.combine([*problems, e]) from None
    return TaskSpec(path=path, kind=kind, config=raw, problems=tuple(problems))


def load_spec(
    name_or_path: str | Path,
    specs_dir: str | Path | None = None,
    kind: str | None = None,
    *,
    skypilot: bool = False,
    strict: bool = True,
) -> TaskSpec:
    """Loads a task spec and checks it, once per file version (cached by path and modification time).

    Args:
        name_or_path: ``caption``, ``caption.yaml`` or a path.
        specs_dir: where named specs live (default ``task_specs/``).
        kind: the spec's kind (names its jobs); defaults to the file's stem. Routing never reads it.
        skypilot: also parse it with SkyPilot's own ``sky.Task`` (imports ``sky``); launches do.
        strict: raise the file's own problems now; otherwise they travel in ``TaskSpec.problems``
            so that :func:`~gpudoor_pipelines.launch.resolve.request.resolve` reports them with every other.

    Raises:
        LaunchConfigError: the file is missing or invalid.
    """
    p = spec_path(name_or_path, specs_dir)
    if not p.is_file():
        raise LaunchConfigError(str(p), "(file)", "expected task spec does not exist", f"create {p.name} in {p.parent}")
    spec = _load_cached(str(p.resolve()), p.stat().st_mtime, kind or p.stem, skypilot)
    if strict and spec.problems:
        raise LaunchConfigError.combine(list(spec.problems))
    return spec
