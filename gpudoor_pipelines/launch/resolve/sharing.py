"""How teams share the fleet: GPU quotas per cost owner, borrowing, and weekly budgets (the fleet file's
``sharing:`` section), and the two verdicts the door reads them by.

Quotas follow Kueue's semantics where they fit. A cost owner's quota on a pool (or on a group of pools,
together) is GPUs it may always hold there: within it, a launch counts only what other teams hold *on
their quotas*, never what they borrowed. Beyond it (or on a pool where it has none) a team may borrow the
pool's idle GPUs; such a job carries the label ``gpudoor-borrowed: "true"`` and, on a pool with a
``borrowed_priority_class``, runs at it, so the scheduler evicts it first when the owner needs its GPUs.

:func:`quota_verdict` is called by routing, on the launcher and in the API server's policy alike;
:func:`budget_verdict` by the launcher, from the week's job history (``launch/ledger.py``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:
    from gpudoor_pipelines.launch.resolve.fleet import Fleet
    from gpudoor_pipelines.launch.resolve.usage import Usage


class Budget(BaseModel):
    """A cost owner's weekly budget (the week starts Monday 00:00 UTC): GPU-hours, dollars, or both."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    gpu_hours: float | None = Field(default=None, gt=0)
    usd: float | None = Field(default=None, gt=0)


class Sharing(BaseModel):
    """The fleet file's ``sharing:`` section.

    Attributes:
        groups: name → pools whose quotas count together (``serving: [inference, ondemand]``).
        quotas: cost owner → pool or group → GPUs the owner may always hold there.
        borrowing: a team beyond its quota (or without one) may use idle GPUs of a pool that has quotas.
        budgets: cost owner → its weekly budget.
        warn_at: the share of a budget from which launches warn.
        budget_enforce: ``refuse`` (new non-interactive launches of an owner past its budget are refused)
            or ``warn`` (they only warn).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    groups: dict[str, tuple[str, ...]] = Field(default_factory=dict)
    quotas: dict[str, dict[str, int]] = Field(default_factory=dict)
    borrowing: bool = True
    budgets: dict[str, Budget] = Field(default_factory=dict)
    warn_at: float = Field(default=0.8, gt=0, le=1)
    budget_enforce: Literal["refuse", "warn"] = "refuse"

    def scope_pools(self, scope: str) -> tuple[str, ...]:
        """The pools a quota's scope names: a group's pools, or the one pool."""
        return self.groups.get(scope, (scope,))

    def quota_of(self, owner: str | None, pool: str) -> Quota | None:
        """The owner's quota that covers ``pool`` (on the pool itself or on a group holding it)."""
        for scope, gpus in self.quotas.get(owner or "", {}).items():
            if pool in self.scope_pools(scope):
                return Quota(owner or "", scope, self.scope_pools(scope), gpus)
        return None

    def has_quotas(self, pool: str) -> bool:
        """Whether any owner has a quota covering ``pool``: only such pools are shared by quota."""
        return any(pool in self.scope_pools(s) for q in self.quotas.values() for s in q)


@dataclasses.dataclass(frozen=True)
class Quota:
    """One owner's quota: ``gpus`` over ``pools`` together (``scope`` names the pool or the group)."""

    owner: str
    scope: str
    pools: tuple[str, ...]
    gpus: int


def check_sharing(fleet: Fleet) -> list[tuple[str, str, str]]:
    """Problems of the ``sharing`` section against the fleet's pools and owners, as (field, problem, fix)."""
    s, out = fleet.sharing, []
    pools = sorted(fleet.pools)
    for group, members in s.groups.items():
        if group in fleet.pools:
            out.append((f"sharing.groups.{group}", f"'{group}' is also a pool", "give the group another name"))
        for i, p in enumerate(members):
            if p not in fleet.pools:
                out.append((f"sharing.groups.{group}[{i}]", f"unknown pool '{p}'", f"use one of {pools}"))
    scopes = [*pools, *s.groups]
    owners = list(fleet.cost_owners)
    for owner, quotas in s.quotas.items():
        if owners and owner not in owners:
            out.append((f"sharing.quotas.{owner}", f"unknown cost owner '{owner}'", f"use one of {owners}"))
        covered: dict[str, str] = {}
        for scope, gpus in quotas.items():
            field = f"sharing.quotas.{owner}.{scope}"
            if scope not in scopes:
                out.append((field, f"unknown pool or group '{scope}'", f"use one of {scopes}"))
                continue
            if gpus < 0:
                out.append((field, f"{gpus} GPUs", "give a quota of 0 or more GPUs"))
            for p in s.scope_pools(scope):
                if p in covered:
                    out.append(
                        (field, f"pool '{p}' is under two quotas of '{owner}' ({covered[p]}, {scope})", "keep one")
                    )
                covered[p] = scope
    for scope in scopes:
        given = {o: q[scope] for o, q in s.quotas.items() if scope in q}
        cap = sum(fleet.pools[p].gpu_cap for p in s.scope_pools(scope) if p in fleet.pools)
        if given and sum(given.values()) > cap:
            out.append(
                (
                    f"sharing.quotas (on '{scope}')",
                    f"the quotas on '{scope}' add up to {sum(given.values())} GPUs, over its gpu_cap of {cap}",
                    "lower the quotas or raise the pool's gpu_cap: a quota is GPUs its team can always have",
                )
            )
    for owner in s.budgets:
        if owners and owner not in owners:
            out.append((f"sharing.budgets.{owner}", f"unknown cost owner '{owner}'", f"use one of {owners}"))
    return out


@dataclasses.dataclass(frozen=True)
class QuotaVerdict:
    """What a pool's quotas say of a job: whether it fits, whether on borrowed GPUs, and in words."""

    problem: str | None = None
    fix: str = ""
    borrowed: bool = False
    said: str = ""


def quota_verdict(fleet: Fleet, pool: str, owner: str | None, gpus: int, usage: Usage) -> QuotaVerdict | None:
    """The quota check of ``gpus`` more GPUs for ``owner`` on ``pool`` with what is held now (``usage``);
    None where no owner has a quota on the pool, or the launch names no owner (its cap alone decides)."""
    s = fleet.sharing
    if not owner or not s.has_quotas(pool):
        return None
    cap = fleet.pools[pool].gpu_cap
    held, lent = usage.gpus.get(pool, 0), usage.borrowed.get(pool, 0)
    quota = s.quota_of(owner, pool)
    if quota is not None:
        key = owner or ""
        mine = sum(usage.owner_gpus.get((key, p), 0) - usage.owner_borrowed.get((key, p), 0) for p in quota.pools)
        if mine + gpus <= quota.gpus:
            # Within its quota a team is held only to what others hold on their own quotas.
            if held - lent + gpus > cap:
                borrowed = f", not counting {lent} borrowed" if lent else ""
                return QuotaVerdict(
                    f"at its cap ({held - lent}/{cap} GPUs in use{borrowed}, {gpus} asked)",
                    "wait for jobs to finish, ask for fewer GPUs, or route to another pool",
                )
            said = f"within the quota of '{owner}' on '{quota.scope}' ({mine} + {gpus} of {quota.gpus} GPUs)"
            return QuotaVerdict(said=said)
        beyond = f"'{owner}' holds {mine} of its quota of {quota.gpus} GPUs on '{quota.scope}'; {gpus} more is over it"
    else:
        beyond = f"'{owner}' has no quota on '{pool}'"
    if not s.borrowing:
        return QuotaVerdict(
            f"{beyond}, and borrowing is off",
            "wait for your team's jobs to finish, or ask the fleet's admins for a quota "
            f"(sharing.quotas in {fleet.source})",
        )
    idle = cap - held
    if gpus > idle:
        return QuotaVerdict(
            f"{beyond}; no idle GPUs to borrow ({held}/{cap} in use, {lent} of them borrowed)",
            "wait for GPUs to free up, launch on your team's quota elsewhere, or ask for a quota "
            f"(sharing.quotas in {fleet.source})",
        )
    return QuotaVerdict(borrowed=True, said=f"{beyond}: borrows {gpus} of {idle} idle GPUs (evicted first)")


@dataclasses.dataclass(frozen=True)
class Spent:
    """What a cost owner spent this week."""

    gpu_hours: float = 0.0
    usd: float = 0.0


@dataclasses.dataclass(frozen=True)
class BudgetVerdict:
    """A cost owner's week against its budget.

    Attributes:
        owner: the cost owner.
        gpu_hours_left / usd_left: what is left (None where the budget sets no such limit).
        share: the largest share spent of the limits set.
        warning: a warning from ``warn_at`` on, in words.
        refusal: the refusal at 100% (None when it may launch).
    """

    owner: str
    spent: Spent
    budget: Budget
    gpu_hours_left: float | None
    usd_left: float | None
    share: float
    warning: str | None = None
    refusal: str | None = None

    def metadata(self) -> dict[str, float | str]:
        """What a materialization records of it."""
        md: dict[str, float | str] = {}
        if self.gpu_hours_left is not None:
            md["budget_gpu_hours_left"] = round(self.gpu_hours_left, 6)
        if self.usd_left is not None:
            md["budget_usd_left"] = round(self.usd_left, 2)
        if self.warning:
            md["budget_warning"] = self.warning
        return md

    def left(self) -> str:
        """``12.5 of 100 GPU-hours, $40.00 of $300 left this week``."""
        parts = []
        if self.budget.gpu_hours is not None:
            parts.append(f"{_hours(self.gpu_hours_left)} of {self.budget.gpu_hours:g} GPU-hours")
        if self.budget.usd is not None:
            parts.append(f"${self.usd_left:.2f} of ${self.budget.usd:g}")
        return f"{', '.join(parts)} left this week"


def _hours(value: float) -> str:
    """GPU-hours for people: ``1234.5``, ``0.0017``."""
    return f"{value:.1f}" if value >= 10 else f"{value:.2g}"


def budget_verdict(fleet: Fleet, owner: str | None, spent: Mapping[str, Spent]) -> BudgetVerdict | None:
    """The owner's week against its budget; None when it has none."""
    s = fleet.sharing
    budget = s.budgets.get(owner or "")
    if budget is None:
        return None
    used = spent.get(owner or "", Spent())
    shares, hours_left, usd_left = [], None, None
    if budget.gpu_hours is not None:
        hours_left = max(0.0, budget.gpu_hours - used.gpu_hours)
        shares.append(used.gpu_hours / budget.gpu_hours)
    if budget.usd is not None:
        usd_left = max(0.0, budget.usd - (0.0 if math.isnan(used.usd) else used.usd))
        shares.append(used.usd / budget.usd)
    share = max(shares, default=0.0)
    v = BudgetVerdict(owner or "", used, budget, hours_left, usd_left, share)
    what = f"'{owner}' spent {_hours(used.gpu_hours)} GPU-hours (${used.usd:.2f}) this week, {share:.0%} of its budget"
    if share >= 1.0:
        refusal = f"{what}: {v.left()}" if s.budget_enforce == "refuse" else None
        return dataclasses.replace(v, warning=f"{what}: over budget", refusal=refusal)
    if share >= s.warn_at:
        return dataclasses.replace(v, warning=f"{what}: {v.left()}")
    return v
