#!/usr/bin/env python
"""Transit throughput: the product's own storage code paths vs a hand-tuned boto3 TransferManager.

    python benchmarks/transit_throughput.py [--big-mib 1024] [--small-count 2000] [--small-kib 256]
                                            [--repeat 4] [--endpoint URL] [--alternatives]

Starts the moto S3 server of the tests (``tests/transit/s3_test_server.py``) on 127.0.0.1 in its own
process (so server and client do not share a GIL), or uses ``--endpoint`` / ``GPUDOOR_TEST_S3_ENDPOINT``.
Four jobs, each done by every contender on the same endpoint, in the same process:

* big up: one big local file. Product: ``publish(uri, manifest, files={"big.bin": path})``, what a
  training job does with a checkpoint.
* big down: the big object into memory. Product: ``read_bytes(uri)``, what evaluate/serve/resume do.
* small up: many small local files. Product: ``TransitBucket.publish(prefix, manifest, files=...)``,
  what ``dataset_shards`` does.
* small down: every object under a prefix into memory. Product: ``list_uris`` then ``read_bytes`` from
  16 threads, what the training and evaluation jobs do with the images.

The product runs as a job does: configured only by the AWS_* variables of ``job_env()`` and
``job_secrets()``. The baseline is what a careful engineer writes directly against boto3 (see
:class:`Baseline`). ``--alternatives`` adds the other libraries considered for the storage layer,
``obstore`` and ``s3fs`` through ``universal_pathlib`` (install them in a separate virtualenv, see
``benchmarks/README.md``). Prints MiB/s per job and contender and each contender's ratio to the
baseline (the product's target: >= 0.9x). The median of ``--repeat`` runs counts (on a small shared
machine single runs vary by up to 50%); the contenders take turns going first, so pass a multiple of
their number (2, or 4 with ``--alternatives``). Against moto the absolute numbers measure moto (a
pure-Python server that reads a whole object for every ranged GET) more than the network; the ratios
are the point.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from gpudoor_pipelines.transit import s3  # noqa: E402
from gpudoor_pipelines.transit import uris as transit  # noqa: E402

MiB = 1024 * 1024
KEY_ID, SECRET, REGION = "bench-key-id", "bench-secret", "us-east-1"
JOBS = ("big up", "big down", "small up", "small down")


def start_moto() -> tuple[str, subprocess.Popen]:
    """The tests' moto server on a free 127.0.0.1 port, in its own process."""
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "tests/transit/s3_test_server.py"), "-p", "0", "--exit-on-stdin-eof"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    port = proc.stdout.readline().strip()
    if not port.isdigit():
        proc.kill()
        raise RuntimeError(f"moto server did not start (printed {port!r})")
    return f"http://127.0.0.1:{port}", proc


def _files(local_dir: Path) -> dict[str, Path]:
    return {p.relative_to(local_dir).as_posix(): p for p in sorted(local_dir.rglob("*")) if p.is_file()}


class Baseline:
    """boto3 used well, by hand: one client with a big connection pool and standard retries; one
    TransferManager with 64 MiB parts x 10 for the big object and one running 32 small transfers at
    once, all submitted together, with sizes provided so that downloads skip the HEAD."""

    def __init__(self, endpoint: str, bucket: str):
        import boto3
        from boto3.s3.transfer import TransferConfig, create_transfer_manager
        from botocore.config import Config

        self.bucket = bucket
        self.client = boto3.session.Session().client(
            "s3",
            endpoint_url=endpoint,
            region_name=REGION,
            aws_access_key_id=KEY_ID,
            aws_secret_access_key=SECRET,
            config=Config(
                max_pool_connections=64,
                retries={"mode": "standard", "max_attempts": 5},
                s3={"addressing_style": "path"},
                request_checksum_calculation="when_required",
                response_checksum_validation="when_required",
                tcp_keepalive=True,
            ),
        )

        def config(concurrency: int) -> TransferConfig:
            return TransferConfig(
                multipart_threshold=64 * MiB,
                multipart_chunksize=64 * MiB,
                max_concurrency=concurrency,
                preferred_transfer_client="classic",
            )

        self.big = create_transfer_manager(self.client, config(10))
        self.many = create_transfer_manager(self.client, config(32))

    def big_up(self, path: Path, key: str) -> None:
        self.big.upload(str(path), self.bucket, key).result()

    def big_down(self, key: str) -> bytes:
        size = self.client.head_object(Bucket=self.bucket, Key=key)["ContentLength"]
        buf = io.BytesIO()
        self.big.download(self.bucket, key, buf, subscribers=[_Size(size)]).result()
        return buf.getvalue()

    def small_up(self, local_dir: Path, prefix: str) -> None:
        futures = [self.many.upload(str(p), self.bucket, f"{prefix}/{rel}") for rel, p in _files(local_dir).items()]
        for f in futures:
            f.result()

    def small_down(self, prefix: str) -> int:
        futures = []
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix + "/"):
            for obj in page.get("Contents", ()):
                buf = io.BytesIO()
                futures.append(
                    (buf, self.many.download(self.bucket, obj["Key"], buf, subscribers=[_Size(obj["Size"])]))
                )
        for _, f in futures:
            f.result()
        return len(futures)

    def close(self) -> None:
        self.big.shutdown()
        self.many.shutdown()


class _Size:
    """s3transfer subscriber that provides the object size up front."""

    def __init__(self, size: int):
        self.size = size

    def on_queued(self, future, **kwargs):
        future.meta.provide_transfer_size(self.size)

    def on_progress(self, **kwargs):
        pass

    def on_done(self, **kwargs):
        pass


class Product:
    """The storage layer's own code paths, configured as a job is: by the AWS_* environment."""

    def __init__(self, endpoint: str, bucket: str):
        orchestrator = s3.S3TransitBucket(
            bucket, endpoint_url=endpoint, region=REGION, access_key_id=KEY_ID, secret_access_key=SECRET
        )
        os.environ.update({**orchestrator.job_env(), **orchestrator.job_secrets()})  # as the launcher does
        self.bucket, self.orchestrator = bucket, orchestrator

    def big_up(self, path: Path, key: str) -> None:
        folder, name = key.rsplit("/", 1)
        transit.publish(f"s3://{self.bucket}/{folder}", {"bench": True}, files={name: path})

    def big_down(self, key: str) -> bytes:
        return transit.read_bytes(f"s3://{self.bucket}/{key}")

    def small_up(self, local_dir: Path, prefix: str) -> None:
        self.orchestrator.publish(prefix, {"bench": True}, files=_files(local_dir))

    def small_down(self, prefix: str) -> int:
        uris = transit.list_uris(f"s3://{self.bucket}/{prefix}")
        with ThreadPoolExecutor(16) as pool:
            return sum(1 for _ in pool.map(transit.read_bytes, uris))

    def close(self) -> None:
        self.orchestrator.close()


class Obstore:
    """``obstore`` (Rust object_store): multipart puts of 64 MiB x 10; many objects through asyncio."""

    def __init__(self, endpoint: str, bucket: str):
        from obstore.store import S3Store

        self.store = S3Store(
            bucket,
            endpoint=endpoint,
            access_key_id=KEY_ID,
            secret_access_key=SECRET,
            region=REGION,
            virtual_hosted_style_request=False,
            client_options={"allow_http": True},
        )

    def big_up(self, path: Path, key: str) -> None:
        import obstore

        obstore.put(self.store, key, path, chunk_size=64 * MiB, max_concurrency=10)

    def big_down(self, key: str) -> bytes:
        import obstore

        size = obstore.head(self.store, key)["size"]  # ranged GETs in parallel, like the TransferManager
        starts = list(range(0, size, 64 * MiB))
        parts = obstore.get_ranges(self.store, key, starts=starts, ends=[min(s + 64 * MiB, size) for s in starts])
        return b"".join(bytes(p) for p in parts)

    def small_up(self, local_dir: Path, prefix: str) -> None:
        import obstore

        async def run() -> None:
            limit = asyncio.Semaphore(32)

            async def put(rel: str, path: Path) -> None:
                async with limit:
                    await obstore.put_async(self.store, f"{prefix}/{rel}", path)

            await asyncio.gather(*(put(rel, p) for rel, p in _files(local_dir).items()))

        asyncio.run(run())

    def small_down(self, prefix: str) -> int:
        import obstore

        keys = [o["path"] for batch in obstore.list(self.store, prefix + "/") for o in batch]

        async def run() -> int:
            limit = asyncio.Semaphore(32)

            async def get(key: str) -> bytes:
                async with limit:
                    return bytes(await (await obstore.get_async(self.store, key)).bytes_async())

            return len(await asyncio.gather(*(get(k) for k in keys)))

        return asyncio.run(run())

    def close(self) -> None:
        pass


class S3fsUPath:
    """fsspec's ``s3fs`` through ``universal_pathlib``, as ``UPath("s3://...")`` would be used."""

    def __init__(self, endpoint: str, bucket: str):
        from upath import UPath

        self.root = UPath(
            f"s3://{bucket}",
            endpoint_url=endpoint,
            key=KEY_ID,
            secret=SECRET,
            client_kwargs={"region_name": REGION},
            max_concurrency=10,
        )
        self.fs, self.bucket = self.root.fs, bucket

    def big_up(self, path: Path, key: str) -> None:
        self.fs.put_file(str(path), f"{self.bucket}/{key}", chunksize=64 * MiB)

    def big_down(self, key: str) -> bytes:
        return (self.root / key).read_bytes()

    def small_up(self, local_dir: Path, prefix: str) -> None:
        files = _files(local_dir)
        self.fs.put([str(p) for p in files.values()], [f"{self.bucket}/{prefix}/{rel}" for rel in files])

    def small_down(self, prefix: str) -> int:
        return len(self.fs.cat(self.fs.find(f"{self.bucket}/{prefix}/")))

    def close(self) -> None:
        pass


def _make_data(work: Path, big_mib: int, small_count: int, small_kib: int) -> tuple[Path, Path]:
    big = work / "big.bin"
    with open(big, "wb") as f:
        for _ in range(big_mib):
            f.write(os.urandom(MiB))
    small, blob = work / "small", os.urandom(small_kib * 1024 + 4096)
    for i in range(small_count):
        p = small / f"d{i % 16:02d}" / f"f{i:05d}.bin"
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(blob[i % 4096 : i % 4096 + small_kib * 1024])
    return big, small


def _delete_all(client, bucket: str) -> None:
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        if objs := [{"Key": o["Key"]} for o in page.get("Contents", ())]:
            client.delete_objects(Bucket=bucket, Delete={"Objects": objs, "Quiet": True})


def run(endpoint: str, args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """MiB/s per contender and job, the median of ``args.repeat`` runs."""
    work = Path(tempfile.mkdtemp(prefix="transit-bench-", dir=args.workdir))
    try:
        print(f"generating {args.big_mib} MiB + {args.small_count} x {args.small_kib} KiB in {work}", flush=True)
        big, small = _make_data(work, args.big_mib, args.small_count, args.small_kib)
        mib = {"big up": args.big_mib, "big down": args.big_mib}
        mib["small up"] = mib["small down"] = args.small_count * args.small_kib / 1024
        bucket = f"transit-bench-{uuid.uuid4().hex[:8]}"
        base = Baseline(endpoint, bucket)
        base.client.create_bucket(Bucket=bucket)
        kinds = {"baseline": Baseline, "product": Product}
        if args.alternatives:
            kinds.update(obstore=Obstore, s3fs_upath=S3fsUPath)
        contenders = {name: kind(endpoint, bucket) for name, kind in kinds.items()}
        runs: dict[str, dict[str, list[float]]] = {name: {job: [] for job in JOBS} for name in contenders}
        for rep in range(args.repeat):
            # Each contender goes first as often as the others (with --repeat a multiple of their number),
            # and its objects are deleted before the next one starts, so that every contender meets the
            # same server; the contenders alternate within each group, so a load change hits them alike.
            names = list(contenders)
            order = names[rep % len(names) :] + names[: rep % len(names)]
            jobs: dict[str, Callable[[str, object], object]] = {
                "big up": lambda n, c, rep=rep: c.big_up(big, f"{n}-{rep}/big/big.bin"),
                "big down": lambda n, c, rep=rep: c.big_down(f"{n}-{rep}/big/big.bin"),
                "small up": lambda n, c, rep=rep: c.small_up(small, f"{n}-{rep}/small"),
                "small down": lambda n, c, rep=rep: c.small_down(f"{n}-{rep}/small"),
            }
            line: dict[str, dict[str, float]] = {name: {} for name in order}
            for group in (("big up", "big down"), ("small up", "small down")):
                for name in order:
                    for job in group:
                        t0 = time.perf_counter()
                        out = jobs[job](name, contenders[name])
                        line[name][job] = mib[job] / (time.perf_counter() - t0)
                        if job == "small down":
                            assert out >= args.small_count, f"{name}: read {out} of {args.small_count}"
                    _delete_all(base.client, bucket)
            for name in order:
                print(f"  run {rep + 1} {name:10s} " + "  ".join(f"{k} {v:7.1f}" for k, v in line[name].items()))
                for job, v in line[name].items():
                    runs[name][job].append(v)
        for c in contenders.values():
            c.close()
        base.client.delete_bucket(Bucket=bucket)
        return {name: {job: statistics.median(v) for job, v in r.items()} for name, r in runs.items()}
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--big-mib", type=int, default=1024, help="size of the big object (MiB), default 1024")
    ap.add_argument("--small-count", type=int, default=2000, help="number of small objects, default 2000")
    ap.add_argument("--small-kib", type=int, default=256, help="size of each small object (KiB), default 256")
    ap.add_argument("--repeat", type=int, default=4, help="runs per contender (the median counts), default 4")
    ap.add_argument("--endpoint", default=os.environ.get("GPUDOOR_TEST_S3_ENDPOINT"), help="S3 endpoint")
    ap.add_argument("--workdir", default=None, help="where to put the generated files (default: $TMPDIR)")
    ap.add_argument("--alternatives", action="store_true", help="also measure obstore and s3fs via UPath")
    args = ap.parse_args(argv)

    endpoint, proc = args.endpoint, None
    if not endpoint:
        endpoint, proc = start_moto()
        print(f"started moto server at {endpoint}", flush=True)
    try:
        results = run(endpoint, args)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=15)

    base = results.pop("baseline")
    print(f"\nMiB/s{'':7s}" + "".join(f"{job:>12s}" for job in JOBS) + f"{'worst ratio':>14s}")
    print(f"{'baseline':12s}" + "".join(f"{base[job]:12.1f}" for job in JOBS))
    for name, r in results.items():
        ratios = [r[job] / base[job] for job in JOBS]
        print(
            f"{name:12s}" + "".join(f"{r[job]:6.1f} ({x:.2f})" for job, x in zip(JOBS, ratios, strict=True)),
            end="",
        )
        print(f"{min(ratios):14.2f}")
    worst = min(results["product"][job] / base[job] for job in JOBS)
    print(f"\nproduct worst ratio {worst:.2f} (target >= 0.90): {'OK' if worst >= 0.9 else 'BELOW TARGET'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
