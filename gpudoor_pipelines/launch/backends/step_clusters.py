"""Steps launched as clusters of their own (the fleet's ``launch_as: {<step>: cluster}``).

For short steps (the smoke test): ``sky.launch`` of a cluster named ``gpudoor-step-…``, the job's log
followed with ``sky.tail_logs``, ``sky.down`` once the job has ended. That is the launch, tail, down of
other orchestrators, some 20 to 30 s quicker than a managed job (no jobs controller in between), with
what a managed job would have given kept by the door:

- **cancel**: the step tears the cluster down and verifies it is gone (as for any release); a run
  worker that dies leaves a cluster labelled with its run, which the orphan reconciler tears down;
- **recovery**: the process that launched the cluster follows its log; when the stream ends without
  the job's end and the cluster is no longer up (its allocation preempted), it launches the same task
  on the same cluster name again, at most ``MAX_RELAUNCHES`` times, and the step sees RECOVERING and
  then RUNNING, as for a managed job. A step re-attached from another process sees the job's state,
  and cannot relaunch it (it does not have the task);
- **caps**: the API server's policy counts the door's step clusters with its managed jobs.

A job id is ``<cluster>/<job id on the cluster>``; a managed job's id is a number.
"""

from __future__ import annotations

import dataclasses
import re
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from gpudoor_pipelines.launch.backends import sky_sdk
from gpudoor_pipelines.launch.backends.base import LogFollower
from gpudoor_pipelines.launch.backends.strategies import JobStrategy, register
from gpudoor_pipelines.launch.errors import LaunchConfigError
from gpudoor_pipelines.launch.job import Holding, JobInfo, JobState
from gpudoor_pipelines.launch.labels import STEP_CLUSTER_PREFIX
from gpudoor_pipelines.launch.resolve.request import ResolvedJob, slug
from gpudoor_pipelines.launch.watch import Backoff

#: Relaunches after preemptions, per step (SkyPilot's own FAILOVER recovers a managed job without limit;
#: a short step preempted three times is better reported than retried on).
MAX_RELAUNCHES = 3
# sky.exceptions.JobExitCode: what ``sky.tail_logs(follow=True)`` returns when the job has ended.
_EXIT_SUCCEEDED, _EXIT_CANCELLED = 0, 103
#: A follower that cannot reach the API server or the cluster looks again after a wait that doubles from the
#: first to the most (seconds); after ``MAX_LOOK_ERRORS`` failed looks in a row the step fails (its cluster
#: is torn down, as for any end).
_LOOK_AGAIN_FIRST_S, _LOOK_AGAIN_MOST_S = 1.0, 30.0
MAX_LOOK_ERRORS = 10
_STEPS: dict[str, _Step] = {}
_LOCK = threading.Lock()


#: A step cluster's job id: the cluster's name (as SkyPilot allows one), a slash, the job's id on it.
_JOB_ID = re.compile(r"[A-Za-z][-_.A-Za-z0-9]*/[0-9]+")


def cluster_of(job_id: str) -> str:
    """The cluster of a step-cluster job id."""
    return str(job_id).split("/", 1)[0]


def sky_job_of(job_id: str) -> int:
    """The job's id on its cluster."""
    return int(str(job_id).rsplit("/", 1)[1])


def cluster_name(job_name: str) -> str:
    """``gpudoor-step-<job name>-<4 hex>``: at most 50 characters, unique per launch."""
    return f"{STEP_CLUSTER_PREFIX}{slug(job_name, 32).lower().strip('-.')}-{uuid.uuid4().hex[:4]}"


@dataclasses.dataclass
class _Step:
    """What this process knows of one step cluster's job."""

    cluster: str
    sky_job_id: int
    task: Any | None  # the sky.Task, to relaunch it; None when adopted from another process
    launched_at: float  # when the launch was asked for: the cluster holds its GPUs from about then
    started_at: float | None = None  # when the job was submitted on the cluster
    state: JobState | None = None  # once decided: the job has ended
    detail: str = ""
    recoveries: int = 0
    relaunching: bool = False
    released: bool = False  # cancelled or torn down by the door: never relaunched
    launch_request: Any = None  # the relaunch's request while it waits for GPUs
    ended_at: float | None = None
    recovered_at: float | None = None  # when the job was last submitted again on a relaunched cluster
    ran_before_s: float = 0.0  # seconds it ran on clusters since lost
    running_since: float | None = None  # when its current run began (None while its cluster is lost)

    def __post_init__(self) -> None:
        if self.running_since is None:
            self.running_since = self.started_at or self.launched_at

    def lost(self) -> None:
        """Its cluster is gone: the run so far counts, the time until it runs again does not."""
        if self.running_since is not None:
            self.ran_before_s += time.time() - self.running_since
            self.running_since = None

    def recovered(self) -> None:
        """Its job was submitted again on a relaunched cluster."""
        self.recovered_at = self.running_since = time.time()

    def ran_s(self) -> float:
        """Seconds it ran, relaunch time left out (as SkyPilot counts a managed job's ``job_duration``)."""
        if self.running_since is None:
            return self.ran_before_s
        return self.ran_before_s + max(0.0, (self.ended_at or time.time()) - self.running_since)

    def decide(self, state: JobState, detail: str = "") -> None:
        if self.state is None:
            self.state, self.detail, self.ended_at = state, detail, time.time()

    def info(self, job_id: str, listed: Mapping[str, str]) -> JobInfo:
        if self.state is not None:
            state = self.state
        elif self.relaunching:
            state = JobState.RECOVERING
        elif self.cluster in listed:
            state = JobState.RUNNING if listed[self.cluster] == "UP" else JobState.STARTING
        else:  # gone, and the follower has not said why yet: it is looking (and relaunches a preempted one)
            state = JobState.RECOVERING
        started = self.started_at or self.launched_at
        return JobInfo(
            job_id=job_id,
            state=state,
            name=self.cluster,
            recoveries=self.recoveries,
            submitted_at=self.launched_at,
            started_at=started,
            ended_at=self.ended_at,
            detail=self.detail,
            ran_s=self.ran_s(),
            recovered_at=self.recovered_at,
        )


def launch(job: ResolvedJob) -> str:
    """``sky.launch`` of the job on a new step cluster (returns once the job is submitted on it).

    A launch that fails part-way (no resources, interrupted) has its cluster torn down before the error
    goes on: nothing half-provisioned stays up.
    """
    sky = sky_sdk.sky()
    cluster, task, asked = cluster_name(job.name), sky_sdk.build_task(job), time.time()
    request_id = None
    try:
        with sky_sdk.refusals(job):
            # Like a managed job, it waits for the pool's GPUs to be free (SkyPilot retries the launch).
            request_id = sky.launch(task, cluster_name=cluster, retry_until_up=True)
            sky_job_id, _ = sky.get(request_id)
    except LaunchConfigError as e:
        if e.field == "resources":  # SkyPilot could not place it: it may have started provisioning
            sky_sdk.down(cluster)
        raise
    except BaseException:  # interrupted (the run cancelled) or failed part-way: the server stops trying
        if request_id is not None:
            sky_sdk.cancel_request(request_id)
        sky_sdk.down(cluster)
        raise
    job_id = f"{cluster}/{sky_job_id}"
    with _LOCK:
        _STEPS[job_id] = _Step(cluster, int(sky_job_id), task, asked, started_at=time.time())
    return job_id


def infos(job_ids: Sequence[str]) -> dict[str, JobInfo]:
    """The jobs' states: what this process decided, else one ``sky.status`` of every undecided cluster."""
    steps = {}
    for job_id in job_ids:
        step = _known(job_id) or _adopt(job_id)
        if step is not None:
            steps[job_id] = step
    undecided = [s.cluster for s in steps.values() if s.state is None and not s.relaunching]
    listed = sky_sdk.clusters(undecided) if undecided else {}
    return {job_id: step.info(job_id, listed) for job_id, step in steps.items()}


def _known(job_id: str) -> _Step | None:
    with _LOCK:
        return _STEPS.get(job_id)


def _adopt(job_id: str) -> _Step | None:
    """A job another process launched (a retried run re-attaching): its state from the server; None when
    its cluster is gone."""
    cluster, sky_job_id = cluster_of(job_id), sky_job_of(job_id)
    if cluster not in sky_sdk.clusters([cluster]):
        return None
    step = _Step(cluster, sky_job_id, None, time.time())
    state = _job_state(cluster, sky_job_id)
    if state is not None and state.is_terminal:
        step.decide(state)
    with _LOCK:
        return _STEPS.setdefault(job_id, step)


def _job_state(cluster: str, sky_job_id: int) -> JobState | None:
    """``sky.job_status`` of the job on its cluster, as a JobState (None when the cluster has no such job)."""
    sky = sky_sdk.sky()
    return sky_sdk.cluster_job_state(sky.get(sky.job_status(cluster, job_ids=[sky_job_id])).get(sky_job_id))


def follow(job_id: str) -> LogFollower:
    """Follows the job's log in a thread, and decides how it ended (relaunching a preempted one)."""
    step = _known(job_id) or _adopt(job_id)
    if step is None:
        raise KeyError(f"no step cluster {cluster_of(job_id)}")
    return sky_sdk.ThreadFollower(lambda out: _follow(step, out))


def _follow(step: _Step, out) -> None:
    """Follows the job's log until its end is decided. It never ends undecided: the step waits on it."""
    errors, looks = 0, Backoff(_LOOK_AGAIN_FIRST_S, _LOOK_AGAIN_MOST_S)
    try:
        while step.state is None:
            try:
                _follow_once(step, out)
                errors = 0
                looks.reset()
            except Exception as e:  # noqa: BLE001 - the API server or the cluster did not answer: look again
                errors += 1
                if errors >= MAX_LOOK_ERRORS:
                    step.decide(
                        JobState.FAILED,
                        f"lost track of cluster {step.cluster} after {errors} failed looks: {type(e).__name__}: {e}",
                    )
                    return
                wait = looks.current
                looks.after(changed=False)
                out.write(
                    f"[gpudoor] could not look at cluster {step.cluster} ({type(e).__name__}: {e}); "
                    f"looking again in {wait:g} s\n"
                )
                time.sleep(wait)
    finally:
        step.decide(JobState.FAILED, f"stopped following cluster {step.cluster}")  # no-op once decided


def _follow_once(step: _Step, out) -> None:
    """One log stream of the job, to its end; then what that end meant (decided, or followed again)."""
    sky = sky_sdk.sky()
    try:
        code = sky.tail_logs(step.cluster, step.sky_job_id, follow=True, output_stream=out)
    except Exception as e:  # noqa: BLE001 - the cluster decides below what the end of the stream meant
        out.write(f"[gpudoor] log stream ended: {type(e).__name__}: {e}\n")
        code = None
    if step.released:
        step.decide(JobState.CANCELLED, "cancelled by the door")
    elif code == _EXIT_SUCCEEDED:
        step.decide(JobState.SUCCEEDED)
    elif code == _EXIT_CANCELLED:
        step.decide(JobState.CANCELLED, f"cancelled on its cluster {step.cluster}")
    elif _cluster_up(step.cluster):
        state = _job_state(step.cluster, step.sky_job_id)
        if state is None or state.is_terminal:
            step.decide(
                state or JobState.FAILED, "" if state else f"cluster {step.cluster} has no job {step.sky_job_id}"
            )
        else:  # the stream dropped while the job runs: follow it again
            time.sleep(1.0)
    else:
        _relaunch(step, out)


def _cluster_up(cluster: str) -> bool:
    """Whether the cluster is UP, asking its infra (``refresh``): a preempted allocation shows here first."""
    sky = sky_sdk.sky()
    from sky.utils import common

    records = sky_sdk.read(
        lambda: sky.status(cluster_names=[cluster], refresh=common.StatusRefreshMode.FORCE, all_users=True)
    )
    return any(str(getattr(r.get("status"), "value", r.get("status"))) == "UP" for r in records or ())


def _relaunch(step: _Step, out) -> None:
    """The cluster was lost under a running job: the same task on the same cluster name, again."""
    step.lost()
    if step.task is None or step.recoveries >= MAX_RELAUNCHES:
        why = (
            "it was launched by another process" if step.task is None else f"relaunched {step.recoveries} times already"
        )
        step.decide(
            JobState.FAILED_NO_RESOURCE, f"its cluster {step.cluster} was lost (preempted); not relaunched: {why}"
        )
        return
    sky = sky_sdk.sky()
    step.relaunching, step.recoveries = True, step.recoveries + 1
    out.write(
        f"[gpudoor] cluster {step.cluster} was lost (preempted): launching it again "
        f"(recovery {step.recoveries} of at most {MAX_RELAUNCHES})\n"
    )
    try:
        sky_sdk.down(step.cluster, wait=True)  # what is left of it (its record, a partial allocation)
        if not step.released:
            step.launch_request = sky.launch(step.task, cluster_name=step.cluster, retry_until_up=True)
            sky_job_id, _ = sky.get(step.launch_request)
            step.sky_job_id = int(sky_job_id)
            step.recovered()
        if step.released:  # cancelled while it was being launched again: it goes at once
            sky_sdk.down(step.cluster, wait=True)
    except Exception as e:  # noqa: BLE001 - the step fails with the reason
        step.decide(JobState.FAILED_NO_RESOURCE, f"relaunching cluster {step.cluster} failed: {type(e).__name__}: {e}")
        sky_sdk.down(step.cluster)
    finally:
        step.relaunching, step.launch_request = False, None


def release(job_id: str, *, wait: bool) -> None:
    """Tears the job's cluster down (``sky.down``); ``wait``: until the request is done. The job is never
    relaunched after this."""
    release_cluster(cluster_of(job_id), wait=wait)


def release_cluster(cluster: str, *, wait: bool) -> bool:
    """Tears a step cluster down; a job of this process on it is never relaunched after this. Returns whether
    there was a cluster to tear down."""
    with _LOCK:
        steps = [s for s in _STEPS.values() if s.cluster == cluster]
    for step in steps:
        step.released = True
        step.decide(JobState.CANCELLED, "cancelled by the door")
        if step.launch_request is not None:  # a relaunch still waiting for GPUs: the server stops trying
            sky_sdk.cancel_request(step.launch_request)
    return sky_sdk.down(cluster, wait=wait) is not None


def finish(job_id: str) -> str:
    """Once the job has ended: ``sky.down`` of its cluster, sent and not waited for (the API server
    carries it out whether this process lives on or not; the orphan reconciler catches any that is left)."""
    step = _known(job_id)
    if step is not None:
        step.released = True
    request_id = sky_sdk.down(cluster_of(job_id))
    return f"Tearing down cluster {cluster_of(job_id)}" + (f" (request {request_id})." if request_id else ".")


@register("cluster")
class StepClusters(JobStrategy):
    """A step on a cluster of its own (see the module docstring); its id is ``<cluster>/<job id on it>``."""

    @staticmethod
    def owns(job_id: str) -> bool:
        return _JOB_ID.fullmatch(str(job_id)) is not None

    def submit(self, job: ResolvedJob) -> str:
        return launch(job)

    def infos(self, job_ids: Sequence[str]) -> dict[str, JobInfo]:
        return infos(job_ids)

    def follow(self, job_id: str) -> LogFollower:
        return follow(job_id)

    def tail(self, job_id: str, lines: int) -> list[str]:
        sky = sky_sdk.sky()
        cluster, sky_job_id = cluster_of(job_id), sky_job_of(job_id)
        return sky_sdk.tail(
            lambda out: sky.tail_logs(cluster, sky_job_id, follow=False, tail=lines, output_stream=out), lines
        )

    def cancel(self, job_ids: Sequence[str]) -> None:
        for job_id in job_ids:
            release(job_id, wait=True)

    def holding(self, job_id: str) -> Holding:
        """What the job holds: its cluster."""
        return Holding("cluster", cluster_of(job_id), name=cluster_of(job_id))

    def finish(self, job_id: str) -> str | None:
        return finish(job_id)
