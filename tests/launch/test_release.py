"""A verified release looks at what it released less and less often: each look is a request to the API server."""

from __future__ import annotations

from collections.abc import Sequence

from gpudoor_pipelines.launch.job import Holding, ReleaseCheck
from gpudoor_pipelines.launch.record.release import MOST_BETWEEN_LOOKS_S, release_and_verify


class _SlowCancels:
    """Jobs that show released at given seconds after the request; every look is counted."""

    def __init__(self, clock: list[float], released_at: dict[str, float]) -> None:
        self.clock, self.released_at = clock, released_at
        self.looks: list[float] = []
        self.asked: list[str] = []

    def release_all(self, holdings: Sequence[Holding]) -> dict[str, str]:
        self.asked += [h.id for h in holdings]
        return {}

    def check_released_all(self, holdings: Sequence[Holding]) -> dict[str, ReleaseCheck]:
        now = self.clock[0]
        self.looks.append(now)
        return {h.key: ReleaseCheck(now >= self.released_at[h.id], (f"job {h.id} at {now:.0f} s",)) for h in holdings}


def _release(released_at: dict[str, float], timeout_s: float = 600.0) -> tuple[_SlowCancels, list]:
    clock = [0.0]
    backend = _SlowCancels(clock, released_at)

    def sleep(seconds: float) -> None:
        clock[0] += seconds

    holdings = [Holding(kind="job", id=job_id) for job_id in released_at]
    outcomes = release_and_verify(
        backend, holdings, timeout_s=timeout_s, poll_s=2.0, clock=lambda: clock[0], sleep=sleep
    )
    return backend, outcomes


def test_a_long_cancel_is_looked_at_less_and_less_often_up_to_the_most():
    backend, (outcome,) = _release({"7": 90.0})
    assert backend.asked == ["7"]
    gaps = [b - a for a, b in zip(backend.looks, backend.looks[1:], strict=False)]
    assert gaps[:4] == [2.0, 4.0, 8.0, MOST_BETWEEN_LOOKS_S]
    assert max(gaps) == MOST_BETWEEN_LOOKS_S
    # A 90-s cancel takes a dozen looks, not one every 2 s (45), and is confirmed within one gap of its end.
    assert len(backend.looks) <= 13
    assert outcome.confirmed and 90.0 <= outcome.seconds <= 90.0 + MOST_BETWEEN_LOOKS_S


def test_a_release_confirmed_meanwhile_makes_the_next_look_come_soon_again():
    backend, outcomes = _release({"1": 20.0, "2": 40.0})
    assert all(o.confirmed for o in outcomes)
    first_confirmed = next(t for t in backend.looks if t >= 20.0)
    # The look after the one that confirmed job 1 comes a first gap later, not a most gap.
    assert backend.looks[backend.looks.index(first_confirmed) + 1] - first_confirmed == 2.0


def test_a_release_never_seen_is_not_confirmed_at_the_bound():
    backend, (outcome,) = _release({"9": 10_000.0}, timeout_s=60.0)
    assert not outcome.confirmed and outcome.seconds == 60.0
    assert outcome.seen == ("job 9 at 60 s",)
