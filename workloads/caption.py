"""Caption the shards of one job of a nightly batch: ``python -m workloads.caption``.

Environment:
    CAPTION_BATCH_URI: URI of the batch file, JSON ``{"window_end": UNIX seconds or null, "jobs": [...]}``;
        ``jobs[rank]`` is this job: ``{"shards": [{"shard", "shard_uri", "output_uri"}, ...],
        "pipes_env": {...}}``.
    SKYPILOT_JOB_RANK: which entry of ``jobs`` this job is (default 0).
    SKYPILOT_NUM_JOBS: when set, must equal the number of entries in ``jobs``.
    CAPTION_MODEL: captioner to use (default and only known model: ``color-shape-v1``).
    IMAGES_PER_PART: images per Parquet part file (default 256).
    WORKLOAD_THROTTLE_S: seconds to pause after each image (default 0); lets tests and demos
        interrupt a run midway.

A shard folder holds ``_manifest.json``, ``{"dataset", "shard", "count", "images": [image URI, ...],
"ids": [image id, ...]}`` (``ids`` in the order of ``images``; a shard registered before ids were recorded has
none, and its images' ids are their file stems).
Its captions go to ``output_uri`` as ``part-00000.parquet``, ``part-00001.parquet``, ... (columns
``image_uri``, ``image_id``, ``caption``, ``model``, ``error``), each part one object written whole; once
every image is in a part, ``_manifest.json`` ``{"shard", "model", "count", "captioned", "skipped",
"skipped_images", "parts"}`` is published, last: it is what says the shard is done.

Restarted (after a preemption, or the next night), a shard resumes from its parts: only images in no
part are captioned, into new parts after the existing ones. A kill loses at most the part in flight.
An image that cannot be decoded or captioned, or whose object is missing, is not an error: its row
has no caption and an ``error`` saying why, and it counts as skipped.

The job stops before starting a part once ``window_end`` has passed (the shard stays unfinished, the
remaining shards unstarted, the exit status 0). A shard whose manifest cannot be read, or whose output
cannot be written, fails alone: the job goes on with its other shards and exits 1 at the end.

Each job of a batch reports through its own Pipes channel (its entry's ``pipes_env``) with custom
messages, per part ``{"shard", "state": "progress", "done", "total"}`` and once per shard ``{"shard",
"state": "done" | "stopped" | "failed", "captioned", "skipped", "total", "parts", "seconds"}`` plus
``reason`` (stopped, failed) or ``skipped_images`` (done). Counts not known, for a shard never opened
or whose manifest could not be read, are null.
"""

from __future__ import annotations

import json
import os
import time
import traceback
from collections.abc import Callable
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from gpudoor_pipelines.transit.bucket import MANIFEST_NAME
from gpudoor_pipelines.transit.uris import bucket_for_uri, join, publish, read_bytes, write_bytes
from workloads.batch import read_batch_entry, require
from workloads.caption_parts import CaptionRow, next_part_index, part_bytes, part_name, read_done
from workloads.config import ConfigError, env_float, env_int, env_str, run_main
from workloads.reporting import Reporter, open_reporting, saved

KNOWN_MODELS = ("color-shape-v1",)
# The manifest keeps the first of the skipped images for a person to look at; messages keep fewer.
SKIPPED_IN_MANIFEST = 100
SKIPPED_IN_MESSAGE = 20
# Reads in flight: on S3 each image is a round trip, which dominates the time per image.
READ_THREADS = 16

CaptionFn = Callable[[bytes], tuple[str | None, str | None]]
"""PNG bytes -> (caption, None), or (None, why there is no caption)."""


class ShardError(Exception):
    """A shard cannot be captioned as given (its manifest is missing or unreadable)."""


def say(message: str) -> None:
    """A line for the job log (the launcher streams the job log into the Dagster run)."""
    print(message, flush=True)


@dataclass(frozen=True)
class ShardTask:
    """One shard of this job: where its images are listed and where its captions go."""

    shard: str
    shard_uri: str
    output_uri: str


@dataclass(frozen=True)
class Settings:
    """This job's settings, from the environment and its entry in the batch file."""

    model: str
    images_per_part: int
    throttle_s: float
    window_end: float | None
    rank: int
    num_jobs: int
    shards: list[ShardTask]
    pipes_env: dict[str, str]


def _shard_task(entry: Any, where: str) -> ShardTask:
    keys = ("shard", "shard_uri", "output_uri")
    require(
        isinstance(entry, dict) and all(isinstance(entry.get(k), str) and entry[k] for k in keys),
        f"{where} must be an object with the strings {', '.join(keys)}: {entry!r}",
    )
    for key in ("shard_uri", "output_uri"):
        try:
            bucket_for_uri(entry[key])  # a bad scheme fails the job now, not each shard later
        except ValueError as exc:
            raise ConfigError(f"{where}.{key}: {exc}") from None
    return ShardTask(entry["shard"], entry["shard_uri"], entry["output_uri"])


def load_settings() -> Settings:
    """Read and check this job's settings; fetches the batch file.

    Raises:
        ConfigError: a setting or the batch file is unusable; the message says which and why.
    """
    model = env_str("CAPTION_MODEL", KNOWN_MODELS[0])
    require(
        model in KNOWN_MODELS,
        f"CAPTION_MODEL={model!r} is not a known caption model; known: {', '.join(KNOWN_MODELS)}",
    )
    images_per_part = env_int("IMAGES_PER_PART", 256)
    require(images_per_part >= 1, f"IMAGES_PER_PART must be at least 1, got {images_per_part}")
    throttle_s = env_float("WORKLOAD_THROTTLE_S", 0.0)
    require(throttle_s >= 0, f"WORKLOAD_THROTTLE_S must not be negative, got {throttle_s}")
    read = read_batch_entry("CAPTION_BATCH_URI")
    window_end = read.batch.get("window_end")
    require(
        window_end is None or (isinstance(window_end, int | float) and not isinstance(window_end, bool)),
        f"window_end in {read.uri} must be UNIX seconds or null, got {window_end!r}",
    )
    shards = read.entry.get("shards")
    require(isinstance(shards, list), f"{read.where} has no list of shards")
    return Settings(
        model=model,
        images_per_part=images_per_part,
        throttle_s=throttle_s,
        window_end=None if window_end is None else float(window_end),
        rank=read.rank,
        num_jobs=read.num_jobs,
        shards=[_shard_task(s, f"{read.where}: shards[{i}]") for i, s in enumerate(shards)],
        pipes_env=read.pipes_env,
    )


def load_captioner(model: str) -> CaptionFn:
    """Load the captioner (``model`` is one of KNOWN_MODELS, the only one being ``color-shape-v1``)."""
    # Imported only now: torch takes seconds to load, and a job with nothing to caption needs none of it.
    from PIL import UnidentifiedImageError

    from gpudoor_pipelines.data.synthetic import caption_text
    from workloads.captioner import ColorShapeCaptioner
    from workloads.model import decode_pixels

    captioner = ColorShapeCaptioner()
    say(f"captioning with {model} on {captioner.device}")

    def caption(png: bytes) -> tuple[str | None, str | None]:
        try:
            pixels = decode_pixels(png)
        except Exception as exc:  # PIL reports damaged files with many exception types
            # PIL's message for an unknown format names a Python object: useless in a report.
            detail = "no known image format" if isinstance(exc, UnidentifiedImageError) else str(exc)
            return None, f"not a decodable image: {detail or type(exc).__name__}"
        try:
            return caption_text(*captioner.describe(pixels)), None
        # Only a ValueError (nothing to caption: a blank image) is the image's fault. Anything else,
        # a GPU failure say, fails the shard, so its images are retried rather than skipped for good.
        except ValueError as exc:
            return None, f"not captionable: {exc}"

    return caption


def _read_image(uri: str) -> tuple[bytes | None, str | None]:
    """The image's bytes, or (None, why) when there is no object to read.

    Other errors (credentials, the network after retries) are raised: they fail the shard, so its
    images are retried rather than skipped for good.
    """
    try:
        return read_bytes(uri), None
    except FileNotFoundError:
        return None, f"cannot read: no object at {uri}"
    except ValueError as exc:  # not a URI the storage layer knows
        return None, f"cannot read: {exc}"


class Job:
    """What the shards of this job share: settings, the read pool, the reporter, the captioner."""

    def __init__(self, settings: Settings, reporter: Reporter, pool: Executor) -> None:
        self.settings = settings
        self.reporter = reporter
        self.pool = pool
        self._caption: CaptionFn | None = None

    def window_closed(self) -> bool:
        """Whether the night's window has ended: then no new part may start."""
        end = self.settings.window_end
        return end is not None and time.time() >= end

    def window_reason(self) -> str:
        """Why the job stopped, for the report."""
        end = datetime.fromtimestamp(self.settings.window_end or 0, UTC).isoformat(timespec="seconds")
        return f"the window closed at {end}"

    def captioner(self) -> CaptionFn:
        """The captioner, loaded on first use: a job with nothing left to caption never loads it."""
        if self._caption is None:
            self._caption = load_captioner(self.settings.model)
        return self._caption

    def caption_images(self, uris: list[str], ids: dict[str, str]) -> list[CaptionRow]:
        """Caption ``uris`` in order, reading ahead in the pool while the captioner works; ``ids`` gives
        each image's id (an image missing from it: its file stem)."""
        caption_png = self.captioner()
        rows = []
        for uri, (png, error) in zip(uris, self.pool.map(_read_image, uris), strict=True):
            caption = None
            if png is not None:
                caption, error = caption_png(png)
            rows.append(CaptionRow(uri, caption, self.settings.model, error, ids.get(uri)))
            if self.settings.throttle_s:
                time.sleep(self.settings.throttle_s)
        return rows


@dataclass
class ShardProgress:
    """A shard's counts, all parts together (earlier runs' too), and its final report."""

    task: ShardTask
    started: float = field(default_factory=time.monotonic)
    total: int | None = None
    captioned: int | None = None
    skipped: int | None = None
    skipped_images: list[dict[str, str]] = field(default_factory=list)
    parts: list[str] | None = None
    done_now: int = 0  # images put in a part by this run, and the seconds it took: the rate
    busy_s: float = 0.0

    @property
    def done(self) -> int:
        """Images in some part, captioned or skipped."""
        return (self.captioned or 0) + (self.skipped or 0)

    def add_part(self, name: str, rows: list[CaptionRow], seconds: float) -> None:
        """Count a part just written in ``seconds``."""
        self.busy_s += seconds
        self.parts = [*(self.parts or []), name]
        self.captioned = (self.captioned or 0) + sum(r.error is None for r in rows)
        self.skipped = (self.skipped or 0) + sum(r.error is not None for r in rows)
        self.skipped_images += [{"uri": r.image_uri, "reason": r.error} for r in rows if r.error is not None]
        self.done_now += len(rows)

    def final(self, state: str, reason: str | None = None) -> dict[str, Any]:
        """The shard's final report (a Pipes custom message)."""
        message: dict[str, Any] = {
            "shard": self.task.shard,
            "state": state,
            "captioned": self.captioned,
            "skipped": self.skipped,
            "total": self.total,
            "parts": None if self.parts is None else len(self.parts),
            "seconds": round(time.monotonic() - self.started, 3),
        }
        if reason is not None:
            message["reason"] = reason
        if state == "done":
            message["skipped_images"] = self.skipped_images[:SKIPPED_IN_MESSAGE]
        return message


def read_shard_images(shard_uri: str) -> tuple[list[str], dict[str, str]]:
    """The image URIs listed by a shard's manifest, each once, in order, and their ids (URI -> id; empty for
    a shard registered before ids were recorded).

    Raises:
        ShardError: the manifest is missing, not JSON, does not list images, or its ids do not match them.
    """
    uri = join(shard_uri, MANIFEST_NAME)
    try:
        manifest = json.loads(read_bytes(uri))
    except FileNotFoundError:
        raise ShardError(f"no shard manifest at {uri}") from None
    except ValueError as exc:
        raise ShardError(f"the shard manifest {uri} is not JSON: {exc}") from None
    images = manifest.get("images") if isinstance(manifest, dict) else None
    if not isinstance(images, list) or not all(isinstance(i, str) for i in images):
        raise ShardError(f"the shard manifest {uri} has no list of image URIs")
    count = manifest.get("count")
    if count is not None and count != len(images):
        raise ShardError(f"the shard manifest {uri} says count={count} but lists {len(images)} images")
    ids = manifest.get("ids")
    if ids is not None and (
        not isinstance(ids, list) or len(ids) != len(images) or not all(isinstance(i, str) and i for i in ids)
    ):
        raise ShardError(f"the shard manifest {uri} has {len(images)} images but not one id for each")
    # An image listed twice is still captioned once.
    return list(dict.fromkeys(images)), dict(zip(images, ids, strict=True)) if ids else {}


def _published(output_uri: str) -> dict[str, Any] | None:
    """The captions manifest of a finished shard, or None while the shard is not finished."""
    uri = join(output_uri, MANIFEST_NAME)
    try:
        manifest = json.loads(read_bytes(uri))
    except FileNotFoundError:
        return None
    except ValueError as exc:
        raise ShardError(f"the captions manifest {uri} is not JSON: {exc}") from None
    if not isinstance(manifest, dict):
        raise ShardError(f"the captions manifest {uri} is not a JSON object")
    return manifest


def _caption_shard(job: Job, progress: ShardProgress) -> tuple[str, str | None]:
    """Caption what is left of a shard, part by part; returns (final state, reason)."""
    task = progress.task
    published = _published(task.output_uri)
    if published is not None:
        progress.total = published.get("count")
        progress.captioned = published.get("captioned")
        progress.skipped = published.get("skipped")
        progress.skipped_images = list(published.get("skipped_images") or [])
        progress.parts = list(published.get("parts") or [])
        say(f"shard {task.shard}: already done")
        return "done", None

    images, ids = read_shard_images(task.shard_uri)
    progress.total = len(images)
    done = read_done(task.output_uri, job.pool)
    progress.parts = done.parts
    listed = set(images)  # parts may hold images the shard no longer lists: those do not count
    progress.captioned = len(done.captioned & listed)
    progress.skipped_images = [{"uri": uri, "reason": reason} for uri, reason in done.skipped.items() if uri in listed]
    progress.skipped = len(progress.skipped_images)
    todo = [uri for uri in images if uri not in done.uris]
    if done.parts:
        say(f"shard {task.shard}: resuming, {progress.done}/{len(images)} images in {len(done.parts)} parts")

    index = next_part_index(done.parts)
    step = job.settings.images_per_part
    for first in range(0, len(todo), step):
        if job.window_closed():  # checked between parts: a part once started is finished
            return "stopped", job.window_reason()
        job.captioner()  # loading it (seconds, once) is no part of the rate
        part_started = time.monotonic()
        rows = job.caption_images(todo[first : first + step], ids)
        name = part_name(index)
        write_bytes(join(task.output_uri, name), part_bytes(rows))
        index += 1
        progress.add_part(name, rows, time.monotonic() - part_started)
        job.reporter.report_custom_message(
            saved("part", shard=task.shard, state="progress", done=progress.done, total=len(images))
        )
        rate = progress.done_now / max(progress.busy_s, 1e-9)
        say(f"shard {task.shard}: captioned {progress.done}/{len(images)} ({rate:.1f} images/s)")

    publish(
        task.output_uri,
        {
            "shard": task.shard,
            "model": job.settings.model,
            "count": len(images),
            "captioned": progress.captioned,
            "skipped": progress.skipped,
            "skipped_images": progress.skipped_images[:SKIPPED_IN_MANIFEST],
            "parts": progress.parts,
        },
    )  # last: every image is in a part
    return "done", None


def caption_shard(job: Job, task: ShardTask) -> dict[str, Any]:
    """Caption one shard and return its final report; a failure is reported, never raised."""
    progress = ShardProgress(task)
    try:
        state, reason = _caption_shard(job, progress)
    except ShardError as exc:
        state, reason = "failed", str(exc)
    except Exception as exc:  # one broken shard must not cost the job its other shards
        traceback.print_exc()
        state, reason = "failed", f"{type(exc).__name__}: {exc}"
    if state == "done":
        say(f"shard {task.shard}: done, {progress.captioned} captioned, {progress.skipped} skipped")
    else:
        say(f"shard {task.shard}: {state}, {reason}")
    return progress.final(state, reason)


def main() -> int:
    """Caption this job's shards in order, until done or the window closes."""
    settings = load_settings()
    # Each job of a batch has its own Pipes channel; open_reporting reads it from the environment.
    os.environ.update(settings.pipes_env)
    with open_reporting() as reporter, ThreadPoolExecutor(READ_THREADS) as pool:
        job = Job(settings, reporter, pool)
        say(
            f"job {settings.rank + 1}/{settings.num_jobs}: {len(settings.shards)} shards, "
            f"{settings.images_per_part} images per part"
        )
        states: list[str] = []
        for task in settings.shards:
            if job.window_closed():
                report = ShardProgress(task).final("stopped", f"{job.window_reason()} before it started")
            else:
                report = caption_shard(job, task)
            # A shard done is saved: its manifest is in the bucket.
            reporter.report_custom_message(saved("shard", **report) if report["state"] == "done" else report)
            states.append(report["state"])
        counts = ", ".join(f"{states.count(s)} {s}" for s in ("done", "stopped", "failed"))
        say(f"job {settings.rank + 1}/{settings.num_jobs}: {counts}")
        if "stopped" in states:
            say(f"{job.window_reason()}: the next run resumes the stopped shards")
        return 1 if "failed" in states else 0


if __name__ == "__main__":
    run_main(main)
