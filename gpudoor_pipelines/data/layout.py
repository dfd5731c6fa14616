"""Where everything lives in the transit bucket: every key prefix, named once.

- ``datasets/<dataset>/``: ``index.parquet`` (every image's shard), ``shards/<shard>/`` (manifests of image
  URIs), ``captioned/<model>/`` (the merged captions); by ``dataset_shards`` and ``captioned_dataset``.
- ``captions/<model>/<shard>/``: Parquet parts, then a manifest; by the caption jobs.
- ``batches/<kind>/<run>/wave-NNN.json``: what each job of a batch does; by the packed runs (captions, evals).
- ``trainings/<day>/<stamp>…``: the journal of trainings started; by ``training_run``.
- ``checkpoints/<training>/step-N/``: a checkpoint and its manifest, and ``_ended/``, how the training ended;
  by the training jobs.
- ``smoke/<training>/``: the smoke test's output; by the smoke job.
- ``evals/<checkpoint>/metrics.json``: a checkpoint's scores; by the eval jobs.
- ``usage/<week>/gpu_hours.png``: the weekly usage chart; by ``gpu_usage``.
- ``housekeeping/plans/<time>/``: a housekeeping plan and what applying it did; ``housekeeping/scores.json``, the
  eval scores it ranks checkpoints by; by ``housekeeping_plan`` and ``housekeeping_applied``.
- ``assets/…``: what the IO manager stores for assets.
- ``_pipes/``: Dagster Pipes' context and messages while a session lives.
- ``.tmp-…``: half-written objects, skipped by listings; by the bucket itself.
"""

from __future__ import annotations

from gpudoor_pipelines.transit.bucket import ASSETS_PREFIX, PIPES_PREFIX, TMP_PREFIX

DATASETS = "datasets"
CAPTIONS = "captions"
BATCHES = "batches"
TRAININGS = "trainings"
CHECKPOINTS = "checkpoints"
#: Under a training's checkpoints: how it ended.
ENDED_DIR = "_ended"
SMOKE = "smoke"
EVALS = "evals"
USAGE_CHART = "usage/{week}/gpu_hours.png"
HOUSEKEEPING = "housekeeping"

__all__ = [
    "ASSETS_PREFIX",
    "BATCHES",
    "CAPTIONS",
    "CHECKPOINTS",
    "DATASETS",
    "ENDED_DIR",
    "EVALS",
    "HOUSEKEEPING",
    "PIPES_PREFIX",
    "SMOKE",
    "TMP_PREFIX",
    "TRAININGS",
    "USAGE_CHART",
]
