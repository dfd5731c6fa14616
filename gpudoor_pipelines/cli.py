"""``gpudoor``: the command line of the package, for people and agents.

gpudoor flow                 materialize the whole flow on this machine and print the result
gpudoor where SPEC [...]     explain where a task spec would run and what it would get
gpudoor check                check every task spec and the fleet file
gpudoor demo stop [NAME]     stop a demo
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from gpudoor_pipelines.launch.errors import LaunchConfigError


def _cmd_flow(args: argparse.Namespace) -> int:
    import dagster as dg

    from gpudoor_pipelines.concurrency import sync_pool_limits
    from gpudoor_pipelines.definitions import defs
    from gpudoor_pipelines.flow import run_flow

    home = _dagster_home()
    run_config = {"dataset_shards": {"num_images": args.images}} if args.images else None
    with dg.DagsterInstance.get() as instance:
        sync_pool_limits(instance)
        summary = run_flow(
            defs,
            instance,
            run_config=run_config,
            on_step=lambda s: print(f"==> materializing {s}", flush=True),
        )
    print()
    print(f"best checkpoint : {summary.best_checkpoint}")
    print(f"accuracy        : {summary.accuracy:.3f} (held-out)")
    print(f"demo            : {summary.demo_url}  (cluster {summary.demo_cluster})")
    print(f"runs recorded in: {home}  (open them with: dagster dev)")
    print(f"stop the demo   : gpudoor demo stop {summary.demo_cluster}")
    return 0


def _dagster_home() -> Path:
    """``$DAGSTER_HOME``, or ``~/.gpudoor/dagster_home`` with the project's instance settings."""
    import shutil

    from gpudoor_pipelines.launch.backends.local import default_home
    from gpudoor_pipelines.launch.fleet import PROJECT_ROOT

    home = Path(os.environ.get("DAGSTER_HOME") or default_home() / "dagster_home")
    home.mkdir(parents=True, exist_ok=True)
    os.environ["DAGSTER_HOME"] = str(home)
    if not (home / "dagster.yaml").exists():
        shutil.copy(PROJECT_ROOT / "dagster.yaml", home / "dagster.yaml")
    return home


def _cmd_pools(args: argparse.Namespace) -> int:
    import dagster as dg

    from gpudoor_pipelines.concurrency import sync_pool_limits

    home = _dagster_home()
    with dg.DagsterInstance.get() as instance:
        for name, limit in sorted(sync_pool_limits(instance).items()):
            print(f"{name}: {limit} concurrent step(s)")
    print(f"DAGSTER_HOME={home}")
    return 0


def _cmd_where(args: argparse.Namespace) -> int:
    import json

    from gpudoor_pipelines.explain import explain

    try:
        print(explain(args.spec, step=args.step, pool=args.pool, infra=args.infra, cost_owner=args.cost_owner,
                      as_json=args.json))  # fmt: skip
    except LaunchConfigError as e:
        if not args.json:
            raise
        problems = [p.as_dict() for p in e.problems]
        print(json.dumps({"error": "refused before launch", **problems[0], "problems": problems}, indent=2))
        return 2
    return 0


def _cmd_check(args: argparse.Namespace) -> int:
    from gpudoor_pipelines.launch.fleet import DEFAULT_SPECS_DIR, load_fleet
    from gpudoor_pipelines.launch.routing import route
    from gpudoor_pipelines.launch.specs import load_spec

    specs_dir = Path(args.specs_dir) if args.specs_dir else DEFAULT_SPECS_DIR
    fleet = load_fleet(specs_dir / "fleet.yaml")
    for path in sorted(specs_dir.glob("*.yaml")):
        if path.name == "fleet.yaml":
            continue
        r = route(load_spec(path, skypilot=True), fleet, step=path.stem)
        print(f"ok  {path.name:12s} → {r.pool.name} ({r.infra}, {r.describe()})")
    return 0


def _cmd_demo_stop(args: argparse.Namespace) -> int:
    import dagster as dg

    from gpudoor_pipelines.definitions import defs

    with dg.build_resources({"skypilot": defs.resources["skypilot"]}) as resources:
        stopped = resources.skypilot.stop_service(args.name)
    print(f"stopped {args.name}" if stopped else f"no demo running on {args.name}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``gpudoor`` command."""
    parser = argparse.ArgumentParser(prog="gpudoor", description="One door to every GPU.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser(
        "flow", help="materialize the whole flow on the configured backend (default: this machine)"
    )
    p.add_argument("--images", type=int, default=None, help="size of the generated dataset (default 96)")
    p.set_defaults(func=_cmd_flow)
    p = sub.add_parser("where", help="explain where a task spec would run, and what it would get")
    p.add_argument("spec", help="a task spec: task_specs/eval.yaml or just eval")
    p.add_argument("--step", help="step kind whose route to use (default: route by the GPU the task needs)")
    p.add_argument("--pool", help="explicit pool override")
    p.add_argument("--infra", help="explicit SkyPilot infra override")
    p.add_argument("--cost-owner", help="cost owner label")
    p.add_argument("--json", action="store_true", help="machine-readable output (for agents)")
    p.set_defaults(func=_cmd_where)
    p = sub.add_parser("pools", help="set Dagster's concurrency pools from the fleet's GPU caps")
    p.set_defaults(func=_cmd_pools)
    p = sub.add_parser("check", help="check every task spec and the fleet file")
    p.add_argument("--specs-dir", default=None)
    p.set_defaults(func=_cmd_check)
    p = sub.add_parser("demo", help="manage demos")
    demo_sub = p.add_subparsers(dest="demo_command", required=True)
    q = demo_sub.add_parser("stop", help="stop a demo")
    q.add_argument("name", nargs="?", default="lab-gpudoor-demo")
    q.set_defaults(func=_cmd_demo_stop)
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except LaunchConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
