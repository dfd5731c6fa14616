#!/usr/bin/env python
"""Housekeeping's plan over a bucket of 100,000 checkpoints and 1,000,000 other objects, against a plain listing.

    python benchmarks/housekeeping.py [--checkpoints 100000] [--others 1000000] [--trainings 1000]
                                      [--s3 http://127.0.0.1:PORT] [--keep DIR]

Fills a transit bucket (a local folder, or with ``--s3`` a bucket on that S3 endpoint) with ``--trainings``
ended trainings of evaluated checkpoints (a manifest and a weights file each, and its eval's metrics) and
``--others`` other objects (dataset shard manifests), then measures, each in a process of its own so that its
peak memory is its own:

1. a plain listing of the whole bucket (``list_sized``: what any tool that reads it pays);
2. the first plan (it reads every checkpoint's metrics once, into the bucket's score index);
3. the next plan (the index is there: only metrics written since are read).

Prints seconds and peak RSS of each, and the plans' ratios to the listing. The plan is made as if 40 days had
passed, so most checkpoints go cold in it (nothing is applied). Absolute figures depend on the machine.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import multiprocessing
import os
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
DAY = 86400.0


def _open(spec: dict):
    from gpudoor_pipelines.transit.bucket import LocalTransitBucket
    from gpudoor_pipelines.transit.s3 import S3TransitBucket

    if spec["kind"] == "local":
        return LocalTransitBucket(spec["root"])
    return S3TransitBucket(
        spec["bucket"],
        "transit",
        endpoint_url=spec["endpoint"],
        access_key_id="bench-key",
        secret_access_key="bench-secret",
        max_concurrency=32,
    )


def _objects(checkpoints: int, others: int, trainings: int):
    """(key, bytes) of the whole bucket, in no particular order."""
    per = max(checkpoints // trainings, 1)
    for t in range(trainings):
        training = f"20261001T000000-{t:08d}"
        for step in range(per):
            name = f"step-{step:06d}"
            yield f"checkpoints/{training}/{name}/model.pt", b"w" * 64
            yield f"checkpoints/{training}/{name}/_manifest.json", b'{"files": ["model.pt"]}'
            score = json.dumps({"accuracy": ((t * 7919 + step * 104729) % 1000) / 1000}).encode()
            yield f"evals/{training}.{name}/metrics.json", score
        yield f"checkpoints/{training}/_manifest.json", b"{}"
    for i in range(others):
        yield f"datasets/bench/shards/bench-{i:07d}/_manifest.json", b'{"images": []}'


def fill(spec: dict, checkpoints: int, others: int, trainings: int) -> int:
    n = 0
    if spec["kind"] == "local":
        root = Path(spec["root"])
        made: set[Path] = set()
        for key, data in _objects(checkpoints, others, trainings):
            path = root / key
            if path.parent not in made:
                path.parent.mkdir(parents=True, exist_ok=True)
                made.add(path.parent)
            path.write_bytes(data)
            n += 1
        return n
    bucket = _open(spec)
    client = bucket.client
    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        batch = []
        for key, data in _objects(checkpoints, others, trainings):
            batch.append((key, data))
            if len(batch) >= 2000:
                list(
                    pool.map(
                        lambda kd: client.put_object(Bucket=spec["bucket"], Key=bucket._full(kd[0]), Body=kd[1]), batch
                    )
                )
                n += len(batch)
                batch = []
        list(pool.map(lambda kd: client.put_object(Bucket=spec["bucket"], Key=bucket._full(kd[0]), Body=kd[1]), batch))
        n += len(batch)
    return n


def _phase(name: str, spec: dict, out) -> None:
    from gpudoor_pipelines.data.housekeeping import Protected, Retention, make_plan

    bucket = _open(spec)
    start = time.perf_counter()
    if name == "listing":
        figure = sum(1 for _ in bucket.list_sized(""))
    else:
        plan = make_plan(bucket, Retention(caption_model="current"), Protected(), now=time.time() + 40 * DAY)
        figure = {"rows": plan.rows, "scores_read": plan.scores_read, "by_action": plan.summary()["by_action"]}
    seconds = time.perf_counter() - start
    out.send(
        {
            "seconds": seconds,
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "figure": figure,
        }
    )


def measure(name: str, spec: dict) -> dict:
    ctx = multiprocessing.get_context("spawn")  # a fresh process: its peak memory is the phase's own
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_phase, args=(name, spec, send))
    proc.start()
    result = recv.recv()
    proc.join()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoints", type=int, default=100_000)
    parser.add_argument("--others", type=int, default=1_000_000)
    parser.add_argument("--trainings", type=int, default=1_000)
    parser.add_argument("--s3", help="an S3 endpoint (e.g. python tests/transit/s3_test_server.py -p 18555)")
    parser.add_argument("--keep", help="keep the local bucket in this folder (reused if filled)")
    args = parser.parse_args()
    tmp = tempfile.mkdtemp(prefix="hk-bench-")
    if args.s3:
        import boto3

        name = f"hk-bench-{os.getpid()}"
        boto3.client(
            "s3",
            endpoint_url=args.s3,
            aws_access_key_id="bench-key",
            aws_secret_access_key="bench-secret",
            region_name="us-east-1",
        ).create_bucket(Bucket=name)
        spec = {"kind": "s3", "endpoint": args.s3, "bucket": name}
    else:
        spec = {"kind": "local", "root": args.keep or os.path.join(tmp, "transit")}
    try:
        marker = Path(spec.get("root", tmp)) / ".filled"
        if spec["kind"] == "local" and marker.exists():
            print(f"bucket: reusing {spec['root']}")
        else:
            start = time.perf_counter()
            n = fill(spec, args.checkpoints, args.others, args.trainings)
            print(f"bucket: {n:,} objects written in {time.perf_counter() - start:.0f} s ({spec['kind']})")
            if spec["kind"] == "local":
                marker.write_text("")
        listing = measure("listing", spec)
        first = measure("plan", spec)
        second = measure("plan", spec)
        print(f"{'':22} {'seconds':>9} {'peak RSS MiB':>13} {'x listing':>10}")
        for label, r in (("plain listing", listing), ("first plan", first), ("next plan", second)):
            ratio = r["seconds"] / listing["seconds"]
            print(f"{label:22} {r['seconds']:9.1f} {r['peak_rss_mib']:13.0f} {ratio:10.2f}")
        print(f"listed objects: {listing['figure']:,}")
        for label, r in (("first plan", first), ("next plan", second)):
            f = r["figure"]
            print(
                f"{label}: {f['rows']:,} rows, {f['scores_read']:,} metrics read, "
                f"by action {json.dumps(f['by_action'])}"
            )
    finally:
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
