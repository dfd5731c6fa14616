"""Benchmark: the checkpoint sensor's tick at 100 vs 100,000 checkpoints, on a folder and on S3 over HTTP.

For each bucket kind (a local folder; the tests' moto S3 server, ``tests/transit/s3_test_server.py``,
started here on 127.0.0.1 in its own process) and each size, on a fresh bucket:

* populate (not timed): N checkpoints in trainings of 100 checkpoints each (100 -> 1 training,
  100,000 -> 1,000), each finished (a journal entry days old, older than the journal lookback, and an
  end marker ``succeeded``), plus, at every size, the same 5 running trainings (a journal entry a few
  minutes before the sensor is turned on, 3 checkpoints each, no end marker). A checkpoint is a
  tiny ``model.pt`` and its ``_manifest.json``; on S3, ``model.pt`` is left out when writing it would
  take populating past ``--populate-budget-s`` (the output says so); and 2 running trainings nobody
  journaled (started by hand, by an agent, or by SkyPilot itself without the training program: dated
  ids, 3 checkpoints each, no journal entry, no end marker);
* turn on: ``scan_checkpoints(bucket, None, ScanPolicy(1, 200, 48 h), now=T0)``, then ticks 30 s
  apart with the returned cursor until one is not capped and the backlog walk is done;
* steady: ``--steady-ticks`` ticks, each after ONE new checkpoint written in a running training,
  journaled or not, in turn (each must hand out exactly that one); halfway, the checkpoint is the first
  of a new training nobody journaled, which must be found at that tick;
* on the local bucket, a few steady ticks through the real Dagster sensor (``new_checkpoint_sensor``
  with ``build_sensor_context``), for its overhead and the run keys of its run requests.

Every call the scan makes goes through a counting proxy of the bucket (``list_keys`` calls and keys
yielded, ``exists``, ``get_bytes``), whose counts must agree with the ``ScanResult``'s own; on S3 the
HTTP requests are counted too (botocore events). "empty list" is the median time of one listing of a
prefix that holds nothing, at that size: what the server costs per listing before any key is sent
(the test server lists from a sorted index, as S3 does; stock moto scans every key on each listing).

    .venv/bin/python benchmarks/checkpoint_sensor.py                  # 100 vs 100,000, local and S3
    .venv/bin/python benchmarks/checkpoint_sensor.py --quick          # 100 vs 10,000, a smoke run
    .venv/bin/python benchmarks/checkpoint_sensor.py --buckets local --sizes 100,100000
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from unittest import mock

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

os.environ.setdefault("SKYPILOT_DISABLE_USAGE_COLLECTION", "1")
os.environ.setdefault("DAGSTER_DISABLE_TELEMETRY", "1")

from gpudoor_pipelines.data.checkpoints import (  # noqa: E402
    ScanPolicy,
    ScanResult,
    TrainingStart,
    checkpoint_key,
    new_training_id,
    record_end,
    record_start,
    scan_checkpoints,
)
from gpudoor_pipelines.transit.bucket import MANIFEST_NAME, LocalTransitBucket  # noqa: E402
from gpudoor_pipelines.transit.s3 import S3TransitBucket  # noqa: E402

PER_TRAINING = 100  # checkpoints per finished training
RUNNING = 5  # running trainings, at every size
RUNNING_CHECKPOINTS = 3  # checkpoints each running training wrote before the sensor was turned on
UNJOURNALED = 2  # running trainings nobody journaled, at every size
TICK_S = 30.0
DAY = 86400.0
POLICY = ScanPolicy(backlog_per_training=1, max_checkpoints=200, forget_after_s=48 * 3600.0)
KEY_ID, SECRET, REGION, PREFIX = "bench-key-id", "bench-secret", "us-east-1", "transit"
UPLOAD_THREADS = 32
MODEL_BYTES = b"weights"


def manifest_bytes(step: int) -> bytes:
    return json.dumps({"step": step}).encode()


def step_dir(step: int) -> str:
    return f"step-{step:06d}"


# ------------------------------------------------------------------------------------------ counting
class CountingBucket:
    """The bucket, with the calls the scan makes counted and timed (everything else passes through).

    Time is summed per kind of call: listing the journal (``trainings/``), listing one training
    (``checkpoints/<id>/``), the backlog walk (``checkpoints/``), ``exists``, ``get_bytes``."""

    PARTS = ("journal", "training", "walk", "exists", "get")

    def __init__(self, bucket: Any) -> None:
        self.bucket = bucket
        self.reset()

    def reset(self) -> None:
        self.lists = self.keys = self.exists_calls = self.gets = 0
        self.seconds = dict.fromkeys(self.PARTS, 0.0)

    def list_keys(self, prefix: str = "", start_after: str | None = None) -> Iterator[str]:
        self.lists += 1
        part = "journal" if prefix.startswith("trainings/") else "walk" if prefix == "checkpoints/" else "training"
        keys = iter(self.bucket.list_keys(prefix, start_after=start_after))
        while True:
            t0 = time.perf_counter()
            try:
                key = next(keys)
            except StopIteration:
                self.seconds[part] += time.perf_counter() - t0
                return
            self.seconds[part] += time.perf_counter() - t0
            self.keys += 1
            yield key

    def exists(self, key: str) -> bool:
        self.exists_calls += 1
        t0 = time.perf_counter()
        try:
            return self.bucket.exists(key)
        finally:
            self.seconds["exists"] += time.perf_counter() - t0

    def get_bytes(self, key: str) -> bytes:
        self.gets += 1
        t0 = time.perf_counter()
        try:
            return self.bucket.get_bytes(key)
        finally:
            self.seconds["get"] += time.perf_counter() - t0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.bucket, name)


class RequestCounter:
    """HTTP requests an S3TransitBucket's client makes, by operation (botocore's after-call events)."""

    def __init__(self, client: Any) -> None:
        self.by_op: dict[str, int] = {}
        client.meta.events.register("after-call.s3", self._count)

    def _count(self, event_name: str, **_: Any) -> None:
        op = event_name.rsplit(".", 1)[-1]
        self.by_op[op] = self.by_op.get(op, 0) + 1

    def total(self) -> int:
        return sum(self.by_op.values())


# ------------------------------------------------------------------------------------------ S3 server
def start_moto() -> tuple[str, subprocess.Popen]:
    """The tests' moto server on a free 127.0.0.1 port, in its own process."""
    proc = subprocess.Popen(
        [
            sys.executable,
            str(REPO / "tests/transit/s3_test_server.py"),
            "-H",
            "127.0.0.1",
            "-p",
            "0",
            "--exit-on-stdin-eof",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    port = proc.stdout.readline().strip()
    if not port.isdigit():
        proc.kill()
        raise RuntimeError(f"moto server did not start (printed {port!r})")
    return f"http://127.0.0.1:{port}", proc


def raw_client(endpoint: str) -> Any:
    import boto3
    from botocore.config import Config

    return boto3.session.Session().client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id=KEY_ID,
        aws_secret_access_key=SECRET,
        region_name=REGION,
        config=Config(
            s3={"addressing_style": "path"},
            max_pool_connections=UPLOAD_THREADS + 8,
            retries={"mode": "standard", "max_attempts": 5},
            parameter_validation=False,
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        ),
    )


# ------------------------------------------------------------------------------------------ populate
class Layout:
    """Which trainings a bucket of ``size`` checkpoints holds, relative to the turn-on time ``t0``."""

    def __init__(self, size: int, t0: float) -> None:
        finished = max(1, -(-size // PER_TRAINING))
        self.finished: list[tuple[str, float, list[int]]] = []  # (training id, started at, steps)
        left = size
        for i in range(finished):
            n = min(PER_TRAINING, left)
            left -= n
            started = t0 - 3 * DAY - (finished - i) * 600.0  # 3 days and more before: outside the lookback
            self.finished.append((new_training_id(f"{i:08x}", now=started), started, [100 * (j + 1) for j in range(n)]))
        self.running: list[tuple[str, float, list[int]]] = []
        for i in range(RUNNING):
            started = t0 - 300.0 + 10.0 * i  # a few minutes before the sensor is turned on
            steps = [100 * (j + 1) for j in range(RUNNING_CHECKPOINTS)]
            self.running.append((new_training_id(f"run{i:05d}", now=started), started, steps))
        self.unjournaled: list[tuple[str, float, list[int]]] = []
        for i in range(UNJOURNALED):
            started = t0 - 200.0 + 10.0 * i
            steps = [100 * (j + 1) for j in range(RUNNING_CHECKPOINTS)]
            self.unjournaled.append((new_training_id(f"own{i:05d}", now=started), started, steps))
        self.checkpoints = sum(len(s) for _, _, s in self.finished)

    def objects(self, trainings: list[tuple[str, float, list[int]]], name: str) -> Iterator[tuple[str, bytes]]:
        for training, _, steps in trainings:
            for step in steps:
                body = MODEL_BYTES if name == "model.pt" else manifest_bytes(step)
                yield f"checkpoints/{training}/{step_dir(step)}/{name}", body


def populate_local(bucket: LocalTransitBucket, layout: Layout) -> dict:
    t0 = time.perf_counter()
    starts = [record_start(bucket, t, now=at) for t, at, _ in layout.finished + layout.running]
    written = 0
    for training, _, steps in layout.finished + layout.running + layout.unjournaled:
        for step in steps:
            folder = bucket.root / "checkpoints" / training / step_dir(step)
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "model.pt").write_bytes(MODEL_BYTES)
            (folder / MANIFEST_NAME).write_bytes(manifest_bytes(step))  # last, as training writes it
            written += 2
    for start in starts[: len(layout.finished)]:
        record_end(bucket, start.ended_key, "succeeded")
    return {"populate_s": time.perf_counter() - t0, "model_files": True, "objects": written + 2 * len(starts)}


def populate_s3(bucket: S3TransitBucket, endpoint: str, layout: Layout, model_files: str, budget_s: float) -> dict:
    """Journal entries through the product (record_start / record_end), checkpoint objects with boto3
    ``put_object`` from a thread pool; manifests first, then ``model.pt`` if the budget allows."""
    client = raw_client(endpoint)
    t0 = time.perf_counter()
    trainings = layout.finished + layout.running
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        starts: list[TrainingStart] = list(pool.map(lambda t: record_start(bucket, t[0], now=t[1]), trainings))

    def put(item: tuple[str, bytes]) -> None:
        client.put_object(Bucket=bucket.bucket, Key=f"{PREFIX}/{item[0]}", Body=item[1])

    def put_all(name: str) -> tuple[int, float]:
        t = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(UPLOAD_THREADS) as pool:
            n = sum(1 for _ in pool.map(put, layout.objects(trainings + layout.unjournaled, name)))
        return n, time.perf_counter() - t

    manifests, manifests_s = put_all(MANIFEST_NAME)
    elapsed = time.perf_counter() - t0
    write_models = model_files == "yes" or (model_files == "auto" and elapsed + manifests_s * 1.1 <= budget_s)
    models = put_all("model.pt")[0] if write_models else 0
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda s: record_end(bucket, s.ended_key, "succeeded"), starts[: len(layout.finished)]))
    populate_s = time.perf_counter() - t0
    return {
        "populate_s": populate_s,
        "model_files": write_models,
        "objects": manifests + models + 2 * len(starts),
        "puts_per_s": manifests / manifests_s if manifests_s else 0.0,
    }


# ------------------------------------------------------------------------------------------ ticks
def tick(proxy: CountingBucket, requests: RequestCounter | None, cursor: dict | None, now: float) -> dict:
    """One scan, timed, with the proxy's and the ScanResult's counts (which must agree)."""
    proxy.reset()
    before = requests.total() if requests else 0
    t0 = time.perf_counter()
    result: ScanResult = scan_checkpoints(proxy, cursor, POLICY, now=now)
    seconds = time.perf_counter() - t0
    assert (proxy.lists, proxy.exists_calls, proxy.keys) == (
        result.lists,
        result.exists,
        result.keys_listed,
    ), (
        "counting proxy and ScanResult disagree",
        (proxy.lists, proxy.exists_calls, proxy.keys),
        (result.lists, result.exists, result.keys_listed),
    )
    return {
        "result": result,
        "s": seconds,
        "lists": result.lists,
        "exists": result.exists,
        "keys": result.keys_listed,
        "gets": proxy.gets,
        "requests": (requests.total() - before) if requests else None,
        "cursor_bytes": len(json.dumps(result.cursor)),
        "parts": {**proxy.seconds, "scan": seconds - sum(proxy.seconds.values())},
    }


def empty_list_s(bucket: Any, repeat: int = 5) -> float:
    """Median time of listing a prefix that holds nothing (the server's cost per listing)."""
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        assert not list(bucket.list_keys("nothing-here/"))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def write_checkpoint(bucket: Any, training: str, step: int) -> str:
    folder = f"checkpoints/{training}/{step_dir(step)}"
    bucket.put_bytes(f"{folder}/model.pt", MODEL_BYTES)
    bucket.put_bytes(f"{folder}/{MANIFEST_NAME}", manifest_bytes(step))  # last: complete from here on
    return checkpoint_key(training, step_dir(step))


def dagster_ticks(root: Path, bucket: Any, layout: Layout, cursor: dict, now: float, next_step: dict, n: int) -> dict:
    """``n`` steady ticks through the real sensor (``new_checkpoint_sensor``), one new checkpoint each."""
    import dagster as dg

    from gpudoor_pipelines.automation import sensors
    from gpudoor_pipelines.launch.client import PipesSkyPilotClient
    from gpudoor_pipelines.transit.resource import TransitBucketResource

    transit = TransitBucketResource(kind="local", local_root=str(bucket.root))
    skypilot = PipesSkyPilotClient(
        backend="local",
        fleet_file=str(REPO / "task_specs" / "fleet.yaml"),
        local_home=str(root / "home"),
        transit=transit,
        validate_with_skypilot=False,
    )
    instance = dg.DagsterInstance.ephemeral()
    scans: list[ScanResult] = []
    real_scan = sensors.scan_checkpoints

    def scan(*args: Any, **kwargs: Any) -> ScanResult:
        scans.append(real_scan(*args, **kwargs))
        return scans[-1]

    cursor_text = json.dumps(cursor, separators=(",", ":"))
    times, run_keys = [], []
    for i in range(n + 1):  # the first one warms up (imports, resources): not timed
        training = layout.running[i % RUNNING][0]
        expected = write_checkpoint(bucket, training, next_step[training])
        next_step[training] += 100
        now += TICK_S
        clock = SimpleNamespace(time=lambda now=now: now)
        with (
            mock.patch.object(sensors, "scan_checkpoints", scan),
            mock.patch.object(sensors, "time", clock) if hasattr(sensors, "time") else contextlib.nullcontext(),
            dg.build_sensor_context(
                instance=instance, cursor=cursor_text, resources={"transit": transit, "skypilot": skypilot}
            ) as context,
        ):
            t0 = time.perf_counter()
            result = sensors.new_checkpoint_sensor(context)
            if i:
                times.append(time.perf_counter() - t0)
        keys = [r.run_key for r in result.run_requests or ()]
        assert keys == [expected], (keys, expected)
        assert scans[-1].checkpoints == [expected]
        run_keys.extend(keys)
        for request in result.dynamic_partitions_requests or ():
            instance.add_dynamic_partitions(request.partitions_def_name, list(request.partition_keys))
        cursor_text = result.cursor
    return {
        "s": statistics.median(times),
        "lists": statistics.median(s.lists for s in scans[1:]),
        "exists": statistics.median(s.exists for s in scans[1:]),
        "run_keys": run_keys,
        "now": now,
        "cursor": json.loads(cursor_text),
    }


# ------------------------------------------------------------------------------------------ one scenario
def scenario(kind: str, size: int, args: argparse.Namespace, endpoint: str | None, tmp: Path) -> dict:
    t0_clock = time.time()
    layout = Layout(size, t0_clock)
    requests = None
    if kind == "local":
        bucket: Any = LocalTransitBucket(tmp / f"bucket-{size}")
        pop = populate_local(bucket, layout)
    else:
        name = f"bench-checkpoints-{size}"
        raw_client(endpoint).create_bucket(Bucket=name)
        bucket = S3TransitBucket(
            name, PREFIX, endpoint_url=endpoint, region=REGION, access_key_id=KEY_ID, secret_access_key=SECRET
        )
        pop = populate_s3(bucket, endpoint, layout, args.s3_model_files, args.populate_budget_s)
        requests = RequestCounter(bucket.client)
    print(
        f"  {kind} {size:,}: populated {pop['objects']:,} objects in {pop['populate_s']:.0f} s"
        + ("" if pop["model_files"] else " (only _manifest.json per checkpoint: model.pt left out, too slow to write)")
        + (f", {pop['puts_per_s']:.0f} puts/s" if "puts_per_s" in pop else ""),
        flush=True,
    )
    proxy = CountingBucket(bucket)
    floor = empty_list_s(bucket)

    # turn on: until the backlog is done and a tick is not capped
    now, cursor, turn_on = t0_clock, None, []
    handed: list[str] = []
    while True:
        t = tick(proxy, requests, cursor, now)
        turn_on.append(t)
        handed.extend(t["result"].checkpoints)
        cursor = t["result"].cursor
        if not t["result"].capped and cursor.get("walk") is None:
            break
        assert len(turn_on) < 100_000, "the turn-on does not end"
        now += TICK_S
    first = turn_on[0]
    assert len(first["result"].checkpoints) <= POLICY.max_checkpoints, "first tick over the cap"
    assert len(handed) == len(set(handed)), "a checkpoint handed out twice"
    expected_backlog = {
        checkpoint_key(t, step_dir(steps[-1])) for t, _, steps in layout.finished + layout.running + layout.unjournaled
    }
    assert set(handed) == expected_backlog, (
        "turn-on handed out",
        len(handed),
        "expected",
        len(expected_backlog),
    )

    # steady: one new checkpoint before each tick, in the running trainings in turn (journaled or not); halfway,
    # the first checkpoint of a training nobody journaled, started after the sensor was turned on
    writers = layout.running + layout.unjournaled
    next_step = {t: steps[-1] + 100 for t, _, steps in writers}
    steady = []
    for i in range(args.steady_ticks):
        training = writers[i % len(writers)][0]
        if i == args.steady_ticks // 2:
            training = new_training_id("ownnew00", now=now)
            next_step[training] = 100
        expected = write_checkpoint(bucket, training, next_step[training])
        next_step[training] += 100
        now += TICK_S
        t = tick(proxy, requests, cursor, now)
        assert t["result"].checkpoints == [expected], (t["result"].checkpoints, expected)
        cursor = t["result"].cursor
        steady.append(t)

    sensor = None
    if kind == "local" and args.dagster_ticks:
        sensor = dagster_ticks(tmp / f"dagster-{size}", bucket, layout, cursor, now, next_step, args.dagster_ticks)

    def med(key: str) -> float:
        return statistics.median(t[key] for t in steady)

    row = {
        "bucket": kind if kind == "local" else "s3 (moto, HTTP)",
        "kind": kind,
        "checkpoints": layout.checkpoints,
        "stored": layout.checkpoints + (RUNNING + UNJOURNALED) * RUNNING_CHECKPOINTS,
        "model_files": pop["model_files"],
        "populate_s": pop["populate_s"],
        "first_s": first["s"],
        "first_handed": len(first["result"].checkpoints),
        "first_lists": first["lists"],
        "first_exists": first["exists"],
        "first_keys": first["keys"],
        "first_requests": first["requests"],
        "turn_on_ticks": len(turn_on),
        "turn_on_s": sum(t["s"] for t in turn_on),
        "turn_on_handed": len(handed),
        "turn_on_lists": sum(t["lists"] for t in turn_on),
        "turn_on_exists": sum(t["exists"] for t in turn_on),
        "turn_on_keys": sum(t["keys"] for t in turn_on),
        "turn_on_cursor_max": max(t["cursor_bytes"] for t in turn_on),
        "steady_s": med("s"),
        "steady_s_max": max(t["s"] for t in steady),
        "steady_lists": med("lists"),
        "steady_exists": med("exists"),
        "steady_keys": med("keys"),
        "steady_gets": med("gets"),
        "steady_calls_max": max(t["lists"] + t["exists"] for t in steady),
        "steady_requests": med("requests") if requests else None,
        "cursor_bytes": steady[-1]["cursor_bytes"] if steady else turn_on[-1]["cursor_bytes"],
        "empty_list_s": floor,
        "steady_parts": {k: statistics.median(t["parts"][k] for t in steady) for k in steady[0]["parts"]},
        "sensor": sensor,
    }
    if kind == "s3":
        bucket.close()
    return row


# ------------------------------------------------------------------------------------------ report
def fmt_int(v: float | None) -> str:
    return "-" if v is None else f"{v:,.0f}" if float(v).is_integer() else f"{v:,.1f}"


def print_table(rows: list[dict]) -> None:
    print()
    print(
        "| bucket | checkpoints | first tick: s | handed out | lists | exists | keys listed "
        "| turn-on: ticks | s | handed out | steady tick: s (median) | lists | exists | keys listed "
        "| HTTP requests | cursor bytes (turn-on max / steady) | empty list |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['bucket']} | {r['checkpoints']:,} | {r['first_s']:.3f} | {r['first_handed']} | {r['first_lists']} "
            f"| {r['first_exists']} | {r['first_keys']:,} | {r['turn_on_ticks']} | {r['turn_on_s']:.2f} "
            f"| {r['turn_on_handed']:,} | {r['steady_s'] * 1000:.1f} ms | {fmt_int(r['steady_lists'])} "
            f"| {fmt_int(r['steady_exists'])} | {fmt_int(r['steady_keys'])} | {fmt_int(r['steady_requests'])} "
            f"| {r['turn_on_cursor_max']:,} / {r['cursor_bytes']:,} | {r['empty_list_s'] * 1000:.2f} ms |"
        )


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b else ("1.00" if a == b else "inf")


def print_ratios(rows: list[dict]) -> None:
    print()
    for kind in dict.fromkeys(r["kind"] for r in rows):
        mine = sorted((r for r in rows if r["kind"] == kind), key=lambda r: r["checkpoints"])
        if len(mine) < 2:
            continue
        base, big = mine[0], mine[-1]
        head = f"{big['bucket']}, {big['checkpoints']:,} vs {base['checkpoints']:,} checkpoints"
        parts = [
            f"steady tick time {ratio(big['steady_s'], base['steady_s'])}",
            f"lists {ratio(big['steady_lists'], base['steady_lists'])}",
            f"exists {ratio(big['steady_exists'], base['steady_exists'])}",
            f"keys listed {ratio(big['steady_keys'], base['steady_keys'])}",
        ]
        if big["steady_requests"] is not None:
            parts.append(f"HTTP requests {ratio(big['steady_requests'], base['steady_requests'])}")
        parts.append(f"cursor bytes {ratio(big['cursor_bytes'], base['cursor_bytes'])}")
        parts.append(f"empty list {ratio(big['empty_list_s'], base['empty_list_s'])}")
        print(f"ratios {head}: " + ", ".join(parts))
    print()
    for r in rows:
        p = {k: v * 1000 for k, v in r["steady_parts"].items()}
        print(
            f"steady tick, where the time goes ({r['bucket']}, {r['checkpoints']:,}; medians, ms): journal list "
            f"{p['journal']:.2f}, training lists {p['training']:.2f}, exists {p['exists']:.2f}, journal reads "
            f"{p['get']:.2f}, the scan's own work {p['scan']:.2f}"
        )
    print()
    for r in rows:
        if r["sensor"]:
            s = r["sensor"]
            print(
                f"dagster sensor tick ({r['bucket']}, {r['checkpoints']:,} checkpoints): {s['s'] * 1000:.1f} ms median "
                f"(bare scan {r['steady_s'] * 1000:.1f} ms, so {(s['s'] - r['steady_s']) * 1000:.1f} ms Dagster), "
                f"lists {fmt_int(s['lists'])}, exists {fmt_int(s['exists'])}, run keys e.g. {s['run_keys'][0]!r}"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="100,100000", help="checkpoints stored (comma-separated)")
    parser.add_argument("--buckets", default="local,s3", help="local, s3 or both")
    parser.add_argument("--steady-ticks", type=int, default=20)
    parser.add_argument("--dagster-ticks", type=int, default=5, help="steady ticks through the real sensor (local)")
    parser.add_argument("--quick", action="store_true", help="sizes 100,10000: a smoke run")
    parser.add_argument(
        "--s3-model-files",
        choices=("auto", "yes", "no"),
        default="auto",
        help="write model.pt on S3 too (auto: if populating stays within --populate-budget-s)",
    )
    parser.add_argument("--populate-budget-s", type=float, default=360.0)
    args = parser.parse_args()
    sizes = [100, 10_000] if args.quick else [int(s) for s in args.sizes.split(",")]
    kinds = [k.strip() for k in args.buckets.split(",") if k.strip()]
    assert set(kinds) <= {"local", "s3"}, kinds

    started = time.perf_counter()
    rows = []
    endpoint, proc = (None, None)
    try:
        with tempfile.TemporaryDirectory(prefix="bench-checkpoint-sensor-") as tmp:
            for kind in kinds:
                if kind == "s3" and proc is None:
                    endpoint, proc = start_moto()
                for size in sizes:
                    rows.append(scenario(kind, size, args, endpoint, Path(tmp)))
                    r = rows[-1]
                    print(
                        f"  {r['bucket']} {r['checkpoints']:,}: first tick {r['first_s']:.3f} s, turn-on "
                        f"{r['turn_on_ticks']} ticks {r['turn_on_s']:.2f} s, steady {r['steady_s'] * 1000:.1f} ms "
                        f"(max {r['steady_s_max'] * 1000:.1f}), {fmt_int(r['steady_lists'])} lists "
                        f"{fmt_int(r['steady_exists'])} exists {fmt_int(r['steady_keys'])} keys",
                        flush=True,
                    )
    finally:
        if proc is not None:
            proc.stdin.close()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
    print_table(rows)
    print_ratios(rows)
    notes = [
        f"{r['bucket']} {r['checkpoints']:,}: only _manifest.json written per checkpoint"
        for r in rows
        if not r["model_files"]
    ]
    for note in notes:
        print(f"note: {note}")
    print(f"benchmark run time: {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
