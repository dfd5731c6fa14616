"""The agent route: the flow from captions to checkpoint evals, submitted through Dagster's GraphQL client
to the same running ``dagster dev`` the UI tests use, checked through the instance."""

from __future__ import annotations

import dagster as dg
import pytest

from gpudoor_pipelines.assets.partitions import SHARDS, checkpoint_partitions
from tests.e2e.conftest import DATASET_RUN_CONFIG, LOCATION_NAME, REPOSITORY_NAME

pytestmark = pytest.mark.e2e

# A shorter training than the spec's default (60 steps): two checkpoints, enough for the evals.
TRAIN_RUN_CONFIG = {"ops": {"training_run": {"config": {"env": {"MAX_STEPS": "20", "CHECKPOINT_EVERY": "10"}}}}}


_ADD_PARTITION = """
mutation($selector: RepositorySelector!, $name: String!, $key: String!) {
  addDynamicPartition(repositorySelector: $selector, partitionsDefName: $name, partitionKey: $key) {
    __typename
    ... on PythonError { message }
  }
}"""


def test_agent_route_from_captions_to_checkpoint_evals(dagster_server):
    server = dagster_server
    instance = server.instance

    # Upstream: whatever the UI tests did not materialize already.
    if instance.get_latest_materialization_event(dg.AssetKey("dataset_shards")) is None:
        server.assert_success(server.submit(["dataset_shards"], run_config=DATASET_RUN_CONFIG))
    shards = list(instance.get_dynamic_partitions(SHARDS))
    assert len(shards) == 4
    # The night's shape: one run for every shard, packed into jobs on a warm pool; done shards are skipped.
    server.assert_success(server.submit_range(["caption_shards"], shards[0], shards[-1]))
    for shard in shards:
        md = server.metadata("caption_shards", shard)
        assert md["caption_model"] == "color-shape-v1" and (md.get("pool") == "onprem" or "note" in md), md
    server.assert_success(server.submit(["captioned_dataset"]))
    assert server.metadata("captioned_dataset")["rows"] == 32

    # Training: a smoke job, then the 2-rank job; it records its checkpoints.
    train_run = server.submit(["training_run"], run_config=TRAIN_RUN_CONFIG)
    server.assert_success(train_run)
    train = server.metadata("training_run")
    assert train["__run_id__"] == train_run
    assert train["pool"] == "h200" and train["num_nodes"] == 2, train
    assert "smoke_job_id" in train and train["job_id"] != train["smoke_job_id"]
    assert train["gpu_hours"] >= 0 and "cost_usd_estimate" in train
    checkpoints = sorted(train["checkpoints"])
    assert len(checkpoints) == 2, checkpoints

    # The checkpoints become partitions (the sensor's work, stopped here), then one run evaluates both.
    selector = {"repositoryLocationName": LOCATION_NAME, "repositoryName": REPOSITORY_NAME}
    for checkpoint in checkpoints:
        added = server.graphql(
            _ADD_PARTITION, {"selector": selector, "name": checkpoint_partitions.name, "key": checkpoint}
        )
        assert added["addDynamicPartition"]["__typename"] == "AddDynamicPartitionSuccess", added
    eval_run = server.submit_range(["checkpoint_evals"], checkpoints[0], checkpoints[-1])
    server.assert_success(eval_run)
    for checkpoint in checkpoints:
        evals = server.metadata("checkpoint_evals", checkpoint)
        assert evals["__run_id__"] == eval_run
        assert 0.0 <= evals["accuracy"] <= 1.0 and evals["pool"] == "inference", evals
        assert "job_id" in evals and "gpu_hours" in evals
    checks = instance.event_log_storage.get_asset_check_execution_history(
        dg.AssetCheckKey(dg.AssetKey("checkpoint_evals"), "accuracy_above_chance"), limit=10
    )
    # (the run also plans the check once for the whole range: that record names no partition)
    assert {c.partition for c in checks if c.run_id == eval_run and c.partition} == set(checkpoints)
