"""Benchmark: what one step costs through the door on the embedded default, against the bare process.

    .venv/bin/python benchmarks/local_step_overhead.py [--seconds 2] [--repeat 5]

Both in this process, one after the other, ``--repeat`` times each, taking turns:

- bare: the task's command (``sleep SECONDS``) as a process of its own, timed to its exit;
- door: an asset that runs the same task file through ``PipesSkyPilotClient`` on the local backend (spec
  checks, routing, the fleet's rules, the Pipes session, the job's runner with SkyPilot's environment,
  its log streamed into the run, the wait for its end, the launch record), timed inside the asset from
  the call to its return.

It prints the median of each and the door's overhead over the bare process. The figure to meet is
0.25 s on a 2-core machine; before the local backend woke on its runner's exit, the wait loop noticed a
job's end at its next look, up to a poll interval (0.5 s) late.
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import dagster as dg
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpudoor_pipelines.launch.client import PipesSkyPilotClient  # noqa: E402
from gpudoor_pipelines.transit.resource import TransitBucketResource  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--seconds", type=float, default=2.0, help="how long the task runs")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()

    os.environ["GPUDOOR_HOME"] = tempfile.mkdtemp(prefix="gpudoor-bench-home-")
    root = Path(tempfile.mkdtemp(prefix="gpudoor-bench-step-"))
    command = f"sleep {args.seconds:g}"
    spec = root / "step.yaml"
    spec.write_text(yaml.safe_dump({"name": "bench-step", "resources": {"accelerators": "L4:1"}, "run": command}))
    client = PipesSkyPilotClient(
        local_home=str(root / "home"),
        transit=TransitBucketResource(kind="local", local_root=str(root / "bucket")),
        validate_with_skypilot=False,
    )
    door_s: list[float] = []

    @dg.asset
    def bench_step(context: dg.AssetExecutionContext, skypilot: PipesSkyPilotClient) -> dg.MaterializeResult:
        started = time.perf_counter()
        invocation = skypilot.run(context=context, request=skypilot.request(context, str(spec), step="eval"))
        door_s.append(time.perf_counter() - started)
        return invocation.get_materialize_result()

    instance = dg.DagsterInstance.ephemeral()
    bare_s: list[float] = []

    def door() -> None:
        assert dg.materialize([bench_step], resources={"skypilot": client}, instance=instance).success

    def bare() -> None:
        started = time.perf_counter()
        subprocess.run(["bash", "-c", command], check=True)
        bare_s.append(time.perf_counter() - started)

    door()  # warm: imports and the first spec read are no part of a step's cost
    door_s.clear()
    for i in range(args.repeat):
        for run in (door, bare) if i % 2 == 0 else (bare, door):
            run()
    door_median, bare_median = statistics.median(door_s), statistics.median(bare_s)
    print(f"a {args.seconds:g} s task, median of {args.repeat} each")
    print(f"  bare process            {bare_median:7.3f} s   1.00x")
    print(f"  door (local backend)    {door_median:7.3f} s   {door_median / bare_median:.2f}x")
    print(f"  overhead                {door_median - bare_median:7.3f} s   (figure to meet: 0.25 s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
