"""Benchmark: launch latency through the door, against SkyPilot called bare, on the Slurm test bed.

Runs on the Slurm test bed (``bash testbed/up.sh`` first, as root; ``source testbed/.state/env``).
All in one process, one after the other (each job ends before the next starts: a job still ending
holds its pool's cap).

Submission (``--repeat`` times each):
- bare: ``sky.jobs.launch`` of a tiny task, timed to its job id;
- door, ``live_caps: server`` (the bed's fleet): the same task materialized through
  ``PipesSkyPilotClient`` (spec checks, routing, fleet rules, Pipes session, submission), timed from
  the asset's first line to "Submitted job"; the API server's policy counts what is held;
- door, ``live_caps: launcher``: the same, the launcher reading what is held before it launches;
- door, shipped settings (``live_caps: server``, a weekly budget for the cost owner, the caption route's two
  pools to choose among by the GPUs free now): once as a machine's first step (no figures kept: the week's
  history is read before the launch), once as a next step (a new process on the same machine: the figures
  kept under ``$GPUDOOR_HOME/cache``).
Those jobs are cancelled once submitted.

End to end (``--e2e``), one 5-second task each, from the call to the job's end:
- the door, managed job: asset start to materialization (SkyPilot recovers it, cancel from anywhere);
- the door, the step launched as a cluster (the fleet's ``launch_as``, as the smoke test is): asset start
  to materialization; the door relaunches it after a preemption, cancel tears it down, the orphan
  reconciler catches it if the step dies. Its ``sky.down`` is sent when the job ends and not waited
  for: the time until the cluster is gone is printed beside it;
- bare managed job: ``sky.jobs.launch`` polled until it ends;
- launch, tail, down, the pattern of other orchestrator integrations: ``sky.launch`` on a cluster,
  ``sky.tail_logs``, ``sky.down`` (no recovery: a preempted cluster is a failed step).

    .venv/bin/python benchmarks/launch_latency.py [--repeat 2] [--e2e]
"""

import argparse
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import dagster as dg
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from gpudoor_pipelines.launch import sky_env  # noqa: E402
from gpudoor_pipelines.launch.backends import local as _local  # noqa: E402,F401
from gpudoor_pipelines.launch.client import PipesSkyPilotClient  # noqa: E402
from gpudoor_pipelines.transit.resource import TransitBucketResource  # noqa: E402

LONG_RUN, SHORT_RUN = "sleep 300", "sleep 5"
OWNER = {"gpudoor-cost-owner": "ml-research"}


def _terminal(job_ids: list[int]) -> bool:
    import sky

    records, *_ = sky.get(
        sky.jobs.queue_v2(refresh=False, all_users=True, job_ids=job_ids, fields=["job_id", "status"])
    )
    return all(r.status.is_terminal() for r in records)


def cancel_and_wait(job_ids: list[int]) -> None:
    """Cancels the jobs and waits until they have ended (outside the timing)."""
    import sky

    sky.get(sky.jobs.cancel(job_ids=job_ids))
    while not _terminal(job_ids):
        time.sleep(1)


def _task(run: str, infra: str):
    import sky

    task = sky.Task(name="bench-bare", run=run)
    task.set_resources(sky.Resources(infra=infra, accelerators="L4:1", labels=OWNER))
    return task


def bare_submit(infra: str) -> float:
    import sky

    start = time.perf_counter()
    job_ids, _ = sky.get(sky.jobs.launch(_task(LONG_RUN, infra), name="bench-bare"))
    elapsed = time.perf_counter() - start
    cancel_and_wait(job_ids)
    return elapsed


def bare_end_to_end(infra: str) -> float:
    import sky

    start = time.perf_counter()
    job_ids, _ = sky.get(sky.jobs.launch(_task(SHORT_RUN, infra), name="bench-bare-e2e"))
    while not _terminal(job_ids):
        time.sleep(1)
    return time.perf_counter() - start


def launch_tail_down(infra: str) -> float:
    import sky

    cluster = f"bench-ltd-{uuid.uuid4().hex[:6]}"
    start = time.perf_counter()
    job_id, _ = sky.get(sky.launch(_task(SHORT_RUN, infra), cluster_name=cluster))
    sky.tail_logs(cluster, job_id, follow=True)
    sky.get(sky.down(cluster))
    return time.perf_counter() - start


def fleet_file(tmp: Path, live_caps: str, launch_as: str = "managed", *, shipped: bool = False) -> Path:
    fleet = yaml.safe_load((REPO / "testbed" / "fleet.yaml").read_text())
    if shipped:  # what the shipped fleet adds to a launch: a budget to weigh (the route has two pools already)
        fleet["sharing"] = {**fleet.get("sharing", {}), "budgets": {"ml-research": {"gpu_hours": 1000, "usd": 5000}}}
    else:
        fleet.pop("sharing", None)
    path = tmp / f"fleet-{live_caps}-{launch_as}{'-shipped' if shipped else ''}.yaml"
    path.write_text(yaml.safe_dump({**fleet, "live_caps": live_caps, "launch_as": {"caption": launch_as}}))
    return path


def forget_figures(home: Path, *, machine_too: bool) -> None:
    """A new step process: the week's figures kept in this process are gone; with ``machine_too``, a machine's
    first step: the ones kept under ``$GPUDOOR_HOME/cache`` too (the rest of that cache, SkyPilot's reading of
    task files, stays: it is no cost of the figures)."""
    from gpudoor_pipelines.launch import ledger

    ledger._FIGURES.clear()  # noqa: SLF001 - what a new process starts with
    if machine_too:
        for kept in (home / "cache").glob("ledger-*.json"):
            kept.unlink()


def cluster_gone_after(started: float, job_id: str) -> float:
    """Seconds from ``started`` until the job's step cluster is gone from ``sky.status``."""
    import sky

    cluster = job_id.split("/")[0]
    while sky.get(sky.status(cluster_names=[cluster], all_users=True)):
        time.sleep(1)
    return time.perf_counter() - started


def through_resource(
    endpoint: str, specs: Path, transit_root: Path, fleet: Path, *, end_to_end: bool = False, marks: dict | None = None
) -> float:
    marks = {} if marks is None else marks

    @dg.asset
    def bench(context: dg.AssetExecutionContext, skypilot: PipesSkyPilotClient) -> dg.MaterializeResult:
        marks["start"] = time.perf_counter()
        backend = skypilot.get_backend()
        submit = backend.submit

        def timed_submit(job):
            job_id = submit(job)
            marks["submitted"], marks["job_id"] = time.perf_counter(), job_id
            if not end_to_end:
                cancel_and_wait([int(job_id)])
            return job_id

        backend.submit = timed_submit
        skypilot.__class__.get_backend = lambda self: backend  # the timed backend for this launch
        # Submission only: the job is cancelled on purpose once submitted; the step fails, the times are kept.
        result = skypilot.run(context=context, request=skypilot.request(context, "caption")).get_materialize_result()
        marks["ended"] = time.perf_counter()
        return result

    resource = PipesSkyPilotClient(
        backend="skypilot",
        api_server_endpoint=endpoint,
        fleet_file=str(fleet),
        specs_dir=str(specs),
        transit=TransitBucketResource(local_root=str(transit_root)),
        poll_interval_s=1.0,
    )
    original = PipesSkyPilotClient.get_backend
    try:
        dg.materialize([bench], resources={"skypilot": resource}, raise_on_error=False)
    finally:
        PipesSkyPilotClient.get_backend = original
    return marks["ended" if end_to_end else "submitted"] - marks["start"]


def _specs(root: Path, run: str) -> Path:
    specs = root / run.replace(" ", "-")
    specs.mkdir()
    (specs / "caption.yaml").write_text(
        yaml.safe_dump({"name": "bench", "resources": {"accelerators": "L4:1"}, "run": run})
    )
    return specs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--e2e", action="store_true", help="also time a 5-second task end to end, three ways")
    args = parser.parse_args()
    sky_env.prepare()
    endpoint = os.environ.get("SKYPILOT_API_SERVER_ENDPOINT")
    infra = os.environ.get("GPUDOOR_TESTBED_INFRA_ONPREM", "slurm/gpudoor-bed/onprem")
    if not endpoint:
        print("source testbed/.state/env first (SKYPILOT_API_SERVER_ENDPOINT is not set)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        long_specs, transit = _specs(root, LONG_RUN), root / "transit"
        server, launcher = fleet_file(root, "server"), fleet_file(root, "launcher")
        shipped = fleet_file(root, "server", shipped=True)
        home = root / "home"
        os.environ["GPUDOOR_HOME"] = str(home)
        times: dict[str, list[float]] = {k: [] for k in ("bare", "server", "launcher", "first", "next")}
        for _ in range(args.repeat):
            times["bare"].append(bare_submit(infra))
            forget_figures(home, machine_too=True)
            times["first"].append(through_resource(endpoint, long_specs, transit, shipped))
            forget_figures(home, machine_too=False)
            times["next"].append(through_resource(endpoint, long_specs, transit, shipped))
            times["server"].append(through_resource(endpoint, long_specs, transit, server))
            times["launcher"].append(through_resource(endpoint, long_specs, transit, launcher))
        b = statistics.median(times["bare"])
        print(f"submission, median of {args.repeat}:")
        each = ", ".join(f"{x:.2f}" for x in times["bare"])
        print(f"  bare sky.jobs.launch                       : {b:6.2f} s  (each {each})")
        labels = {
            "server": "door, live_caps: server   ",
            "launcher": "door, live_caps: launcher ",
            "first": "door, shipped, first step ",
            "next": "door, shipped, next steps ",
        }
        for name, label in labels.items():
            t = statistics.median(times[name])
            each = ", ".join(f"{x:.2f}" for x in times[name])
            print(f"  {label} asset -> submit : {t:6.2f} s  ({t / b:.2f}x bare; each {each})")
        if args.e2e:
            ltd = launch_tail_down(infra)
            managed = bare_end_to_end(infra)
            short = _specs(root, SHORT_RUN)
            door = through_resource(endpoint, short, transit, server, end_to_end=True)
            marks: dict = {}
            clustered = through_resource(
                endpoint, short, transit, fleet_file(root, "server", "cluster"), end_to_end=True, marks=marks
            )
            gone = cluster_gone_after(marks["start"], marks["job_id"])
            print("end to end, a 5-second task, once each:")
            print(f"  sky.launch + tail_logs + sky.down          : {ltd:6.2f} s")
            print(
                f"  bare sky.jobs.launch, polled to its end    : {managed:6.2f} s  ({managed / ltd:.2f}x "
                "launch-tail-down)"
            )
            print(
                f"  door (managed job), asset -> materialized  : {door:6.2f} s  ({door / ltd:.2f}x launch-tail-down, "
                f"{door / managed:.2f}x bare managed)"
            )
            print(
                f"  door (step cluster), asset -> materialized : {clustered:6.2f} s  ({clustered / ltd:.2f}x "
                "launch-tail-down); "
                f"its cluster gone {gone:6.2f} s after asset start ({gone / ltd:.2f}x)"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
