"""What the launcher does, as Dagster sees it: failures that say nothing was launched or what a job ended
with, run tags, error events for a release not confirmed, and the hooks that turn the launcher's events
into a step's log."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import dagster as dg

from gpudoor_pipelines.launch.errors import JobFailed, LaunchConfigError
from gpudoor_pipelines.launch.job import JobInfo
from gpudoor_pipelines.launch.labels import TAG_JOB_PREFIX, TAG_RELEASED_PREFIX
from gpudoor_pipelines.launch.record.release import ReleaseOutcome
from gpudoor_pipelines.launch.resolve.request import LaunchRequest, slug
from gpudoor_pipelines.launch.watch import Hooks


@contextlib.contextmanager
def nothing_launched() -> Iterator[None]:
    """Turns a configuration error into a clean step failure that says nothing was launched."""
    try:
        yield
    except LaunchConfigError as e:
        raise dg.Failure(
            description=f"Nothing was launched. {e}", metadata={"file": e.source, "field": e.field}
        ) from None


def job_failure(failure: JobFailed) -> dg.Failure:
    """A failed job as the step's failure: its end state and its last log lines."""
    return dg.Failure(
        description=str(failure),
        metadata={
            "job_id": failure.job_id,
            "status": failure.status,
            "log_tail": dg.MetadataValue.md("```\n" + "\n".join(failure.log_tail) + "\n```"),
        },
    )


def report_unconfirmed(
    instance: dg.DagsterInstance, run: dg.DagsterRun, outcome: ReleaseOutcome, step_key: str | None = None
) -> None:
    """An error event on ``run`` naming a holding whose release was not confirmed (the UI shows it in red)."""
    from dagster._core.events import EngineEventData
    from dagster._utils.error import SerializableErrorInfo

    message = f"GPUs may still be held: {outcome.summary()}"
    data = EngineEventData(
        metadata={"kind": outcome.holding.kind, "id": outcome.holding.id, "seen": "; ".join(outcome.seen)},
        error=SerializableErrorInfo(message, [], "ReleaseNotConfirmed"),
    )
    instance.report_engine_event(message, run, data, step_key=step_key)


def results_are_reported_by_the_caller(context: dg.AssetExecutionContext) -> None:
    """Lifts the check Pipes sets on an asset that the session's results are returned.

    A batch reports through custom messages, and its caller logs one materialization per partition as each
    finishes: a range run may end with some partitions done and others left for later, which one returned
    result cannot say. Dagster 1.13 has no public way to lift the check.
    """
    context.op_execution_context._step_execution_context._requires_typed_event_stream = False  # noqa: SLF001


def job_tag_key(request: LaunchRequest) -> str:
    """The run tag under which a step records the job it launched (a retried step re-attaches to it)."""
    partition = f"-{slug(request.partition, 60)}" if request.partition else ""
    return f"{TAG_JOB_PREFIX}{slug(request.asset or '', 60)}{partition}-{slug(request.step or request.spec.kind, 20)}"


def summarize(infos: Mapping[str, JobInfo]) -> str:
    counts: dict[str, int] = {}
    for info in infos.values():
        counts[info.state.value] = counts.get(info.state.value, 0) + 1
    return ", ".join(f"{n} {state.lower()}" for state, n in sorted(counts.items()))


def step_hooks(context: dg.AssetExecutionContext, **more: Any) -> Hooks:
    """The launcher's hooks, as events of the step: log lines, what the launcher did, releases."""
    step_key = context.get_step_execution_context().step.key

    def released(outcomes: list[ReleaseOutcome]) -> None:
        context.instance.add_run_tags(
            context.run.run_id,
            {
                f"{TAG_RELEASED_PREFIX}{o.holding.kind}-{o.holding.id}"[
                    :255
                ]: f"{'confirmed' if o.confirmed else 'NOT confirmed'} in {o.seconds:.0f} s"
                for o in outcomes
            },
        )
        for outcome in outcomes:
            if outcome.confirmed:
                context.log.warning(outcome.summary())
            else:
                report_unconfirmed(context.instance, context.run, outcome, step_key=step_key)

    return Hooks(line=context.log.info, said=context.log.warning, released=released, **more)
