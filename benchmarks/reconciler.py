#!/usr/bin/env python
"""The orphan reconciler's tick at the team's scale: 100 vs 10,000 unfinished jobs on one API server.

    python benchmarks/reconciler.py [--jobs 10000] [--baseline-jobs 100] [--repeat 3]

One tick of the ``orphan_reconciler`` sensor on the SkyPilot path, after the API server has answered:
read every user's unfinished managed jobs, warm pools and clusters (``SkyPilotBackend.holdings``: labels
from the record, or from the task the job was launched with while it waits for a cluster, which is
half the jobs here), ask the Dagster instance about every run they name (a real SQLite instance with
one run per five jobs, a fifth of them failed), judge, and build the run request. The SDK is a stand-in
that counts requests and returns prepared records: SkyPilot's server cannot run at this size here.

Checks that the tick makes the same three SDK requests at both sizes and releases exactly the jobs of
the failed runs, and prints the time per job at both sizes and their ratio (about flat means the tick
grows with the jobs and nothing else). Absolute figures depend on the machine.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import types
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("SKYPILOT_DISABLE_USAGE_COLLECTION", "1")
os.environ.setdefault("DAGSTER_DISABLE_TELEMETRY", "1")

JOBS_PER_RUN = 5


def _instance_with_runs(runs: int, home: str):
    """A SQLite Dagster instance with ``runs`` runs: every fifth failed (its worker died), the rest running."""
    import dagster as dg

    from gpudoor_pipelines.automation.reconciler import release_held_gpus_job

    instance = dg.DagsterInstance.local_temp(home)
    config = {"ops": {"release_held_gpus": {"config": {"releases": []}}}}
    ids, failed = [], set()
    for i in range(runs):
        run = instance.create_run_for_job(release_held_gpus_job, run_config=config)
        if i % 5 == 0:
            instance.report_run_failed(run)
            failed.add(run.run_id)
        else:
            instance.handle_run_event(
                run.run_id, dg.DagsterEvent(dg.DagsterEventType.RUN_START.value, job_name=run.job_name)
            )
        ids.append(run.run_id)
    return instance, ids, failed


def _fake_sdk(n: int, run_ids: list[str], key: str):
    import yaml

    from gpudoor_pipelines.launch.resolve.rules import identity_signature

    dumper = getattr(yaml, "CSafeDumper", yaml.SafeDumper)
    records = []
    for i in range(n):
        labels = {
            "gpudoor-pool": "h200",
            "gpudoor-user": f"u{i % 40}",
            "gpudoor-cost-owner": "ml-research",
            "dagster-run-id": run_ids[i // JOBS_PER_RUN],
            "dagster-asset": "training_run",
        }
        labels["gpudoor-signature"] = identity_signature(labels, key)
        pending = i % 2 == 0  # no cluster yet: the labels are in the task it was launched with
        task = {"name": f"job-{i}", "resources": {"accelerators": "H200:8", "labels": labels}}
        records.append(
            types.SimpleNamespace(
                job_id=i + 1,
                job_name=f"job-{i}",
                status="PENDING" if pending else "RUNNING",
                labels=None if pending else labels,
                submitted_at=time.time() - 7200,
                pool=None,
                cluster_name_on_cloud=None if pending else f"job-{i}-{i + 1}-abcd",
                task_id=0,
                user_yaml=yaml.dump_all([{"name": f"job-{i}"}, task], Dumper=dumper) if pending else None,
            )
        )
    requests: dict[str, int] = {}

    def count(name, value):
        requests[name] = requests.get(name, 0) + 1
        return value

    fake = types.SimpleNamespace(
        get=lambda request: request,
        jobs=types.SimpleNamespace(
            queue_v2=lambda **_: count("queue_v2", (records, len(records), {}, len(records))),
            pool_status=lambda names: count("pool_status", []),
        ),
        status=lambda **_: count("status", []),
    )
    return fake, requests


def _measure(n: int, repeat: int) -> dict:
    import dagster as dg
    import yaml

    from gpudoor_pipelines.automation.reconciler import orphan_reconciler
    from gpudoor_pipelines.launch.backends import sky_sdk
    from gpudoor_pipelines.launch.client import PipesSkyPilotClient
    from gpudoor_pipelines.launch.resolve.fleet import DEFAULT_FLEET_FILE
    from gpudoor_pipelines.transit.resource import TransitBucketResource

    key = "benchmark-key"
    os.environ["GPUDOOR_LABEL_KEY"] = key
    with tempfile.TemporaryDirectory() as home:
        instance, run_ids, failed = _instance_with_runs(-(-n // JOBS_PER_RUN), home)
        fake, requests = _fake_sdk(n, run_ids, key)
        sky_sdk.sky = lambda: fake
        fleet = {
            **yaml.safe_load(DEFAULT_FLEET_FILE.read_text()),
            "reconciler": {"grace_minutes": 0},
        }  # the runs failed just now
        fleet_file = Path(home) / "fleet.yaml"
        fleet_file.write_text(yaml.safe_dump(fleet))
        client = PipesSkyPilotClient(
            backend="skypilot",
            api_server_endpoint="http://127.0.0.1:1",
            fleet_file=str(fleet_file),
            transit=TransitBucketResource(local_root=str(Path(home) / "transit")),
        )
        best = float("inf")
        for _ in range(repeat):
            requests.clear()
            t0 = time.perf_counter()
            with dg.build_sensor_context(instance=instance, resources={"skypilot": client}) as context:
                result = orphan_reconciler(context)
            best = min(best, time.perf_counter() - t0)
        (request,) = result.run_requests
        released = request.run_config["ops"]["release_held_gpus"]["config"]["releases"]
        expected = {str(i + 1) for i in range(n) if run_ids[i // JOBS_PER_RUN] in failed}
        assert {r["id"] for r in released} == expected, "the tick must release exactly the failed runs' jobs"
        assert requests == {"queue_v2": 1, "pool_status": 1, "status": 1}, requests
        instance.dispose()
    return {
        "jobs": n,
        "seconds": best,
        "per_job_us": best / n * 1e6,
        "released": len(expected),
        "requests": sum(requests.values()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=10_000)
    parser.add_argument("--baseline-jobs", type=int, default=100)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    base = _measure(args.baseline_jobs, args.repeat)
    big = _measure(args.jobs, args.repeat)
    for r in (base, big):
        print(
            f"{r['jobs']:>7,} unfinished jobs ({r['jobs'] // JOBS_PER_RUN:,} runs): tick {r['seconds']:6.2f} s, "
            f"{r['per_job_us']:7.1f} us per job, {r['requests']} SDK requests, {r['released']:,} released (every "
            "failed run's job)"
        )
    print(
        f"time per job at {args.jobs:,} vs {args.baseline_jobs:,} jobs: {big['per_job_us'] / base['per_job_us']:.2f}x"
    )


if __name__ == "__main__":
    main()
