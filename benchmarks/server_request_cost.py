"""Benchmark: what each request the door sends costs the SkyPilot API server, on the Slurm test bed.

Runs on the Slurm test bed (``bash testbed/up.sh`` first, as root; ``set -a; . testbed/.state/env; set +a``).
The bed's API server runs on this machine, so the machine's CPU time over a batch of requests (read from
``/proc/stat``, this client's own CPU time left out) is what the server spent answering them. Run it
with nothing else on the bed.

Each request the door sends while steps watch jobs, ``--repeat`` times one after the other:
- ``sky.api_info()``: the baseline, answered by the server's own process;
- ``sky.jobs.queue_v2`` of the unfinished jobs (the status hub's one read per interval, and the
  reconciler's);
- ``sky.status`` of named clusters (a step cluster's look);
- ``sky.jobs.pool_status`` (the caption night's look at its warm pool).

It prints, per request, the wall time and the server's CPU-seconds, each as a ratio to the baseline,
then what the status hub's read costs the server for a number of run-worker processes, each polling
at the ceiling ``max_poll_interval_s``.

    .venv/bin/python benchmarks/server_request_cost.py [--repeat 10] [--processes 50 200] [--interval-s 20]
"""

import argparse
import os
import resource
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpudoor_pipelines.launch import sky_env  # noqa: E402

_TICKS = os.sysconf("SC_CLK_TCK")


def _machine_busy_s() -> float:
    """CPU-seconds this machine has spent busy since boot (every core, idle and iowait left out)."""
    with open("/proc/stat") as f:
        user, nice, system, _idle, _iowait, irq, softirq, steal, *_ = (int(x) for x in f.readline().split()[1:])
    return (user + nice + system + irq + softirq + steal) / _TICKS


def _own_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def measure(call: Callable[[], object], repeat: int) -> tuple[float, float]:
    """(wall seconds, server CPU-seconds) per call, over ``repeat`` calls one after the other."""
    call()  # warm: the client's imports and connections are not the server's cost
    busy, own, began = _machine_busy_s(), _own_cpu_s(), time.perf_counter()
    for _ in range(repeat):
        call()
    wall = time.perf_counter() - began
    server = (_machine_busy_s() - busy) - (_own_cpu_s() - own)
    return wall / repeat, max(0.0, server) / repeat


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--processes", type=int, nargs="+", default=[50, 200])
    parser.add_argument("--interval-s", type=float, default=20.0, help="the status hub's ceiling (max_poll_interval_s)")
    args = parser.parse_args()
    if not os.environ.get("SKYPILOT_API_SERVER_ENDPOINT"):
        sys.exit("no SKYPILOT_API_SERVER_ENDPOINT: load the bed's env first (set -a; . testbed/.state/env; set +a)")
    sky_env.prepare()
    import sky

    requests: dict[str, Callable[[], object]] = {
        "api_info (baseline)": lambda: sky.api_info(),
        "jobs.queue_v2 (status hub)": lambda: sky.get(
            sky.jobs.queue_v2(
                refresh=False, skip_finished=True, all_users=True, fields=["job_id", "status", "recovery_count"]
            )
        ),
        "status of named clusters": lambda: sky.get(
            sky.status(cluster_names=["gpudoor-step-benchmark-none"], all_users=True)
        ),
        "jobs.pool_status": lambda: sky.get(sky.jobs.pool_status(None)),
    }
    results = {name: measure(call, args.repeat) for name, call in requests.items()}
    base_wall, base_cpu = results["api_info (baseline)"]
    print(f"{args.repeat} requests each, one after the other, against {os.environ['SKYPILOT_API_SERVER_ENDPOINT']}")
    print(f"{'request':<30} {'wall s':>8} {'x base':>8} {'server CPU-s':>13} {'x base':>8}")
    for name, (wall, cpu) in results.items():
        print(f"{name:<30} {wall:8.3f} {wall / base_wall:8.1f} {cpu:13.3f} {cpu / max(base_cpu, 1e-3):8.1f}")
    _, queue_cpu = results["jobs.queue_v2 (status hub)"]
    print(f"\nThe status hub's read at its ceiling ({args.interval_s:g} s), one per run-worker process:")
    for n in args.processes:
        per_s = n / args.interval_s
        print(f"  {n:>5} processes: {per_s:5.1f} requests/s, about {per_s * queue_cpu:5.1f} server cores")


if __name__ == "__main__":
    main()
