#!/usr/bin/env python
"""Weekly GPU usage at a busy week's scale: 1,000 vs 100,000 jobs in SkyPilot's queue.

    python benchmarks/gpu_usage.py [--jobs 100000] [--baseline-jobs 1000] [--repeat 3]

What ``gpu_usage`` does for a week on the SkyPilot path, after the API server has answered: read the
queue's records (``SkyPilotBackend.job_history``: labels from the record, or from the task it was
launched with once its cluster is gone, which is the slow case and half the jobs here), keep the
week's, and build the table, the metadata the UI plots and the chart. The SDK is a stand-in that
returns prepared records: SkyPilot's server and its JSON over HTTP cannot run at this size here,
and their cost is the server's, not this package's.

Checks that every job of the week is counted (the GPU-hours add up to what was generated: no page
limit cuts a busy week short), and prints the time per job at both sizes and their ratio (about flat
means the work grows with the jobs and nothing else). Absolute figures depend on the machine.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import types
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("SKYPILOT_DISABLE_USAGE_COLLECTION", "1")

HOUR = 3600.0
POOLS = [("h200", "H200", 8, 2), ("onprem", "RTX6000-Ada", 2, 1), ("inference", "L4", 1, 1)]
OWNERS = ["ml-research", "ml-engineering", "product-demos"]


def _records(n: int, week_start: float) -> tuple[list, float]:
    """``n`` queue records inside the week, and the GPU-hours they hold in it."""
    import yaml

    dumper = getattr(yaml, "CSafeDumper", yaml.SafeDumper)
    records, hours = [], 0.0
    for i in range(n):
        pool, gpu, per_node, nodes = POOLS[i % len(POOLS)]
        labels = {
            "gpudoor-pool": pool,
            "gpudoor-cost-owner": OWNERS[i % len(OWNERS)],
            "gpudoor-user": f"u{i % 40}",
        }
        start = week_start + (i % 160) * HOUR
        length = (1 + i % 5) * HOUR
        gone = i % 2 == 0  # its cluster is torn down: labels and GPUs only in the launched task
        task = {
            "name": f"job-{i}",
            "num_nodes": nodes,
            "resources": {"accelerators": f"{gpu}:{per_node}", "labels": labels},
        }
        records.append(
            types.SimpleNamespace(
                job_id=i + 1,
                job_name=f"job-{i}",
                status="SUCCEEDED",
                labels=None if gone else labels,
                accelerators=None if gone else {gpu: per_node},
                resources=f"{nodes}x[{gpu}:{per_node}]",
                submitted_at=start - 60,
                start_at=start,
                end_at=start + length,
                recovery_count=i % 7 == 0,
                job_duration=length * 0.9,
                task_id=0,
                user_yaml=yaml.dump_all([{"name": f"job-{i}"}, task], Dumper=dumper) if gone else None,
            )
        )
        hours += per_node * nodes * length / HOUR
    return records, hours


def _measure(n: int, repeat: int) -> dict:
    from gpudoor_pipelines.assets.usage import WEEKS, chart_png, usage_metadata, usage_table
    from gpudoor_pipelines.launch.backends import sky_sdk
    from gpudoor_pipelines.launch.backends import skypilot as skypilot_backend
    from gpudoor_pipelines.launch.resolve.fleet import load_fleet

    fleet = load_fleet()
    week = WEEKS.get_partition_keys()[-3]
    window = WEEKS.time_window_for_partition_key(week)
    since, until = window.start.timestamp(), window.end.timestamp()
    records, expected = _records(n, since)
    fake = types.SimpleNamespace(
        get=lambda request: request,
        jobs=types.SimpleNamespace(queue_v2=lambda **_: (records, len(records), {}, len(records))),
        cost_report=lambda days=None: [],
    )
    sky_sdk.sky = lambda: fake  # the SDK's answer, prepared
    backend = skypilot_backend.SkyPilotBackend("http://127.0.0.1:1")
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        jobs = backend.job_history(since, until)
        table = usage_table(jobs, since, until, fleet, now=until + HOUR)
        md = usage_metadata(table, fleet)
        chart_png(table, sorted(fleet.pools), f"week of {week}")
        best = min(best, time.perf_counter() - t0)
    assert md["jobs"] == n, f"{md['jobs']} of {n} jobs counted"
    assert abs(md["gpu_hours"] - expected) < 1e-6 * expected, (md["gpu_hours"], expected)
    return {"jobs": n, "seconds": best, "per_job_us": best / n * 1e6, "gpu_hours": md["gpu_hours"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=100_000)
    parser.add_argument("--baseline-jobs", type=int, default=1_000)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    base = _measure(args.baseline_jobs, args.repeat)
    big = _measure(args.jobs, args.repeat)
    for r in (base, big):
        print(
            f"{r['jobs']:>8,} jobs: {r['seconds']:7.2f} s, {r['per_job_us']:6.1f} us per job, "
            f"{r['gpu_hours']:,.0f} GPU-hours, every job counted"
        )
    print(
        f"time per job at {args.jobs:,} vs {args.baseline_jobs:,} jobs: {big['per_job_us'] / base['per_job_us']:.2f}x"
    )


if __name__ == "__main__":
    main()
