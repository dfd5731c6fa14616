"""training_run's side of the checkpoint sensor: its journal entry, its end marker on every way out,
and training ids that cannot break the checkpoints' keys. Real Dagster runs on the local backend."""

from __future__ import annotations

import json

import dagster as dg
import pytest

from gpudoor_pipelines.assets.training import training_run
from gpudoor_pipelines.launch.client import PipesSkyPilotClient
from gpudoor_pipelines.transit.io_manager import TransitIOManager, TransitRef
from gpudoor_pipelines.transit.resource import TransitBucketResource
from tests.conftest import SPECS_DIR


@pytest.fixture
def door(tmp_path):
    transit = TransitBucketResource(kind="local", local_root=str(tmp_path / "bucket"))
    skypilot = PipesSkyPilotClient(
        backend="local",
        fleet_file=str(SPECS_DIR / "fleet.yaml"),
        local_home=str(tmp_path / "home"),
        transit=transit,
        poll_interval_s=0.2,
        validate_with_skypilot=False,
    )
    bucket = transit.get_bucket()
    # A published captioned dataset whose data file is missing: the training job fails on it.
    bucket.publish("datasets/gone/captioned/m", {"file": "data.parquet", "rows": 0})
    ref = TransitRef(uri=bucket.uri("datasets/gone/captioned/m"), manifest={})
    bucket.put_bytes("assets/captioned_dataset/__all__.ref.json", ref.to_json().encode())
    defs = dg.Definitions(
        assets=[dg.AssetSpec("captioned_dataset"), training_run],
        resources={"transit": transit, "skypilot": skypilot, "io_manager": TransitIOManager(transit=transit)},
    )
    instance = dg.DagsterInstance.ephemeral()

    def train(**config):
        return defs.resolve_implicit_global_asset_job_def().execute_in_process(
            instance=instance,
            asset_selection=[dg.AssetKey("training_run")],
            raise_on_error=False,
            run_config={"ops": {"training_run": {"config": {"skip_smoke_test": True, **config}}}},
        )

    return bucket, train, instance


def test_a_failed_training_says_so_for_the_sensor(door):
    bucket, train, _ = door
    result = train(training_name="lr sweep 3")
    assert not result.success
    [entry_key] = list(bucket.list_keys("trainings/"))
    entry = json.loads(bucket.get_bytes(entry_key))
    assert entry["name"] == "lr sweep 3" and entry["training_id"] in entry_key
    [ended] = list(bucket.list_keys(f"checkpoints/{entry['training_id']}/_ended/"))
    marker = json.loads(bucket.get_bytes(ended))
    assert marker["state"] == "failed" and "job" in marker["reason"].lower()
    run_info = json.loads(bucket.get_bytes(f"checkpoints/{entry['training_id']}/_run.json"))
    assert run_info["training_name"] == "lr sweep 3"


@pytest.mark.parametrize("bad", ["my.run", "team/run", "-x"])
def test_a_training_id_that_would_break_keys_is_refused_before_anything_runs(door, bad):
    bucket, train, _ = door
    result = train(training_id=bad)
    assert not result.success
    [failure] = [e for e in result.all_events if e.is_step_failure]
    message = failure.step_failure_data.error.message
    assert "Nothing was launched" in message and "training_id" in message and "training_name" in message
    assert list(bucket.list_keys("trainings/")) == []  # no journal entry, no job
