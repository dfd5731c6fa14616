"""The weekly GPU usage: what every job the team ran held, per pool and cost owner, read from the backend."""

import base64
import datetime as dt
import io
import time
from pathlib import Path

import dagster as dg
import pytest
import yaml
from PIL import Image

from gpudoor_pipelines.assets.usage import WEEKS, gpu_usage, smoke_test_metadata, usage_table, week_of
from gpudoor_pipelines.automation.schedules import weekly_gpu_usage_schedule
from gpudoor_pipelines.launch.backends.local import LocalBackend
from gpudoor_pipelines.launch.client import PipesSkyPilotClient
from gpudoor_pipelines.launch.resolve.request import LaunchRequest, resolve
from gpudoor_pipelines.launch.resolve.specs import load_spec
from gpudoor_pipelines.transit.io_manager import TransitIOManager
from gpudoor_pipelines.transit.resource import TransitBucketResource
from tests.launch.fake_sky import Record, Status

HOUR = 3600.0


def _client(tmp_path: Path, **kwargs) -> PipesSkyPilotClient:
    transit = TransitBucketResource(kind="local", local_root=str(tmp_path / "bucket"))
    return PipesSkyPilotClient(
        local_home=str(tmp_path / "home"), transit=transit, validate_with_skypilot=False, **kwargs
    )


def _materialize(client: PipesSkyPilotClient, week: str) -> tuple[dict, object, bool]:
    """The week's table and metadata, as the UI shows them."""
    result = dg.materialize(
        [gpu_usage],
        partition_key=week,
        resources={"skypilot": client, "io_manager": TransitIOManager(transit=client.transit)},
    )
    (event,) = result.asset_materializations_for_node("gpu_usage")
    return (
        {k: v.value for k, v in event.metadata.items()},
        result.output_for_node("gpu_usage"),
        result.success,
    )


def _figures(table) -> dict[tuple[str, str], float]:
    return {(r.pool, r.cost_owner): r.gpu_hours for r in table.itertuples()}


# ----------------------------------------------------------------- the embedded default
def _launch(
    client: PipesSkyPilotClient,
    tmp_path: Path,
    accelerators: str,
    *,
    nodes: int = 1,
    seconds: float = 0.3,
    **request,
) -> str:
    """A real launch of a small task (``sleep``) through routing and the fleet rules, on the local backend."""
    spec = tmp_path / f"job-{accelerators.replace(':', '-')}-{nodes}.yaml"
    spec.write_text(
        yaml.safe_dump(
            {
                "name": "probe",
                "num_nodes": nodes,
                "resources": {"accelerators": accelerators},
                "run": f"sleep {seconds}",
            }
        )
    )
    job = resolve(LaunchRequest(spec=load_spec(spec), user="ana", **request), client.get_fleet())
    return client.get_backend().submit(job)


def _wait(backend: LocalBackend, job_ids: list[str], timeout: float = 60) -> None:
    deadline = time.time() + timeout
    while any(not backend.status(j).state.is_terminal for j in job_ids):
        assert time.time() < deadline, "jobs still running"
        time.sleep(0.1)


def _held_hours(backend: LocalBackend, job_id: str, gpus: int) -> float:
    info = backend.status(job_id)
    return gpus * (info.ended_at - info.started_at) / HOUR


def test_the_week_counts_every_local_job_by_pool_and_cost_owner(tmp_path):
    client = _client(tmp_path)
    backend = client.get_backend()
    run = {"dagster/run-id": "0123456789abcdef", "dagster/job": "__ASSET_JOB"}
    jobs = {
        "train": (
            _launch(
                client,
                tmp_path,
                "H200:2",
                nodes=2,
                step="train",
                cost_owner="ml-research",
                asset="training_run",
                dagster=run,
            ),
            4,
        ),
        "caption": (
            _launch(
                client,
                tmp_path,
                "RTX6000-Ada:1",
                step="caption",
                cost_owner="ml-engineering",
                asset="caption_shards",
                dagster=run,
            ),
            1,
        ),
        # Launched by hand, outside Dagster: no step, no run; routed by its GPU.
        "adhoc": (_launch(client, tmp_path, "L4:1", cost_owner="product-demos"), 1),
        "rented": (
            _launch(
                client,
                tmp_path,
                "H100:1",
                pool="ondemand",
                cost_owner="ml-research",
                asset="checkpoint_evals",
                dagster=run,
            ),
            1,
        ),
    }
    _wait(backend, [j for j, _ in jobs.values()])
    held = {name: _held_hours(backend, j, gpus) for name, (j, gpus) in jobs.items()}

    md, table, ok = _materialize(client, week_of(dt.datetime.now(dt.UTC)))

    assert ok
    expected = {
        ("h200", "ml-research"): held["train"],
        ("onprem", "ml-engineering"): held["caption"],
        ("inference", "product-demos"): held["adhoc"],
        ("ondemand", "ml-research"): held["rented"],
    }
    assert _figures(table) == pytest.approx(expected, rel=1e-9)
    assert md["jobs"] == 4 and md["gpu_hours"] == pytest.approx(sum(held.values()), abs=1e-6)
    assert md["gpu_hours_h200"] == pytest.approx(held["train"], abs=1e-6) and md["gpu_hours_onprem"] == pytest.approx(
        held["caption"], abs=1e-6
    )
    # On-prem and rented GPUs cost the fleet's $/GPU-hour; the idle inference GPUs cost nothing.
    fleet = client.get_fleet()
    cost = (
        held["train"] * fleet.pools["h200"].usd_per_gpu_hour
        + held["caption"] * fleet.pools["onprem"].usd_per_gpu_hour
        + held["rented"] * fleet.pools["ondemand"].usd_per_gpu_hour
    )
    assert md["cost_usd"] == pytest.approx(cost, abs=1e-3)
    assert md["share_off_h200"] == pytest.approx(1 - held["train"] / sum(held.values()), abs=1e-5)
    assert md["preemptions"] == 0 and md["goodput"] == pytest.approx(1.0)
    # Every pool and cost owner of the fleet has its series, so the UI's plots have no gaps.
    assert {f"gpu_hours_{p}" for p in fleet.pools} <= set(md) and {f"cost_usd_{o}" for o in fleet.cost_owners} <= set(
        md
    )
    assert "| h200 | ml-research | 1 |" in md["by_pool_and_owner"]
    # The chart: in the metadata as an image the UI's Markdown renders, and in the transit bucket.
    assert md["chart"].startswith("![GPU-hours per pool and cost owner") and "(data:image/png;base64," in md["chart"]
    inline = base64.b64decode(md["chart"].split("base64,", 1)[1].rstrip(")"))
    stored = Path(md["chart_uri"].removeprefix("file://")).read_bytes()
    assert inline == stored and Image.open(io.BytesIO(stored)).size == (760, 420)

    assert md["smoke_tests"] == 0 and md["smoke_tests_failed"] == 0  # no training this week

    # The week before saw none of these jobs.
    md, table, ok = _materialize(client, week_of(dt.datetime.now(dt.UTC) - dt.timedelta(days=7)))
    assert ok and len(table) == 0 and md["gpu_hours"] == 0 and md["jobs"] == 0


def test_the_week_counts_smoke_tests_run_those_that_caught_a_problem_and_their_median_time():
    from gpudoor_pipelines.launch.job import JobState, JobUsage

    def job(n: int, step: str, state: JobState, started: float | None, ended: float | None) -> JobUsage:
        return JobUsage(
            job_id=str(n),
            name=f"j{n}",
            pool="h200",
            user="ana",
            cost_owner="ml-research",
            step=step,
            gpus=1,
            started_at=started,
            ended_at=ended,
            state=state,
        )

    jobs = [
        job(1, "smoke", JobState.SUCCEEDED, 100.0, 160.0),
        job(2, "smoke", JobState.FAILED, 200.0, 230.0),  # the training's code failed: caught before the long run
        job(3, "smoke", JobState.FAILED_SETUP, 300.0, 310.0),
        job(4, "smoke", JobState.FAILED_NO_RESOURCE, None, 400.0),  # no GPU: the fleet's problem, not the code's
        job(5, "smoke", JobState.CANCELLED, 500.0, 590.0),
        job(6, "smoke", JobState.RUNNING, 600.0, None),  # not ended: counts when it ends
        job(7, "smoke", JobState.SUCCEEDED, 0.0, 5000.0),  # ended after the window
        job(8, "train", JobState.FAILED, 100.0, 200.0),
    ]
    assert smoke_test_metadata(jobs, 0.0, 1000.0) == {
        "smoke_tests": 5,
        "smoke_tests_failed": 2,
        "smoke_test_median_s": 45.0,  # of 60, 30, 10 and 90 s (the one that never started has no time)
    }
    empty = smoke_test_metadata(jobs[7:], 0.0, 1000.0)
    assert empty["smoke_tests"] == 0 and empty["smoke_test_median_s"] != empty["smoke_test_median_s"]  # NaN


def test_a_window_counts_only_its_part_of_a_job(tmp_path):
    client = _client(tmp_path)
    backend = client.get_backend()
    done = _launch(client, tmp_path, "H200:8", seconds=1.0, step="train", cost_owner="ml-research")
    _wait(backend, [done])
    start, end = backend.status(done).started_at, backend.status(done).ended_at
    running = _launch(client, tmp_path, "L4:1", seconds=60, cost_owner="product-demos")
    try:
        while backend.status(running).started_at is None:
            time.sleep(0.05)
        fleet, now = client.get_fleet(), time.time()

        def hours(since: float, until: float) -> dict:
            return _figures(usage_table(backend.job_history(since, until), since, until, fleet, now=now))

        middle = (start + end) / 2
        # A window that opens halfway through the finished job: its second half only.
        assert hours(middle, end + 1)[("h200", "ml-research")] == pytest.approx(8 * (end - middle) / HOUR)
        # One that closes halfway: its first half only.
        assert hours(start - 10, middle)[("h200", "ml-research")] == pytest.approx(8 * (middle - start) / HOUR)
        # One that opens after it ended: nothing of it.
        assert ("h200", "ml-research") not in hours(end + 0.5, now)
        # The job still running counts up to the end of the window.
        started = backend.status(running).started_at
        assert hours(started - 5, started + 30)[("inference", "product-demos")] == pytest.approx(30 / HOUR)
    finally:
        backend.cancel(running)


# ----------------------------------------------------------------- SkyPilot's queue


def _labels(pool: str, owner: str, **more: str) -> dict:
    return {"gpudoor-pool": pool, "gpudoor-cost-owner": owner, "gpudoor-user": "ana", **more}


def _task_yaml(labels: dict, accelerators: str, nodes: int = 1) -> str:
    """The queue's ``user_yaml``: a document with the job's name, then its task."""
    task = {
        "name": "job",
        "num_nodes": nodes,
        "resources": {"accelerators": accelerators, "labels": labels},
        "run": "x",
    }
    return yaml.safe_dump_all([{"name": "job"}, task])


def test_on_skypilot_the_week_is_read_by_label_from_the_queue_and_the_cluster_history(tmp_path, fake_sky):
    import sky

    week = week_of(dt.datetime.now(dt.UTC) - dt.timedelta(days=14))
    w0 = WEEKS.time_window_for_partition_key(week).start.timestamp()
    w1 = w0 + 7 * 24 * HOUR
    train = _labels("h200", "ml-research", **{"gpudoor-step": "train", "dagster-run-id": "abc"})
    fake_sky.records = {
        r.job_id: r
        for r in [
            # Inside the week, on 2 nodes of 8 H200 each; preempted once, it ran 1.5 of its 2 hours.
            Record(
                1,
                "train",
                Status.SUCCEEDED,
                train,
                {"H200": 8},
                "2x[H200:8]",
                submitted_at=w0 + 9 * HOUR,
                start_at=w0 + 10 * HOUR,
                end_at=w0 + 12 * HOUR,
                recovery_count=1,
                job_duration=1.5 * HOUR,
            ),
            # Started before the week and ended an hour into it; its cluster is gone, so the queue shows no
            # labels nor GPUs any more: they come from the task it was launched with.
            Record(
                2,
                "caption",
                Status.SUCCEEDED,
                None,
                None,
                "1x[RTX6000-Ada:2]",
                submitted_at=w0 - 3 * HOUR,
                start_at=w0 - 2 * HOUR,
                end_at=w0 + HOUR,
                job_duration=3 * HOUR,
                user_yaml=_task_yaml(_labels("onprem", "ml-engineering"), "RTX6000-Ada:2"),
            ),
            # A demo-sized job launched by hand, outside Dagster, still running: it counts up to the week's end.
            Record(
                3,
                "adhoc",
                Status.RUNNING,
                _labels("inference", "product-demos"),
                {"L4": 1},
                "1x[L4:1]",
                submitted_at=w1 - 49 * HOUR,
                start_at=w1 - 48 * HOUR,
            ),
            # Ended the week before: not counted.
            Record(
                4,
                "old",
                Status.SUCCEEDED,
                train,
                {"H200": 8},
                "1x[H200:8]",
                submitted_at=w0 - 30 * HOUR,
                start_at=w0 - 29 * HOUR,
                end_at=w0 - HOUR,
                job_duration=28 * HOUR,
            ),
            # Someone else's job, not launched through the door: no gpudoor-pool label, not counted.
            Record(
                5,
                "theirs",
                Status.SUCCEEDED,
                {"team": "other"},
                {"H200": 8},
                "1x[H200:8]",
                submitted_at=w0,
                start_at=w0 + HOUR,
                end_at=w0 + 5 * HOUR,
            ),
            # Submitted after the week: not counted.
            Record(
                6,
                "later",
                Status.RUNNING,
                train,
                {"H200": 8},
                "1x[H200:8]",
                submitted_at=w1 + HOUR,
                start_at=w1 + 2 * HOUR,
            ),
            # Another of the same pool and cost owner, preempted for 2 of its 4 hours.
            Record(
                7,
                "eval",
                Status.SUCCEEDED,
                _labels("inference", "product-demos"),
                {"L4": 1},
                "1x[L4:1]",
                submitted_at=w0 + 20 * HOUR,
                start_at=w0 + 20 * HOUR,
                end_at=w0 + 24 * HOUR,
                recovery_count=2,
                job_duration=2 * HOUR,
            ),
        ]
    }
    # The demo: a lab- cluster launched with sky.launch, not a managed job. SkyPilot's cluster history keeps
    # it after it is torn down: up 3 hours on one L4 this week, and 5 hours the week before.
    demo = sky.Resources(
        accelerators={"L4": 1}, labels=_labels("inference", "product-demos", **{"gpudoor-step": "demo"})
    )
    fake_sky.clusters = [
        {
            "name": "lab-gpudoor-demo",
            "num_nodes": 1,
            "resources": demo,
            "usage_intervals": [(w0 - 6 * HOUR, w0 - HOUR), (w0 + 30 * HOUR, w0 + 33 * HOUR)],
        },
        # A managed job's own cluster, counted from the queue already; and a cluster launched outside the door.
        {
            "name": "train-1",
            "num_nodes": 2,
            "resources": sky.Resources(accelerators={"H200": 8}, labels=train),
            "usage_intervals": [(w0 + 10 * HOUR, w0 + 12 * HOUR)],
        },
        {
            "name": "lab-theirs",
            "num_nodes": 1,
            "resources": sky.Resources(accelerators={"L4": 1}),
            "usage_intervals": [(w0, w0 + 9 * HOUR)],
        },
    ]
    client = _client(tmp_path, backend="skypilot", api_server_endpoint=fake_sky.endpoint)

    md, table, ok = _materialize(client, week)

    assert ok
    assert _figures(table) == pytest.approx(
        {("h200", "ml-research"): 32.0, ("onprem", "ml-engineering"): 2.0, ("inference", "product-demos"): 55.0}
    )
    assert md["gpu_hours"] == pytest.approx(89.0) and md["jobs"] == 5
    assert md["gpu_hours_h200"] == pytest.approx(32.0) and md["gpu_hours_inference"] == pytest.approx(55.0)
    assert md["cost_usd"] == pytest.approx(32 * 2.30 + 2 * 0.35 + 55 * 0.0)
    assert md["cost_usd_ml-research"] == pytest.approx(32 * 2.30)
    assert md["share_off_h200"] == pytest.approx(1 - 32 / 89)
    assert md["preemptions"] == 1 + 2
    # Goodput covers the jobs whose run time SkyPilot reports (not the one still running): 1.5 of 2 hours
    # on 16 GPUs, all of the caption job's hour, 2 of the eval's 4 hours, all of the demo's 3 hours.
    assert md["goodput"] == pytest.approx((24 + 2 + 2 + 3) / (32 + 2 + 4 + 3))
    by_pool = table.set_index("pool")
    assert by_pool.loc["h200", "goodput"] == pytest.approx(0.75) and by_pool.loc[
        "inference", "goodput"
    ] == pytest.approx((2 + 3) / (4 + 3))
    (request,) = fake_sky.queue_requests
    assert (
        request["all_users"]
        and not request["skip_finished"]
        and request["job_ids"] is None
        and request["limit"] is None
    )
    assert "user_yaml" in request["fields"] and "labels" in request["fields"]


# ----------------------------------------------------------------- the schedule
def test_the_weekly_schedule_refreshes_the_week_that_just_ended():
    monday = dt.datetime(2026, 11, 30, 6, tzinfo=dt.UTC)
    request = weekly_gpu_usage_schedule(dg.build_schedule_context(scheduled_execution_time=monday))
    assert request.partition_key == "2026-11-23"
    window = WEEKS.time_window_for_partition_key(request.partition_key)
    assert window.end <= monday and window.end > monday - dt.timedelta(days=7)
    assert weekly_gpu_usage_schedule.cron_schedule == "0 6 * * 1"
