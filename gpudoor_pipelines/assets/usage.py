"""GPU usage: GPU-hours and estimated cost per pool and per asset, from every launch's metadata."""

import datetime as dt

import dagster as dg
import pandas as pd
from pydantic import Field

LAUNCHING_ASSETS = ("caption_shards", "training_run", "checkpoint_evals")


def _num(metadata, key: str) -> float:
    value = metadata.get(key)
    return float(value.value) if value is not None else 0.0


class UsageConfig(dg.Config):
    """Which window to sum over."""

    days: int = Field(default=7, description="Sum launches of the last N days.")


@dg.asset(group_name="usage", kinds={"pandas"})
def gpu_usage(context: dg.AssetExecutionContext, config: UsageConfig) -> pd.DataFrame:
    """GPU-hours and cost estimate per pool and asset over the last days, read from the launches' metadata."""
    since = (dt.datetime.now(dt.UTC) - dt.timedelta(days=config.days)).timestamp()
    rows = []
    for key in LAUNCHING_ASSETS:
        result = context.instance.fetch_materializations(
            dg.AssetRecordsFilter(asset_key=dg.AssetKey(key), after_timestamp=since), limit=10_000
        )
        for record in result.records:
            md = record.asset_materialization.metadata if record.asset_materialization else {}
            if "gpu_hours" not in md:
                continue
            rows.append(
                {
                    "asset": key,
                    "pool": md["pool"].value,
                    # A training's smoke test runs on the same pool and counts towards it.
                    "gpu_hours": _num(md, "gpu_hours") + _num(md, "smoke_gpu_hours"),
                    "cost_usd_estimate": _num(md, "cost_usd_estimate") + _num(md, "smoke_cost_usd_estimate"),
                }
            )
    df = pd.DataFrame(rows, columns=["asset", "pool", "gpu_hours", "cost_usd_estimate"])
    by_pool = df.groupby("pool")[["gpu_hours", "cost_usd_estimate"]].sum().reset_index()
    context.add_output_metadata(
        {
            "launches": len(df),
            "gpu_hours": round(float(df["gpu_hours"].sum()), 4),
            "cost_usd_estimate": round(float(df["cost_usd_estimate"].sum()), 4),
            "by_pool": dg.MetadataValue.md(
                "| pool | GPU-hours | cost (USD) |\n|---|---|---|\n"
                + "\n".join(f"| {r.pool} | {r.gpu_hours:.4f} | {r.cost_usd_estimate:.2f} |" for r in by_pool.itertuples())
            ),
        }
    )
    return df
