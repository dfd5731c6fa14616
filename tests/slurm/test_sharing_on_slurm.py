"""Teams sharing the bed's fleet through the door: quotas held by the API server's policy, and start soonest.

The bed's ``east`` and ``west`` partitions have one L4 each and no other test holds them. The bed's fleet gives
``ml-engineering`` a quota of east's one GPU; any other team borrows it while it is idle. Nothing is faked: the
launches go through the bed's API server, whose policy counts what is held in its own process
(``live_caps: server``); another team's job that fills a partition is a plain ``sbatch`` job, which only Slurm
knows of.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest
import yaml

from gpudoor_pipelines.launch.config import LaunchSettings
from gpudoor_pipelines.launch.errors import LaunchConfigError
from gpudoor_pipelines.launch.launcher import Launcher
from gpudoor_pipelines.launch.resolve.request import LaunchRequest
from gpudoor_pipelines.launch.resolve.specs import load_spec
from tests.slurm.conftest import scancel
from tests.slurm.test_client_on_slurm import BED_FLEET

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(900)]


@pytest.fixture
def bed_launcher(testbed, tmp_path: Path):
    """A launcher on the bed, and the jobs it submitted, released (and the release verified) at the end."""
    specs = tmp_path / "specs"
    specs.mkdir()
    (specs / "probe.yaml").write_text(
        yaml.safe_dump({"name": "probe", "resources": {"accelerators": "L4:1"}, "run": "sleep 600"})
    )
    settings = LaunchSettings(
        backend="skypilot",
        api_server_endpoint=testbed.api_endpoint,
        fleet_file=str(BED_FLEET),
        specs_dir=str(specs),
        cancel_timeout_s=240.0,
    )
    launcher = Launcher.from_settings(settings)
    launched: list[str] = []
    yield launcher, launched
    outcomes = launcher.release([launcher.backend.holding_of(j) for j in launched])
    assert all(o.confirmed for o in outcomes), [o.summary() for o in outcomes]


def _request(launcher: Launcher, owner: str, *, pool: str | None = None) -> LaunchRequest:
    return LaunchRequest(
        spec=load_spec("probe", launcher.settings.specs_dir, skypilot=True),
        cost_owner=owner,
        user="bed-sharing",
        pool=pool,
        step="probe",
    )


def _launch(launcher: Launcher, launched: list[str], request: LaunchRequest) -> str:
    job_id, _job = launcher.submit(launcher.resolve(request), request)
    launched.append(job_id)
    return job_id


def _labels(job_id: str) -> dict[str, str]:
    """The labels the API server's policy gave the job (from the task it was launched with)."""
    import sky

    from gpudoor_pipelines.launch.backends import sky_records

    records, *_ = sky.get(
        sky.jobs.queue_v2(
            refresh=False, job_ids=[int(job_id)], all_users=True, fields=["job_id", "labels", "task_id", "user_yaml"]
        )
    )
    return sky_records.launched_labels(records[0])


def test_a_team_beyond_its_quota_is_refused_while_the_owner_of_the_quota_is_not(bed_launcher):
    launcher, launched = bed_launcher
    # product-demos has no quota on east: it borrows the idle GPU, and its job is marked borrowed.
    borrower = _launch(launcher, launched, _request(launcher, "product-demos", pool="east"))
    # A second launch of product-demos finds nothing idle to borrow: the server's policy refuses it.
    with pytest.raises(LaunchConfigError) as refused:
        _launch(launcher, launched, _request(launcher, "product-demos", pool="east"))
    text = str(refused.value)
    assert "'product-demos' has no quota on 'east'" in text and "no idle GPUs to borrow" in text, text
    assert "1/1 in use, 1 of them borrowed" in text, text
    # ml-engineering's quota is east's GPU: what product-demos borrowed does not count against it.
    owner = _launch(launcher, launched, _request(launcher, "ml-engineering", pool="east"))
    assert _labels(borrower)["gpudoor-borrowed"] == "true"
    assert _labels(owner)["gpudoor-borrowed"] == "false"
    assert _labels(owner)["gpudoor-fingerprint"]


def _free_l4(launcher: Launcher, infra: str, wanted: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    free = None
    while time.monotonic() < deadline:
        free = (launcher.backend.free_gpus_at(infra) or {}).get("l4")
        if free == wanted:
            return
        time.sleep(2)
    raise AssertionError(f"{infra}: {free} L4 free, waited for {wanted}")


def test_a_job_goes_where_it_starts_soonest_and_back_when_the_first_pool_frees_up(testbed, bed_launcher):
    launcher, launched = bed_launcher
    east = launcher.fleet.pools["east"].infra
    # Another team's job, outside the door, takes east's GPU: east is under its cap, but busy.
    filler = subprocess.run(
        ["runuser", "-u", "gpudoor", "--", "sbatch", "--parsable", "-p", "east", "--gres=gpu:l4:1", "-o", "/dev/null"]
        + ["--wrap", "sleep 600"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    try:
        _free_l4(launcher, east, 0)
        job = launcher.resolve(_request(launcher, "ml-research"))
        assert job.pool == "west", job.route
        assert "'east' would queue (0 L4 free), 'west' starts now (1 L4 free)" in job.route.reason
        job_id = _launch(launcher, launched, _request(launcher, "ml-research"))
        assert _labels(job_id)["gpudoor-pool"] == "west"
    finally:
        scancel(filler)
    _free_l4(launcher, east, 1)
    back = launcher.resolve(_request(launcher, "ml-research"))
    assert back.pool == "east", back.route
    assert "'east' starts now (1 L4 free)" in back.route.reason
