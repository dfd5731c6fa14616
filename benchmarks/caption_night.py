"""Benchmark: a night of captioning at full scale on the embedded default, against a small night.

In one process, two nights on fresh local buckets and Dagster instances, each the way the nightly
schedule runs them (one Dagster run over the partition range of every shard, packed into jobs on a
local warm pool sized to the free GPUs of the caption pool):

* the baseline night: ``--baseline-shards`` shards (100);
* the full night: ``--shards`` shards (10,000), ``--images-per-shard`` images each (5), so the
  caption jobs take seconds per shard and what is measured is the orchestration.

Prints, per night: wall time, the orchestrator's CPU seconds per shard (this process only; the jobs
are child processes), jobs launched, the most jobs running at once against the free GPU slots,
objects written per 1,000 images, and the ratios full/baseline. Then the definitions-load part:
loading the code location and snapshotting its repository (what the webserver and daemon do) with
10 and with 10,000 shards registered, and the nightly schedule's tick at both sizes.

    .venv/bin/python benchmarks/caption_night.py                       # 10,000 shards (~10 min on 2 cores)
    .venv/bin/python benchmarks/caption_night.py --shards 1000 --baseline-shards 50   # quicker
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import dagster as dg
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from gpudoor_pipelines.assets.captioning import caption_shards, captioned_dataset, dataset_shards  # noqa: E402
from gpudoor_pipelines.assets.partitions import SHARDS  # noqa: E402
from gpudoor_pipelines.launch.client import PipesSkyPilotClient  # noqa: E402
from gpudoor_pipelines.transit.io_manager import TransitIOManager  # noqa: E402
from gpudoor_pipelines.transit.resource import TransitBucketResource  # noqa: E402

MODEL = "color-shape-v1"


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def night(root: Path, shards: int, images_per_shard: int, free_gpus: int) -> dict:
    """One night of ``shards`` shards on a fresh bucket and instance; returns its figures."""
    fleet = yaml.safe_load((REPO / "task_specs" / "fleet.yaml").read_text())
    fleet["pools"]["onprem"].update(gpu_cap=free_gpus, max_gpus_per_user=free_gpus)
    fleet.pop("sharing", None)  # onprem's cap shrinks below the teams' quotas there
    fleet["routes"]["caption"] = ["onprem"]
    (root / "fleet.yaml").write_text(yaml.safe_dump(fleet))
    transit = TransitBucketResource(kind="local", local_root=str(root / "bucket"))
    skypilot = PipesSkyPilotClient(
        backend="local",
        fleet_file=str(root / "fleet.yaml"),
        local_home=str(root / "home"),
        transit=transit,
        poll_interval_s=1.0,
    )
    defs = dg.Definitions(
        assets=[dataset_shards, caption_shards, captioned_dataset],
        resources={"transit": transit, "skypilot": skypilot, "io_manager": TransitIOManager(transit=transit)},
    )
    job = defs.resolve_implicit_global_asset_job_def()
    (root / "dagster").mkdir()
    with dg.instance_for_test(temp_dir=str(root / "dagster")) as instance:
        config = {"num_images": shards * images_per_shard, "shard_size": images_per_shard, "image_size": 16}
        t0 = time.perf_counter()
        assert job.execute_in_process(
            instance=instance,
            asset_selection=[dg.AssetKey("dataset_shards")],
            run_config={"ops": {"dataset_shards": {"config": config}}},
        ).success
        register_s = time.perf_counter() - t0
        keys = list(instance.get_dynamic_partitions(SHARDS))
        assert len(keys) == shards
        cpu0, t0 = _cpu(), time.perf_counter()
        result = job.execute_in_process(
            instance=instance,
            asset_selection=[dg.AssetKey("caption_shards")],
            raise_on_error=False,
            tags={"dagster/asset_partition_range_start": keys[0], "dagster/asset_partition_range_end": keys[-1]},
        )
        wall, cpu = time.perf_counter() - t0, _cpu() - cpu0
        assert result.success, [e.message for e in result.all_events if e.is_failure][:3]
        materialized = len(instance.get_materialized_partitions(dg.AssetKey("caption_shards")))
    jobs = []
    for job_dir in (root / "home" / "jobs").iterdir():
        if json.loads((job_dir / "task.json").read_text()).get("worker_pool"):
            jobs.append(json.loads((job_dir / "state.json").read_text()))
    edges = sorted([(j["started_at"], 1) for j in jobs] + [(j["ended_at"], -1) for j in jobs])
    most = current = 0
    for _, step in edges:
        current += step
        most = max(most, current)
    captions = list((root / "bucket" / "captions" / MODEL).rglob("*"))
    objects = sum(1 for p in captions if p.is_file())
    return {
        "shards": shards,
        "images": shards * images_per_shard,
        "materialized": materialized,
        "register_s": register_s,
        "wall_s": wall,
        "orchestrator_cpu_s_per_shard": cpu / shards,
        "jobs": len(jobs),
        "most_jobs_at_once": most,
        "free_gpus": free_gpus,
        "objects_per_1000_images": 1000 * objects / (shards * images_per_shard),
    }


def definitions_load(registered: int, repeat: int = 5) -> dict:
    """Loading the code location with ``registered`` shards in the instance, and the nightly tick."""
    from dagster._core.remote_representation.external_data import RepositorySnap

    from gpudoor_pipelines.definitions import build_defs

    with tempfile.TemporaryDirectory() as tmp, dg.instance_for_test(temp_dir=tmp) as instance:
        instance.add_dynamic_partitions(SHARDS, [f"bench-{i:05d}" for i in range(registered)])
        loads, ticks = [], []
        for _ in range(repeat):
            t0 = time.perf_counter()
            defs = build_defs()
            repo = defs.get_repository_def()
            RepositorySnap.from_def(repo)
            instance.get_dynamic_partitions(SHARDS)
            loads.append(time.perf_counter() - t0)
            schedule = defs.get_schedule_def("nightly_captioning_schedule")
            start = datetime.datetime(2026, 12, 1, 1, 0, tzinfo=datetime.UTC)
            transit = TransitBucketResource(kind="local", local_root=tmp)
            with dg.build_schedule_context(
                instance=instance, scheduled_execution_time=start, resources={"transit": transit}
            ) as context:
                t0 = time.perf_counter()
                schedule.evaluate_tick(context)
                ticks.append(time.perf_counter() - t0)
    return {"registered": registered, "load_s": statistics.median(loads), "tick_s": statistics.median(ticks)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, default=10_000)
    parser.add_argument("--baseline-shards", type=int, default=100)
    parser.add_argument("--images-per-shard", type=int, default=5)
    parser.add_argument("--free-gpus", type=int, default=8)
    args = parser.parse_args()
    os.environ.setdefault("SKYPILOT_DISABLE_USAGE_COLLECTION", "1")
    home = tempfile.mkdtemp(prefix="bench-dagster-home-")  # building definitions may open the instance here
    Path(home, "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
    os.environ["DAGSTER_HOME"] = home

    results = []
    for shards in (args.baseline_shards, args.shards):
        with tempfile.TemporaryDirectory() as tmp:
            r = night(Path(tmp), shards, args.images_per_shard, args.free_gpus)
        results.append(r)
        print(
            f"night of {r['shards']} shards ({r['images']} images): {r['wall_s']:.1f} s wall, "
            f"{r['orchestrator_cpu_s_per_shard'] * 1000:.1f} ms orchestrator CPU per shard, {r['jobs']} jobs, "
            f"at most {r['most_jobs_at_once']} at once on {r['free_gpus']} free GPUs, "
            f"{r['objects_per_1000_images']:.0f} objects per 1,000 images, {r['materialized']} shards materialized "
            f"(registration {r['register_s']:.1f} s)",
            flush=True,
        )
    base, full = results
    print(
        "ratios full/baseline: orchestrator CPU per shard "
        f"{full['orchestrator_cpu_s_per_shard'] / base['orchestrator_cpu_s_per_shard']:.2f}, "
        f"wall per shard {full['wall_s'] / full['shards'] / (base['wall_s'] / base['shards']):.2f}"
    )

    small_load, big_load = definitions_load(10), definitions_load(10_000)
    print(
        f"definitions load: {small_load['load_s']:.3f} s with 10 shards, {big_load['load_s']:.3f} s with 10,000 "
        f"(ratio {big_load['load_s'] / small_load['load_s']:.2f}); nightly tick {small_load['tick_s'] * 1000:.0f} ms "
        "vs "
        f"{big_load['tick_s'] * 1000:.0f} ms",
        flush=True,
    )


if __name__ == "__main__":
    main()
