"""Evaluation: one GPU job per checkpoint, then the best checkpoint across all of them."""

import json

import dagster as dg
import pandas as pd

from gpudoor_pipelines.assets.common import require_object
from gpudoor_pipelines.assets.partitions import checkpoint_partitions, checkpoint_prefix
from gpudoor_pipelines.assets.training import run_info_key, training_run
from gpudoor_pipelines.concurrency import STEP_POOLS
from gpudoor_pipelines.launch.client import LaunchConfig, PipesSkyPilotClient
from gpudoor_pipelines.transit.bucket import MANIFEST_NAME
from gpudoor_pipelines.transit.io_manager import TransitRef
from gpudoor_pipelines.transit.resource import TransitBucketResource

ACCURACY_CHECK = "accuracy_above_chance"
EVALS_PREFIX = "evals"


class EvalConfig(LaunchConfig):
    """Run config of a checkpoint evaluation: the launch overrides."""


def _chance(metrics: dict) -> float:
    return float(metrics.get("chance_accuracy", 1 / 18))


@dg.asset(
    group_name="evaluation",
    partitions_def=checkpoint_partitions,
    deps=[training_run],
    kinds={"skypilot", "pytorch"},
    pool=STEP_POOLS["eval"],
    check_specs=[
        dg.AssetCheckSpec(
            ACCURACY_CHECK, asset="checkpoint_evals", description="Held-out accuracy beats chance."
        )
    ],
)
def checkpoint_evals(
    context: dg.AssetExecutionContext,
    config: EvalConfig,
    skypilot: PipesSkyPilotClient,
    transit: TransitBucketResource,
):  # No return annotation: on an asset with checks Dagster reads one as a tuple of outputs.
    """Held-out accuracy of one checkpoint, measured by a GPU job on spare GPUs."""
    bucket = transit.get_bucket()
    request = skypilot.request(context, "eval", config=config)
    checkpoint = request.partition or ""
    ckpt = checkpoint_prefix(checkpoint)
    require_object(bucket, f"{ckpt}/{MANIFEST_NAME}", "training_run (this checkpoint)")
    training_id = ckpt.split("/")[1]
    run_info = (
        json.loads(bucket.get_bytes(run_info_key(training_id)))
        if bucket.exists(run_info_key(training_id))
        else {}
    )
    dataset_uri = run_info.get("dataset_uri")
    if not dataset_uri:
        raise dg.Failure(
            description=f"No dataset recorded for training {training_id} at {bucket.uri(run_info_key(training_id))}. Fix: re-materialize training_run."
        )
    out = f"{EVALS_PREFIX}/{checkpoint}"
    request = request.with_inputs(CHECKPOINT_URI=bucket.uri(ckpt), DATASET_URI=dataset_uri, OUTPUT_URI=bucket.uri(out))
    done = skypilot.run(context=context, request=request)
    metrics = json.loads(bucket.get_bytes(f"{out}/metrics.json"))
    md = {k: v for k, v in metrics.items() if isinstance(v, (int, float))}
    md["checkpoint_uri"] = dg.MetadataValue.path(bucket.uri(ckpt))
    row = pd.DataFrame([{"checkpoint": checkpoint, "checkpoint_uri": bucket.uri(ckpt), **metrics}])
    result = done.get_materialize_result(value=row, metadata=md)
    if any(c.check_name == ACCURACY_CHECK for c in result.check_results or ()):
        return result
    # The job did not report (e.g. re-attached to an earlier job): judge from its metrics file.
    accuracy = float(metrics["accuracy"])
    check = dg.AssetCheckResult(check_name=ACCURACY_CHECK, passed=accuracy > _chance(metrics), metadata={"accuracy": accuracy})
    return done.get_materialize_result(value=row, metadata=md, check_results=[check])


@dg.asset(group_name="evaluation", deps=[checkpoint_evals], kinds={"python"})
def best_checkpoint(context: dg.AssetExecutionContext, transit: TransitBucketResource) -> TransitRef:
    """The checkpoint with the best held-out accuracy among all evaluated checkpoints."""
    bucket = transit.get_bucket()
    known = set(context.instance.get_dynamic_partitions(checkpoint_partitions.name))
    results = []
    for key in bucket.list_keys(f"{EVALS_PREFIX}/"):
        if key.endswith("/metrics.json"):
            partition = key.split("/")[1]
            if partition in known:
                results.append({"checkpoint": partition, **json.loads(bucket.get_bytes(key))})
    if not results:
        raise dg.Failure(
            description=f"No evaluation results under {bucket.uri(EVALS_PREFIX)}. Fix: materialize checkpoint_evals first."
        )
    table = pd.DataFrame(results).sort_values(["accuracy", "checkpoint"], ascending=[False, False])
    best = table.iloc[0].to_dict()
    ckpt_uri = bucket.uri(checkpoint_prefix(best["checkpoint"]))
    context.add_output_metadata(
        {
            "checkpoint": best["checkpoint"],
            "checkpoint_uri": dg.MetadataValue.path(ckpt_uri),
            "accuracy": float(best["accuracy"]),
            "evaluated_checkpoints": len(table),
            "leaderboard": dg.MetadataValue.md(
                "| checkpoint | accuracy |\n|---|---|\n"
                + "\n".join(f"| {r.checkpoint} | {r.accuracy:.3f} |" for r in table.itertuples())
            ),
        }
    )
    return TransitRef(
        uri=ckpt_uri, manifest={"checkpoint": best["checkpoint"], "accuracy": float(best["accuracy"])}
    )
