"""GPU usage per week: GPU-hours, cost, preemptions and goodput per pool and cost owner, from every job the team ran.

The figures come from the launch backend's own record of jobs (SkyPilot's managed-jobs queue and
cluster history, or the local job folders), so demos, ad-hoc launches and jobs of other tools count as
much as Dagster steps.
"""

import base64
import datetime as dt
import io
import math
import time
from collections.abc import Sequence

import dagster as dg
import pandas as pd

from gpudoor_pipelines.assets.k8s import cpu_step_tags
from gpudoor_pipelines.data import layout
from gpudoor_pipelines.launch.client import PipesSkyPilotClient
from gpudoor_pipelines.launch.job import JobState, JobUsage
from gpudoor_pipelines.launch.resolve.fleet import Fleet

#: Weeks run from Monday 00:00 UTC; the week under way is a partition too, its figures growing until it ends.
WEEKS = dg.WeeklyPartitionsDefinition(start_date="2026-01-05", day_offset=1, end_offset=1)
#: The step kind whose pools are "the H200 pool" of ``share_off_h200``.
TRAINING_STEP = "train"
#: The step kind of the short run on the target GPU before a long one.
SMOKE_STEP = "smoke"
#: How a smoke test that caught a problem ends: the code or its setup failed (not the infrastructure, not a cancel).
_CAUGHT = (JobState.FAILED, JobState.FAILED_SETUP)
COLUMNS = [
    "pool",
    "cost_owner",
    "jobs",
    "gpu_hours",
    "cost_usd",
    "preemptions",
    "useful_gpu_hours",
    "timed_gpu_hours",
    "goodput",
]


def week_of(moment: dt.datetime) -> str:
    """The partition key of the week holding ``moment``: its Monday (UTC)."""
    day = moment.astimezone(dt.UTC).date()
    return (day - dt.timedelta(days=day.weekday())).isoformat()


def last_finished_week(moment: dt.datetime) -> str:
    """The partition key of the last week that had ended by ``moment``."""
    return week_of(moment - dt.timedelta(days=7))


def training_pools(fleet: Fleet) -> set[str]:
    """The pools of the fleet's training route: GPU-hours kept off them are what ``share_off_h200`` counts."""
    return set(fleet.routes.get(TRAINING_STEP, ()))


def usage_table(jobs: Sequence[JobUsage], since: float, until: float, fleet: Fleet, *, now: float) -> pd.DataFrame:
    """One row per (pool, cost owner) of the jobs' GPU use between ``since`` and ``until``.

    Only the part of a job inside the window counts. A job's preemptions count in the week it ended
    (while it runs, in the week under way). Goodput is ``useful_gpu_hours`` ÷ ``timed_gpu_hours``: the
    GPU-hours of the jobs whose backend knows how long they actually ran; NaN where none does.
    """
    rows: dict[tuple[str, str], dict] = {}
    current = until >= now
    for job in jobs:
        held_h = job.gpu_hours(since, until)
        if held_h <= 0:
            continue
        row = rows.setdefault(
            (job.pool, job.cost_owner),
            {"jobs": 0, "gpu_hours": 0.0, "preemptions": 0, "useful_gpu_hours": 0.0, "timed_gpu_hours": 0.0},
        )
        row["jobs"] += 1
        row["gpu_hours"] += held_h
        ended_here = job.ended_at is not None and since <= job.ended_at < until
        if ended_here or (job.ended_at is None and current):
            row["preemptions"] += job.recoveries
        share = job.running_share(now)
        if share is not None:
            row["useful_gpu_hours"] += held_h * share
            row["timed_gpu_hours"] += held_h
    out = []
    for (pool, owner), row in sorted(rows.items()):
        rate = fleet.usd_per_gpu_hour(pool)
        timed = row["timed_gpu_hours"]
        out.append(
            {
                "pool": pool,
                "cost_owner": owner,
                **row,
                "cost_usd": row["gpu_hours"] * rate,
                "goodput": row["useful_gpu_hours"] / timed if timed else math.nan,
            }
        )
    return pd.DataFrame(out, columns=COLUMNS)


def usage_metadata(table: pd.DataFrame, fleet: Fleet) -> dict[str, float | int]:
    """The week's totals under stable names, which the UI plots across the weekly partitions."""
    hours = float(table["gpu_hours"].sum())
    timed = float(table["timed_gpu_hours"].sum())
    h200 = float(table.loc[table["pool"].isin(training_pools(fleet)), "gpu_hours"].sum())
    md: dict[str, float | int] = {
        "jobs": int(table["jobs"].sum()),
        "gpu_hours": round(hours, 6),
        "cost_usd": round(float(table["cost_usd"].sum()), 4),
        "preemptions": int(table["preemptions"].sum()),
        "goodput": round(float(table["useful_gpu_hours"].sum()) / timed, 6) if timed else math.nan,
        "share_off_h200": round(1.0 - h200 / hours, 6) if hours else math.nan,
    }
    for pool in sorted({*fleet.pools, *table["pool"]}):
        md[f"gpu_hours_{pool}"] = round(float(table.loc[table["pool"] == pool, "gpu_hours"].sum()), 6)
    for owner in sorted({*fleet.cost_owners, *table["cost_owner"]}):
        md[f"cost_usd_{owner}"] = round(float(table.loc[table["cost_owner"] == owner, "cost_usd"].sum()), 4)
    return md


def smoke_test_metadata(jobs: Sequence[JobUsage], since: float, until: float) -> dict[str, float | int]:
    """The smoke tests that ended between ``since`` and ``until``: how many ran, how many caught a problem
    (failed in their code or setup, so the long run they guard never started), and their median seconds."""
    ended = [j for j in jobs if j.step == SMOKE_STEP and j.ended_at is not None and since <= j.ended_at < until]
    seconds = sorted(j.ended_at - j.started_at for j in ended if j.started_at is not None and j.ended_at is not None)
    return {
        "smoke_tests": len(ended),
        "smoke_tests_failed": sum(j.state in _CAUGHT for j in ended),
        "smoke_test_median_s": round(float(pd.Series(seconds).median()), 1) if seconds else math.nan,
    }


def markdown_table(table: pd.DataFrame) -> str:
    """The table as Markdown, for the UI."""
    lines = [
        "| pool | cost owner | jobs | GPU-hours | cost (USD) | preemptions | goodput |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in table.itertuples():
        goodput = "n/a" if math.isnan(r.goodput) else f"{r.goodput:.1%}"
        lines.append(
            f"| {r.pool} | {r.cost_owner} | {r.jobs} | {r.gpu_hours:.2f} | {r.cost_usd:.2f} | {r.preemptions} | "
            f"{goodput} |"
        )
    return "\n".join(lines)


_COLOURS = ["#4C78A8", "#F58518", "#54A24B", "#E45756", "#72B7B2", "#B279A2", "#FF9DA6", "#9D755D"]


def chart_png(table: pd.DataFrame, pools: Sequence[str], title: str) -> bytes:
    """A bar per pool of the week's GPU-hours, stacked by cost owner, as a PNG."""
    from PIL import Image, ImageDraw, ImageFont

    width, height, left, right, top, bottom = 760, 420, 70, 190, 50, 60
    image = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(image)
    font, small = ImageFont.load_default(size=15), ImageFont.load_default(size=12)
    draw.text((left, 15), title, fill="black", font=font)
    owners = sorted(set(table["cost_owner"]))
    colour = {owner: _COLOURS[i % len(_COLOURS)] for i, owner in enumerate(owners)}
    totals = table.groupby("pool")["gpu_hours"].sum()
    peak = float(totals.max()) if len(totals) else 0.0
    scale = _nice_ceiling(peak)
    plot_h, plot_w = height - top - bottom, width - left - right
    for i in range(6):  # grid and y ticks
        y = top + plot_h - plot_h * i / 5
        draw.line([(left, y), (left + plot_w, y)], fill="#dddddd")
        draw.text((left - 8, y), f"{scale * i / 5:g}", fill="black", font=small, anchor="rm")
    draw.text((12, top - 22), "GPU-hours", fill="black", font=small)
    slot = plot_w / max(len(pools), 1)
    for i, pool in enumerate(pools):
        x0, x1 = left + slot * (i + 0.2), left + slot * (i + 0.8)
        base = top + plot_h
        for owner in owners:
            hours = float(table.loc[(table["pool"] == pool) & (table["cost_owner"] == owner), "gpu_hours"].sum())
            if hours <= 0:
                continue
            h = plot_h * hours / scale
            draw.rectangle([x0, base - h, x1, base], fill=colour[owner])
            base -= h
        draw.text(((x0 + x1) / 2, top + plot_h + 8), pool, fill="black", font=small, anchor="mt")
        if pool in totals.index:
            draw.text(((x0 + x1) / 2, base - 4), f"{totals[pool]:.3g}", fill="black", font=small, anchor="mb")
    draw.line([(left, top), (left, top + plot_h), (left + plot_w, top + plot_h)], fill="black")
    if not owners:
        draw.text(
            (left + plot_w / 2, top + plot_h / 2),
            "no GPU job this week",
            fill="#666666",
            font=font,
            anchor="mm",
        )
    for i, owner in enumerate(owners):  # legend
        y = top + 10 + 22 * i
        draw.rectangle([left + plot_w + 20, y, left + plot_w + 34, y + 14], fill=colour[owner])
        draw.text((left + plot_w + 42, y + 7), owner, fill="black", font=small, anchor="lm")
    out = io.BytesIO()
    image.save(out, format="PNG", optimize=True)
    return out.getvalue()


def _nice_ceiling(value: float) -> float:
    """The smallest of 1, 2, 2.5 or 5 times a power of ten at or above ``value`` (1 for nothing)."""
    if value <= 0:
        return 1.0
    power = 10 ** math.floor(math.log10(value))
    return next(m * power for m in (1, 2, 2.5, 5, 10) if m * power >= value)


@dg.asset(
    group_name="usage",
    kinds={"pandas"},
    partitions_def=WEEKS,
    # A busy week's queue (100,000 jobs) is read and tabled in memory: a few hundred MiB.
    op_tags=cpu_step_tags("1", "2Gi"),
)
def gpu_usage(context: dg.AssetExecutionContext, skypilot: PipesSkyPilotClient) -> pd.DataFrame:
    """The week's GPU-hours, cost, preemptions and goodput per pool and cost owner, for every job the team ran.

    Read from the launch backend, not from Dagster: SkyPilot's managed-jobs queue and its cluster
    history for the ``lab-…``/``dev-…`` clusters of demos (what carries a ``gpudoor-pool`` label,
    whoever launched it), or the local job folders. Only the part of a job
    inside the week counts; the week under way counts up to now.

    - GPU-hours: GPUs × the time from the job's start to its end, time spent recovering after a
      preemption included.
    - Cost: GPU-hours × the pool's ``usd_per_gpu_hour`` in the fleet file.
    - Preemptions: recoveries, counted in the week the job ended (while it runs, in the week under way).
    - Goodput: the share of those GPU-hours in which the job ran (SkyPilot's ``job_duration``; local
      jobs are never preempted). Work redone after a preemption since the last checkpoint is not seen,
      so goodput is an upper bound.
    - Share off H200: 1 − GPU-hours on the training route's pool ÷ all GPU-hours.
    - Smoke tests: the ~60 s runs on the target GPU before each training, that ended in the week; how many
      failed in their code or setup (each a long run that never started on a broken job), and their median
      seconds.

    The UI plots ``gpu_hours``, ``cost_usd``, ``preemptions``, ``goodput``, ``share_off_h200``,
    ``gpu_hours_<pool>``, ``cost_usd_<cost owner>``, ``smoke_tests``, ``smoke_tests_failed`` and
    ``smoke_test_median_s`` across the weeks; ``chart`` shows the week's bars.
    """
    week = context.partition_key
    window = context.partition_time_window
    now = time.time()
    since, until = window.start.timestamp(), min(window.end.timestamp(), now)
    fleet = skypilot.get_fleet()
    jobs = skypilot.get_backend().job_history(since, until) if until > since else []
    table = usage_table(jobs, since, until, fleet, now=now)
    for pool in sorted(set(table["pool"]) - set(fleet.pools)):
        context.log.warning(f"Pool '{pool}' is not in {fleet.source}: its GPU-hours have no cost.")
    pools = sorted({*fleet.pools, *table["pool"]})
    png = chart_png(table, pools, f"GPU-hours per pool and cost owner, week of {week}")
    bucket = skypilot.transit.get_bucket()
    key = layout.USAGE_CHART.format(week=week)
    bucket.put_bytes(key, png)
    md = {**usage_metadata(table, fleet), **smoke_test_metadata(jobs, since, until)}
    context.add_output_metadata(
        {
            **md,
            "by_pool_and_owner": dg.MetadataValue.md(markdown_table(table)),
            "chart": dg.MetadataValue.md(
                "![GPU-hours per pool and cost owner, week of "
                f"{week}](data:image/png;base64,{base64.b64encode(png).decode()})"
            ),
            "chart_uri": dg.MetadataValue.path(bucket.uri(key)),
            "window": f"{window.start.isoformat()} to {dt.datetime.fromtimestamp(until, dt.UTC).isoformat()}",
        }
    )
    context.log.info(
        f"Week of {week}: {md['jobs']} jobs, {md['gpu_hours']:.2f} GPU-hours, ${md['cost_usd']:.2f}, "
        f"{md['preemptions']} preemptions; {md['smoke_tests']} smoke tests, {md['smoke_tests_failed']} of them "
        f"caught a problem; chart at {bucket.uri(key)}."
    )
    return table
