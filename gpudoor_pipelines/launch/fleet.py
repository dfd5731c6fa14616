"""The fleet file: the team's GPU pools and the routes from step kinds to pools."""

from __future__ import annotations

import dataclasses
import difflib
import functools
from pathlib import Path
from typing import Any

import yaml

from gpudoor_pipelines.launch.errors import LaunchConfigError

PROJECT_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_SPECS_DIR = PROJECT_ROOT / "task_specs"
DEFAULT_FLEET_FILE = DEFAULT_SPECS_DIR / "fleet.yaml"

_POOL_FIELDS = {
    "description",
    "infra",
    "gpus",
    "gpu_cap",
    "max_gpus_per_user",
    "usd_per_gpu_hour",
    "preemptible",
    "priority_class",
    "multi_node",
    "env",
    "autostop_idle_minutes",
}
_TOP_FIELDS = {"pools", "routes", "accelerator_routes", "cost_owners", "default_cost_owner"}


@dataclasses.dataclass(frozen=True)
class Pool:
    """One GPU pool SkyPilot can reach.

    Attributes:
        name: the pool's name in the fleet file.
        infra: SkyPilot infra string (``slurm/onprem``, ``k8s/inference-prod``, ``vast``).
        gpus: GPU types the pool offers, as SkyPilot accelerator names.
        gpu_cap: most GPUs the pool lends the team at once.
        max_gpus_per_user: most GPUs one user may hold on the pool at once.
        usd_per_gpu_hour: price used for cost estimates.
        preemptible: jobs may be evicted (managed jobs recover on their own).
        priority_class: Kubernetes priority class research jobs must use (production pools).
        multi_node: the pool has a fast interconnect for multi-node jobs.
        env: injected into every job on the pool (paths on that cluster).
        autostop_idle_minutes: autostop for interactive clusters (demos, dev sessions) on the pool.
    """

    name: str
    infra: str
    gpus: tuple[str, ...]
    gpu_cap: int
    max_gpus_per_user: int
    usd_per_gpu_hour: float
    preemptible: bool = False
    priority_class: str | None = None
    multi_node: bool = False
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    description: str = ""
    autostop_idle_minutes: int = 60

    @property
    def is_kubernetes(self) -> bool:
        """Whether the pool is a Kubernetes cluster (pod settings apply)."""
        return self.infra.split("/", 1)[0].lower() in {"k8s", "kubernetes"}

    def offers(self, gpu: str) -> bool:
        """Whether the pool has GPUs of this type (case-insensitive, like SkyPilot)."""
        return gpu.lower() in {g.lower() for g in self.gpus}


@dataclasses.dataclass(frozen=True)
class Fleet:
    """All pools, and for each step kind the pools it may use, in order of preference."""

    source: str
    pools: dict[str, Pool]
    routes: dict[str, tuple[str, ...]]
    accelerator_routes: dict[str, str]
    cost_owners: tuple[str, ...]
    default_cost_owner: str

    def pool(self, name: str, *, field: str = "pool") -> Pool:
        """Returns a pool by name, or a clear error naming the known pools."""
        try:
            return self.pools[name]
        except KeyError:
            raise LaunchConfigError(
                self.source,
                field,
                f"unknown pool '{name}'",
                f"use one of {sorted(self.pools)}{_did_you_mean(name, self.pools)}",
            ) from None

    def pool_for_infra(self, infra: str) -> Pool | None:
        """The pool whose infra string is ``infra`` or a prefix of it (``slurm/onprem/part``)."""
        wanted = normalize_infra(infra)
        for pool in self.pools.values():
            mine = normalize_infra(pool.infra)
            if wanted == mine or wanted.startswith(mine + "/"):
                return pool
        return None

    @property
    def all_gpus(self) -> set[str]:
        """Every GPU type any pool offers."""
        return {g for p in self.pools.values() for g in p.gpus}


_CLOUD_ALIASES = {"kubernetes": "k8s"}


def normalize_infra(infra: str) -> str:
    """Canonical form of an infra string: SkyPilot writes ``k8s/ctx`` back as ``kubernetes/ctx``."""
    head, sep, rest = infra.strip().strip("/").partition("/")
    head = _CLOUD_ALIASES.get(head.lower(), head.lower())
    return head + sep + rest


def _did_you_mean(name: str, choices: Any) -> str:
    close = difflib.get_close_matches(name, list(choices), n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _require(source: str, field: str, value: Any, kind: type | tuple[type, ...], fix: str) -> Any:
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise LaunchConfigError(source, field, f"expected {_kind_name(kind)}, got {value!r}", fix)
    return value


def _kind_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join(k.__name__ for k in kinds)


def parse_fleet(raw: Any, source: str) -> Fleet:
    """Validates a parsed fleet document.

    Args:
        raw: the YAML document.
        source: file name used in error messages.

    Returns:
        The fleet.

    Raises:
        LaunchConfigError: naming the field and the fix.
    """
    _require(source, "(top level)", raw, dict, "the fleet file must be a mapping with 'pools' and 'routes'")
    for key in raw:
        if key not in _TOP_FIELDS:
            raise LaunchConfigError(
                source,
                key,
                "unknown field",
                f"remove it; known fields: {sorted(_TOP_FIELDS)}{_did_you_mean(key, _TOP_FIELDS)}",
            )
    pools: dict[str, Pool] = {}
    raw_pools = _require(source, "pools", raw.get("pools"), dict, "list the pools under 'pools:'")
    for name, body in raw_pools.items():
        where = f"pools.{name}"
        _require(source, where, body, dict, "give the pool its fields (infra, gpus, gpu_cap, ...)")
        for key in body:
            if key not in _POOL_FIELDS:
                raise LaunchConfigError(
                    source,
                    f"{where}.{key}",
                    "unknown field",
                    f"remove it; known fields: {sorted(_POOL_FIELDS)}{_did_you_mean(key, _POOL_FIELDS)}",
                )
        for required in ("infra", "gpus", "gpu_cap", "usd_per_gpu_hour"):
            if required not in body:
                raise LaunchConfigError(
                    source, f"{where}.{required}", "missing", f"add '{required}' to pool '{name}'"
                )
        gpus = _require(source, f"{where}.gpus", body["gpus"], list, "a list of GPU types, e.g. [H100, L4]")
        env = body.get("env") or {}
        _require(source, f"{where}.env", env, dict, "a mapping of variable name to value")
        gpu_cap = _require(source, f"{where}.gpu_cap", body["gpu_cap"], int, "a whole number of GPUs")
        pools[name] = Pool(
            name=name,
            infra=_require(
                source, f"{where}.infra", body["infra"], str, "a SkyPilot infra string, e.g. slurm/onprem"
            ),
            gpus=tuple(str(g) for g in gpus),
            gpu_cap=gpu_cap,
            max_gpus_per_user=int(body.get("max_gpus_per_user", gpu_cap)),
            usd_per_gpu_hour=float(
                _require(
                    source,
                    f"{where}.usd_per_gpu_hour",
                    body["usd_per_gpu_hour"],
                    (int, float),
                    "a price, e.g. 2.1",
                )
            ),
            preemptible=bool(body.get("preemptible", False)),
            priority_class=body.get("priority_class"),
            multi_node=bool(body.get("multi_node", False)),
            env={str(k): str(v) for k, v in env.items()},
            description=str(body.get("description", "")),
            autostop_idle_minutes=int(body.get("autostop_idle_minutes", 60)),
        )
    routes: dict[str, tuple[str, ...]] = {}
    for step, pool_names in _require(
        source, "routes", raw.get("routes") or {}, dict, "map step kinds to lists of pools"
    ).items():
        _require(source, f"routes.{step}", pool_names, list, "a list of pool names, most preferred first")
        for i, pool_name in enumerate(pool_names):
            if pool_name not in pools:
                raise LaunchConfigError(
                    source,
                    f"routes.{step}[{i}]",
                    f"unknown pool '{pool_name}'",
                    f"use one of {sorted(pools)}{_did_you_mean(pool_name, pools)}",
                )
        routes[step] = tuple(pool_names)
    accel_routes = _require(
        source, "accelerator_routes", raw.get("accelerator_routes") or {}, dict, "map GPU types to pools"
    )
    for gpu, pool_name in accel_routes.items():
        if pool_name not in pools:
            raise LaunchConfigError(
                source,
                f"accelerator_routes.{gpu}",
                f"unknown pool '{pool_name}'",
                f"use one of {sorted(pools)}",
            )
    owners = tuple(raw.get("cost_owners") or ())
    default_owner = raw.get("default_cost_owner") or (owners[0] if owners else "")
    if owners and default_owner not in owners:
        raise LaunchConfigError(
            source, "default_cost_owner", f"'{default_owner}' is not in cost_owners", "add it to cost_owners"
        )
    return Fleet(
        source=source,
        pools=pools,
        routes=routes,
        accelerator_routes={str(k): str(v) for k, v in accel_routes.items()},
        cost_owners=owners,
        default_cost_owner=str(default_owner),
    )


@functools.lru_cache(maxsize=16)
def _load_fleet_cached(path: str, mtime: float) -> Fleet:
    with open(path) as f:
        try:
            raw = yaml.safe_load(f)
        except yaml.YAMLError as e:
            raise LaunchConfigError(path, "(yaml)", f"not valid YAML: {e}", "fix the YAML syntax") from None
    return parse_fleet(raw, path)


def load_fleet(path: str | Path | None = None) -> Fleet:
    """Loads and validates the fleet file (cached until the file changes).

    Args:
        path: the fleet file; defaults to ``task_specs/fleet.yaml`` in the project.
    """
    p = Path(path) if path else DEFAULT_FLEET_FILE
    if not p.is_file():
        raise LaunchConfigError(
            str(p), "(file)", "expected fleet file does not exist", "create it or point fleet_file at it"
        )
    return _load_fleet_cached(str(p.resolve()), p.stat().st_mtime)
