"""Caption one shard of images: ``python -m workloads.caption``.

Environment:
    SHARD_URI: prefix holding ``images/<image_id>.png``.
    OUTPUT_URI: prefix for the captions, one ``<image_id>.json`` per image plus ``_manifest.json``.
    CAPTION_MODEL: captioner to use (default and only known model: ``color-shape-v1``).
    REPORT_EVERY: images per batch, and a progress line after each batch (default 8).
    WORKLOAD_THROTTLE_S: seconds to pause after each image (default 0); lets tests and demos
        interrupt a run midway.

Restarted (after a preemption, say), it skips the images already captioned in OUTPUT_URI. The
manifest ``{"count", "model", "images"}`` is written last, once every image has a caption.
"""

from __future__ import annotations

import json
import posixpath
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from gpudoor_pipelines.transit.bucket import MANIFEST_NAME, join, list_uris, publish, read_bytes, write_bytes
from workloads.config import ConfigError, env_float, env_int, env_str, run_main
from workloads.reporting import open_reporting

KNOWN_MODELS = ("color-shape-v1",)


def _stem(uri: str) -> str:
    return posixpath.splitext(posixpath.basename(uri))[0]


def main() -> int:
    """Caption every image of the shard not captioned yet, then write the manifest."""
    model_name = env_str("CAPTION_MODEL", KNOWN_MODELS[0])
    if model_name not in KNOWN_MODELS:
        raise ConfigError(
            f"CAPTION_MODEL={model_name!r} is not a known caption model; known: {', '.join(KNOWN_MODELS)}"
        )
    shard_uri = env_str("SHARD_URI")
    output_uri = env_str("OUTPUT_URI")
    report_every = max(1, env_int("REPORT_EVERY", 8))
    throttle_s = env_float("WORKLOAD_THROTTLE_S", 0.0)

    # Opened first so that a failure anywhere below reaches Dagster, not just the job log.
    with open_reporting() as reporter:

        def say(message: str) -> None:
            """A line for the job log (the launcher streams the job log into the Dagster run)."""
            print(message, flush=True)

        images = {_stem(u): u for u in list_uris(join(shard_uri, "images")) if u.endswith(".png")}
        if not images:
            print(f"no images under {join(shard_uri, 'images')}", file=sys.stderr, flush=True)
            return 1
        done = {
            _stem(u)
            for u in list_uris(output_uri)
            if u.endswith(".json") and posixpath.basename(u) != MANIFEST_NAME
        }
        todo = sorted(set(images) - done)
        skipped = len(images) - len(todo)
        # Imported only now: torch takes seconds to load, and bad settings should fail before that.
        from workloads.captioner import ColorShapeCaptioner

        captioner = ColorShapeCaptioner()
        say(f"captioning {len(todo)} of {len(images)} images with {model_name} on {captioner.device}")
        if skipped:
            say(f"skipping {skipped} images already captioned")

        def write(record: dict[str, str]) -> None:
            write_bytes(join(output_uri, f"{record['image_id']}.json"), json.dumps(record).encode())

        started = time.monotonic()
        # Reads and writes overlap in a thread pool (on S3 each is a round trip, which dominates);
        # every caption is still its own object, so a kill loses at most the batch in flight.
        with ThreadPoolExecutor(max_workers=8) as pool:
            for first in range(0, len(todo), report_every):
                batch = todo[first : first + report_every]
                records = []
                for image_id, png in zip(
                    batch, pool.map(read_bytes, [images[i] for i in batch]), strict=True
                ):
                    records.append(
                        {
                            "image_id": image_id,
                            "image_uri": images[image_id],
                            "caption": captioner.caption(png),
                            "model": model_name,
                        }
                    )
                    if throttle_s:
                        time.sleep(throttle_s)
                list(pool.map(write, records))
                done_now = first + len(batch)
                rate = done_now / max(time.monotonic() - started, 1e-9)
                say(f"captioned {done_now}/{len(todo)} ({rate:.1f} images/s)")
        elapsed = max(time.monotonic() - started, 1e-9)

        manifest = {"count": len(images), "model": model_name, "images": sorted(images)}
        publish(output_uri, manifest)  # last: the captions are all written
        say(f"done: {len(todo)} captioned, {skipped} skipped, manifest written")
        reporter.report_asset_materialization(
            metadata={
                "images_captioned": len(todo),
                "images_skipped": skipped,
                "images_total": len(images),
                "images_per_second": round(len(todo) / elapsed, 2),
            }
        )
        return 0


if __name__ == "__main__":
    run_main(main)
