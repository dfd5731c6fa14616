"""caption.py: one correct caption per image, resumable after a kill, reporting through Pipes."""

from __future__ import annotations

import json
import os
import re

from workload_helpers import caption_files, run_workload

from gpudoor_pipelines.transit import bucket as storage


def _path(uri: str) -> str:
    return uri.removeprefix("file://")


def test_one_correct_caption_per_image_and_manifest_last(caption_runs, shard):
    output = caption_runs["output"]
    shard_uri, truth = shard
    assert caption_runs["rerun"].returncode == 0, caption_runs["rerun"].stderr
    files = caption_files(output)
    assert len(files) == len(truth)
    hits = 0
    for uri in files:
        record = json.loads(storage.read_bytes(uri))
        assert set(record) == {"image_id", "image_uri", "caption", "model"}
        assert record["model"] == "color-shape-v1"
        assert record["image_uri"] == storage.join(shard_uri, "images", record["image_id"] + ".png")
        color, shape = truth[record["image_id"]]
        hits += record["caption"] == f"a {color} {shape}"
    assert hits / len(truth) >= 0.95

    manifest_uri = storage.join(output, storage.MANIFEST_NAME)
    manifest = json.loads(storage.read_bytes(manifest_uri))
    assert manifest == {"count": len(truth), "model": "color-shape-v1", "images": sorted(truth)}
    manifest_time = os.stat(_path(manifest_uri)).st_mtime_ns
    assert all(os.stat(_path(uri)).st_mtime_ns <= manifest_time for uri in files)


def test_killed_midway_then_rerun_skips_what_was_done(caption_runs, shard):
    done_before = caption_runs["done_before"]
    assert 10 <= done_before < len(shard[1])
    assert not caption_runs["had_manifest_before"]  # no manifest until every image is captioned
    stdout = caption_runs["rerun"].stdout
    assert int(re.search(r"skipping (\d+) images already captioned", stdout).group(1)) == done_before
    assert "captioned 25/" in stdout  # a progress line every REPORT_EVERY images


def test_rerun_reports_its_counts_through_pipes(caption_runs, shard):
    result = caption_runs["result"]
    assert result.success
    metadata = result.asset_materializations_for_node("caption")[0].metadata
    assert metadata["images_captioned"].value == len(shard[1]) - caption_runs["done_before"]
    assert metadata["images_skipped"].value == caption_runs["done_before"]
    assert metadata["images_total"].value == len(shard[1])
    assert metadata["images_per_second"].value > 0


def test_unknown_caption_model_exits_2_naming_the_setting(shard, bucket):
    output = storage.join(bucket, "captions", "bad")
    proc = run_workload("caption", SHARD_URI=shard[0], OUTPUT_URI=output, CAPTION_MODEL="gpt-9")
    assert proc.returncode == 2
    assert "CAPTION_MODEL" in proc.stderr and "color-shape-v1" in proc.stderr
    assert not caption_files(output)
