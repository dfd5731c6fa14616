"""Wait until the test bed's SkyPilot API server can place work on every Slurm partition of the bed.

Run by testbed/up.sh with the client environment (testbed/.state/env) loaded. Uses the
SkyPilot Python SDK only:
  1. the API server answers (``sky.api_info``),
  2. ``sdk.check(('slurm',))`` reports Slurm enabled,
  3. ``sdk.slurm_node_info`` shows, for each ``INFRA=ACCELERATOR`` argument, a node of that
     partition with that GPU,
  4. ``sky.optimize`` finds a placement for each of them (an admin policy refusing the bare
     probe task counts as an answer).

Before that, once the server answers: a warm pool the previous server was shutting down when it was
stopped stays SHUTTING_DOWN for good (its controller process died with that server) and takes the
server's only pool slot; it is purged (``sky.jobs.pool_down(purge=True)``, SkyPilot's own way out).

Usage: python wait_ready.py --timeout 180 --cluster gpudoor-bed slurm/gpudoor-bed/onprem=L4:1 \
    slurm/gpudoor-bed/h200=H200:1 slurm/gpudoor-bed/east=L4:1 slurm/gpudoor-bed/west=L4:1
Exit status 0 when everything is usable, 1 otherwise (reason on stderr).
"""

import argparse
import io
import os
import re
import sys
import time


def _log(msg: str) -> None:
    print(f"[wait_ready {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _retry(what: str, fn, deadline: float, pause: float = 3.0):
    last: BaseException | None = None
    while time.time() < deadline:
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - report the last one
            last = e
            _log(f"{what}: not yet ({type(e).__name__}: {str(e).strip()[:300]})")
            time.sleep(pause)
    raise TimeoutError(f"{what} did not succeed in time; last error: {last!r}")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--timeout", type=float, default=180)
    parser.add_argument("--cluster", required=True)
    parser.add_argument("placements", nargs="+", help="INFRA=ACCELERATORS")
    args = parser.parse_args()
    deadline = time.time() + args.timeout
    t0 = time.time()

    import sky  # after argparse: ~2 s
    from sky.client import sdk  # `sky.check` is also a module name: call the SDK functions here

    def _health():
        info = sky.api_info()
        status = getattr(info, "status", None)
        if str(getattr(status, "value", status)).lower() != "healthy":
            raise RuntimeError(f"API server status {status}")
        return info

    info = _retry("API server health", _health, deadline, pause=1.0)
    _log(f"API server healthy (version {getattr(info, 'version', '?')}) after {time.time() - t0:.1f}s")
    for pool in sdk.get(sky.jobs.pool_status(None)):
        if str(pool["status"].value) == "SHUTTING_DOWN" and not _alive(pool.get("controller_pid")):
            sdk.get(sky.jobs.pool_down(pool["name"], purge=True))
            _log(f"purged warm pool {pool['name']}: left shutting down by the previous server")

    def _check():
        result = sdk.get(sdk.check(("slurm",), verbose=False))
        enabled = {cloud.lower() for per_ws in result.values() for cloud in per_ws}
        if "slurm" not in enabled:
            raise RuntimeError(f"sky.check result has no Slurm: {result}")
        return result

    result = _retry("sky.check slurm", _check, deadline)
    _log(f"sky.check: {result} after {time.time() - t0:.1f}s")

    placements = [(infra, acc) for infra, _, acc in (p.partition("=") for p in args.placements)]

    def _nodes():
        nodes = sdk.get(sdk.slurm_node_info(slurm_cluster_name=args.cluster))
        for infra, accelerators in placements:
            partition = infra.split("/")[2]
            gpu, _, count = accelerators.partition(":")
            if not any(
                (n.get("partition") or "").rstrip("*") == partition
                and (n.get("gpu_type") or "").lower() == gpu.lower()
                and (n.get("total_gpus") or 0) >= int(count or 1)
                for n in nodes
            ):
                raise RuntimeError(f"no node with {accelerators} in partition {partition}: {nodes}")
        return nodes

    nodes = _retry("sdk.slurm_node_info shows the GPU nodes", _nodes, deadline)
    for node in nodes:
        _log(
            "node {node_name} partition={partition} state={node_state} gpu={gpu_type} "
            "total={total_gpus} free={free_gpus}".format(
                **{
                    k: node.get(k)
                    for k in ("node_name", "partition", "node_state", "gpu_type", "total_gpus", "free_gpus")
                }
            )
        )

    for infra, accelerators in placements:

        def _optimize(infra=infra, accelerators=accelerators):
            task = sky.Task(name="testbed-ready", run="true")
            # The cost owner the fleet's admin policy demands of every request.
            task.set_resources(
                sky.Resources(infra=infra, accelerators=accelerators, labels={"gpudoor-cost-owner": "ml-research"})
            )
            # The request returns nothing (the server drops the optimized DAG); it raises
            # ResourcesUnavailableError when nothing fits. Keep the optimizer's table.
            out = io.StringIO()
            try:
                sdk.stream_and_get(sdk.optimize(_dag_of(task)), output_stream=out)
            except sky.exceptions.UserRequestRejectedByPolicy as e:
                # An admin policy (GPUDOOR_TESTBED_ADMIN_POLICY) may refuse this bare probe task
                # (labels it demands, ...): the server answered, and the node check above
                # already showed the GPUs of the partition.
                return f"(probe task refused by the admin policy: {str(e).strip()[:200]})"
            text = re.sub(r"\x1b\[[0-9;]*m", "", out.getvalue())
            rows = [" ".join(line.split()) for line in text.splitlines() if "Slurm" in line]
            return rows[-1] if rows else "(feasible)"

        best = _retry(f"placement {accelerators} on {infra}", _optimize, deadline)
        _log(f"{infra} usable for {accelerators}: {best} ({time.time() - t0:.1f}s)")
    return 0


def _alive(pid) -> bool:
    """Whether process ``pid`` of this machine runs (the consolidated controllers are the server's)."""
    if not pid:
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _dag_of(task):
    import sky

    with sky.Dag() as dag:
        dag.add(task)
    return dag


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception as e:  # noqa: BLE001
        _log(f"NOT READY: {type(e).__name__}: {e}")
        sys.exit(1)
