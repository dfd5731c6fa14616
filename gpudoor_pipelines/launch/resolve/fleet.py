"""The fleet file: the team's pools and the routes from step kinds to pools, as pydantic models.

Pydantic parses and checks the file; :func:`parse_fleet` turns its errors into a
:class:`LaunchConfigError` that names the file, the field and the fix.
"""

from __future__ import annotations

import difflib
import functools
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from gpudoor_pipelines.launch.errors import LaunchConfigError
from gpudoor_pipelines.launch.resolve.fleet_sections import (
    EvalPolicy,
    FieldError,
    HousekeepingPolicy,
    NightWindow,
    ReconcilerPolicy,
)
from gpudoor_pipelines.launch.resolve.sharing import Sharing, check_sharing

PROJECT_ROOT = Path(__file__).resolve().parents[3]
DEFAULT_SPECS_DIR = PROJECT_ROOT / "task_specs"
DEFAULT_FLEET_FILE = DEFAULT_SPECS_DIR / "fleet.yaml"

_CLOUD_ALIASES = {"kubernetes": "k8s"}
#: SkyPilot's cloud feature names (``sky.clouds.CloudImplementationFeatures``) a pool may declare it has.
SKYPILOT_FEATURES = frozenset(
    {
        "stop",
        "multi-node",
        "clone_disk_from_cluster",
        "image_id",
        "docker_image",
        "spot_instance",
        "custom_disk_tier",
        "custom_network_tier",
        "open_ports",
        "storage_mounting",
        "host_controllers",
        "high_availability_controllers",
        "auto_terminate",
        "autostop",
        "autodown",
        "custom_multi_network",
        "local_disk",
    }
)
_LABEL_VALUE = re.compile(r"[^A-Za-z0-9_.-]+")


def label_value(text: str) -> str:
    """Makes a string a valid Kubernetes label value (SkyPilot passes labels on as pod labels)."""
    cleaned = _LABEL_VALUE.sub("-", str(text)).strip("-_.")
    return cleaned[:63].rstrip("-_.") or "none"


def normalize_infra(infra: str) -> str:
    """Canonical form of an infra string: SkyPilot writes ``k8s/ctx`` back as ``kubernetes/ctx``."""
    head, sep, rest = infra.strip().strip("/").partition("/")
    return _CLOUD_ALIASES.get(head.lower(), head.lower()) + sep + rest


def did_you_mean(name: str, choices: Any) -> str:
    """`` (did you mean 'x'?)`` when a close match exists, else ``""``."""
    close = difflib.get_close_matches(str(name), [str(c) for c in choices], n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""


class Pool(BaseModel):
    """One pool SkyPilot can reach.

    Attributes:
        name: the pool's name in the fleet file.
        infra: SkyPilot infra string (``slurm/onprem``, ``k8s/inference-prod``, ``vast``).
        gpus: GPU types the pool offers, as SkyPilot accelerator names, most preferred first.
        gpu_cap: most GPUs the pool lends the team at once.
        max_gpus_per_user: most GPUs one user may hold on the pool at once (default: ``gpu_cap``).
        usd_per_gpu_hour: price used for cost estimates.
        vcpu_cap: most vCPUs CPU-only jobs may hold on the pool at once (no cap when unset).
        usd_per_vcpu_hour: price of a vCPU-hour for CPU-only jobs.
        preemptible: jobs may be evicted (managed jobs recover on their own).
        priority_class: Kubernetes priority class research jobs must use (production pools).
        interactive_priority_class: the priority class of interactive sessions on the pool (else ``priority_class``).
        borrowed_priority_class: the priority class of a job beyond its cost owner's quota, on borrowed GPUs
            (else ``priority_class``): the first the scheduler evicts.
        max_interactive_gpus: most GPUs one interactive session (a ``dev-…``/``lab-…`` cluster, a demo) may hold.
        multi_node: the pool has a fast interconnect for multi-node jobs.
        env: injected into every job on the pool (paths on that cluster).
        autostop_idle_minutes: autostop for interactive clusters (demos, dev sessions) on the pool.
        features: SkyPilot features this pool's cluster has beyond SkyPilot's table for its kind of
            infra (``spot_instance`` on a Kubernetes cluster with spot nodes, ``docker_image`` on Slurm
            with Pyxis); SkyPilot detects these only by asking the cluster.
        recover_to: pools a managed job evicted from this one may move to, in order. When a step sees
            its job RECOVERING here, it launches the job on the first of them that can take it now (that
            pool's env and rules, its caps), cancels the one recovering, and follows the new one; the job
            resumes from what it saved in the transit bucket. None can take it: SkyPilot recovers it here.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = ""
    description: str = ""
    infra: str
    gpus: tuple[str, ...] = ()
    gpu_cap: int = Field(default=0, ge=0)
    max_gpus_per_user: int | None = Field(default=None, ge=0)
    usd_per_gpu_hour: float = Field(default=0.0, ge=0)
    vcpu_cap: int | None = Field(default=None, ge=1)
    usd_per_vcpu_hour: float = Field(default=0.0, ge=0)
    preemptible: bool = False
    priority_class: str | None = None
    interactive_priority_class: str | None = None
    borrowed_priority_class: str | None = None
    max_interactive_gpus: int = Field(default=1, ge=0)
    multi_node: bool = False
    env: dict[str, str] = Field(default_factory=dict)
    autostop_idle_minutes: int = Field(default=60, ge=1)
    features: tuple[str, ...] = ()
    recover_to: tuple[str, ...] = ()

    @model_validator(mode="after")
    def _gpus_need_a_cap(self) -> Pool:
        if self.gpus and not self.gpu_cap:
            raise FieldError(
                f"pools.{self.name}.gpu_cap", "missing", f"say how many GPUs pool '{self.name}' lends at once"
            )
        for i, feature in enumerate(self.features):
            if feature not in SKYPILOT_FEATURES:
                raise FieldError(
                    f"pools.{self.name}.features[{i}]",
                    f"unknown SkyPilot feature '{feature}'",
                    f"use one of {sorted(SKYPILOT_FEATURES)}{did_you_mean(feature, SKYPILOT_FEATURES)}",
                )
        return self

    @property
    def user_gpu_cap(self) -> int:
        """GPUs one user may hold on the pool at once."""
        return self.gpu_cap if self.max_gpus_per_user is None else self.max_gpus_per_user

    def owns_infra(self, infra: str) -> bool:
        """Whether ``infra`` is this pool's infra string or a part of it (``slurm/onprem/debug``)."""
        wanted, mine = normalize_infra(infra), normalize_infra(self.infra)
        return wanted == mine or wanted.startswith(mine + "/")

    def gpu_named(self, gpu: str) -> str | None:
        """The pool's own spelling of ``gpu`` (SkyPilot compares GPU names case-insensitively)."""
        return next((g for g in self.gpus if g.lower() == gpu.lower()), None)


class Fleet(BaseModel):
    """All pools, the pools each step kind may use in order of preference, and who pays.

    Attributes:
        source: the file it was read from, for messages.
        pools: pools by name.
        routes: step kind → pools, most preferred first.
        accelerator_routes: GPU type → its own pool, tried first for a job launched without a step.
        cpu_route: the pools that take CPU-only jobs, most preferred first (none when empty).
        cost_owners: every job must carry one of these as its cost owner.
        default_cost_owner: the cost owner of jobs that name none.
        night_window: when the nightly captioning may launch.
        evaluation: what the checkpoint sensor evaluates, and how much at once.
        reconciler: what the orphan reconciler releases, and when; interactive clusters' time to live.
        housekeeping: what stays in the transit bucket, what moves to cheaper storage, what is deleted.
        sharing: quotas per cost owner, borrowing and weekly budgets (``sharing.py``).
        secrets: the secrets a job may ask for by name (``secrets: {HF_TOKEN: null}`` in its task file).
        live_caps: who counts what running jobs hold before a launch, for the caps. ``launcher``: the
            launcher reads it (one full-queue request per launch, seconds on a busy server) and routes
            around full pools; the server's policy checks again where it can. ``server``: the API
            server's policy counts it (it must run this package's policy with the jobs controller in
            consolidation mode, or it refuses every launch); the launcher routes without reading it and,
            when the server says a pool is full, reads it then and tries the next pool.
        launch_as: how each step kind is launched on SkyPilot: ``managed`` (the default: a managed job,
            which SkyPilot's jobs controller recovers after a preemption) or ``cluster`` (for short steps
            such as the smoke test: ``sky.launch`` of a cluster of its own, its log followed, the cluster
            torn down once the job ends; the step itself relaunches it after a preemption). A managed
            job spends some 20 to 30 s more in the jobs controller than a cluster launched and torn down.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    source: str = "fleet.yaml"
    pools: dict[str, Pool]
    routes: dict[str, tuple[str, ...]] = Field(default_factory=dict)
    accelerator_routes: dict[str, str] = Field(default_factory=dict)
    cpu_route: tuple[str, ...] = ()
    cost_owners: tuple[str, ...] = ()
    default_cost_owner: str = ""
    night_window: NightWindow = Field(default_factory=NightWindow)
    evaluation: EvalPolicy = Field(default_factory=EvalPolicy)
    reconciler: ReconcilerPolicy = Field(default_factory=ReconcilerPolicy)
    housekeeping: HousekeepingPolicy = Field(default_factory=HousekeepingPolicy)
    sharing: Sharing = Field(default_factory=Sharing)
    secrets: tuple[str, ...] = ()
    live_caps: Literal["launcher", "server"] = "launcher"
    launch_as: dict[str, Literal["managed", "cluster"]] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _name_pools(cls, raw: Any) -> Any:
        if isinstance(raw, dict) and isinstance(raw.get("pools"), dict):
            pools = {n: {**b, "name": n} if isinstance(b, dict) else b for n, b in raw["pools"].items()}
            raw = {**raw, "pools": pools}
        return raw

    @model_validator(mode="after")
    def _check_references(self) -> Fleet:
        where = [(f"routes.{s}[{i}]", p) for s, ps in self.routes.items() for i, p in enumerate(ps)]
        where += [(f"accelerator_routes.{g}", p) for g, p in self.accelerator_routes.items()]
        where += [(f"cpu_route[{i}]", p) for i, p in enumerate(self.cpu_route)]
        where += [
            (f"pools.{n}.recover_to[{i}]", p) for n, pool in self.pools.items() for i, p in enumerate(pool.recover_to)
        ]
        for name, pool in self.pools.items():
            if name in pool.recover_to:
                raise FieldError(
                    f"pools.{name}.recover_to",
                    f"pool '{name}' names itself",
                    "list other pools (SkyPilot already recovers a job on its own pool)",
                )
        for field, name in where:
            if name not in self.pools:
                raise FieldError(
                    field, f"unknown pool '{name}'", f"use one of {sorted(self.pools)}{did_you_mean(name, self.pools)}"
                )
        for step in self.launch_as:
            if step not in self.routes:
                raise FieldError(
                    f"launch_as.{step}",
                    f"unknown step '{step}'",
                    f"use a step named under routes: {sorted(self.routes)}{did_you_mean(step, self.routes)}",
                )
        for field, problem, fix in check_sharing(self)[:1]:
            raise FieldError(field, problem, fix)
        if not self.default_cost_owner and self.cost_owners:
            object.__setattr__(self, "default_cost_owner", self.cost_owners[0])
        if self.cost_owners and self.default_cost_owner not in self.cost_owners:
            raise FieldError(
                "default_cost_owner", f"'{self.default_cost_owner}' is not in cost_owners", "add it to cost_owners"
            )
        return self

    def pool(self, name: str, *, field: str = "pool") -> Pool:
        """A pool by name, or a clear error naming the known pools."""
        if name not in self.pools:
            raise LaunchConfigError(
                self.source,
                field,
                f"unknown pool '{name}'",
                f"use one of {sorted(self.pools)}{did_you_mean(name, self.pools)}",
            )
        return self.pools[name]

    def pool_for_infra(self, infra: str) -> Pool | None:
        """The pool whose infra string is ``infra`` or a prefix of it (``slurm/onprem/part``)."""
        return next((pool for pool in self.pools.values() if pool.owns_infra(infra)), None)

    def pools_for_gpus(self, gpus: list[str]) -> list[Pool]:
        """The pools offering any of ``gpus``: a GPU's own pool (``accelerator_routes``) first, then the cheapest."""
        wanted = {g.lower() for g in gpus}
        preferred = {p for g, p in self.accelerator_routes.items() if g.lower() in wanted}
        offering = [p for p in self.pools.values() if any(g.lower() in wanted for g in p.gpus)]
        order = list(self.pools)
        return sorted(offering, key=lambda p: (p.name not in preferred, p.usd_per_gpu_hour, order.index(p.name)))

    def usd_per_gpu_hour(self, pool: str) -> float:
        """A pool's price of a GPU-hour (NaN for a pool the fleet no longer has)."""
        return self.pools[pool].usd_per_gpu_hour if pool in self.pools else float("nan")

    @property
    def all_gpus(self) -> set[str]:
        """Every GPU type any pool offers."""
        return {g for p in self.pools.values() for g in p.gpus}


def _field_path(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(top level)"


def _known_fields(model: type[BaseModel]) -> list[str]:
    return sorted(f for f in model.model_fields if f not in ("name", "source"))


def parse_fleet(raw: Any, source: str) -> Fleet:
    """Validates a parsed fleet document.

    Raises:
        LaunchConfigError: naming the file, the field and the fix.
    """
    if not isinstance(raw, dict):
        raise LaunchConfigError(
            source,
            "(top level)",
            f"expected a mapping, got {raw!r}",
            "the fleet file must be a mapping with 'pools' and 'routes'",
        )
    try:
        return Fleet.model_validate({**raw, "source": source})
    except ValidationError as e:
        err = e.errors()[0]
        if isinstance(err.get("ctx", {}).get("error"), FieldError):
            fe = err["ctx"]["error"]
            raise LaunchConfigError(source, fe.field, fe.problem, fe.fix) from None
        loc = tuple(err["loc"])
        field = _field_path(loc)
        if err["type"] == "extra_forbidden":
            model = {
                "pools": Pool,
                "evaluation": EvalPolicy,
                "reconciler": ReconcilerPolicy,
                "housekeeping": HousekeepingPolicy,
                "night_window": NightWindow,
                "sharing": Sharing,
            }.get(loc[0], Fleet)
            known = _known_fields(model)
            fix = f"remove it; known fields: {known}{did_you_mean(loc[-1], known)}"
            raise LaunchConfigError(source, field, "unknown field", fix) from None
        if err["type"] == "missing":
            raise LaunchConfigError(source, field, "missing", f"add '{loc[-1]}'") from None
        got = err.get("input")
        raise LaunchConfigError(
            source,
            field,
            f"{err['msg'].lower()} (got {got!r})",
            "see the field list at the top of task_specs/fleet.yaml",
        ) from None


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
