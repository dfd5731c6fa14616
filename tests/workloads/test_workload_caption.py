"""caption.py: batches of shards captioned into Parquet parts, resumable, bounded by a window."""

from __future__ import annotations

import io
import math
import os
import time
from pathlib import Path

import pandas as pd
import pytest
from PIL import Image
from workload_helpers import (
    KILL_PART_SIZE,
    PATIENCE_S,
    custom_messages,
    file_pipes_env,
    part_uris,
    publish_images,
    publish_shard,
    read_manifest,
    read_parts,
    run_workload,
    shard_entry,
    start_workload,
    write_batch,
)

from gpudoor_pipelines.data.synthetic import generate_image
from gpudoor_pipelines.transit import uris as storage
from gpudoor_pipelines.transit.bucket import MANIFEST_NAME

PART_COLUMNS = ["image_uri", "image_id", "caption", "model", "error"]


def _mtime(uri: str) -> int:
    """When the object at a file:// URI was last written."""
    return os.stat(uri.removeprefix("file://")).st_mtime_ns


def _finals(messages: list[dict]) -> dict[str, dict]:
    """The final report of each shard, by shard name."""
    return {m["shard"]: m for m in messages if m["state"] != "progress"}


@pytest.fixture(scope="module")
def night(bucket: str, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One job with two shards: a clean one, and one with damaged and missing images.

    Returns:
        {"clean"/"damaged": (shard URI, truth, output URI), "damaged_uris": how the reason for each
        damaged image starts, "missing": the URI with no object, "pale": a pale image (captioned), "proc": the
        finished job,
        "messages": its Pipes custom messages}.
    """
    root = storage.join(bucket, "night")
    # The clean shard's images have the same file names in two folders; its manifest gives their ids (their
    # paths below the source). The damaged shard's gives none, as one registered before ids were recorded.
    clean_root = storage.join(root, "images", "clean")
    clean_truth = {
        **publish_images(storage.join(clean_root, "a"), range(5)),
        **publish_images(storage.join(clean_root, "b", "a"), range(5)),
    }
    clean = publish_shard(
        storage.join(root, "shards", "clean"), list(clean_truth), [u[len(clean_root) + 1 :] for u in clean_truth]
    )

    images = storage.join(root, "images", "damaged")
    damaged_truth = publish_images(images, range(10, 14))
    png = generate_image(15)[0]
    blank = io.BytesIO()
    Image.new("RGB", (32, 32), "white").save(blank, format="PNG")
    # A pale image (no pixel far from white, none white either) is not blank: it is captioned.
    pale = io.BytesIO()
    Image.new("RGB", (32, 32), (235, 252, 195)).save(pale, format="PNG")
    pale_uri = storage.join(images, "pale.png")
    storage.write_bytes(pale_uri, pale.getvalue())
    damaged = {
        storage.join(images, "truncated.png"): (png[: len(png) // 2], "not a decodable image"),
        storage.join(images, "empty.png"): (b"", "not a decodable image"),
        storage.join(images, "text.png"): (b"a caption, not an image\n", "not a decodable image"),
        storage.join(images, "blank.png"): (
            blank.getvalue(),
            "not captionable: blank image: every pixel is within 12 of white (R+G+B below 255 each; the farthest is 0)",
        ),
    }
    for uri, (data, _) in damaged.items():
        storage.write_bytes(uri, data)
    missing = storage.join(images, "missing.png")
    listed = [*list(damaged_truth)[:2], *damaged, missing, pale_uri, *list(damaged_truth)[2:]]
    damaged_shard = publish_shard(storage.join(root, "shards", "damaged"), listed)

    outputs = {name: storage.join(root, "captions", name) for name in ("clean", "damaged")}
    messages = tmp_path_factory.mktemp("night") / "messages.jsonl"
    batch = write_batch(
        storage.join(root, "batch.json"),
        [[shard_entry(clean, outputs["clean"]), shard_entry(damaged_shard, outputs["damaged"])]],
        pipes_envs=[file_pipes_env(messages)],
    )
    proc = run_workload("caption", CAPTION_BATCH_URI=batch, IMAGES_PER_PART="4")
    return {
        "clean": (clean, clean_truth, outputs["clean"]),
        "damaged": (damaged_shard, damaged_truth, outputs["damaged"]),
        "damaged_uris": {**{u: r for u, (_, r) in damaged.items()}, missing: "cannot read"},
        "missing": missing,
        "pale": pale_uri,
        "proc": proc,
        "messages": custom_messages(messages),
    }


def test_each_shard_is_written_as_parts_then_a_manifest(night):
    proc = night["proc"]
    assert proc.returncode == 0, proc.stderr
    for name in ("clean", "damaged"):
        _, _, output = night[name]
        listed = 10  # images each shard lists; 4 per part
        parts = part_uris(output)
        assert len(parts) == math.ceil(listed / 4)
        # One object per part plus the manifest: never one object per image.
        assert len(storage.list_uris(output)) == len(parts) + 1
        rows = read_parts(output)
        assert list(rows.columns[:-1]) == PART_COLUMNS
        assert len(rows) == listed and rows["image_uri"].is_unique
        assert (rows.groupby("part").size() <= 4).all()
        manifest = read_manifest(output)
        assert manifest["shard"] == name and manifest["count"] == listed
        assert manifest["parts"] == [uri.rsplit("/", 1)[-1] for uri in parts]
        assert manifest["model"] == "color-shape-v1"
        # The manifest is written last.
        manifest_mtime = _mtime(storage.join(output, MANIFEST_NAME))
        assert all(_mtime(uri) <= manifest_mtime for uri in parts)
    assert "shard clean: done, 10 captioned, 0 skipped" in proc.stdout
    assert "shard damaged: done, 5 captioned, 5 skipped" in proc.stdout


def test_captions_match_the_pictures(night):
    for name in ("clean", "damaged"):
        _, truth, output = night[name]
        rows = read_parts(output).set_index("image_uri")
        for uri, caption in truth.items():
            assert rows.loc[uri, "caption"] == caption
            if name == "clean":  # the id the shard gives: unique, though two images share a file name
                assert rows.loc[uri, "image_id"] == uri.split("/images/clean/", 1)[1]
            else:  # a shard without ids: the file stem, as before ids were recorded
                assert rows.loc[uri, "image_id"] == uri.rsplit("/", 1)[-1].removesuffix(".png")
            assert pd.isna(rows.loc[uri, "error"])
        assert rows["image_id"].is_unique


def test_damaged_and_missing_images_are_skipped_with_a_reason(night):
    _, _, output = night["damaged"]
    rows = read_parts(output).set_index("image_uri")
    for uri, reason in night["damaged_uris"].items():
        assert pd.isna(rows.loc[uri, "caption"])
        assert rows.loc[uri, "error"].startswith(reason), rows.loc[uri, "error"]
    assert rows.loc[night["pale"], "caption"] and pd.isna(rows.loc[night["pale"], "error"])  # pale, not blank
    manifest = read_manifest(output)
    assert (manifest["captioned"], manifest["skipped"]) == (5, 5)
    skipped = {s["uri"]: s["reason"] for s in manifest["skipped_images"]}
    assert skipped.keys() == night["damaged_uris"].keys()
    assert skipped[night["missing"]] == f"cannot read: no object at {night['missing']}"


def test_progress_and_results_go_out_as_pipes_messages(night):
    messages = night["messages"]
    progress = [m for m in messages if m["state"] == "progress" and m["shard"] == "clean"]
    assert [(m["done"], m["total"]) for m in progress] == [(4, 10), (8, 10), (10, 10)]
    finals = _finals(messages)
    assert finals.keys() == {"clean", "damaged"}
    damaged = finals["damaged"]
    assert damaged["state"] == "done"
    assert (damaged["captioned"], damaged["skipped"], damaged["total"], damaged["parts"]) == (5, 5, 10, 3)
    assert damaged["seconds"] > 0
    assert {s["uri"] for s in damaged["skipped_images"]} == night["damaged_uris"].keys()
    assert finals["clean"]["skipped_images"] == []


def test_a_finished_shard_is_not_captioned_again(night, bucket):
    clean, _, output = night["clean"]
    before = {uri: _mtime(uri) for uri in storage.list_uris(output)}
    batch = write_batch(storage.join(bucket, "night", "again.json"), [[shard_entry(clean, output)]])
    proc = run_workload("caption", CAPTION_BATCH_URI=batch, IMAGES_PER_PART="4")
    assert proc.returncode == 0, proc.stderr
    assert "shard clean: already done" in proc.stdout
    assert "captioning with" not in proc.stdout  # the captioner is not even loaded
    assert {uri: _mtime(uri) for uri in storage.list_uris(output)} == before


@pytest.fixture(scope="module")
def three_jobs(bucket: str, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A batch of three jobs run at once; the last job's first shard has no manifest.

    Returns:
        {"shards_per_job": shard names by rank, "truth": true captions by shard, "entries": batch
        entries by shard, "codes": exit codes by rank, "logs": logs by rank, "messages": rank 2's
        Pipes custom messages}.
    """
    root = storage.join(bucket, "three-jobs")
    logs = tmp_path_factory.mktemp("three-jobs")
    truth, entries = {}, {}
    for i in range(5):
        name = f"shard-{i}"
        truth[name] = publish_images(storage.join(root, "images", name), range(200 + 3 * i, 203 + 3 * i))
        shard = publish_shard(storage.join(root, "shards", name), list(truth[name]))
        entries[name] = shard_entry(shard, storage.join(root, "captions", name))
    gone = storage.join(root, "shards", "gone")  # never published
    entries["gone"] = shard_entry(gone, storage.join(root, "captions", "gone"))
    shards_per_job = [["shard-0", "shard-3"], ["shard-1", "shard-4"], ["gone", "shard-2"]]
    batch = write_batch(
        storage.join(root, "batch.json"),
        [[entries[n] for n in names] for names in shards_per_job],
        pipes_envs=[{}, {}, file_pipes_env(logs / "messages.jsonl")],
    )
    procs = [
        start_workload(
            "caption",
            logs / f"rank{rank}.log",
            CAPTION_BATCH_URI=batch,
            SKYPILOT_JOB_RANK=str(rank),
            SKYPILOT_NUM_JOBS="3",
        )
        for rank in range(3)
    ]
    return {
        "shards_per_job": shards_per_job,
        "truth": truth,
        "entries": entries,
        "codes": [proc.wait(timeout=PATIENCE_S) for proc in procs],
        "logs": [(logs / f"rank{rank}.log").read_text() for rank in range(3)],
        "messages": custom_messages(logs / "messages.jsonl"),
    }


def test_each_job_of_a_batch_captions_only_its_own_shards(three_jobs):
    assert three_jobs["codes"][:2] == [0, 0], three_jobs["logs"]
    for rank, names in enumerate(three_jobs["shards_per_job"]):
        log = three_jobs["logs"][rank]
        assert f"job {rank + 1}/3" in log
        done_here = {name for name in three_jobs["entries"] if f"shard {name}: done" in log}
        assert done_here == set(names) - {"gone"}, log
    for name, truth in three_jobs["truth"].items():
        output = three_jobs["entries"][name]["output_uri"]
        rows = read_parts(output)
        assert dict(zip(rows["image_uri"], rows["caption"], strict=True)) == truth
        assert read_manifest(output)["captioned"] == 3


def test_a_shard_without_manifest_fails_alone(three_jobs):
    assert three_jobs["codes"][2] == 1, three_jobs["logs"][2]
    log = three_jobs["logs"][2]
    assert "shard gone: failed, no shard manifest at" in log
    assert "shard shard-2: done, 3 captioned, 0 skipped" in log  # the job went on
    assert not storage.list_uris(three_jobs["entries"]["gone"]["output_uri"])
    finals = _finals(three_jobs["messages"])
    assert finals["gone"]["state"] == "failed" and "no shard manifest" in finals["gone"]["reason"]
    assert finals["shard-2"]["state"] == "done"


def test_killed_job_resumes_without_touching_or_repeating_parts(caption_runs, shard):
    shard_uri, truth = shard
    before = caption_runs["parts_before"]
    assert before and not caption_runs["had_manifest_before"], caption_runs["first_log"]
    assert len(before) < math.ceil(len(truth) / KILL_PART_SIZE)  # killed midway
    rerun = caption_runs["reruns"][0]
    assert rerun.returncode == 0, rerun.stderr
    done_before = KILL_PART_SIZE * len(before)
    assert f"resuming, {done_before}/{len(truth)} images in {len(before)} parts" in rerun.stdout

    output = caption_runs["output"]
    after = {uri.rsplit("/", 1)[-1]: uri for uri in part_uris(output)}
    for name, (data, mtime) in before.items():  # the killed job's parts are kept as they were
        assert storage.read_bytes(after[name]) == data
        assert _mtime(after[name]) == mtime
    rows = read_parts(output)
    assert rows["image_uri"].is_unique  # no image in two parts
    assert dict(zip(rows["image_uri"], rows["caption"], strict=True)) == truth  # none lost
    new_parts = sorted(after.keys() - before.keys())
    assert len(new_parts) == math.ceil((len(truth) - done_before) / KILL_PART_SIZE)
    assert max(before) < min(new_parts)  # numbered after the parts already there
    manifest = read_manifest(output)
    assert manifest["count"] == manifest["captioned"] == len(truth)
    assert manifest["parts"] == sorted(after)


def test_each_job_of_a_batch_reports_through_its_own_pipes_channel(caption_runs, shard):
    result = caption_runs["result"]
    assert result.success
    finals = _finals(caption_runs["messages"])
    assert finals.keys() == {"shard-0000", "shard-0001"}  # one from each job
    assert finals["shard-0000"]["state"] == finals["shard-0001"]["state"] == "done"
    assert finals["shard-0000"]["captioned"] == len(shard[1])
    assert finals["shard-0001"]["total"] == 5
    progress = [m for m in caption_runs["messages"] if m["state"] == "progress"]
    assert {m["shard"] for m in progress} == {"shard-0000", "shard-0001"}
    done = [m["done"] for m in progress if m["shard"] == "shard-0000"]
    assert done == sorted(done) and done[-1] == len(shard[1])  # counting from the parts already there
    assert done[0] > KILL_PART_SIZE
    other_shard, other_truth, other_output = caption_runs["other"]
    rows = read_parts(other_output)
    assert dict(zip(rows["image_uri"], rows["caption"], strict=True)) == other_truth
    # Many jobs share one asset step: the jobs report progress, never a materialization.
    metadata = result.asset_materializations_for_node("caption")[0].metadata
    assert not {"images_captioned", "captioned"} & metadata.keys()


def _window_batch(bucket: str, name: str, count: int, window_end: float, messages: Path) -> tuple[str, list]:
    root = storage.join(bucket, name)
    truth = publish_images(storage.join(root, "images"), range(300, 300 + count))
    entries = [
        shard_entry(
            publish_shard(storage.join(root, "shards", shard), list(truth)),
            storage.join(root, "captions", shard),
        )
        for shard in ("first", "second")
    ]
    batch = write_batch(
        storage.join(root, "batch.json"),
        [entries],
        window_end=window_end,
        pipes_envs=[file_pipes_env(messages)],
    )
    return batch, entries


def test_a_closed_window_starts_nothing(bucket, tmp_path):
    batch, entries = _window_batch(bucket, "window-past", 3, time.time() - 60, tmp_path / "messages.jsonl")
    proc = run_workload("caption", CAPTION_BATCH_URI=batch)
    assert proc.returncode == 0, proc.stderr
    for entry in entries:
        assert not storage.list_uris(entry["output_uri"])
    finals = _finals(custom_messages(tmp_path / "messages.jsonl"))
    assert [f["state"] for f in finals.values()] == ["stopped", "stopped"]
    assert "window closed" in finals["first"]["reason"]
    assert "0 done, 2 stopped, 0 failed" in proc.stdout
    assert "captioning with" not in proc.stdout  # the captioner is not even loaded


def test_a_window_closing_midway_lets_the_running_part_finish(bucket, tmp_path):
    # The window must close while the first part runs: the job checks it before the part, well within
    # window_s of starting, and the part (loading torch, then three images of window_s / 3 each) ends
    # after it. Should a loaded machine reach the first part only after the window, a longer one is tried.
    for attempt, window_s in enumerate((2.0, 5.0, 10.0)):
        messages = tmp_path / f"messages-{attempt}.jsonl"
        batch, entries = _window_batch(bucket, f"window-mid-{attempt}", 6, time.time() + window_s, messages)
        proc = run_workload(
            "caption", CAPTION_BATCH_URI=batch, IMAGES_PER_PART="3", WORKLOAD_THROTTLE_S=str(window_s / 3)
        )
        assert proc.returncode == 0, proc.stderr
        if part_uris(entries[0]["output_uri"]):
            break
    first, second = (entry["output_uri"] for entry in entries)
    assert len(part_uris(first)) == 1 and len(read_parts(first)) == 3  # the part finished...
    assert read_manifest(first) is None  # ...and no other started
    assert not storage.list_uris(second)
    finals = _finals(custom_messages(messages))
    assert finals["first"]["state"] == "stopped" and finals["first"]["captioned"] == 3
    assert finals["second"]["state"] == "stopped"
    assert "shard first: stopped, the window closed" in proc.stdout


@pytest.mark.parametrize(
    ("env", "says"),
    [
        (
            {"CAPTION_MODEL": "gpt-9"},
            "CAPTION_MODEL='gpt-9' is not a known caption model; known: color-shape-v1",
        ),
        ({"SKYPILOT_JOB_RANK": "2"}, "SKYPILOT_JOB_RANK=2 is out of range"),
        ({"SKYPILOT_NUM_JOBS": "3"}, "SKYPILOT_NUM_JOBS=3 but the batch file"),
    ],
)
def test_bad_settings_exit_2_naming_the_setting(bucket, env, says):
    root = storage.join(bucket, "config-errors")
    shard = publish_shard(storage.join(root, "shards", "s"), [])
    output = storage.join(root, "captions", "s")
    batch = write_batch(storage.join(root, "batch.json"), [[shard_entry(shard, output)]] * 2)
    proc = run_workload("caption", CAPTION_BATCH_URI=batch, **env)
    assert proc.returncode == 2
    assert says in proc.stderr
    assert not storage.list_uris(output)
