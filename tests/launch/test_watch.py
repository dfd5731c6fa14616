"""Watching many jobs without flooding the API server, and without noticing their end any later.

The backend is a counting stand-in (``watch_fakes.TimedBackend``): jobs that run for a set time and
a log that ends with them. SkyPilot's API server cannot run fifty jobs on these machines; the Slurm
tests watch real managed jobs through the same code.
"""

from __future__ import annotations

import threading
import time

import pytest

from gpudoor_pipelines.launch.backends import skypilot as skypilot_backend
from gpudoor_pipelines.launch.config import LaunchSettings
from gpudoor_pipelines.launch.job import JobInfo, JobState
from gpudoor_pipelines.launch.launcher import Launcher
from gpudoor_pipelines.launch.resolve.fleet import load_fleet
from gpudoor_pipelines.launch.watch import Backoff, Hooks, status_hub
from tests.launch.fake_sky import FakeSky, Status, install
from tests.launch.watch_fakes import TimedBackend


def _client(tmp_path, **kwargs) -> LaunchSettings:
    return LaunchSettings(**kwargs)


def _wait(settings: LaunchSettings, backend, job_id: str):
    return Launcher(backend, load_fleet(), settings).wait([job_id]).infos[job_id]


def _watch_all(client, backend, job_ids) -> dict[str, float]:
    """Each job watched by its own thread, as the steps of one run are; returns when each saw its job end."""
    returned: dict[str, float] = {}

    def watch(job_id: str) -> None:
        info = _wait(client, backend, job_id)
        assert info.state.value == "SUCCEEDED"
        returned[job_id] = time.monotonic()

    threads = [threading.Thread(target=watch, args=(j,)) for j in job_ids]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert len(returned) == len(job_ids)
    return returned


def test_fifty_steps_of_one_process_share_their_status_requests_and_see_each_end_at_once(tmp_path):
    backend = TimedBackend()
    client = _client(tmp_path, poll_interval_s=0.1, max_poll_interval_s=30.0)
    jobs = [str(i) for i in range(50)]
    for job_id in jobs:
        backend.add(job_id, 3.5)
    returned = _watch_all(client, backend, jobs)
    # One request per job per poll interval, as before, would be 50 x 35 = 1,750 requests. Shared and
    # backed off (0.1 s, then doubling), a handful of rounds cover all fifty jobs.
    assert backend.requests <= 20, backend.requests
    # Backed off, the next poll would come at 6.4 s; each log stream's end brought it forward.
    ends = {j: backend.jobs[j][1] for j in jobs}
    late = max(returned[j] - ends[j] for j in jobs)
    assert late < 2.0, late


def test_a_job_whose_state_keeps_changing_is_asked_about_at_the_short_interval():
    backoff = Backoff(0.5, 20.0)
    assert [backoff.after(changed=False) for _ in range(8)] == [1.0, 2.0, 4.0, 8.0, 16.0, 20.0, 20.0, 20.0]
    assert backoff.after(changed=True) == 0.5


def test_local_jobs_are_not_backed_off(tmp_path):
    backend = TimedBackend(remote_status=False)  # states are files: asking costs nothing
    client = _client(tmp_path, poll_interval_s=0.1, max_poll_interval_s=30.0)
    backend.add("a", 1.5)
    _watch_all(client, backend, ["a"])
    assert backend.requests >= 10  # every 0.1 s, as before


def test_an_unknown_job_is_an_error_not_a_wait(tmp_path):
    backend = TimedBackend()
    hub = status_hub(backend)
    hub.watch(["nope"])
    assert hub.get(["nope"]) == {}
    client = _client(tmp_path, poll_interval_s=0.1)
    with pytest.raises(KeyError, match="no job nope"):
        _wait(client, backend, "nope")


def test_the_team_usage_is_read_once_for_launches_close_together_and_again_after_a_submit(monkeypatch):
    fake = install(monkeypatch, FakeSky("http://127.0.0.1:1"))
    fake.add_job(1, Status.RUNNING, {"gpudoor-pool": "onprem", "gpudoor-user": "ana"})
    backend = skypilot_backend.SkyPilotBackend(fake.endpoint)
    first = [skypilot_backend.SkyPilotBackend(fake.endpoint).usage() for _ in range(20)]
    assert len(fake.queue_requests) == 1 and all(u.gpus == {"onprem": 1} for u in first)
    backend.cancel("1")  # this process changed what is held: the next launch reads it again
    backend.usage()
    assert len(fake.queue_requests) == 2


class _Restless(TimedBackend):
    """A backend whose job's state changes at every look until it ends (the worst case for backing off), and
    whose states change no faster than once a second (as SkyPilot's controller changes them every 5-15 s)."""

    status_granularity_s = 1.0

    def _info(self, job_id: str) -> JobInfo:
        info = super()._info(job_id)
        if info.state.is_terminal:
            return info
        return JobInfo(job_id=job_id, state=JobState.STARTING if self.requests % 2 else JobState.RUNNING)


def test_a_job_is_looked_at_no_sooner_than_its_backend_can_change_it_and_its_end_is_seen_at_once():
    """Every look at SkyPilot's queue costs its API server a Python process: however short the poll interval, a
    job is not asked about again sooner than its state can change. Its log still streams at the poll interval,
    and the end of its log brings the look that sees it end."""
    backend = _Restless()
    backend.add("a", 4.0)
    lines: list[str] = []
    settings = LaunchSettings(poll_interval_s=0.05, max_poll_interval_s=30.0)
    watched = Launcher(backend, load_fleet(), settings).wait(["a"], hooks=Hooks(line=lines.append))
    seen_end = time.monotonic()
    assert watched.infos["a"].state is JobState.SUCCEEDED
    # At the poll interval, a state that changes at every look would be asked about some 80 times.
    assert backend.requests <= 6, backend.requests
    assert seen_end - backend.jobs["a"][1] < 0.5
    assert lines == [f"a: second {i}" for i in range(4)]


class _Phased(TimedBackend):
    """A job that waits (PENDING), launches (STARTING), runs, is preempted and recovers, then ends, at set times;
    ``looks`` keeps when each look came and what it saw."""

    PHASES = ((0.5, JobState.PENDING), (1.5, JobState.STARTING), (3.0, JobState.RUNNING), (3.6, JobState.RECOVERING))

    def __init__(self) -> None:
        super().__init__()
        self.looks: list[tuple[float, JobState]] = []

    def _info(self, job_id: str) -> JobInfo:
        info = super()._info(job_id)
        start = self.jobs[job_id][0]
        if not info.state.is_terminal:
            elapsed = time.monotonic() - start
            state = next((s for until, s in self.PHASES if elapsed < until), JobState.RUNNING)
            info = JobInfo(job_id=job_id, state=state)
        self.looks.append((time.monotonic() - start, info.state))
        return info


def test_a_job_is_followed_closely_only_when_it_recovers_and_its_end_is_seen_at_once():
    """A job going from waiting to launching to running is not asked about again sooner for each step (on
    SkyPilot, every look is a process on the API server): what it does next is end, which its log's end cues.
    A job that enters recovery is: its next states come soon, and a move to another pool may be due."""
    backend = _Phased()
    backend.add("a", 6.0)
    settings = LaunchSettings(poll_interval_s=0.1, max_poll_interval_s=1.6)
    watched = Launcher(backend, load_fleet(), settings).wait(["a"])
    seen_end = time.monotonic()
    assert watched.infos["a"].state is JobState.SUCCEEDED and seen_end - backend.jobs["a"][1] < 0.5
    before = [at for at, state in backend.looks if at < 3.0]
    # Doubling from 0.1 s without a restart at each step: 0.1, 0.3, 0.7, 1.5 (restarting at each step, as every
    # change did, made 10 looks by then).
    assert len(before) <= 4, backend.looks
    recovering = next(at for at, state in backend.looks if state is JobState.RECOVERING)
    after = [at for at, _ in backend.looks if at > recovering]
    assert after and after[0] - recovering < 0.3, backend.looks  # the next look comes at the short interval
