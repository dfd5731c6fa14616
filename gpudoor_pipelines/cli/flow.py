"""The whole flow, materialized in order on one Dagster instance: the main job of the embedded default.

The same assets run from the UI, schedules and sensors; this module strings them together for one
command (``gpudoor flow``): dataset → every caption shard (one run, as at night) → merge → smoke test + training → an
evaluation per checkpoint → best checkpoint → demo. ``gpudoor caption`` runs its first part on a folder of
the user's own: register → caption now → merge.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import logging
from collections.abc import Callable

import dagster as dg
from dagster._core.utils import make_new_run_id

from gpudoor_pipelines.assets.partitions import SHARDS, checkpoint_partitions
from gpudoor_pipelines.assets.usage import week_of
from gpudoor_pipelines.data.datasets import shard_key

log = logging.getLogger(__name__)


@dataclasses.dataclass
class FlowSummary:
    """What the flow produced."""

    best_checkpoint: str
    accuracy: float
    demo_url: str
    demo_cluster: str
    checkpoints: list[str]
    run_ids: list[str]


@dataclasses.dataclass
class CaptionSummary:
    """What captioning a dataset produced: the merged table and its counts."""

    dataset: str
    dataset_uri: str
    rows: int
    images_skipped: int
    shards: int
    shards_captioned_now: int
    shards_missing: int
    run_ids: list[str]


class FlowFailed(RuntimeError):
    """A step of the flow failed: which step, which run, and why (the job's last lines and the fix)."""

    def __init__(self, label: str, run_id: str, why: str) -> None:
        self.label, self.run_id, self.why = label, run_id, why
        super().__init__(f"{label} failed (run {run_id}): {why}")


def _why(event: dg.DagsterEvent) -> str:
    """What a step failure says to a person: the failure's own description, else the innermost error."""
    data = event.step_failure_data
    if data is None:
        return event.message or "the step failed"
    if data.user_failure_data is not None and data.user_failure_data.description:
        return data.user_failure_data.description
    error = data.error
    while error is not None and error.cause is not None:
        error = error.cause
    return (error.message if error is not None else event.message or "the step failed").strip()


def _latest_md(instance: dg.DagsterInstance, key: str) -> dict:
    event = instance.get_latest_materialization_event(dg.AssetKey(key))
    if event is None or event.asset_materialization is None:
        return {}
    return {k: v.value for k, v in event.asset_materialization.metadata.items()}


class _Runs:
    """Materializes one asset at a time on ``instance``, as a run of the code location's asset job, each run
    watched (``watch``) and recorded; a failed run raises :class:`FlowFailed` naming the asset and why."""

    def __init__(
        self,
        defs: dg.Definitions,
        instance: dg.DagsterInstance,
        config: dict,
        watch: Callable[[str, str], contextlib.AbstractContextManager] | None,
        console_log_level: str | None,
        on_step: Callable[[str], None] | None = None,
    ) -> None:
        self.job = defs.resolve_implicit_global_asset_job_def()
        self.instance, self.config, self.watch = instance, config, watch
        self.console_log_level, self.on_step = console_log_level, on_step
        self.run_ids: list[str] = []

    def materialize(self, key: str, partition: str | None = None, partitions: list[str] | None = None) -> None:
        label = f"{key}[{partition}]" if partition else key
        tags = {}
        if partitions:  # one run for the range, as the nightly schedule does
            label = f"{key}[{partitions[0]}…{partitions[-1]}]"
            tags = {
                "dagster/asset_partition_range_start": partitions[0],
                "dagster/asset_partition_range_end": partitions[-1],
            }
        if self.on_step:
            self.on_step(label)
        ops = {key: {"config": self.config[key]}} if key in self.config else {}
        run_config = {"ops": ops} if ops else {}
        if self.console_log_level:
            run_config["loggers"] = {"console": {"config": {"log_level": self.console_log_level}}}
        run_id = make_new_run_id()
        with self.watch(label, run_id) if self.watch else contextlib.nullcontext():
            result = self.job.execute_in_process(
                instance=self.instance,
                asset_selection=[dg.AssetKey(key)],
                partition_key=partition,
                tags=tags or None,
                run_config=run_config or None,
                raise_on_error=False,
                run_id=run_id,
            )
        self.run_ids.append(result.run_id)
        if not result.success:
            failures = [_why(e) for e in result.all_events if e.is_step_failure]
            raise FlowFailed(label, result.run_id, "\n".join(failures) or "the run failed")


def run_flow(
    defs: dg.Definitions,
    instance: dg.DagsterInstance,
    *,
    run_config: dict | None = None,
    on_step: Callable[[str], None] | None = None,
    watch: Callable[[str, str], contextlib.AbstractContextManager] | None = None,
    console_log_level: str | None = None,
) -> FlowSummary:
    """Materializes every asset of the flow in dependency order.

    Args:
        defs: the code location's definitions.
        instance: the Dagster instance to record runs in.
        run_config: extra run config per asset key, e.g. ``{"dataset_shards": {"num_images": 48}}``.
        on_step: called with a short description before each run.
        watch: ``watch(label, run_id)``, a context manager held while each run executes (the live
            progress line of ``gpudoor flow``).
        console_log_level: level of Dagster's console logger (``CRITICAL`` silences it; the event
            log stays in the instance).

    Raises:
        FlowFailed: a run failed; it names the asset, the run id and why.
    """
    runs = _Runs(defs, instance, run_config or {}, watch, console_log_level, on_step)
    materialize = runs.materialize
    materialize("dataset_shards")
    materialize("caption_shards", partitions=list(instance.get_dynamic_partitions(SHARDS)))
    materialize("captioned_dataset")
    materialize("training_run")
    checkpoints = list(_latest_md(instance, "training_run").get("checkpoints") or [])
    if not checkpoints:
        raise RuntimeError("training_run recorded no checkpoint")
    # As the checkpoint sensor does: the checkpoints become partitions, and one run evaluates them all
    # (a few per job, on a warm pool that fits the free GPUs).
    known = set(instance.get_dynamic_partitions(checkpoint_partitions.name))
    instance.add_dynamic_partitions(checkpoint_partitions.name, [c for c in checkpoints if c not in known])
    if len(checkpoints) == 1:
        materialize("checkpoint_evals", checkpoints[0])
    else:
        materialize("checkpoint_evals", partitions=checkpoints)
    materialize("best_checkpoint")
    materialize("demo")
    materialize("gpu_usage", week_of(datetime.datetime.now(datetime.UTC)))  # the week under way, up to now
    best = _latest_md(instance, "best_checkpoint")
    demo = _latest_md(instance, "demo")
    return FlowSummary(
        best_checkpoint=str(best.get("checkpoint")),
        accuracy=float(best.get("accuracy", 0.0)),
        demo_url=str(demo.get("url")),
        demo_cluster=str(demo.get("cluster_name")),
        checkpoints=checkpoints,
        run_ids=runs.run_ids,
    )


def run_caption(
    defs: dg.Definitions,
    instance: dg.DagsterInstance,
    *,
    source: str,
    name: str,
    shard_size: int | None = None,
    watch: Callable[[str, str], contextlib.AbstractContextManager] | None = None,
    console_log_level: str | None = None,
) -> CaptionSummary:
    """Captions a dataset now: registers ``source`` as dataset ``name`` (new images into new shards), captions
    every shard of it not captioned yet in one run (the night's waves, on the GPUs free now), then merges.

    Raises:
        FlowFailed: a run failed (a source that cannot be read fails the first, before any GPU is asked for).
    """
    dataset = {"source": source, "name": name, **({"shard_size": shard_size} if shard_size else {})}
    runs = _Runs(defs, instance, {"dataset_shards": dataset}, watch, console_log_level)
    runs.materialize("dataset_shards")
    registered = _latest_md(instance, "dataset_shards")
    shards = {shard_key(name, n) for n in range(int(registered.get("shards", 0)))}
    done = instance.get_materialized_partitions(dg.AssetKey("caption_shards"))
    todo = [s for s in instance.get_dynamic_partitions(SHARDS) if s in shards and s not in done]
    for partitions in _contiguous(todo, list(instance.get_dynamic_partitions(SHARDS))):
        if len(partitions) == 1:
            runs.materialize("caption_shards", partitions[0])
        else:
            runs.materialize("caption_shards", partitions=partitions)
    runs.materialize("captioned_dataset")
    merged = _latest_md(instance, "captioned_dataset")
    return CaptionSummary(
        dataset=name,
        dataset_uri=str(merged.get("dataset_uri")),
        rows=int(merged.get("rows", 0)),
        images_skipped=int(merged.get("images_skipped", 0)),
        shards=len(shards),
        shards_captioned_now=len(todo),
        shards_missing=int(merged.get("shards_missing", 0)),
        run_ids=runs.run_ids,
    )


def _contiguous(wanted: list[str], order: list[str]) -> list[list[str]]:
    """``wanted`` (in ``order``) cut into runs of neighbours in ``order``: a partition range is every partition
    between its ends, so shards of other datasets registered in between must not fall inside one."""
    position = {key: i for i, key in enumerate(order)}
    out: list[list[str]] = []
    for key in wanted:
        if out and position[key] == position[out[-1][-1]] + 1:
            out[-1].append(key)
        else:
            out.append([key])
    return out
