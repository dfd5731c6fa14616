"""``gpudoor housekeeping``: the transit bucket's housekeeping plan for a person or an agent, a plan applied by
hand, and a cold checkpoint restored (the same functions as the ``housekeeping_plan`` and
``housekeeping_applied`` assets, on the bucket and Dagster instance of this environment)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

GiB = 1024**3


def add_parser(sub: Any, dagster_home: Any) -> None:
    """The subcommand; ``dagster_home()`` readies this environment's Dagster instance (the CLI's own)."""
    p = sub.add_parser(
        "housekeeping",
        help="plan what to keep, move to cheaper storage and delete in the transit bucket; apply a plan; restore",
    )
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--plan", action="store_true", help="make a plan now and print it (it is stored in the bucket)")
    what.add_argument("--apply", metavar="PLAN", help="apply a plan made within a day (its key, as --plan prints)")
    what.add_argument("--restore", metavar="CHECKPOINT", help="bring a cold checkpoint (<training>.step-N) back")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    p.add_argument("--rows", type=int, default=20, help="rows of the plan to print besides its totals (not 'keep')")
    p.set_defaults(func=run, dagster_home=dagster_home)


def run(args: argparse.Namespace) -> int:
    import dagster as dg

    from gpudoor_pipelines.assets.housekeeping import protected_now, retention
    from gpudoor_pipelines.data import housekeeping as hk
    from gpudoor_pipelines.data.checkpoints import checkpoint_prefix
    from gpudoor_pipelines.data.housekeeping_apply import PlanNotApplicable, apply_plan
    from gpudoor_pipelines.launch.resolve.fleet import load_fleet
    from gpudoor_pipelines.transit import tiers
    from gpudoor_pipelines.transit.uris import open_bucket, settings_from_env

    bucket = open_bucket(**settings_from_env())
    if args.restore:
        try:
            prefix = checkpoint_prefix(args.restore)
        except ValueError as e:
            return _fail(args, f"--restore: {e}")
        cold = [o.key for o in tiers.list_objects(bucket, prefix + "/") if o.cold]
        restored = tiers.restore(bucket, cold)
        return _print(
            args,
            {"checkpoint": args.restore, "restored_objects": restored},
            f"{args.restore}: {restored} object(s) restored",
        )
    fleet = load_fleet()
    args.dagster_home()
    with dg.DagsterInstance.get() as instance:
        protected = protected_now(instance, fleet)
    if args.apply:
        try:
            result = apply_plan(bucket, args.apply, protected)
        except PlanNotApplicable as e:
            return _fail(args, str(e))
        summary = result.summary()
        return _print(args, summary, _human_totals(summary["by_prefix"], f"applied {args.apply}"))
    plan = hk.make_plan(bucket, retention(fleet), protected)
    summary = plan.summary()
    shown: list[dict] = []
    changes = 0  # rows that change something, counted as they stream by: a plan may name millions
    for batch in hk.plan_rows(bucket, plan.key, [a for a in hk.ACTIONS if a != hk.KEEP]):
        shown.extend(batch[: max(args.rows - len(shown), 0)])
        changes += len(batch)
    payload = {**summary, "plan_uri": bucket.uri(plan.key), "apply_with": f"gpudoor housekeeping --apply {plan.key}"}
    payload["rows"] = shown
    payload["rows_left_out"] = changes - len(shown)
    head = f"plan {plan.key} ({bucket.uri(plan.key)}): {plan.rows} objects, {summary['bytes'] / GiB:.3f} GiB"
    human = _human_totals(summary["by_prefix"], head)
    human += "".join(f"\n  {r['action']:8} {r['key']}  ({r['reason']})" for r in payload["rows"])
    if payload["rows_left_out"]:
        human += f"\n  … {payload['rows_left_out']} more in the plan"
    human += f"\napply it (within a day): {payload['apply_with']}"
    return _print(args, payload, human)


def _human_totals(by_prefix: list[dict], head: str) -> str:
    lines = [head, f"  {'prefix':16} {'action':8} {'objects':>10} {'GiB':>10}"]
    lines += [f"  {r['prefix']:16} {r['action']:8} {r['objects']:>10} {r['bytes'] / GiB:>10.3f}" for r in by_prefix]
    return "\n".join(lines)


def _print(args: argparse.Namespace, payload: dict, human: str) -> int:
    print(json.dumps(payload, default=str) if args.json else human, flush=True)
    return 0


def _fail(args: argparse.Namespace, message: str) -> int:
    """A refusal: one JSON object on stdout with ``--json``, a line on stderr otherwise; exit status 2."""
    if args.json:
        print(json.dumps({"error": "housekeeping", "problem": message}), flush=True)
    else:
        print(f"error: {message}", file=sys.stderr, flush=True)
    return 2
