"""The IO manager that keeps asset values in the transit bucket, on Dagster's ``UPathIOManager``.

Layout under the bucket root (multi-partition keys are ``<v1>/<v2>``, dimensions sorted by name)::

    assets/<asset key path>/<partition or "__all__">.parquet    pandas.DataFrame
    assets/<asset key path>/<partition or "__all__">.ref.json   TransitRef
    assets/<asset key path>/<partition or "__all__">.pickle     anything else (None stores nothing)
    runs/<run id>/<step key>/<output name>.<suffix>             op outputs
"""

from __future__ import annotations

import dataclasses
import io
import json
import pickle
import sys
from collections.abc import Mapping
from typing import Any

import dagster as dg
from upath import UPath

from gpudoor_pipelines.transit.bucket import ASSETS_PREFIX, TransitBucket, TransitObjectMissing
from gpudoor_pipelines.transit.resource import TransitBucketResource

PARQUET, REF, PICKLE = ".parquet", ".ref.json", ".pickle"


@dataclasses.dataclass(frozen=True)
class TransitRef:
    """A pointer to data a job wrote into the transit bucket itself (caption shards, checkpoints): a folder
    or object ``uri`` in the bucket and its ``manifest`` (or any JSON-serialisable description)."""

    uri: str
    manifest: dict = dataclasses.field(default_factory=dict)

    def to_json(self) -> str:
        """The JSON form stored in the bucket."""
        return json.dumps({"uri": self.uri, "manifest": self.manifest}, sort_keys=True, default=str)

    @classmethod
    def from_json(cls, s: str | bytes) -> TransitRef:
        """Inverse of :meth:`to_json`."""
        d = json.loads(s)
        return cls(uri=str(d["uri"]), manifest=dict(d.get("manifest") or {}))


def _escape(path: str) -> str:
    """Empty, ``.`` and ``..`` segments (of a partition or asset key) as ``%2F``, ``%2E``, ``%2E%2E``."""
    return "/".join(s.replace(".", "%2E") if s in (".", "..") else s or "%2F" for s in path.split("/"))


def _frame_type(tp: Any) -> bool:
    pd = sys.modules.get("pandas")  # not imported yet: nothing can be a DataFrame
    return pd is not None and isinstance(tp, type) and issubclass(tp, pd.DataFrame)


def _suffix(obj: Any) -> str:
    return PARQUET if _frame_type(type(obj)) else REF if isinstance(obj, TransitRef) else PICKLE


def _dict_of(tp: Any) -> Any:
    """X for an input typed ``dict[str, X]`` (several partitions), else None."""
    args = getattr(tp, "__args__", ())
    return args[1] if getattr(tp, "__origin__", None) in (dict, Mapping) and len(args) == 2 else None


class _BucketIOManager(dg.UPathIOManager):
    """UPathIOManager over the bucket: Dagster makes the paths, the bucket does the I/O (so S3 needs no
    s3fs). Paths come without suffix (``extension`` is None): the value's type chooses it."""

    def __init__(self, bucket: TransitBucket):
        self.bucket = bucket
        super().__init__(base_path=UPath(bucket.root_uri))

    def _key(self, path: UPath, suffix: str = "") -> str:
        return self.bucket.key_of(str(path)) + suffix

    def get_asset_relative_path(self, context: dg.InputContext | dg.OutputContext) -> UPath:
        tail = [] if context.has_asset_partitions else ["__all__"]
        return UPath(ASSETS_PREFIX, *map(_escape, context.asset_key.path), *tail)

    def get_op_output_relative_path(self, context: dg.InputContext | dg.OutputContext) -> UPath:
        return UPath("runs", *(_escape(str(p)) for p in context.get_identifier()))

    def make_safe_partition_path(self, base_path: UPath, partition: str) -> UPath:
        return base_path / _escape(partition)

    def dump_to_path(self, context: dg.OutputContext, obj: Any, path: UPath) -> None:
        if obj is None:  # the asset wrote through the bucket itself
            return
        suffix = _suffix(obj)
        if suffix == PARQUET:
            data = obj.to_parquet(engine="pyarrow")
        else:
            data = obj.to_json().encode() if suffix == REF else pickle.dumps(obj, pickle.HIGHEST_PROTOCOL)
        self.bucket.put_bytes(self._key(path, suffix), data)

    def load_from_path(self, context: dg.InputContext, path: UPath) -> Any:
        tp = context.dagster_type.typing_type
        tp = _dict_of(tp) or tp
        suffixes = [PARQUET] if _frame_type(tp) else [REF] if tp is TransitRef else [PARQUET, REF, PICKLE]
        for suffix in suffixes:
            try:
                data = self.bucket.get_bytes(self._key(path, suffix))
            except TransitObjectMissing:
                continue
            if suffix == PARQUET:
                import pandas as pd

                return pd.read_parquet(io.BytesIO(data))
            return TransitRef.from_json(data) if suffix == REF else pickle.loads(data)
        uris = [self.bucket.uri(self._key(path, s)) for s in suffixes]
        if context.has_asset_key:
            name = context.asset_key.to_user_string()
            part = self._key(path).split("/", len(context.asset_key.path) + 1)[-1]
            what = f"'{name}'" + (f" partition '{part}'" if context.has_asset_partitions else "")
            what, fix = f"upstream asset {what}", f"Materialize {what} first, then run this again."
        else:
            what, fix = f"upstream output {self._key(path)}", "Re-execute the upstream step first."
        raise TransitObjectMissing(
            self._key(path, suffixes[0]),
            uris[0],
            f"Cannot load input '{context.name}': {what} has never been materialized into the transit bucket "
            f"(looked for {uris[0]}" + "".join(f", {u}" for u in uris[1:]) + f"). {fix}",
        )

    def load_partitions(self, context: dg.InputContext) -> Any:
        # UPathIOManager hands a single partition over bare; an input typed dict[str, X] still wants a dict
        value, keys = super().load_partitions(context), context.asset_partition_keys
        if len(keys) == 1 and _dict_of(context.dagster_type.typing_type):
            return {} if value is None else {keys[0]: value}
        return value

    def get_metadata(self, context: dg.OutputContext, obj: Any) -> dict[str, Any]:
        if obj is None:
            return {}
        paths = self._get_paths_for_partitions(context) if context.has_asset_partitions else {}
        path = paths.popitem()[1] if paths else self._get_path(context)
        uri = dg.MetadataValue.path(self.bucket.uri(self._key(path, _suffix(obj))))
        meta: dict[str, Any] = {"uri": uri, "path": uri}  # the base class's "path" has no suffix
        if isinstance(obj, TransitRef):
            meta.update(target_uri=dg.MetadataValue.path(obj.uri), manifest=obj.manifest)
        elif _frame_type(type(obj)):
            columns = [dg.TableColumn(name=str(c), type=str(t)) for c, t in obj.dtypes.items()]
            meta.update({"rows": len(obj), "columns": len(obj.columns), "dagster/row_count": len(obj)})
            meta["dagster/column_schema"] = dg.TableSchema(columns=columns)
        return meta

    # The base class would reach the storage through UPath (s3fs for s3://); the bucket does it instead.
    def path_exists(self, path: UPath) -> bool:
        return any(self.bucket.exists(self._key(path, s)) for s in (PARQUET, REF, PICKLE))

    def make_directory(self, path: UPath) -> None:
        return None  # the bucket makes folders as it writes

    def unlink(self, path: UPath) -> None:
        raise NotImplementedError("the transit IO manager never deletes stored values")

    def _handle_transition_to_partitioned_asset(self, context: dg.OutputContext, path: UPath) -> None:
        return None  # nothing to move: an unpartitioned value lives at <asset>/__all__.*, not at <asset>


class TransitIOManager(dg.ConfigurableIOManagerFactory):
    """Keeps asset values in the transit bucket (layout: module docstring); DataFrames are Parquet that
    pandas, pyarrow or duckdb read straight from the URI. Several upstream partitions load as a dict; input
    metadata ``allow_missing_partitions`` skips the missing ones. Configured by the transit resource alone:
    ``TransitIOManager(transit=bucket_from_env())``."""

    transit: TransitBucketResource

    def create_io_manager(self, context: dg.InitResourceContext) -> dg.UPathIOManager:
        return _BucketIOManager(self.transit.get_bucket())

    def uri_for(
        self, asset_key: dg.AssetKey | list[str] | str, partition: str | None = None, suffix: str = PARQUET
    ) -> str:
        """The URI of an asset (partition) value, e.g. to read it with duckdb or pandas outside Dagster;
        a string key is a user string (``"team/frames"``)."""
        if isinstance(asset_key, str):
            asset_key = dg.AssetKey.from_user_string(asset_key)
        path = dg.AssetKey.from_coercible(asset_key)
        if isinstance(partition, dg.MultiPartitionKey):
            partition = "/".join(v for _, v in sorted(partition.keys_by_dimension.items()))
        tail = "__all__" if partition is None else _escape(partition)
        return self.transit.get_bucket().uri("/".join([ASSETS_PREFIX, *map(_escape, path.path), tail]) + suffix)
