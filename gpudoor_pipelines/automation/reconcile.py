"""The orphan reconciler's judgement: which held GPUs nobody is waiting for any more.

A step forwards a run's termination to its job, but a run worker that dies (OOM, a drained node,
``kill -9``, a deploy) forwards nothing: its managed job, or its warm pool, keeps its GPUs. Every job
the door launches for a Dagster run carries that run's id (``dagster-run-id``, signed with the
deployment's key), so the run can be asked. :func:`plan_releases` is pure: from what the backend holds
and what the Dagster instance knows of the runs named, it says what to release and why:

- a job, warm pool or step cluster (``gpudoor-step-…``, a step the fleet launches as a cluster) whose run
  has ended (succeeded, failed, canceled) more than the grace period ago;
- one that names a run this instance does not know, once it is older than the grace period;
- a job that names a live run which never recorded launching it (a replayed label), after the grace period;
- an interactive cluster (``lab-…``, ``dev-…``) past its time to live (the fleet's, or its launch's own).

Jobs and pools that name no run (ad-hoc launches by people and agents) are left alone, as are holdings
without the door's ``gpudoor-pool`` label, runs that are still going, and what another Dagster
deployment sharing the API server launched (``dagster-deployment``; none means ``default``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence

from gpudoor_pipelines.launch.job import Holding
from gpudoor_pipelines.launch.labels import (
    LABEL_DEPLOYMENT,
    LABEL_POOL,
    LABEL_RUN_ID,
    LABEL_TTL,
    STEP_CLUSTER_PREFIX,
    TAG_JOB_PREFIX,
)
from gpudoor_pipelines.launch.resolve.fleet import ReconcilerPolicy
from gpudoor_pipelines.launch.resolve.request import slug
from gpudoor_pipelines.launch.resolve.rules import identity_verified

#: Dagster run statuses after which a run launches nothing and waits for nothing.
ENDED_RUN_STATUSES = frozenset({"SUCCESS", "FAILURE", "CANCELED"})
#: The run tag prefix under which a step records the job it launched (``<backend>:<job id>``).


@dataclasses.dataclass(frozen=True)
class RunFacts:
    """What the Dagster instance knows of one run.

    Attributes:
        status: the run's status (``DagsterRunStatus`` value).
        ended_at: when it ended (UNIX seconds), if it has.
        job_ids: the job ids its steps recorded launching (its ``gpudoor/job-*`` tags).
    """

    status: str
    ended_at: float | None = None
    job_ids: frozenset[str] = frozenset()

    @classmethod
    def from_tags(cls, status: str, ended_at: float | None, tags: Mapping[str, str]) -> RunFacts:
        """The facts of a run from its status, end and tags."""
        ids = frozenset(v.rsplit(":", 1)[-1] for k, v in tags.items() if k.startswith(TAG_JOB_PREFIX) and ":" in v)
        return cls(status=status, ended_at=ended_at, job_ids=ids)


@dataclasses.dataclass(frozen=True)
class Release:
    """One holding to release, and why (in words, for the run's log and metadata)."""

    holding: Holding
    reason: str


def claimed_run(holding: Holding, label_key: str | None) -> str | None:
    """The Dagster run a holding names, when its label is signed with the deployment's key (or no key is set)."""
    run_id = holding.labels.get(LABEL_RUN_ID)
    return run_id if run_id and identity_verified(holding.labels, label_key) else None


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.0f} min" if seconds < 7200 else f"{seconds / 3600:.1f} h"


def plan_releases(
    holdings: Iterable[Holding],
    runs: Mapping[str, RunFacts],
    *,
    now: float,
    policy: ReconcilerPolicy,
    first_seen: Mapping[str, float] | None = None,
    label_key: str | None = None,
    deployment: str = "default",
) -> list[Release]:
    """What to release now, and why (see the module docstring).

    Args:
        holdings: what the backend holds (:meth:`Backend.holdings`).
        runs: the facts of every run the holdings name that the instance knows; a run missing here is unknown.
        now: UNIX seconds.
        policy: the fleet's ``reconciler`` section.
        first_seen: when the reconciler first saw each holding (by key): the age of one whose backend
            gives no time.
        label_key: the deployment's key; when set, a holding's run counts only if its label is signed.
        deployment: this Dagster deployment's name: holdings of another one are not judged.
    """
    grace = policy.grace_minutes * 60.0
    seen = first_seen or {}
    out = []
    for h in holdings:
        if not h.labels.get(LABEL_POOL):
            continue  # not launched through the door: not the door's to judge
        if h.labels.get(LABEL_DEPLOYMENT, "default") != deployment:
            continue  # another Dagster deployment's: its own reconciler judges it
        since = h.since if h.since is not None else seen.get(h.key, now)
        age = max(0.0, now - since)
        if _interactive(h):
            ttl = _ttl_hours(h, policy) * 3600.0
            if age > ttl:
                out.append(Release(h, f"past its time to live of {ttl / 3600:g} h (up {_minutes(age)})"))
            continue
        run_id = claimed_run(h, label_key)
        if run_id is None:
            continue  # an ad-hoc launch (a person, an agent): its owner's to stop
        run = runs.get(run_id)
        if run is None:
            if age > grace:
                out.append(Release(h, f"its Dagster run {run_id} is unknown to this instance (held {_minutes(age)})"))
        elif run.status in ENDED_RUN_STATUSES:
            ended = run.ended_at if run.ended_at is not None else since
            if now - ended >= grace:
                out.append(Release(h, f"its Dagster run {run_id} ended {run.status} {_minutes(now - ended)} ago"))
        elif age > grace and not _launched_by(h, run_id, run):
            out.append(Release(h, f"it names the running Dagster run {run_id}, which did not launch it"))
    return out


def _ttl_hours(h: Holding, policy: ReconcilerPolicy) -> float:
    try:
        asked = float(h.labels.get(LABEL_TTL, ""))
    except ValueError:
        asked = 0.0
    return min(asked, policy.max_interactive_ttl_hours) if asked > 0 else policy.interactive_ttl_hours


def _launched_by(h: Holding, run_id: str, run: RunFacts) -> bool:
    """Whether a live run owns the holding: a job it recorded (runs whose steps record none own theirs),
    a warm pool named after it."""
    if h.kind == "pool":
        return h.id.endswith(slug(run_id, 8))
    if h.kind == "cluster":  # a step cluster: its step recorded ``<cluster>/<job id>``
        return not run.job_ids or any(j.split("/", 1)[0] == h.id for j in run.job_ids)
    return not run.job_ids or h.id in run.job_ids


def _interactive(h: Holding) -> bool:
    """A ``lab-…``/``dev-…`` cluster, kept for its time to live; a step cluster lives as long as its run."""
    return h.kind == "cluster" and not h.id.startswith(STEP_CLUSTER_PREFIX)


def named_runs(holdings: Sequence[Holding], label_key: str | None) -> list[str]:
    """The run ids the holdings name (signed where a key is set), each once."""
    return sorted({r for h in holdings if not _interactive(h) and (r := claimed_run(h, label_key))})
