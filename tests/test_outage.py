"""The outage rule (``gpudoor_pipelines/outage.py``): who is waited for, how long, and what a step starting
during an outage knows. The services themselves going away: tests/transit/test_outages_s3.py (the bucket),
tests/launch/test_client_on_fake_skypilot.py (the API server)."""

from __future__ import annotations

import os
import time

import pytest

from gpudoor_pipelines import outage


def _flaky(failures: int):
    calls = {"n": 0}

    def fn() -> str:
        calls["n"] += 1
        if calls["n"] <= failures:
            raise ConnectionRefusedError("refused")
        return "answer"

    return fn, calls


def _transient(e: BaseException) -> bool:
    return isinstance(e, ConnectionError)


def test_a_service_that_never_answered_is_not_waited_for():
    fn, calls = _flaky(1)
    with pytest.raises(ConnectionRefusedError):
        outage.service("svc-new").call(fn, _transient, "reading")
    assert calls["n"] == 1


def test_a_step_starting_during_an_outage_waits_like_the_ones_already_running(monkeypatch):
    """Another process on this machine saw the service answer: this one waits for it too."""
    outage.service("svc-known").ok()  # an earlier process
    outage._SERVICES.clear()  # this process starts now
    fn, calls = _flaky(2)
    monkeypatch.setattr(outage, "FIRST_WAIT_S", 0.01)
    assert outage.service("svc-known").call(fn, _transient, "reading") == "answer" and calls["n"] == 3


def test_what_a_machine_remembers_is_forgotten_after_a_day():
    svc = outage.service("svc-old")
    svc.ok()
    day_ago = time.time() - outage.REMEMBER_S - 60
    os.utime(svc._marker, (day_ago, day_ago))
    outage._SERVICES.clear()
    assert not outage.service("svc-old").answered


def test_the_bound_is_counted_from_the_first_failure_whoever_saw_it(monkeypatch):
    monkeypatch.setenv(outage.TOLERANCE_ENV, "0.5")
    monkeypatch.setattr(outage, "FIRST_WAIT_S", 0.05)
    svc = outage.service("svc-down")
    svc.ok()
    svc.down_since = time.monotonic() - 10  # another thread has waited for ten seconds already
    fn, calls = _flaky(100)
    with pytest.raises(outage.ServiceUnavailable, match="svc-down has not answered for 10 s") as e:
        svc.call(fn, _transient, "reading")
    assert e.value.past_bound and calls["n"] == 1


def test_a_callers_own_wait_ends_before_the_outage_does(monkeypatch):
    monkeypatch.setattr(outage, "FIRST_WAIT_S", 0.05)
    svc = outage.service("svc-tick")
    svc.ok()
    fn, _ = _flaky(100)
    with outage.waiting_at_most(0.3), pytest.raises(outage.ServiceUnavailable) as e:
        svc.call(fn, _transient, "reading")
    assert not e.value.past_bound and "still waiting" in str(e.value)


def test_a_tolerance_that_is_not_a_number_says_what_to_set(monkeypatch):
    monkeypatch.setenv(outage.TOLERANCE_ENV, "five minutes")
    with pytest.raises(ValueError, match="GPUDOOR_OUTAGE_TOLERANCE_S='five minutes': set it to a number of seconds"):
        outage.tolerance_s()
