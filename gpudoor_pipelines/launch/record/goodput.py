"""What preemptions cost one job: GPU-hours held, GPU-hours lost, goodput.

A managed job that is preempted is recovered by SkyPilot on a new allocation and resumes from its
last saved progress (a caption part written, a checkpoint published). What it did between that save
and the preemption is done again: those GPU-hours were held and wasted.

The step watching the job knows two things, and this module turns them into figures:

- when the job stopped running: the states the step saw, with the time it saw each
  (:class:`Timeline`). A preemption is dated when the step sees the job leave RUNNING for a state
  from which it runs again (RECOVERING, PENDING, STARTING), or sees its recovery count go up. The
  step looks at least every ``max_poll_interval_s`` while a job runs, so a preemption is dated at
  most that late: the lost figure is an upper bound by that much per preemption. A recovery the step
  sees only once it is over (the job running again, or ended) is dated no later than the backend's own
  time for it (``JobInfo.recovered_at``).
- when work was last saved: the ``durable_at`` times (UNIX seconds, the job's clock) of the Pipes
  custom messages the job sent after each save (``workloads.reporting.saved``). A job that sends
  none loses, on each preemption, everything since its last (re)start.

Goodput is useful GPU-hours ÷ GPU-hours held, useful being held minus lost.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from gpudoor_pipelines.launch.job import JobInfo, JobState

#: The key of a Pipes custom message's save time (see ``workloads.reporting.saved``).
DURABLE_AT = "durable_at"
_RUNS_AGAIN = {JobState.RECOVERING, JobState.PENDING, JobState.STARTING}


@dataclasses.dataclass
class Timeline:
    """A job's states as a step saw them: ``(seen_at, state, recoveries)``, one entry per change."""

    seen: list[tuple[float, JobState, int]] = dataclasses.field(default_factory=list)

    def see(self, at: float, info: JobInfo) -> None:
        """Record the job's state at ``at`` if its state or recovery count changed.

        A recovery count that went up since the last look, with a recovery the backend dates after that
        look (``JobInfo.recovered_at``), is dated then: the job was preempted before it ran again, even
        when the step sees it only after its end.
        """
        if self.seen and self.seen[-1][1:] == (info.state, info.recoveries):
            return
        if self.seen and info.recovered_at is not None and info.recoveries > self.seen[-1][2]:
            if self.seen[-1][0] < info.recovered_at < at:
                at = info.recovered_at
        self.seen.append((at, info.state, info.recoveries))


@dataclasses.dataclass(frozen=True)
class Preemption:
    """One preemption: when the step saw it, the last save before it, the seconds of work lost."""

    seen_at: float
    last_saved_at: float | None
    lost_s: float


@dataclasses.dataclass(frozen=True)
class PreemptionCost:
    """GPU-hours a job held and lost to preemptions, and its goodput (1.0 when nothing was lost)."""

    recoveries: int
    held_s: float
    preemptions: tuple[Preemption, ...]
    gpus: float

    @property
    def lost_s(self) -> float:
        """Seconds of work done again after preemptions (never more than the time held)."""
        return min(self.held_s, sum(p.lost_s for p in self.preemptions))

    @property
    def gpu_hours_held(self) -> float:
        return self.gpus * self.held_s / 3600.0

    @property
    def gpu_hours_lost(self) -> float:
        return self.gpus * self.lost_s / 3600.0

    @property
    def goodput(self) -> float:
        """Useful GPU-hours ÷ GPU-hours held; 1.0 for a job that held nothing."""
        return (self.held_s - self.lost_s) / self.held_s if self.held_s > 0 else 1.0

    def summary(self, job_id: str) -> str:
        """What the preemptions of job ``job_id`` cost, in words: one line, then one per preemption (those the
        step never saw the job run before are counted, but not what they lost)."""
        lines = [
            f"Job {job_id} was preempted {self.recoveries} time(s) and recovered: "
            f"{self.gpu_hours_lost:.3f} of {self.gpu_hours_held:.3f} GPU-hours held were lost (goodput "
            f"{self.goodput:.1%})."
        ]
        for p in self.preemptions:
            saved = (
                "nothing saved before it"
                if p.last_saved_at is None
                else f"last save {p.seen_at - p.last_saved_at:.0f} s before"
            )
            seen = time.strftime("%H:%M:%S", time.localtime(p.seen_at))
            lines.append(f"- preempted (seen) at {seen}, {saved}: {p.lost_s:.0f} s of work lost")
        if (unseen := self.recoveries - len(self.preemptions)) > 0:
            lines.append(f"- {unseen} before the step saw the job run: what it ran then is not counted")
        return "\n".join(lines)

    def to_metadata(self) -> dict[str, Any]:
        """The figures under the names the materialization shows."""
        return {
            "recoveries": self.recoveries,
            "gpu_hours_held": round(self.gpu_hours_held, 6),
            "gpu_hours_lost_to_preemption": round(self.gpu_hours_lost, 6),
            "goodput": round(self.goodput, 4),
        }


def saved_times(messages: Iterable[Any]) -> list[float]:
    """The ``durable_at`` times of a job's Pipes custom messages, sorted (other messages are skipped)."""
    out = []
    for message in messages:
        if isinstance(message, Mapping) and isinstance(message.get(DURABLE_AT), int | float):
            out.append(float(message[DURABLE_AT]))
    return sorted(out)


def preemption_cost(
    timeline: Timeline, saved_at: Sequence[float], *, gpus: float, ended_at: float, ran_s: float | None = None
) -> PreemptionCost:
    """What the job's preemptions cost, from what the step saw and the job's save times.

    Args:
        timeline: the job's states as the step saw them.
        saved_at: the job's save times, sorted (:func:`saved_times`).
        gpus: the GPUs the job holds over all its nodes.
        ended_at: when the step saw the job end (closes a last running stretch).
        ran_s: the backend's own count of the seconds the job ran, recovery time excluded (SkyPilot's
            ``job_duration``); the running stretches the step saw when None.
    """
    stretches: list[tuple[float, float, bool]] = []  # (start, end, ended by a preemption)
    start: float | None = None
    recoveries = 0
    # Times the step saw the job enter RECOVERING (even when it never saw it RUNNING before); a job waiting
    # for new GPUs goes back and forth between RECOVERING and PENDING: one entry until it runs again.
    entered = 0
    previous: JobState | None = None
    ran_since = True
    for at, state, count in timeline.seen:
        if state is JobState.RECOVERING and previous is not JobState.RECOVERING and ran_since:
            entered += 1
            ran_since = False
        ran_since = ran_since or state is JobState.RUNNING
        previous = state
        recovered = count > recoveries
        if start is not None and (state is not JobState.RUNNING or recovered):
            stretches.append((start, at, recovered or state in _RUNS_AGAIN))
            start = None
        if state is JobState.RUNNING and start is None:
            start = at
        recoveries = max(recoveries, count)
    if start is not None:
        stretches.append((start, max(start, ended_at), False))
    preemptions = []
    for begin, end, preempted in stretches:
        if not preempted:
            continue
        saves = [t for t in saved_at if begin <= t <= end]
        last = saves[-1] if saves else None
        preemptions.append(
            Preemption(seen_at=end, last_saved_at=last, lost_s=end - (last if last is not None else begin))
        )
    held = ran_s if ran_s is not None else sum(end - begin for begin, end, _ in stretches)
    return PreemptionCost(
        recoveries=max(recoveries, len(preemptions), entered),
        held_s=max(0.0, held),
        preemptions=tuple(preemptions),
        gpus=gpus,
    )


def report_preemptions(
    job_ids: Sequence[str],
    before: Mapping[str, JobInfo],
    now: Mapping[str, JobInfo],
    reported: dict[str, int],
    report: Callable[[int, JobInfo, float], None],
) -> None:
    """Calls ``report`` once per preemption of each rank since the last poll: a rank seen entering RECOVERING,
    or whose recovery count rose past what was reported.

    A job waiting for a new worker goes back and forth between RECOVERING and PENDING: only its first entry
    into RECOVERING after it last ran counts (``reported`` keeps, under ``<job id>/ran``, whether it ran since).
    """
    at = time.time()
    for rank, job_id in enumerate(job_ids):
        info = now.get(job_id)
        if info is None:
            continue
        old = before.get(job_id)
        done = reported.get(job_id, 0)
        ran_key = f"{job_id}/ran"
        fresh = done == 0 or reported.get(ran_key, 0) == 1
        entered = info.state is JobState.RECOVERING and (old is None or old.state is not JobState.RECOVERING) and fresh
        events = max(done + (1 if entered else 0), info.recoveries)
        for _ in range(events - done):
            report(rank, info, at)
        if events > done:
            reported[ran_key] = 0
        if info.state is JobState.RUNNING:
            reported[ran_key] = 1
        reported[job_id] = events
