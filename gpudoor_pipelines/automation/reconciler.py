"""The orphan reconciler: a sensor that finds GPUs nobody is waiting for, and a job that releases them.

Each tick lists what the backend holds (on SkyPilot: three requests, whatever the number of jobs),
asks the Dagster instance about the runs those holdings name (one query per 500 runs), and judges with
:func:`gpudoor_pipelines.automation.reconcile.plan_releases`. What to release goes to one run of
``release_held_gpus``, which asks for each release and then *verifies* it
(:func:`gpudoor_pipelines.launch.record.release.release_and_verify`): the run's metadata lists what was
released and what was seen; a release not confirmed within the bound fails the run with an error
event naming the job. The run that launched the holding gets a ``gpudoor/released-…`` tag saying so.

A run whose steps execute in its own process (``gpudoor flow``, ``dg.materialize``) has no run worker for
Dagster's run monitoring to watch: its first launching step names that process in a run tag
(:mod:`gpudoor_pipelines.launch.record.process`), and each tick marks failed a run in flight whose process,
on this host, is gone. Its jobs are then released as any ended run's are, ``grace_minutes`` later.

Restarts are harmless: the cursor remembers when each holding was first seen and when its release was
asked (a release asked is not asked again until its bound has passed), and each run has a run key made
of what it releases, so a tick that Dagster resumes launches nothing twice. With ``dry_run`` in the
fleet's ``reconciler`` section, a tick says what it would release and releases nothing.
"""

import dataclasses
import hashlib
import json
import os
import time
from collections.abc import Sequence

import dagster as dg
from pydantic import Field

from gpudoor_pipelines.assets.k8s import cpu_step_tags
from gpudoor_pipelines.automation.reconcile import Release, RunFacts, claimed_run, named_runs, plan_releases
from gpudoor_pipelines.automation.sensors import riding_out
from gpudoor_pipelines.launch.client import PipesSkyPilotClient
from gpudoor_pipelines.launch.events import report_unconfirmed
from gpudoor_pipelines.launch.job import Holding
from gpudoor_pipelines.launch.labels import LABEL_KEY_ENV, TAG_RELEASED_PREFIX, TAG_RUN_PROCESS
from gpudoor_pipelines.launch.record.process import run_process_gone
from gpudoor_pipelines.launch.record.release import ReleaseOutcome, release_and_verify
from gpudoor_pipelines.launch.resolve.fleet import ReconcilerPolicy
from gpudoor_pipelines.launch.resolve.rules import deployment_name

#: Tag on the reconciler's own runs.
RECONCILER_TAG = "gpudoor/reconciler"
#: Prefix of the tag the reconciler leaves on the run that launched what it released.
_RUNS_PER_QUERY = 500


class HeldConfig(dg.Config):
    """One holding to release (as the sensor saw it)."""

    kind: str = Field(description="job, pool or cluster")
    id: str = Field(description="job id, pool name or cluster name")
    name: str = ""
    labels: dict[str, str] = Field(default_factory=dict)
    reason: str = ""


class ReleaseConfig(dg.Config):
    """What ``release_held_gpus`` releases."""

    releases: list[HeldConfig] = Field(default_factory=list)


def run_facts(instance: dg.DagsterInstance, run_ids: Sequence[str]) -> dict[str, RunFacts]:
    """The facts of the runs the instance knows among ``run_ids`` (one query per 500 runs)."""
    out: dict[str, RunFacts] = {}
    for i in range(0, len(run_ids), _RUNS_PER_QUERY):
        chunk = list(run_ids[i : i + _RUNS_PER_QUERY])
        for record in instance.get_run_records(filters=dg.RunsFilter(run_ids=chunk), limit=len(chunk)):
            run = record.dagster_run
            out[run.run_id] = RunFacts.from_tags(run.status.value, record.end_time, run.tags)
    return out


#: Run statuses of a run still going (or about to): its process may have died under it.
_IN_FLIGHT = [dg.DagsterRunStatus.STARTING, dg.DagsterRunStatus.STARTED, dg.DagsterRunStatus.CANCELING]


def dead_runs(instance: dg.DagsterInstance) -> list[tuple[dg.DagsterRun, str]]:
    """The runs in flight whose own process (their ``gpudoor/run-process`` tag), on this host, is gone; with
    that process. One query of the runs in flight (at most 500 a tick)."""
    out = []
    for record in instance.get_run_records(filters=dg.RunsFilter(statuses=_IN_FLIGHT), limit=_RUNS_PER_QUERY):
        identity = record.dagster_run.tags.get(TAG_RUN_PROCESS)
        if identity and run_process_gone(identity):
            out.append((record.dagster_run, identity))
    return out


def label_key() -> str | None:
    """The deployment's key for signed run identities (``GPUDOOR_LABEL_KEY``), if set."""
    return os.environ.get(LABEL_KEY_ENV) or None


def reconcile_tick(
    instance: dg.DagsterInstance,
    skypilot: PipesSkyPilotClient,
    cursor: dict,
    now: float,
    ended: frozenset[str] | set[str] = frozenset(),
) -> tuple[list[Release], list[Release], dict]:
    """One tick's judgement: (to release now, judged but asked already, the new cursor). Runs in ``ended``
    (whose process is gone) are judged as failed ``now``, marked so or not (a dry run marks nothing)."""
    policy = skypilot.get_fleet().reconciler
    backend = skypilot.get_backend()
    holdings = backend.holdings()
    key = label_key()
    keys = {h.key for h in holdings}
    first_seen = {k: v for k, v in (cursor.get("first_seen") or {}).items() if k in keys}
    for h in holdings:
        first_seen.setdefault(h.key, now)
    runs = run_facts(instance, named_runs(holdings, key))
    for run_id in ended & runs.keys():
        runs[run_id] = dataclasses.replace(runs[run_id], status="FAILURE", ended_at=now)
    judged = plan_releases(
        holdings, runs, now=now, policy=policy, first_seen=first_seen, label_key=key, deployment=deployment_name()
    )
    retry_s = retry_after_s(policy)
    asked = {k: v for k, v in (cursor.get("asked") or {}).items() if k in keys and now - v < retry_s}
    fresh = [r for r in judged if r.holding.key not in asked]
    waiting = [r for r in judged if r.holding.key in asked]
    if not policy.dry_run:
        asked.update({r.holding.key: now for r in fresh})
    return fresh, waiting, {"first_seen": first_seen, "asked": asked}


def retry_after_s(policy: ReconcilerPolicy) -> float:
    """How long after asking for a release the reconciler asks again (its bound, and five minutes)."""
    return policy.release_timeout_minutes * 60.0 + 300.0


def run_request(releases: Sequence[Release], now: float, retry_s: float) -> dg.RunRequest:
    """One run releasing ``releases``; keyed by what it releases (and the retry window it falls in)."""
    keys = sorted(r.holding.key for r in releases)
    digest = hashlib.sha256("\n".join(keys).encode()).hexdigest()[:16]
    config = ReleaseConfig(
        releases=[
            HeldConfig(
                kind=r.holding.kind,
                id=r.holding.id,
                name=r.holding.name,
                labels=dict(r.holding.labels),
                reason=r.reason,
            )
            for r in releases
        ]
    )
    return dg.RunRequest(
        run_key=f"release-{digest}-{int(now // retry_s)}",
        run_config={"ops": {"release_held_gpus": {"config": config.model_dump()}}},
        tags={RECONCILER_TAG: "release"},
    )


@dg.op(tags=cpu_step_tags("250m", "512Mi"))
def release_held_gpus(
    context: dg.OpExecutionContext, config: ReleaseConfig, skypilot: PipesSkyPilotClient
) -> dg.Output[list[dict]]:
    """Releases what the reconciler found, verifies each release, and records what it saw.

    Raises:
        dagster.Failure: a release was not confirmed within the fleet's ``release_timeout_minutes``.
    """
    policy = skypilot.get_fleet().reconciler
    backend = skypilot.get_backend()
    holdings = [Holding(h.kind, h.id, labels=h.labels, name=h.name) for h in config.releases]
    reasons = {f"{h.kind}:{h.id}": h.reason for h in config.releases}
    for h in holdings:
        context.log.warning(f"Releasing {h.describe()}: {reasons[h.key]}.")
    outcomes = release_and_verify(backend, holdings, timeout_s=policy.release_timeout_minutes * 60.0)
    _record_on_owners(context, outcomes)
    unconfirmed = [o for o in outcomes if not o.confirmed]
    for o in outcomes:
        if o.confirmed:
            context.log.info(o.summary())
        else:
            report_unconfirmed(context.instance, context.run, o)
    records = [{**o.to_record(), "reason": reasons[o.holding.key]} for o in outcomes]
    metadata = {
        "released": len(outcomes) - len(unconfirmed),
        "not_confirmed": len(unconfirmed),
        "releases": dg.MetadataValue.md(_table(records)),
    }
    if unconfirmed:
        raise dg.Failure(
            description="Release not confirmed: " + "; ".join(o.summary() for o in unconfirmed),
            metadata={**metadata, "not_confirmed_ids": ", ".join(o.holding.key for o in unconfirmed)},
        )
    return dg.Output(records, metadata=metadata)


def _record_on_owners(context: dg.OpExecutionContext, outcomes: Sequence[ReleaseOutcome]) -> None:
    """Tags the run that launched each released holding with what the reconciler did about it."""
    for o in outcomes:
        run_id = claimed_run(o.holding, label_key())
        if not run_id or context.instance.get_run_by_id(run_id) is None:
            continue
        verdict = f"{'confirmed' if o.confirmed else 'NOT confirmed'} in {o.seconds:.0f} s by run {context.run_id[:8]}"
        context.instance.add_run_tags(run_id, {f"{TAG_RELEASED_PREFIX}{o.holding.kind}-{o.holding.id}"[:255]: verdict})


def _table(records: Sequence[dict]) -> str:
    lines = ["| what | id | released | seconds | why | seen |", "|---|---|---|---|---|---|"]
    for r in records:
        lines.append(
            f"| {r['kind']} | {r['id']} | {'yes' if r['confirmed'] else '**NOT CONFIRMED**'} | {r['seconds']} "
            f"| {r['reason']} | {'; '.join(r['seen'])} |"
        )
    return "\n".join(lines)


@dg.job(
    tags={RECONCILER_TAG: "release"},
    description="Release GPUs the orphan reconciler found, and verify each release.",
)
def release_held_gpus_job() -> None:
    release_held_gpus()


@dg.sensor(job=release_held_gpus_job, minimum_interval_seconds=60, default_status=dg.DefaultSensorStatus.RUNNING)
def orphan_reconciler(context: dg.SensorEvaluationContext, skypilot: PipesSkyPilotClient) -> dg.SensorResult:
    """Releases jobs and warm pools whose Dagster run has ended or is unknown, and interactive clusters past
    their time to live (see the module docstring)."""
    return riding_out(lambda: _reconciler_tick(context, skypilot))


def _reconciler_tick(context: dg.SensorEvaluationContext, skypilot: PipesSkyPilotClient) -> dg.SensorResult:
    cursor = json.loads(context.cursor) if context.cursor else {}
    policy = skypilot.get_fleet().reconciler
    dead = dead_runs(context.instance)
    for run, identity in dead if not policy.dry_run else ():
        said = f"its process ({identity}) is gone: nothing waits for its jobs"
        context.instance.report_run_failed(run, message=f"Marked failed by the orphan reconciler: {said}.")
        context.log.warning(f"Marked run {run.run_id} failed: {said}.")
    now = time.time()
    ended = {run.run_id for run, _ in dead}
    fresh, waiting, new_cursor = reconcile_tick(context.instance, skypilot, cursor, now, ended=ended)
    cursor_text = json.dumps(new_cursor, separators=(",", ":"))
    for r in waiting:
        context.log.info(f"{r.holding.describe()}: release already asked ({r.reason})")
    if policy.dry_run:
        marks = [f"run {run.run_id} (its process {identity} is gone)" for run, identity in dead]
        lines = [f"{r.holding.describe()}: {r.reason}" for r in fresh]
        for line in marks:
            context.log.info(f"dry run: would mark failed {line}")
        for line in lines:
            context.log.info(f"dry run: would release {line}")
        said = f"would release {len(lines)}: " + "; ".join(lines) if lines else "nothing to release"
        if marks:
            said = f"would mark failed {len(marks)}: " + "; ".join(marks) + "; " + said
        return dg.SensorResult(skip_reason=f"dry run: {said}", cursor=cursor_text)
    if not fresh:
        return dg.SensorResult(skip_reason="nothing to release", cursor=cursor_text)
    return dg.SensorResult(run_requests=[run_request(fresh, now, retry_after_s(policy))], cursor=cursor_text)
