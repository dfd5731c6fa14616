"""End what the test bed's API server still runs: every user's managed jobs and warm pools.

Run by testbed/down.sh, with the client environment (testbed/.state/env) loaded, while the server still
answers. A managed job or a pool left unfinished in the server's state is not over when the bed goes
down: the next server start recovers it (SkyPilot's controller resumes every unfinished job), and the
next test run finds its GPUs taken. Uses the SkyPilot Python SDK only.

Usage: python end_jobs.py [--timeout 300]
Exit status 0 when nothing is left running, 1 otherwise (what is left on stderr).
"""

import argparse
import sys
import time


def _log(msg: str) -> None:
    print(f"[end_jobs {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _unfinished(sky) -> list:
    records, *_ = sky.get(
        sky.jobs.queue_v2(refresh=False, skip_finished=True, all_users=True, fields=["job_id", "job_name", "status"])
    )
    return [r for r in records if not r.status.is_terminal()]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--timeout", type=float, default=300.0)
    args = parser.parse_args()
    deadline = time.monotonic() + args.timeout
    import sky

    pools = [p["name"] for p in sky.get(sky.jobs.pool_status(None))]
    if pools:
        _log(f"taking down warm pools: {', '.join(pools)}")
        sky.get(sky.jobs.pool_down(None, all=True))
    jobs = _unfinished(sky)
    if jobs:
        _log(f"cancelling managed jobs: {', '.join(str(j.job_id) for j in jobs)}")
        sky.get(sky.jobs.cancel(all=True, all_users=True))
    # Cancelling tears each job's cluster down, as taking a pool down does its workers: a minute or more
    # each, side by side, on a loaded machine.
    while jobs and time.monotonic() < deadline:
        time.sleep(5)
        jobs = _unfinished(sky)
    if jobs:
        _log(f"still unfinished after {args.timeout:.0f} s: {', '.join(f'{j.job_id} {j.status}' for j in jobs)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
