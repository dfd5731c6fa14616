#!/usr/bin/env python
"""Transit bucket throughput: S3TransitBucket vs a hand-tuned boto3 TransferManager baseline.

    python benchmarks/transit_throughput.py [--big-mib 1024] [--small-count 2000] [--small-kib 256]
                                            [--repeat 1] [--endpoint URL]

Against a moto S3 server this script starts itself on 127.0.0.1 (in its own process, so server and
client do not share a GIL), or the server at ``--endpoint`` / ``GPUDOOR_TEST_S3_ENDPOINT``. Moves
one big file and many small files, up and down, through ``S3TransitBucket`` and through a
hand-written boto3 TransferManager setup on the same endpoint in the same process, prints MiB/s for
each and the ratio transit/baseline (target >= 0.9x). The best of ``--repeat`` runs is reported;
the two contenders alternate order between runs.

Against moto the absolute numbers measure moto (a pure-Python server) more than the network; the
ratio is the point: the transit layer must not cost throughput compared with using boto3 well.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpudoor_pipelines.transit.bucket import S3TransitBucket  # noqa: E402

MiB = 1024 * 1024
KEY_ID, SECRET, REGION = "bench-key-id", "bench-secret", "us-east-1"


# ---- server -------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_moto() -> tuple[str, subprocess.Popen]:
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    deadline = time.monotonic() + 60
    while True:
        try:
            opener.open(f"{endpoint}/moto-api/", timeout=2).read()
            return endpoint, proc
        except Exception:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError("moto server did not start") from None
            time.sleep(0.2)


# ---- the baseline: boto3 used well, by hand ------------------------------------------------------


class Baseline:
    """What a careful engineer writes directly against boto3: one client with a big connection pool
    and standard retries, 64 MiB parts x 10 for big files, one TransferManager with all small-file
    transfers submitted at once (and sizes provided, so downloads skip the HEAD)."""

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
                retries={"mode": "standard", "max_attempts": 8},
                s3={"addressing_style": "path"},
                request_checksum_calculation="when_required",
                response_checksum_validation="when_required",
                tcp_keepalive=True,
            ),
        )

        def cfg(conc: int) -> TransferConfig:
            return TransferConfig(
                multipart_threshold=64 * MiB,
                multipart_chunksize=64 * MiB,
                max_concurrency=conc,
                preferred_transfer_client="classic",
            )

        self.big = create_transfer_manager(self.client, cfg(10))
        self.many = create_transfer_manager(self.client, cfg(32))

    def upload_file(self, path: Path, key: str) -> None:
        self.big.upload(str(path), self.bucket, key).result()

    def download_file(self, key: str, path: Path) -> None:
        self.big.download(self.bucket, key, str(path)).result()

    def upload_dir(self, local_dir: Path, prefix: str) -> None:
        futures = [
            self.many.upload(str(p), self.bucket, f"{prefix}/{p.relative_to(local_dir).as_posix()}")
            for p in sorted(local_dir.rglob("*"))
            if p.is_file()
        ]
        for f in futures:
            f.result()

    def download_dir(self, prefix: str, local_dir: Path) -> None:
        from s3transfer.subscribers import BaseSubscriber

        class Size(BaseSubscriber):
            def __init__(self, size):
                self.size = size

            def on_queued(self, future, **kwargs):
                future.meta.provide_transfer_size(self.size)

        futures = []
        for page in self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=prefix + "/"
        ):
            for o in page.get("Contents", ()):
                dest = local_dir / o["Key"][len(prefix) + 1 :]
                dest.parent.mkdir(parents=True, exist_ok=True)
                futures.append(
                    self.many.download(self.bucket, o["Key"], str(dest), subscribers=[Size(o["Size"])])
                )
        for f in futures:
            f.result()

    def close(self) -> None:
        self.big.shutdown()
        self.many.shutdown()


class Transit:
    def __init__(self, endpoint: str, bucket: str):
        self.b = S3TransitBucket(
            bucket, "", endpoint_url=endpoint, region=REGION, access_key_id=KEY_ID, secret_access_key=SECRET
        )
        self.b.check()

    def upload_file(self, path: Path, key: str) -> None:
        self.b.upload_file(path, key)

    def download_file(self, key: str, path: Path) -> None:
        self.b.download_file(key, path)

    def upload_dir(self, local_dir: Path, prefix: str) -> None:
        self.b.upload_dir(local_dir, prefix)

    def download_dir(self, prefix: str, local_dir: Path) -> None:
        self.b.download_dir(prefix, local_dir)

    def close(self) -> None:
        self.b.close()


# ---- the benchmark ------------------------------------------------------------------------------


def _timed(fn: Callable[[], None]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _make_data(work: Path, big_mib: int, small_count: int, small_kib: int) -> tuple[Path, Path]:
    big = work / "big.bin"
    with open(big, "wb") as f:
        for _ in range(big_mib):
            f.write(os.urandom(MiB))
    small = work / "small"
    blob = os.urandom(small_kib * 1024 + 4096)
    for i in range(small_count):
        p = small / f"d{i % 16:02d}" / f"f{i:05d}.bin"
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(blob[i % 4096 : i % 4096 + small_kib * 1024])
    return big, small


def _delete_all(client, bucket: str) -> None:
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        objs = [{"Key": o["Key"]} for o in page.get("Contents", ())]
        if objs:
            client.delete_objects(Bucket=bucket, Delete={"Objects": objs, "Quiet": True})


def run(endpoint: str, args) -> dict[str, dict[str, float]]:
    work = Path(tempfile.mkdtemp(prefix="transit-bench-", dir=args.workdir))
    results: dict[str, dict[str, float]] = {"transit": {}, "baseline": {}}
    try:
        print(
            f"generating {args.big_mib} MiB file and {args.small_count} x {args.small_kib} KiB files in {work}",
            flush=True,
        )
        big, small = _make_data(work, args.big_mib, args.small_count, args.small_kib)
        big_mib = args.big_mib
        small_mib = args.small_count * args.small_kib / 1024
        bucket = f"transit-bench-{uuid.uuid4().hex[:8]}"
        base = Baseline(endpoint, bucket)
        base.client.create_bucket(Bucket=bucket)
        contenders = {"baseline": base, "transit": Transit(endpoint, bucket)}
        outs = {name: work / f"out-{name}" for name in contenders}
        for rep in range(args.repeat):
            # phases interleave the contenders (order alternating per run), so that a load change on
            # the machine hits both alike
            order = ["baseline", "transit"] if rep % 2 == 0 else ["transit", "baseline"]
            for out in outs.values():
                shutil.rmtree(out, ignore_errors=True)
                out.mkdir()
            phases: list[tuple[str, float, Callable[[str, Transit | Baseline], None]]] = [
                ("big up", big_mib, lambda n, c, rep=rep: c.upload_file(big, f"{n}-{rep}/big.bin")),
                (
                    "big down",
                    big_mib,
                    lambda n, c, rep=rep: c.download_file(f"{n}-{rep}/big.bin", outs[n] / "big.bin"),
                ),
                ("small up", small_mib, lambda n, c, rep=rep: c.upload_dir(small, f"{n}-{rep}/small")),
                (
                    "small down",
                    small_mib,
                    lambda n, c, rep=rep: c.download_dir(f"{n}-{rep}/small", outs[n] / "small"),
                ),
            ]
            line = {name: {} for name in contenders}
            for phase, mib, fn in phases:
                for name in order:
                    line[name][phase] = mib / _timed(lambda fn=fn, name=name: fn(name, contenders[name]))
                if phase == "big down":
                    for out in outs.values():
                        (out / "big.bin").unlink()
            for name in order:
                n = sum(1 for p in (outs[name] / "small").rglob("*") if p.is_file())
                assert n == args.small_count, f"{name}: downloaded {n} of {args.small_count} small files"
                print(
                    f"  run {rep + 1} {name:8s} "
                    + "  ".join(f"{k} {v:7.1f} MiB/s" for k, v in line[name].items()),
                    flush=True,
                )
                for k, v in line[name].items():
                    results[name][k] = max(results[name].get(k, 0.0), v)
            _delete_all(base.client, bucket)
        for out in outs.values():
            shutil.rmtree(out, ignore_errors=True)
        for c in contenders.values():
            c.close()
        base.client.delete_bucket(Bucket=bucket)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--big-mib", type=int, default=1024, help="size of the big file (MiB), default 1024")
    ap.add_argument("--small-count", type=int, default=2000, help="number of small files, default 2000")
    ap.add_argument("--small-kib", type=int, default=256, help="size of each small file (KiB), default 256")
    ap.add_argument("--repeat", type=int, default=1, help="runs per contender; the best is reported")
    ap.add_argument(
        "--endpoint", default=os.environ.get("GPUDOOR_TEST_S3_ENDPOINT"), help="S3 endpoint to use"
    )
    ap.add_argument("--workdir", default=None, help="where to put the generated files (default: $TMPDIR)")
    args = ap.parse_args(argv)

    proc = None
    endpoint = args.endpoint
    if not endpoint:
        endpoint, proc = start_moto()
        print(f"started moto server at {endpoint}", flush=True)
    try:
        results = run(endpoint, args)
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    print()
    print(f"{'':12s}{'transit MiB/s':>15s}{'baseline MiB/s':>16s}{'ratio':>8s}")
    worst = float("inf")
    for k in ("big up", "big down", "small up", "small down"):
        t, b = results["transit"][k], results["baseline"][k]
        worst = min(worst, t / b)
        print(f"{k:12s}{t:15.1f}{b:16.1f}{t / b:8.2f}")
    print(f"\nworst ratio {worst:.2f} (target >= 0.90): {'OK' if worst >= 0.9 else 'BELOW TARGET'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
