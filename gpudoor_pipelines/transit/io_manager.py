"""IO manager that keeps asset values in the transit bucket (local folder or S3).

Layout (relative to the bucket root)::

    assets/<asset key path>/<partition key or "__all__">.parquet    pandas.DataFrame
    assets/<asset key path>/<partition key or "__all__">.ref.json   TransitRef
    assets/<asset key path>/<partition key or "__all__">.pickle     anything else
    runs/<run id>/<step key>/<output name>.<ext>                    op outputs (no asset key)

Multi-dimensional partition keys become ``<dim1 value>/<dim2 value>`` (dimensions sorted by name),
like Dagster's UPath IO manager. ``None`` outputs store nothing. Loading several upstream partitions
gives a ``dict`` partition key -> value.
"""

from __future__ import annotations

import dataclasses
import io
import json
import pickle
from collections.abc import Mapping, Sequence
from typing import Any

import dagster as dg

from .bucket import TransitBucket, TransitObjectMissing, asset_object_key, escape_partition, join_key
from .resource import TransitBucketResource

PARQUET = ".parquet"
REF = ".ref.json"
PICKLE = ".pickle"


@dataclasses.dataclass(frozen=True)
class TransitRef:
    """A pointer to data a job wrote into the transit bucket itself (caption shards, checkpoints).

    ``uri`` is a folder prefix or an object URI inside the bucket; ``manifest`` is the published
    manifest (or any JSON-serialisable description). JSON round-trips with to_json/from_json.
    """

    uri: str
    manifest: dict = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"uri": self.uri, "manifest": self.manifest}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> TransitRef:
        return cls(uri=str(d["uri"]), manifest=dict(d.get("manifest") or {}))

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, default=str)

    @classmethod
    def from_json(cls, s: str | bytes) -> TransitRef:
        return cls.from_dict(json.loads(s))


class TransitAssetMissing(TransitObjectMissing):
    """load_input found no stored value for an upstream asset (partition)."""


def partition_path(partition_key: str) -> str:
    """Key path of a partition: multi-partition keys become '<v1>/<v2>' (dimensions sorted by name)."""
    if isinstance(partition_key, dg.MultiPartitionKey):
        return "/".join(v for _, v in sorted(partition_key.keys_by_dimension.items()))
    return partition_key


def _is_dataframe(obj: Any) -> bool:
    try:
        import pandas as pd
    except ImportError:  # pragma: no cover
        return False
    return isinstance(obj, pd.DataFrame)


def _is_dataframe_type(tp: Any) -> bool:
    try:
        import pandas as pd
    except ImportError:  # pragma: no cover
        return False
    return isinstance(tp, type) and issubclass(tp, pd.DataFrame)


def _is_dict_type(tp: Any) -> bool:
    return tp is dict or getattr(tp, "__origin__", None) in (dict, Mapping)


class TransitIOManager(dg.ConfigurableIOManager):
    """Stores asset values in the transit bucket: DataFrames as Parquet (readable by pandas, pyarrow,
    duckdb straight from the bucket URI), :class:`TransitRef` as JSON, ``None`` as nothing, anything
    else pickled. Needs only the transit resource::

        transit = bucket_from_env()
        Definitions(..., resources={"transit": transit, "io_manager": TransitIOManager(transit=transit)})
    """

    transit: TransitBucketResource

    # ---- locations ------------------------------------------------------------------------------

    @property
    def bucket(self) -> TransitBucket:
        return self.transit.get_bucket()

    def key_for(
        self, asset_key: dg.AssetKey | Sequence[str] | str, partition: str | None, suffix: str
    ) -> str:
        """Bucket key of an asset (partition) value with a given suffix."""
        if isinstance(asset_key, str):
            path = dg.AssetKey.from_user_string(asset_key).path
        elif isinstance(asset_key, dg.AssetKey):
            path = asset_key.path
        else:
            path = list(asset_key)
        return asset_object_key(path, partition_path(partition) if partition is not None else None, suffix)

    def uri_for(
        self,
        asset_key: dg.AssetKey | Sequence[str] | str,
        partition: str | None = None,
        suffix: str = PARQUET,
    ) -> str:
        """URI of an asset (partition) value, e.g. to read it with duckdb/pandas outside Dagster."""
        return self.bucket.uri(self.key_for(asset_key, partition, suffix))

    @staticmethod
    def _op_key(identifier: Sequence[str], suffix: str) -> str:
        parts = [escape_partition(str(p)) for p in identifier]
        parts[-1] = parts[-1] + suffix
        return join_key("runs", *parts)

    def _output_base(self, context: dg.OutputContext) -> tuple[Any, str | None]:
        """(asset key or op identifier, partition path or None)."""
        if context.has_asset_key:
            partition = None
            if context.has_asset_partitions:
                keys = list(context.asset_partition_keys)
                if len(keys) != 1:
                    raise dg.DagsterInvariantViolationError(
                        f"TransitIOManager stores one partition per output, but {context.asset_key.to_user_string()} "
                        f"produced {len(keys)} partitions in one step (a single-run backfill). Launch the "
                        "backfill as one run per partition, or write the data yourself and return None."
                    )
                partition = keys[0]
            return context.asset_key, partition
        return tuple(context.get_identifier()), None

    def _key(self, base: Any, partition: str | None, suffix: str) -> str:
        if isinstance(base, dg.AssetKey):
            return self.key_for(base, partition, suffix)
        return self._op_key(base, suffix)

    # ---- output ---------------------------------------------------------------------------------

    def handle_output(self, context: dg.OutputContext, obj: Any) -> None:
        if obj is None:
            return  # nothing stored (assets that write through the bucket themselves return None)
        base, partition = self._output_base(context)
        bucket = self.bucket
        metadata: dict[str, Any] = {}
        if _is_dataframe(obj):
            key = self._key(base, partition, PARQUET)
            buf = io.BytesIO()
            obj.to_parquet(buf, engine="pyarrow")
            data = buf.getvalue()
            bucket.put_bytes(key, data)
            metadata.update(
                {
                    "rows": dg.MetadataValue.int(len(obj)),
                    "columns": dg.MetadataValue.int(len(obj.columns)),
                    "dagster/row_count": dg.MetadataValue.int(len(obj)),
                    "dagster/column_schema": dg.TableSchema(
                        columns=[dg.TableColumn(name=str(c), type=str(t)) for c, t in obj.dtypes.items()]
                    ),
                    "bytes": dg.MetadataValue.int(len(data)),
                }
            )
        elif isinstance(obj, TransitRef):
            key = self._key(base, partition, REF)
            bucket.put_bytes(key, obj.to_json().encode("utf-8"))
            metadata.update(
                {
                    "target_uri": dg.MetadataValue.path(obj.uri),
                    "manifest": dg.MetadataValue.json(obj.manifest),
                }
            )
        else:
            key = self._key(base, partition, PICKLE)
            bucket.put_bytes(key, pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
        uri = bucket.uri(key)
        context.log.debug(f"TransitIOManager: wrote {uri}")
        context.add_output_metadata({"uri": dg.MetadataValue.path(uri), **metadata})

    # ---- input ----------------------------------------------------------------------------------

    def load_input(self, context: dg.InputContext) -> Any:
        typing_type = context.dagster_type.typing_type
        if context.has_asset_key and context.has_asset_partitions:
            keys = list(context.asset_partition_keys)
            if not keys:
                return None
            allow_missing = bool((context.definition_metadata or {}).get("allow_missing_partitions", False))
            if len(keys) == 1 and not _is_dict_type(typing_type):
                return self._load_one(context, context.asset_key, keys[0], typing_type)
            out = {}
            value_type = Any
            args = getattr(typing_type, "__args__", None)
            if _is_dict_type(typing_type) and args and len(args) == 2:
                value_type = args[1]
            for pk in keys:
                try:
                    out[pk] = self._load_one(context, context.asset_key, pk, value_type)
                except TransitAssetMissing:
                    if not allow_missing:
                        raise
                    context.log.warning(
                        f"partition {pk!r} of {context.asset_key.to_user_string()} is missing; skipped"
                    )
            return out
        if context.has_asset_key:
            return self._load_one(context, context.asset_key, None, typing_type)
        upstream = context.upstream_output
        if upstream is None:  # pragma: no cover
            raise dg.DagsterInvariantViolationError("TransitIOManager: input has no upstream output")
        return self._load_one(context, tuple(upstream.get_identifier()), None, typing_type)

    def _load_one(self, context: dg.InputContext, base: Any, partition: str | None, typing_type: Any) -> Any:
        if _is_dataframe_type(typing_type):
            suffixes = [PARQUET]
        elif typing_type is TransitRef:
            suffixes = [REF]
        else:
            suffixes = [PARQUET, REF, PICKLE]
        bucket = self.bucket
        for suffix in suffixes:
            key = self._key(base, partition, suffix)
            try:
                data = bucket.get_bytes(key)
            except TransitObjectMissing:
                continue
            context.log.debug(f"TransitIOManager: loading {bucket.uri(key)}")
            if suffix == PARQUET:
                import pandas as pd

                return pd.read_parquet(io.BytesIO(data))
            if suffix == REF:
                return TransitRef.from_json(data)
            return pickle.loads(data)
        raise self._missing(context, base, partition, [self._key(base, partition, s) for s in suffixes])

    def _missing(
        self, context: dg.InputContext, base: Any, partition: str | None, keys: list[str]
    ) -> TransitAssetMissing:
        bucket = self.bucket
        uris = [bucket.uri(k) for k in keys]
        if isinstance(base, dg.AssetKey):
            what = f"upstream asset '{base.to_user_string()}'"
            part = f" partition '{partition}'" if partition is not None else ""
            fix = f"Materialize '{base.to_user_string()}'{part} first, then run this again."
        else:
            what = f"upstream output {'/'.join(map(str, base))}"
            part = ""
            fix = "Re-execute the upstream step first."
        looked = uris[0] if len(uris) == 1 else uris[0] + " (also tried " + ", ".join(uris[1:]) + ")"
        return TransitAssetMissing(
            keys[0],
            uris[0],
            f"Cannot load input '{context.name}': {what}{part} has never been materialized into the "
            f"transit bucket (looked for {looked}). {fix}",
        )
