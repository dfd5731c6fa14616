"""Evaluation: checkpoints evaluated a batch at a time on spare GPUs, then the best one of a training."""

import concurrent.futures
import json
from collections.abc import Mapping, Sequence
from typing import Any

import dagster as dg
import pandas as pd
from pydantic import Field

from gpudoor_pipelines.assets.concurrency import STEP_POOLS
from gpudoor_pipelines.assets.packed import PackedRun
from gpudoor_pipelines.assets.partitions import checkpoint_partitions
from gpudoor_pipelines.assets.training import TAG_TRAINING_ID, run_info_key, training_run
from gpudoor_pipelines.data import layout
from gpudoor_pipelines.data.checkpoints import check_training_id, checkpoint_prefix, training_of
from gpudoor_pipelines.data.housekeeping import restore_command
from gpudoor_pipelines.launch.client import LaunchConfig, PipesSkyPilotClient
from gpudoor_pipelines.launch.resolve.fleet import load_fleet
from gpudoor_pipelines.transit import tiers
from gpudoor_pipelines.transit.bucket import MANIFEST_NAME, TransitBucket, TransitObjectMissing
from gpudoor_pipelines.transit.io_manager import TransitRef
from gpudoor_pipelines.transit.resource import TransitBucketResource

ACCURACY_CHECK = "accuracy_above_chance"
#: Metrics recorded as numbers on each checkpoint's materialization: the UI plots them across checkpoints.
PLOTTED = ("accuracy", "color_accuracy", "shape_accuracy", "checkpoint_step", "num_examples")


def metrics_key(checkpoint: str) -> str:
    """Where a checkpoint's evaluation writes its metrics."""
    return f"{layout.EVALS}/{checkpoint}/metrics.json"


class EvalConfig(LaunchConfig):
    """Run config of an evaluation run: the launch overrides, and how to pack the checkpoints."""

    max_workers: int | None = Field(default=None, ge=1, description="At most this many workers, whatever is free.")
    checkpoints_per_job: int | None = Field(
        default=None, ge=1, description="Checkpoints per job (default: a few jobs per worker)."
    )
    max_attempts: int = Field(default=2, ge=1, description="Tries per checkpoint in this run.")
    wait_for_gpus_s: float = Field(default=600.0, ge=0, description="How long to wait for a free GPU when none is.")


def _chance(metrics: Mapping[str, Any]) -> float:
    return float(metrics.get("chance", metrics.get("chance_accuracy", 1 / 18)))


class CheckpointEvals(PackedRun):
    """Evaluates the checkpoints of one run, a few per job, on a warm pool that fits the free GPUs."""

    batch_env = "EVAL_BATCH_URI"
    item_field = "checkpoint"
    kind = "eval"
    doing = "evaluation"

    def __init__(self, *args: Any, datasets: Mapping[str, str], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.datasets = datasets  # training id -> the dataset it trained on (its held-out split is scored)

    def done_items(self, items: Sequence[str]) -> set[str]:
        # One HEAD per checkpoint of this run (tens): never a listing of every evaluation ever written.
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            found = pool.map(lambda c: self.bucket.exists(metrics_key(c)), items)
            return {c for c, there in zip(items, found, strict=True) if there}

    def entry(self, item: str) -> dict[str, str]:
        return {
            "checkpoint": item,
            "checkpoint_uri": self.bucket.uri(checkpoint_prefix(item)),
            "dataset_uri": self.datasets[training_of(item)],
            "output_uri": self.bucket.uri(f"{layout.EVALS}/{item}"),
        }

    def materialize(self, item: str, message: Mapping[str, Any], rank: int | None = None) -> None:
        metrics = message.get("metrics")
        if not isinstance(metrics, Mapping):  # done before this run, or its message was lost
            metrics = json.loads(self.bucket.get_bytes(metrics_key(item)))
        metadata: dict[str, Any] = {k: metrics[k] for k in PLOTTED if isinstance(metrics.get(k), int | float)}
        metadata.update(
            training_id=training_of(item),
            checkpoint_uri=dg.MetadataValue.path(self.bucket.uri(checkpoint_prefix(item))),
            metrics_uri=dg.MetadataValue.path(self.bucket.uri(metrics_key(item))),
        )
        if "seconds" in message:
            metadata["seconds"] = float(message["seconds"])
        metadata.update(self.job_share(item, rank, float(message.get("seconds") or 0.0)))
        if message.get("state") == "already done":
            metadata["note"] = "evaluated before this run"
        self.context.log_event(
            dg.AssetMaterialization(asset_key=self.context.asset_key, partition=item, metadata=metadata)
        )
        accuracy, chance = float(metrics["accuracy"]), _chance(metrics)
        self.context.log_event(
            dg.AssetCheckEvaluation(
                asset_key=self.context.asset_key,
                check_name=ACCURACY_CHECK,
                passed=accuracy > chance,
                metadata={"accuracy": accuracy, "chance": chance},
                partition=item,
            )
        )


def _datasets(bucket: TransitBucket, checkpoints: Sequence[str]) -> tuple[dict[str, str], dict[str, str]]:
    """The dataset of each checkpoint's training (one read per training), and the checkpoints that
    cannot be evaluated (missing, or their training recorded no dataset), with why."""
    datasets: dict[str, str] = {}
    problems: dict[str, str] = {}
    for training in sorted({training_of(c) for c in checkpoints}):
        try:
            dataset = json.loads(bucket.get_bytes(run_info_key(training))).get("dataset_uri")
        except TransitObjectMissing:
            dataset = None
        if dataset:
            datasets[training] = dataset
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        there = list(pool.map(lambda c: bucket.exists(f"{checkpoint_prefix(c)}/{MANIFEST_NAME}"), checkpoints))
    for checkpoint, complete in zip(checkpoints, there, strict=True):
        if not complete:
            problems[checkpoint] = f"no complete checkpoint at {bucket.uri(checkpoint_prefix(checkpoint))}"
        elif tiers.unreadable(bucket, checkpoint_prefix(checkpoint)):
            problems[checkpoint] = f"housekeeping moved it to cold storage; fix: {restore_command(checkpoint)}"
        elif training_of(checkpoint) not in datasets:
            problems[checkpoint] = (
                f"no dataset recorded for training {training_of(checkpoint)} at "
                f"{bucket.uri(run_info_key(training_of(checkpoint)))}; fix: re-materialize training_run"
            )
    return datasets, problems


# A multi-asset only to let each checkpoint's check be logged with it: a check of an ``@asset`` must be
# returned once per run, and a run here covers many checkpoints (``can_subset`` makes it optional).
@dg.multi_asset(
    specs=[
        dg.AssetSpec(
            "checkpoint_evals",
            group_name="evaluation",
            deps=[training_run],
            kinds={"skypilot", "pytorch"},
            partitions_def=checkpoint_partitions,
            skippable=True,
            description="Held-out accuracy of each checkpoint, measured on spare GPUs.",
        )
    ],
    check_specs=[
        dg.AssetCheckSpec(ACCURACY_CHECK, asset="checkpoint_evals", description="Held-out accuracy beats chance.")
    ],
    can_subset=True,
    pool=STEP_POOLS["eval"],
    backfill_policy=dg.BackfillPolicy.multi_run(load_fleet().evaluation.checkpoints_per_run),
)
def checkpoint_evals(
    context: dg.AssetExecutionContext,
    config: EvalConfig,
    skypilot: PipesSkyPilotClient,
    transit: TransitBucketResource,
):
    """Held-out accuracy of each checkpoint (``evals/<checkpoint>/metrics.json``), measured on spare GPUs.

    A run covers one checkpoint or a range of them (the sensor asks for a range when many arrive at
    once): they are packed into a few jobs on a warm pool that fits the free GPUs, and each checkpoint
    is materialized, with its metrics as numbers the UI plots across checkpoints, the moment its job
    reports it. A checkpoint evaluated before is not evaluated again.
    """
    yield from ()  # no output: each checkpoint is materialized on its own, as its job reports it
    bucket = transit.get_bucket()
    checkpoints = list(context.partition_keys)
    for checkpoint in checkpoints:
        try:
            checkpoint_prefix(checkpoint)
        except ValueError as e:
            raise dg.Failure(description=f"Nothing was launched. {e}.") from None
    datasets, problems = _datasets(bucket, checkpoints)
    todo = [c for c in checkpoints if c not in problems]
    report = None
    if todo:
        run = CheckpointEvals(
            context,
            skypilot,
            bucket,
            skypilot.request(context, "eval", config=config),
            datasets=datasets,
            max_workers=config.max_workers,
            items_per_job=config.checkpoints_per_job,
            max_attempts=config.max_attempts,
            wait_for_gpus_s=config.wait_for_gpus_s,
        )
        report = run.run(todo)
        context.log.info(f"Evaluation: {report.to_metadata('checkpoints')}")
        problems.update(report.failed)
        if report.left:
            problems.update(
                dict.fromkeys(report.left, f"no free GPU within {config.wait_for_gpus_s:.0f} s ({report.no_gpu})")
            )
    if problems:
        checkpoint, reason = next(iter(problems.items()))
        raise dg.Failure(
            description=f"{len(problems)} of {len(checkpoints)} checkpoints not evaluated (the others are "
            f"materialized). {checkpoint}: {reason}",
            metadata={
                **(report.to_metadata("checkpoints") if report else {}),
                "not_evaluated": dg.MetadataValue.json(dict(list(problems.items())[:100])),
            },
        )


class BestConfig(dg.Config):
    """Which training to pick the best checkpoint of."""

    training_id: str | None = Field(
        default=None, description="The training to choose in (default: the latest training_run's)."
    )


def _latest_training(instance: dg.DagsterInstance) -> str | None:
    """The training of the latest training_run, else of the latest evaluated checkpoint."""
    for key in ("training_run", "checkpoint_evals"):
        event = instance.get_latest_materialization_event(dg.AssetKey(key))
        if event is None or event.asset_materialization is None:
            continue
        mat = event.asset_materialization
        value = mat.metadata.get("training_id")
        if value is not None:
            return str(value.value)
        if mat.partition:
            return training_of(mat.partition)
    return None


@dg.asset(group_name="evaluation", deps=[checkpoint_evals], kinds={"python"})
def best_checkpoint(
    context: dg.AssetExecutionContext, config: BestConfig, transit: TransitBucketResource
) -> TransitRef:
    """The checkpoint with the best held-out accuracy within one training (the latest, or the one named)."""
    bucket = transit.get_bucket()
    if config.training_id:
        try:
            training, chosen_by = check_training_id(config.training_id), "run config"
        except ValueError as e:
            raise dg.Failure(description=f"run config best_checkpoint.training_id: {e}") from None
    else:
        training, chosen_by = _latest_training(context.instance), "the latest training"
        if training is None:
            raise dg.Failure(
                description="No training yet. Fix: materialize training_run, or name one in run config (training_id)."
            )
    keys = [k for k in bucket.list_keys(f"{layout.EVALS}/{training}.") if k.endswith("/metrics.json")]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda k: {"checkpoint": k.split("/")[1], **json.loads(bucket.get_bytes(k))}, keys))
    if not results:
        raise dg.Failure(
            description=f"No evaluation of training {training} ({chosen_by}) under {bucket.uri(layout.EVALS)}. "
            "Fix: materialize checkpoint_evals for its checkpoints first."
        )
    table = pd.DataFrame(results).sort_values(["accuracy", "checkpoint"], ascending=[False, False])
    best = table.iloc[0].to_dict()
    ckpt_uri = bucket.uri(checkpoint_prefix(best["checkpoint"]))
    by_step = table.sort_values("checkpoint")
    context.add_output_metadata(
        {
            "training_id": training,
            "chosen_by": chosen_by,
            "checkpoint": best["checkpoint"],
            "checkpoint_uri": dg.MetadataValue.path(ckpt_uri),
            "accuracy": float(best["accuracy"]),
            "evaluated_checkpoints": len(table),
            "leaderboard": dg.MetadataValue.md(
                "| checkpoint | accuracy |\n|---|---|\n"
                + "\n".join(f"| {r.checkpoint} | {r.accuracy:.3f} |" for r in table.head(20).itertuples())
            ),
            "accuracy_by_checkpoint": dg.MetadataValue.json(
                {r.checkpoint: round(float(r.accuracy), 6) for r in by_step.tail(200).itertuples()}
            ),
        }
    )
    context.instance.add_run_tags(context.run.run_id, {TAG_TRAINING_ID: training})
    return TransitRef(
        uri=ckpt_uri,
        manifest={"checkpoint": best["checkpoint"], "accuracy": float(best["accuracy"]), "training_id": training},
    )
