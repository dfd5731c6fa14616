"""Benchmark: short shard jobs through a warm pool against as many separate managed jobs, on the test bed.

Runs on the Slurm test bed (``bash testbed/up.sh`` first, as root; ``source testbed/.state/env``).
In one process, the same ``--shards`` (50) shards of ``--seconds`` (5) seconds of work each, on as
many GPU slots (``--workers``, 2), three ways:

* ``separate``: one managed job per shard (``sky.jobs.launch`` each, all submitted at once): the
  baseline, what one Dagster run per shard gave;
* ``pool``: one job per shard on a warm pool (``sky.jobs.pool_apply``, then one
  ``sky.jobs.launch(pool=, num_jobs=50)``), the pool's start-up included;
* ``packed``: the night's shape, the shards packed into a few jobs per worker on the warm pool.

Each is timed from the first request to the last job's end; prints the three and the ratios against
``separate``. The jobs go through the project's SkyPilot backend (routing, fleet rules, admin policy).
All three run one after the other on the bed's two L4s. On this 2-core bed, 50 managed jobs submitted
at once overloaded the API server (load average 56, requests refused): pass ``--shards 12`` there.

    .venv/bin/python benchmarks/pool_vs_jobs.py [--shards 50] [--seconds 5] [--workers 2]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from gpudoor_pipelines.assets.packed import JOBS_PER_WORKER  # noqa: E402
from gpudoor_pipelines.launch.backends.skypilot import SkyPilotBackend  # noqa: E402
from gpudoor_pipelines.launch.resolve.fleet import load_fleet  # noqa: E402
from gpudoor_pipelines.launch.resolve.request import LaunchRequest, resolve  # noqa: E402
from gpudoor_pipelines.launch.resolve.specs import load_spec  # noqa: E402

# Each job sleeps for its share of the shards: SKYPILOT_JOB_RANK of SKYPILOT_NUM_JOBS, or one shard.
RUN = (
    'n=1; if [ -n "$SKYPILOT_NUM_JOBS" ]; then n=$(( SHARDS / SKYPILOT_NUM_JOBS + '
    "(SKYPILOT_JOB_RANK < SHARDS % SKYPILOT_NUM_JOBS ? 1 : 0) )); fi; "
    'echo "rank ${SKYPILOT_JOB_RANK:-0}: $n shards"; sleep $(( n * SECONDS_PER_SHARD ))'
)


def _job(specs: Path, name: str, shards: int, seconds: int, gpu: str):
    folder = specs / name
    folder.mkdir()
    (folder / "caption.yaml").write_text(
        yaml.safe_dump(
            {
                "name": name,
                "resources": {"accelerators": f"{gpu}:1"},
                "setup": "echo warm",
                "envs": {"SHARDS": shards, "SECONDS_PER_SHARD": seconds},
                "run": RUN,
            }
        )
    )
    spec = load_spec("caption", str(folder))
    request = LaunchRequest(
        spec=spec, inputs={}, env={}, user=os.environ.get("USER", "bench"), asset=name, partition=None, step="caption"
    )
    return resolve(request, load_fleet(str(REPO / "testbed" / "fleet.yaml")))


def _wait(backend: SkyPilotBackend, ids: list[str]) -> dict[str, str]:
    while True:
        infos = backend.statuses(ids)
        if len(infos) == len(ids) and all(i.state.is_terminal for i in infos.values()):
            return {k: v.state.value for k, v in infos.items()}
        time.sleep(5)


def separate(backend, job, shards: int) -> float:
    start = time.perf_counter()
    ids = [backend.submit(job) for _ in range(shards)]
    states = _wait(backend, ids)
    assert set(states.values()) == {"SUCCEEDED"}, states
    return time.perf_counter() - start


def on_pool(backend, job, num_jobs: int, workers: int, pool: str) -> float:
    start = time.perf_counter()
    try:
        ids = backend.submit_batch(job, num_jobs, pool_name=pool, workers=workers)
        states = _wait(backend, ids)
        assert set(states.values()) == {"SUCCEEDED"}, states
        return time.perf_counter() - start
    finally:
        backend.release_pool(pool)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, default=50)
    parser.add_argument("--seconds", type=int, default=5)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    backend = SkyPilotBackend(os.environ["SKYPILOT_API_SERVER_ENDPOINT"])
    backend.check()
    with tempfile.TemporaryDirectory() as tmp:
        specs = Path(tmp)
        one = _job(specs, "bench-separate", 1, args.seconds, "L4")
        shared = _job(specs, "bench-pool", args.shards, args.seconds, "L4")
        t_sep = separate(backend, one, args.shards)
        print(f"separate: {args.shards} managed jobs, {t_sep:.0f} s", flush=True)
        t_pool = on_pool(backend, shared, args.shards, args.workers, f"bench-each-{os.getpid()}")
        print(f"pool: {args.shards} jobs on {args.workers} warm workers, {t_pool:.0f} s", flush=True)
        packed_jobs = min(args.shards, args.workers * JOBS_PER_WORKER)
        t_packed = on_pool(backend, shared, packed_jobs, args.workers, f"bench-packed-{os.getpid()}")
        print(
            f"packed: {args.shards} shards in {packed_jobs} jobs on {args.workers} warm workers, {t_packed:.0f} s",
            flush=True,
        )
    print(f"ratios against separate managed jobs: pool {t_pool / t_sep:.2f}, packed {t_packed / t_sep:.2f}")


if __name__ == "__main__":
    main()
