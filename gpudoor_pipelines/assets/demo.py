"""Demo: the best checkpoint served on a ``lab-…`` cluster, its URL recorded."""

import dataclasses

import dagster as dg
from pydantic import Field, field_validator

from gpudoor_pipelines.assets.concurrency import STEP_POOLS
from gpudoor_pipelines.data.housekeeping import restore_command
from gpudoor_pipelines.launch.client import LaunchConfig, PipesSkyPilotClient
from gpudoor_pipelines.transit import tiers
from gpudoor_pipelines.transit.io_manager import TransitRef
from gpudoor_pipelines.transit.resource import TransitBucketResource

DEFAULT_DEMO_CLUSTER = "lab-gpudoor-demo"


class DemoConfig(LaunchConfig):
    """Run config of the demo."""

    cluster_name: str = Field(
        default=DEFAULT_DEMO_CLUSTER, description="Cluster to serve on; demo clusters are named lab-…."
    )
    ttl_hours: float | None = Field(
        default=None,
        description="Hours until the orphan reconciler tears the demo down (default: the fleet's "
        "reconciler.interactive_ttl_hours).",
    )

    @field_validator("cluster_name")
    @classmethod
    def _lab_prefix(cls, value: str) -> str:
        if not value.startswith("lab-"):
            raise ValueError(f"cluster_name '{value}': demo clusters must be named lab-… (e.g. lab-{value})")
        return value


@dg.asset(group_name="demo", kinds={"skypilot"}, pool=STEP_POOLS["demo"])
def demo(
    context: dg.AssetExecutionContext,
    config: DemoConfig,
    skypilot: PipesSkyPilotClient,
    transit: TransitBucketResource,
    best_checkpoint: TransitRef,
) -> dg.MaterializeResult:
    """The best checkpoint behind an HTTP endpoint, for the product team to try; re-materializing replaces it."""
    bucket = transit.get_bucket()
    if tiers.unreadable(bucket, bucket.key_of(best_checkpoint.uri)):
        checkpoint = best_checkpoint.manifest.get("checkpoint", best_checkpoint.uri)
        raise dg.Failure(
            description=f"Nothing was launched: housekeeping moved {checkpoint} to cold storage. "
            f"Fix: {restore_command(checkpoint)}, then materialize demo again."
        )
    inputs = {"CHECKPOINT_URI": best_checkpoint.uri}
    request = skypilot.request(context, "demo", inputs=inputs, config=config, cluster_name=config.cluster_name)
    request = dataclasses.replace(request, ttl_hours=config.ttl_hours)
    service = skypilot.serve(context=context, request=request)
    return dg.MaterializeResult(
        metadata={
            **service.to_metadata(),
            "checkpoint": best_checkpoint.manifest.get("checkpoint", best_checkpoint.uri),
            "stop_with": f"gpudoor demo stop {config.cluster_name}",
        }
    )


class StopDemoConfig(dg.Config):
    """Which demo to stop."""

    cluster_name: str = Field(default=DEFAULT_DEMO_CLUSTER, description="The demo's cluster.")


@dg.op
def stop_demo(context: dg.OpExecutionContext, config: StopDemoConfig, skypilot: PipesSkyPilotClient) -> None:
    """Tears the demo's cluster down."""
    if skypilot.stop_service(config.cluster_name):
        context.log.info(f"Stopped {config.cluster_name}.")
    else:
        context.log.info(f"No demo running on {config.cluster_name}.")


@dg.job(description="Stop a running demo and free its GPU.")
def stop_demo_job() -> None:
    stop_demo()
