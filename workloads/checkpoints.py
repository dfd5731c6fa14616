"""Where checkpoints live in storage; torch-free, so a program can decide to resume or stop early.

A checkpoint is ``<prefix>/step-XXXXXX/model.pt`` plus ``<prefix>/step-XXXXXX/_manifest.json``
written last; only a step folder with a manifest is a complete checkpoint.
"""

from __future__ import annotations

import json
import re
from typing import Any

from gpudoor_pipelines.transit.bucket import MANIFEST_NAME
from gpudoor_pipelines.transit.uris import join, list_uris, read_bytes

MODEL_FILE = "model.pt"
_STEP_MANIFEST = re.compile(r"/step-(\d+)/" + re.escape(MANIFEST_NAME) + "$")


def checkpoint_dir_name(step: int) -> str:
    """The folder name of the checkpoint taken after ``step`` steps."""
    return f"step-{step:06d}"


def checkpoint_file_uri(checkpoint_uri: str) -> str:
    """The model file of a checkpoint, given its folder (or the file itself)."""
    return checkpoint_uri if checkpoint_uri.endswith(".pt") else join(checkpoint_uri, MODEL_FILE)


def latest_checkpoint(prefix_uri: str) -> tuple[int, str] | None:
    """The newest complete checkpoint under ``prefix_uri``.

    Returns:
        (step, checkpoint folder URI), or None when there is none.
    """
    steps = [int(m.group(1)) for uri in list_uris(prefix_uri) if (m := _STEP_MANIFEST.search(uri))]
    if not steps:
        return None
    step = max(steps)
    return step, join(prefix_uri, checkpoint_dir_name(step))


def read_manifest(checkpoint_uri: str) -> dict[str, Any]:
    """The manifest of a checkpoint folder."""
    return json.loads(read_bytes(join(checkpoint_uri, MANIFEST_NAME)))
