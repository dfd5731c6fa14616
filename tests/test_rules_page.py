"""``gpudoor rules``: the committed rules page is what the fleet file says, names no env value, and ``--check`` "
"catches a stale one."""

from __future__ import annotations

import copy

import pytest
import yaml

from gpudoor_pipelines.cli.main import main
from gpudoor_pipelines.cli.rules_page import DEFAULT_RULES_PAGE, render_file
from gpudoor_pipelines.launch.resolve.fleet import DEFAULT_FLEET_FILE


@pytest.fixture(scope="module")
def fleet_raw() -> dict:
    return yaml.safe_load(DEFAULT_FLEET_FILE.read_text())


@pytest.fixture(scope="module")
def page() -> str:
    return render_file()


@pytest.fixture
def changed_fleet(tmp_path, fleet_raw):
    """A fleet file with one more pool (and its route) and a smaller cap on the H200 pool."""
    raw = copy.deepcopy(fleet_raw)
    raw["pools"]["a100"] = {
        "description": "A borrowed A100 partition.",
        "infra": "slurm/a100",
        "gpus": ["A100"],
        "gpu_cap": 32,
        "max_gpus_per_user": 12,
        "usd_per_gpu_hour": 1.25,
        "autostop_idle_minutes": 25,
        "env": {"CHECKPOINTS_DIR": "/borrowed/a100/checkpoints", "A100_ONLY_SETTING": "/borrowed/a100/opt"},
    }
    raw["pools"]["h200"]["gpu_cap"] = 96
    raw["sharing"]["quotas"]["ml-research"]["h200"] = 64  # the quotas fit the smaller cap
    raw["routes"]["finetune"] = ["a100", "h200"]
    path = tmp_path / "fleet.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def test_committed_page_is_fresh(page):
    committed = DEFAULT_RULES_PAGE.read_text() if DEFAULT_RULES_PAGE.is_file() else ""
    assert committed == page, "docs/rules.md is stale: run `gpudoor rules` and commit docs/rules.md"


def test_page_is_computed_from_the_fleet(page, fleet_raw):
    for name, pool in fleet_raw["pools"].items():
        assert f"| `{name}` | `{pool['infra']}` |" in page
    assert "| `h200` | `slurm/h200-ib` | `H200` | 128 | 64 | 2.30 |" in page
    assert "| `eval` | `inference` → `onprem` → `ondemand` |" in page
    assert "| `inference` | `research-preemptible` | `research-interactive` | `research-borrowed` | yes |" in page
    # Quotas and budgets: each team's quotas (a group's pools named), its weekly budget, GPUs per session.
    assert "| `ml-research` | `h200` | `h200` | 96 |" in page
    assert "| `product-demos` | `serving` | `inference`, `ondemand` | 2 |" in page
    assert "| `ml-engineering` | 6000 | 12000.00 |" in page
    assert "| `inference` | 1 | `research-interactive` | `research-borrowed` |" in page
    assert "`gpudoor-borrowed`" in page and "`gpudoor-fingerprint`" in page
    assert "no: Opening ports is not supported in Slurm." in page  # SkyPilot's own table, per pool
    assert "tears an interactive cluster down 12 hours after" in page and "at most 72 hours" in page
    assert render_file() == page  # no timestamp: the same fleet gives the same bytes


def test_a_changed_fleet_shows_up(changed_fleet, page):
    changed = render_file(changed_fleet)
    assert changed != page
    assert "| `a100` | `slurm/a100` | `A100` | 32 | 12 | 1.25 |" in changed
    assert "| `h200` | `slurm/h200-ib` | `H200` | 96 | 64 |" in changed
    assert "| `finetune` | `a100` → `h200` |" in changed
    assert "| `A100` | — (cheapest first) | `a100` |" in changed
    assert "`CHECKPOINTS_DIR`, `A100_ONLY_SETTING`, `GPUDOOR_POOL`" in changed
    assert "25 idle minutes" in changed
    assert "| `ml-research` | `h200` | `h200` | 64 |" in changed


def test_no_env_value_reaches_the_page(page, fleet_raw, changed_fleet):
    values = {v for pool in fleet_raw["pools"].values() for v in (pool.get("env") or {}).values() if "/" in str(v)}
    assert "/lustre/checkpoints" in values
    for value in values:
        assert value not in page
    changed = render_file(changed_fleet)
    assert "/borrowed/a100" not in changed and "/lustre/" not in changed


def test_check_fails_on_a_stale_page_and_passes_on_a_fresh_one(tmp_path, changed_fleet, capsys):
    out = tmp_path / "rules.md"
    assert main(["rules", "--fleet", str(changed_fleet), "--out", str(out), "--check"]) == 1  # no page yet
    assert main(["rules", "--fleet", str(changed_fleet), "--out", str(out)]) == 0
    assert out.read_text() == render_file(changed_fleet)
    capsys.readouterr()
    assert main(["rules", "--fleet", str(changed_fleet), "--out", str(out), "--check"]) == 0
    out.write_text(out.read_text().replace("| 96 |", "| 128 |"))
    assert main(["rules", "--fleet", str(changed_fleet), "--out", str(out), "--check"]) == 1
    message = capsys.readouterr().err.strip()
    assert len(message.splitlines()) == 1 and "is stale: run `gpudoor rules --fleet" in message


def test_check_passes_on_the_committed_page():
    assert main(["rules", "--check"]) == 0
