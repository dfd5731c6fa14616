"""The Dagster UI, driven in a real browser: the asset graph, materializing from the UI, a failing shard.

Screenshots of every step go to the artifacts folder (see conftest.py). Playwright's ``expect``
waits (30 s by default here); runs get RUN_TIMEOUT_S.
"""

from __future__ import annotations

import re
import time

import pytest

from tests.e2e.conftest import DATASET_RUN_CONFIG, EXPECT_TIMEOUT_MS, RUN_TIMEOUT_S

pytestmark = pytest.mark.e2e

FLOW_ASSETS = [
    "dataset_shards",
    "caption_shards",
    "captioned_dataset",
    "training_run",
    "checkpoint_evals",
    "best_checkpoint",
    "demo",
]
GOOD_SHARD = "sample-00001"
BAD_SHARD = "sample-00002"
_RUN_PATH = re.compile(r"/runs/([0-9a-f-]{36})")
BAD_MODEL_YAML = "ops:\n  caption_shards:\n    config:\n      env:\n        CAPTION_MODEL: bogus\n"


def _expect():
    from playwright.sync_api import expect

    return expect


def _yaml(run_config: dict) -> str:
    import yaml

    return yaml.safe_dump(run_config, sort_keys=False)


def _shot(page, artifacts_dir, name: str) -> None:
    page.screenshot(path=str(artifacts_dir / f"{name}.png"))


def _type_into_editor(page, editor, text: str) -> None:
    """Replaces the text of a CodeMirror config editor as a person would (select all, then type).

    ``insert_text`` sends the text as one input event, so the editor's auto-indent does not add to
    the YAML's own indentation."""
    code = editor.locator(".CodeMirror")
    _expect()(code).to_be_visible()
    code.click()
    page.keyboard.press("Control+A")
    page.keyboard.insert_text(text)
    assert code.evaluate("el => el.CodeMirror.getValue()") == text


def _launched_run_id(page) -> str:
    """The id of the run just launched: the launchpad opens the run's page, the partition dialog
    shows a "Launched run … View" toast."""
    toast_link = page.get_by_role("region", name=re.compile("^Notifications")).locator('a[href^="/runs/"]').first
    deadline = time.monotonic() + EXPECT_TIMEOUT_MS / 1000
    while time.monotonic() < deadline:
        match = _RUN_PATH.search(page.url)
        if match:
            return match.group(1)
        if toast_link.count():
            return _RUN_PATH.search(toast_link.get_attribute("href")).group(1)
        page.wait_for_timeout(200)
    raise AssertionError(f"no run was launched (no toast, still on {page.url})")


def _open_run_and_wait(page, server, run_id: str) -> str:
    """Opens the run's page and waits until its status tag says it ended; returns that status."""
    page.goto(f"{server.url}/runs/{run_id}")
    status = page.get_by_text(re.compile(r"^(Success|Failure|Canceled)$")).first
    _expect()(status).to_be_visible(timeout=RUN_TIMEOUT_S * 1000)
    return status.inner_text()


def _filter_log(page, text: str) -> None:
    """The event log is virtualized: filter it so the lines asserted on are rendered."""
    box = page.get_by_role("textbox", name="Filter…")
    box.fill(text)
    _expect()(box).to_have_value(text)


def _open_partition_dialog(page, server, partition: str):
    """Opens caption_shards' "Materialize…" dialog with one partition selected; returns the dialog."""
    expect = _expect()
    page.goto(f"{server.url}/assets/caption_shards")
    button = page.get_by_role("button", name=re.compile(r"Materialize…$"))
    expect(button).to_be_enabled()
    button.click()
    dialog = page.get_by_role("dialog").filter(has_text="Launch runs to materialize caption_shards")
    expect(dialog).to_be_visible()
    dialog.get_by_text("Select a partition or create one").click()
    page.get_by_role("menuitem", name=re.compile(rf"^{partition}")).click()
    dialog.get_by_text("Launch runs to materialize caption_shards").click()  # closes the popup
    expect(dialog.get_by_text("1 partition", exact=True)).to_be_visible()
    expect(dialog.get_by_text(partition).first).to_be_visible()
    return dialog


def test_asset_graph_shows_the_whole_flow(page, dagster_server, artifacts_dir):
    """The global asset lineage shows every asset of the flow, dataset to demo."""
    expect = _expect()
    page.set_viewport_size({"width": 2400, "height": 900})  # wide enough for full (not minimal) nodes
    page.goto(f"{dagster_server.url}/asset-groups")
    expect(page.get_by_text("Global asset lineage")).to_be_visible()
    expect(page.get_by_text("captioning").first).to_be_visible()
    page.get_by_role("button", name="panel_show_right", exact=True).click()  # hide the asset tree
    # Four groups: the graph starts with them collapsed.
    page.get_by_role("button", name="settings", exact=True).click()
    expand = page.get_by_role("menuitem", name="Expand all groups")
    expect(expand.or_(page.get_by_role("menuitem", name="Collapse all groups"))).to_be_visible()
    if expand.is_visible():
        expand.click()
    page.keyboard.press("Escape")
    for asset in FLOW_ASSETS:
        expect(page.get_by_text(asset, exact=True).first).to_be_visible()
    expect(page.get_by_text("Loading...")).to_have_count(0)
    _shot(page, artifacts_dir, "01-asset-graph")


def test_materialize_dataset_and_one_shard_from_the_ui(page, dagster_server, artifacts_dir):
    """dataset_shards from the launchpad, then one caption shard from the partition dialog: both
    succeed, the captioning job's own lines are in the run's log, the launch metadata on the asset."""
    expect = _expect()
    server = dagster_server

    # 1. dataset_shards, from the launchpad (shift-click Materialize) with a small dataset.
    page.goto(f"{server.url}/assets/dataset_shards")
    button = page.get_by_role("button", name=re.compile(r"Materialize$"))
    expect(button).to_be_enabled()
    button.click(modifiers=["Shift"])
    launchpad = page.get_by_role("dialog").filter(has_text="Launchpad")
    expect(launchpad).to_be_visible()
    _type_into_editor(page, launchpad, _yaml(DATASET_RUN_CONFIG))
    expect(launchpad.get_by_text("No errors")).to_be_visible()
    _shot(page, artifacts_dir, "02-dataset-launchpad")
    launchpad.get_by_role("button", name=re.compile(r"Materialize$")).click()
    run_id = _launched_run_id(page)
    assert _open_run_and_wait(page, server, run_id) == "Success", server.run_failure_message(run_id)
    _shot(page, artifacts_dir, "03-dataset-run-success")
    dataset = server.metadata("dataset_shards")
    assert dataset["__run_id__"] == run_id and dataset["images_total"] == 32 and dataset["shards"] == 4

    # 2. One caption shard, from the partition dialog.
    dialog = _open_partition_dialog(page, server, GOOD_SHARD)
    _shot(page, artifacts_dir, "04-shard-partition-dialog")
    dialog.get_by_role("button", name="Launch 1 run").click()
    run_id = _launched_run_id(page)
    assert _open_run_and_wait(page, server, run_id) == "Success", server.run_failure_message(run_id)
    # The captioning job's own progress lines, streamed into the Dagster run.
    _filter_log(page, "captioned")
    expect(page.get_by_text(re.compile(rf"^shard {GOOD_SHARD}: captioned 8/8 \(")).first).to_be_visible()
    expect(page.get_by_text(f"shard {GOOD_SHARD}: done, 8 captioned, 0 skipped").first).to_be_visible()
    _shot(page, artifacts_dir, "05-shard-run-success-job-logs")

    # 3. The asset page shows the launch metadata of that partition.
    shard = server.metadata("caption_shards", GOOD_SHARD)
    assert shard["__run_id__"] == run_id and shard["images_captioned"] == 8
    page.goto(f"{server.url}/assets/caption_shards?view=partitions&partition={GOOD_SHARD}")
    expect(page.get_by_text("Materialized", exact=True).first).to_be_visible()
    for key in ("job_id", "pool", "infra", "accelerators"):
        expect(page.get_by_role("row", name=re.compile(rf"^{key}\s")).first).to_contain_text(str(shard[key]))
    for key in ("gpu_hours", "cost_usd_estimate"):  # floats: the UI formats them its own way
        expect(page.get_by_role("row", name=re.compile(rf"^{key}\s+[0-9]")).first).to_be_visible()
    _shot(page, artifacts_dir, "06-shard-launch-metadata")


def test_failing_shard_shows_the_job_log_tail(page, dagster_server, artifacts_dir, dataset_ready):
    """A shard launched with a caption model the job does not know fails, and the run's error
    carries the job's last log lines."""
    expect = _expect()
    server = dagster_server
    dialog = _open_partition_dialog(page, server, BAD_SHARD)
    # The dialog's config editor: run config for this launch.
    dialog.get_by_text("Config", exact=True).click()
    dialog.get_by_role("button", name="Add config").click()
    editor = page.get_by_role("dialog").filter(has_text="Config Editor")
    _type_into_editor(page, editor, BAD_MODEL_YAML)
    expect(editor.get_by_text("No errors")).to_be_visible()
    _shot(page, artifacts_dir, "07-bad-shard-config")
    editor.get_by_role("button", name="Save config").click()
    expect(editor).to_have_count(0)
    expect(dialog.get_by_text("CAPTION_MODEL: bogus")).to_be_visible()
    dialog.get_by_role("button", name="Launch 1 run").click()
    run_id = _launched_run_id(page)

    assert _open_run_and_wait(page, server, run_id) == "Failure"
    # The job's own line, streamed while it ran...
    _filter_log(page, "CAPTION_MODEL")
    expect(page.get_by_text(re.compile(r"^configuration error: CAPTION_MODEL='bogus'")).first).to_be_visible()
    # ...and the step's error, with the job's last lines in it.
    _filter_log(page, "type:STEP_FAILURE")
    expect(page.get_by_text("--- last log lines ---").first).to_be_visible()
    expect(page.get_by_text("CAPTION_MODEL='bogus' is not a known caption model", exact=False).first).to_be_visible()
    _shot(page, artifacts_dir, "08-bad-shard-failure-log-tail")

    run = server.instance.get_run_by_id(run_id)
    assert run.tags.get("dagster/partition") == BAD_SHARD
    assert run.run_config["ops"]["caption_shards"]["config"]["env"] == {"CAPTION_MODEL": "bogus"}
    message = server.run_failure_message(run_id)
    assert "--- last log lines ---" in message and "CAPTION_MODEL" in message, message
