"""Benchmark: from asset start to managed job submitted, against a bare ``sky.jobs.launch``.

Runs on the Slurm test bed (``bash testbed/up.sh`` first, as root; ``source testbed/.state/env``).
In one process: a bare ``sky.jobs.launch`` of a tiny task, then the same task materialized
through ``PipesSkyPilotClient`` (spec checks, routing, fleet rules, Pipes session, submission),
timed from the asset's first line to "Submitted job". Both jobs are cancelled right after
submission. Prints both times and the ratio.

    .venv/bin/python benchmarks/launch_latency.py [--repeat 2]
"""

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import dagster as dg
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from gpudoor_pipelines.launch import sky_env  # noqa: E402
from gpudoor_pipelines.launch.backends import local as _local  # noqa: E402,F401
from gpudoor_pipelines.launch.client import PipesSkyPilotClient  # noqa: E402
from gpudoor_pipelines.transit.resource import TransitBucketResource  # noqa: E402

RUN = "sleep 300"
OWNER = {"gpudoor-cost-owner": "ml-research"}


def bare_launch(infra: str) -> float:
    import sky

    task = sky.Task(name="bench-bare", run=RUN)
    task.set_resources(sky.Resources(infra=infra, accelerators="L4:1", labels=OWNER))
    start = time.perf_counter()
    job_ids, _ = sky.get(sky.jobs.launch(task, name="bench-bare"))
    elapsed = time.perf_counter() - start
    sky.get(sky.jobs.cancel(job_ids=job_ids))
    return elapsed


def through_resource(endpoint: str, specs: Path, transit_root: Path) -> float:
    import sky

    marks: dict[str, float] = {}

    @dg.asset
    def bench(context: dg.AssetExecutionContext, skypilot: PipesSkyPilotClient) -> None:
        marks["start"] = time.perf_counter()
        backend = skypilot.get_backend()
        submit = backend.submit

        def timed_submit(job):
            job_id = submit(job)
            marks["submitted"] = time.perf_counter()
            sky.get(sky.jobs.cancel(job_ids=[int(job_id)]))
            return job_id

        backend.submit = timed_submit
        skypilot.__class__.get_backend = lambda self: backend  # the timed backend for this launch
        # The job is cancelled on purpose right after submission: the step fails, the times are kept.
        skypilot.run(context=context, request=skypilot.request(context, "caption"))

    resource = PipesSkyPilotClient(
        backend="skypilot", api_server_endpoint=endpoint, fleet_file=str(REPO / "testbed" / "fleet.yaml"),
        specs_dir=str(specs), transit=TransitBucketResource(local_root=str(transit_root)), poll_interval_s=1.0,
    )  # fmt: skip
    original = PipesSkyPilotClient.get_backend
    try:
        dg.materialize([bench], resources={"skypilot": resource}, raise_on_error=False)
    finally:
        PipesSkyPilotClient.get_backend = original
    return marks["submitted"] - marks["start"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()
    sky_env.prepare()
    endpoint = os.environ.get("SKYPILOT_API_SERVER_ENDPOINT")
    infra = os.environ.get("GPUDOOR_TESTBED_INFRA_ONPREM", "slurm/gpudoor-bed/onprem")
    if not endpoint:
        print("source testbed/.state/env first (SKYPILOT_API_SERVER_ENDPOINT is not set)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        specs = Path(tmp) / "specs"
        specs.mkdir()
        (specs / "caption.yaml").write_text(yaml.safe_dump({"name": "bench", "resources": {"accelerators": "L4:1"}, "run": RUN}))
        bare, ours = [], []
        for _ in range(args.repeat):
            bare.append(bare_launch(infra))
            ours.append(through_resource(endpoint, specs, Path(tmp) / "transit"))
    b, o = statistics.median(bare), statistics.median(ours)
    print(f"bare sky.jobs.launch         : {b:.2f} s (median of {args.repeat})")
    print(f"asset start -> job submitted : {o:.2f} s (median of {args.repeat})")
    print(f"ratio (resource / bare)      : {o / b:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
