"""What preemptions cost a job, from the states a step saw and the job's save times."""

import pytest

from gpudoor_pipelines.launch.job import JobInfo, JobState
from gpudoor_pipelines.launch.record.goodput import Timeline, preemption_cost, saved_times

R, REC, P, OK = JobState.RUNNING, JobState.RECOVERING, JobState.PENDING, JobState.SUCCEEDED


def _timeline(*seen: tuple[float, JobState, int]) -> Timeline:
    timeline = Timeline()
    for at, state, recoveries in seen:
        timeline.see(at, JobInfo("1", state, recoveries=recoveries))
    return timeline


def test_a_job_never_preempted_lost_nothing():
    cost = preemption_cost(_timeline((0, P, 0), (10, R, 0), (110, R, 0), (110, OK, 0)), [50.0], gpus=8, ended_at=111)
    assert cost.recoveries == 0 and cost.preemptions == ()
    assert cost.held_s == 100 and cost.gpu_hours_lost == 0 and cost.goodput == 1.0


def test_work_since_the_last_save_before_a_preemption_is_lost():
    # 16 H200s: ran 0-100 s, saved at 30 and 80, preempted (seen at 100), recovered at 160, ran to 260.
    timeline = _timeline((0, R, 0), (100, REC, 1), (160, R, 1), (260, OK, 1))
    cost = preemption_cost(timeline, [30.0, 80.0, 200.0], gpus=16, ended_at=261)
    (preemption,) = cost.preemptions
    assert preemption.last_saved_at == 80 and preemption.lost_s == 20
    assert cost.recoveries == 1 and cost.held_s == 200
    assert cost.gpu_hours_lost == pytest.approx(16 * 20 / 3600)
    assert cost.goodput == pytest.approx(180 / 200)
    md = cost.to_metadata()
    assert (
        md["recoveries"] == 1
        and md["goodput"] == 0.9
        and md["gpu_hours_held"] == pytest.approx(16 * 200 / 3600, abs=1e-6)
    )


def test_a_job_that_saves_nothing_loses_every_interrupted_stretch():
    timeline = _timeline((0, R, 0), (50, REC, 1), (70, P, 1), (90, R, 1), (140, REC, 2), (150, R, 2), (200, OK, 2))
    cost = preemption_cost(timeline, [], gpus=1, ended_at=201)
    assert [p.lost_s for p in cost.preemptions] == [50, 50]
    assert cost.recoveries == 2 and cost.held_s == 150 and cost.goodput == pytest.approx(50 / 150)


def test_a_recovery_missed_between_two_looks_still_counts():
    # The step looked at 0 and 300: RUNNING both times, but the recovery count went up in between.
    cost = preemption_cost(_timeline((0, R, 0), (300, R, 1), (400, OK, 1)), [100.0], gpus=2, ended_at=401)
    (preemption,) = cost.preemptions
    assert cost.recoveries == 1 and preemption.last_saved_at == 100 and preemption.lost_s == 200


def test_a_recovery_seen_only_after_the_job_ended_is_dated_by_the_backend():
    # The step saw it RUNNING at 0, then SUCCEEDED with one recovery at 300; the backend says it ran again
    # from 120: the preemption came before 120, and what it ran after that was useful.
    timeline = Timeline()
    timeline.see(0, JobInfo("1", R))
    timeline.see(300, JobInfo("1", OK, recoveries=1, recovered_at=120))
    cost = preemption_cost(timeline, [100.0], gpus=1, ended_at=301, ran_s=280.0)
    (preemption,) = cost.preemptions
    assert preemption.seen_at == 120 and preemption.lost_s == 20 and cost.goodput == pytest.approx(260 / 280)
    # A recovery the backend dates before the step's last look is an earlier one: the look dates it.
    stale = Timeline()
    stale.see(0, JobInfo("1", R, recoveries=1, recovered_at=-50))
    stale.see(300, JobInfo("1", OK, recoveries=2, recovered_at=-50))
    assert stale.seen[-1][0] == 300


def test_a_job_seen_recovering_but_never_seen_running_still_counts_a_recovery():
    # On a loaded machine the step may look at STARTING, then RECOVERING (SkyPilot's count not yet up), then a
    # job launched in its place (another pool, counting from 0): the job was preempted once.
    timeline = _timeline((0, P, 0), (40, REC, 0), (45, P, 0), (60, R, 0), (90, OK, 0))
    cost = preemption_cost(timeline, [], gpus=1, ended_at=91)
    assert cost.recoveries == 1 and cost.to_metadata()["recoveries"] == 1
    # The step says so, though it cannot say what the preemption lost.
    said = cost.summary("7")
    assert said.startswith("Job 7 was preempted 1 time(s) and recovered") and "1 before the step saw" in said


def test_a_job_waiting_for_new_gpus_between_recovering_and_pending_counts_one_recovery():
    timeline = _timeline(
        (0, R, 0), (40, REC, 0), (45, P, 0), (60, REC, 0), (70, P, 0), (80, REC, 0), (90, R, 1), (120, OK, 1)
    )
    cost = preemption_cost(timeline, [], gpus=1, ended_at=121)
    assert cost.recoveries == 1 and len(cost.preemptions) == 1


def test_the_backend_count_of_time_ran_is_the_time_held():
    timeline = _timeline((0, R, 0), (100, REC, 1), (400, R, 1), (500, OK, 1))
    cost = preemption_cost(timeline, [90.0], gpus=1, ended_at=501, ran_s=190.0)
    assert cost.held_s == 190 and cost.lost_s == 10 and cost.goodput == pytest.approx(180 / 190)


def test_a_cancel_is_not_a_preemption():
    cost = preemption_cost(
        _timeline((0, R, 0), (50, JobState.CANCELLING, 0), (60, JobState.CANCELLED, 0)), [], gpus=1, ended_at=61
    )
    assert cost.preemptions == () and cost.goodput == 1.0


def test_only_messages_with_a_save_time_are_saves():
    messages = [
        {"saved": "part", "durable_at": 20.5},
        {"shard": "a", "state": "done"},
        "text",
        {"durable_at": "soon"},
        {"durable_at": 3},
    ]
    assert saved_times(messages) == [3.0, 20.5]
