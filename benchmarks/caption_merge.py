#!/usr/bin/env python
"""Caption merge: the streaming merge of ``gpudoor_pipelines.data.captions`` at 10,000 to 1,000,000 captions,
against itself at a small size and against the approaches it replaces.

    python benchmarks/caption_merge.py [--captions 1000000] [--per-shard 100] [--old-captions 100000]
                                       [--json-captions 10000] [--workers 8] [--workdir DIR]

Generates, with pyarrow, what caption jobs leave in a local folder transit bucket (shards of
``--per-shard`` captions in one or two Parquet parts each, about 2% of rows without a caption, a
manifest per shard), one caption model per size so that each merge lists only its own shards. Then runs
every case in a fresh subprocess, so that each one's peak memory (``ru_maxrss``) is its own:

* product: ``merge_captions(bucket, model, shards, out_prefix)`` at 1%, 10% and 100% of ``--captions``;
* pandas: every part read with ``pd.read_parquet`` into one DataFrame, filtered, written with
  ``to_parquet`` and published: the obvious merge, at ``--old-captions``;
* json: one JSON object per caption, read one GET each, into a DataFrame, as the merge did before
  the caption jobs wrote Parquet parts, at ``--json-captions``.

Prints, per case, wall time, captions/s and peak RSS (and the part of it above the imports), then the
ratios that matter: the product at 100% against itself at 1% (time per caption, peak memory: both should
stay about flat) and the older approaches against the product at the same size. Absolute figures depend
on the machine; the ratios are the point.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

MiB = 1024 * 1024
COLORS = ("red", "green", "blue", "yellow", "purple", "orange")
SHAPES = ("circle", "square", "triangle")


def _model(kind: str, captions: int) -> str:
    return f"bench-{kind}-{captions}"


def _shards(captions: int, per_shard: int) -> list[str]:
    return [f"bench-{s:05d}" for s in range(-(-captions // per_shard))]


def _captions(start: int, count: int) -> list[str | None]:
    """Deterministic captions; every 50th image has none (the job could not caption it)."""
    return [None if i % 50 == 7 else f"a {COLORS[i % 6]} {SHAPES[(i // 7) % 3]}" for i in range(start, start + count)]


def generate_parts(root: Path, model: str, captions: int, per_shard: int) -> None:
    """What the caption jobs write: per shard, one part (even shards) or two (odd ones), then the manifest."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    ids = [f"img-{i:07d}" for i in range(captions)]
    text = pa.array(_captions(0, captions), pa.string())
    table = pa.table(
        {
            "image_uri": pa.array([f"s3://team-data/imgs/{i}.png" for i in ids], pa.string()),
            "image_id": pa.array(ids, pa.string()),
            "caption": text,
            "model": pa.array([model] * captions, pa.string()),
            "error": pc.if_else(pc.is_valid(text), pa.scalar(None, pa.string()), pa.scalar("cannot decode")),
        }
    )
    for s, shard in enumerate(_shards(captions, per_shard)):
        folder = root / "captions" / model / shard
        folder.mkdir(parents=True)
        start, count = s * per_shard, min(per_shard, captions - s * per_shard)
        cuts = [0, count] if s % 2 == 0 else [0, count * 3 // 5, count]
        names = []
        for p, (a, b) in enumerate(zip(cuts, cuts[1:], strict=False)):
            names.append(f"part-{p:05d}.parquet")
            pq.write_table(table.slice(start + a, b - a), folder / names[-1])
        manifest = {"shard": shard, "model": model, "count": count, "parts": names}
        (folder / "_manifest.json").write_text(json.dumps(manifest))


def generate_json(root: Path, model: str, captions: int, per_shard: int) -> None:
    """One JSON object per caption and a manifest per shard: what the caption jobs wrote before parts."""
    for s, shard in enumerate(_shards(captions, per_shard)):
        folder = root / "captions" / model / shard
        folder.mkdir(parents=True)
        start, count = s * per_shard, min(per_shard, captions - s * per_shard)
        for i, caption in enumerate(_captions(start, count), start):
            record = {"image_id": f"img-{i:07d}", "image_uri": f"s3://team-data/imgs/img-{i:07d}.png"}
            (folder / f"img-{i:07d}.json").write_text(json.dumps({**record, "caption": caption}))
        (folder / "_manifest.json").write_text(json.dumps({"shard": shard, "count": count}))


def generate(work: Path, sizes: list[int], args: argparse.Namespace) -> None:
    """Every case's input: parts for each size (the pandas cases read the product's), and JSON objects."""
    for captions in sizes:
        generate_parts(work, _model("product", captions), captions, args.per_shard)
    for captions in (args.old_captions // 10, args.old_captions):
        target = work / "captions" / _model("product", captions)
        (work / "captions" / _model("pandas", captions)).symlink_to(target)
    generate_json(work, _model("json", args.json_captions), args.json_captions, args.per_shard)


# ---- the cases, each run in its own process --------------------------------------------------------


def _merge_product(bucket, model: str, shards: list[str], workers: int) -> int:
    from gpudoor_pipelines.data.captions import merge_captions

    return merge_captions(bucket, model, shards, f"merged/{model}", workers=workers).rows


def _merge_pandas(bucket, model: str, shards: list[str], workers: int) -> int:
    """Read everything into one DataFrame, then write it: memory grows with the dataset."""
    import io

    import pandas as pd

    frames = []
    for shard in shards:
        prefix = f"captions/{model}/{shard}"
        for part in bucket.read_manifest(prefix)["parts"]:
            frame = pd.read_parquet(io.BytesIO(bucket.get_bytes(f"{prefix}/{part}")))
            frames.append(frame.assign(shard=shard))
    df = pd.concat(frames, ignore_index=True)
    df = df[df["caption"].notna()][["image_id", "image_uri", "caption", "shard"]]
    bucket.publish(f"merged/{model}", {"rows": len(df)}, files={"data.parquet": df.to_parquet(index=False)})
    return len(df)


def _merge_json(bucket, model: str, shards: list[str], workers: int) -> int:
    """One GET per caption into a list of dicts, then a DataFrame."""
    import pandas as pd

    from gpudoor_pipelines.transit.bucket import MANIFEST_NAME

    rows = []
    for shard in shards:
        for key in bucket.list_keys(f"captions/{model}/{shard}/"):
            if key.endswith(".json") and not key.endswith(MANIFEST_NAME):
                record = json.loads(bucket.get_bytes(key))
                if record["caption"] is not None:
                    rows.append({**record, "shard": shard})
    df = pd.DataFrame(rows).sort_values("image_id").reset_index(drop=True)
    bucket.publish(f"merged/{model}", {"rows": len(df)}, files={"data.parquet": df.to_parquet(index=False)})
    return len(df)


CASES = {"product": _merge_product, "pandas": _merge_pandas, "json": _merge_json}


def run_case(kind: str, root: str, captions: int, per_shard: int, workers: int) -> dict:
    """One merge in this process: wall time and peak RSS (all cases import the same modules first)."""
    import pandas  # noqa: F401
    import pyarrow.parquet  # noqa: F401

    from gpudoor_pipelines import captions as _  # noqa: F401
    from gpudoor_pipelines.transit.bucket import LocalTransitBucket

    bucket = LocalTransitBucket(root)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    t0 = time.perf_counter()
    rows = CASES[kind](bucket, _model(kind, captions), _shards(captions, per_shard), workers)
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"seconds": seconds, "rows": rows, "peak": peak, "base": base}


def measure(kind: str, root: Path, captions: int, args: argparse.Namespace) -> dict:
    """Median wall time and peak RSS of ``--repeat`` runs of a case, each in a fresh process."""
    cmd = [sys.executable, __file__, "--case", kind, "--root", str(root), "--captions", str(captions)]
    cmd += ["--per-shard", str(args.per_shard), "--workers", str(args.workers)]
    expected = sum(c is not None for c in _captions(0, captions))
    runs = []
    for _ in range(args.repeat):
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        runs.append(json.loads(out.strip().splitlines()[-1]))
        assert runs[-1]["rows"] == expected, f"{kind} at {captions}: {runs[-1]['rows']} rows, not {expected}"
    result = {key: statistics.median(r[key] for r in runs) for key in ("seconds", "peak", "base")}
    print(
        f"  {kind:8s} {captions:>9,d} captions  {result['seconds']:7.2f} s  "
        f"{captions / result['seconds']:>10,.0f} captions/s  peak RSS {result['peak'] / MiB:5.0f} MiB "
        f"({_above(result)} above the imports)",
        flush=True,
    )
    return result


def _above(result: dict) -> str:
    return f"{(result['peak'] - result['base']) / MiB:.0f} MiB"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--captions", type=int, default=1_000_000, help="captions of the biggest merge")
    ap.add_argument("--per-shard", type=int, default=100, help="captions per shard, default 100")
    ap.add_argument("--old-captions", type=int, default=100_000, help="biggest pandas merge (also 1/10)")
    ap.add_argument("--json-captions", type=int, default=10_000, help="one-JSON-per-caption merge")
    ap.add_argument("--workers", type=int, default=8, help="merge_captions' workers, default 8")
    ap.add_argument("--repeat", type=int, default=3, help="runs per case (the median counts), default 3")
    ap.add_argument("--workdir", default=None, help="where to generate the parts (default: $TMPDIR)")
    ap.add_argument("--case", choices=[*CASES, "generate"], help=argparse.SUPPRESS)
    ap.add_argument("--root", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    big, old = args.captions, args.old_captions
    sizes = sorted({big // 100, big // 10, big, old // 10, old, args.json_captions})
    if args.case == "generate":
        generate(Path(args.root), sizes, args)
        return 0
    if args.case:  # a child: one case, its figures as the last line
        print(json.dumps(run_case(args.case, args.root, args.captions, args.per_shard, args.workers)))
        return 0

    work = Path(tempfile.mkdtemp(prefix="caption-merge-bench-", dir=args.workdir))
    try:
        t0 = time.perf_counter()
        # in a child too: a child's ru_maxrss starts from its parent's RSS at the fork, so this process
        # must stay small
        argv = sys.argv[1:] if argv is None else argv
        subprocess.run([sys.executable, __file__, *argv, "--case", "generate", "--root", str(work)], check=True)
        print(
            f"generated {sum(sizes):,d} captions in parts and {args.json_captions:,d} as JSON objects "
            f"in {time.perf_counter() - t0:.0f} s ({work}); median of {args.repeat} runs per case:",
            flush=True,
        )
        product = {n: measure("product", work, n, args) for n in sizes}
        pandas = {n: measure("pandas", work, n, args) for n in (old // 10, old)}
        json_case = measure("json", work, args.json_captions, args)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    small, large = product[big // 100], product[big]
    time_ratio = (large["seconds"] / big) / (small["seconds"] / (big // 100))
    print(f"\nproduct at {big:,d} vs product at {big // 100:,d} captions (the baseline):")
    print(f"  time per caption {time_ratio:5.2f}x")
    print(
        f"  peak RSS         {large['peak'] / small['peak']:5.2f}x  ({_above(small)} -> {_above(large)} above the "
        "imports)"
    )
    small, large = pandas[old // 10], pandas[old]
    print(f"pandas at {old:,d} vs pandas at {old // 10:,d} captions:")
    print(
        f"  peak RSS         {large['peak'] / small['peak']:5.2f}x  ({_above(small)} -> {_above(large)} above the "
        "imports)"
    )
    for name, result, captions in (("pandas", pandas[old], old), ("json", json_case, args.json_captions)):
        ours = product[captions]
        print(f"{name} vs product, both at {captions:,d} captions:")
        print(f"  time             {result['seconds'] / ours['seconds']:5.2f}x")
        print(
            f"  peak RSS         {result['peak'] / ours['peak']:5.2f}x  ({_above(result)} vs {_above(ours)} above the "
            "imports)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
