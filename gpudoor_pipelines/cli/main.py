"""``gpudoor``: the command line of the package, for people and agents.

gpudoor flow                 materialize the whole flow on this machine and print the result
gpudoor caption SRC --name N caption a folder, S3 prefix or table of images now: register, caption, merge
gpudoor where SPEC [...]     explain where a task spec would run and what it would get
gpudoor check                check every task spec and the fleet file
gpudoor rules [--check]      write docs/rules.md, the fleet's rules as one page (--check: fail if stale)
gpudoor demo stop [NAME]     stop a demo
gpudoor launch SPEC [...]    launch a task file as an ad-hoc job through the same door (--json for agents)
gpudoor status [JOB]         a job's state, or your recent jobs
gpudoor logs JOB [--follow]  a job's log
gpudoor cancel JOB           cancel a job and wait until it has ended
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpudoor_pipelines.cli import housekeeping
from gpudoor_pipelines.launch.errors import LaunchConfigError


def _watched(args: argparse.Namespace, log_name: str, run: Callable[..., Any]) -> tuple[Path, Any] | None:
    """Calls ``run(defs, instance, watch=..., console_log_level=...)`` on the Dagster instance of
    ``$DAGSTER_HOME``, one live line per step, Dagster's event log in a file (``--verbose``: here). Returns
    the home and what ``run`` returned, or None when a step failed (said on stderr, with the fix)."""
    import datetime
    import logging
    import warnings

    if not args.verbose:  # one line per step: the library's own chatter goes to the event log or nowhere
        warnings.simplefilter("ignore")
        logging.getLogger("alembic").setLevel(logging.WARNING)

    import dagster as dg

    from gpudoor_pipelines.assets.concurrency import sync_pool_limits
    from gpudoor_pipelines.cli.flow import FlowFailed
    from gpudoor_pipelines.cli.progress import FlowProgress
    from gpudoor_pipelines.definitions import defs

    home = _dagster_home()
    log_path = home / "logs" / f"{log_name}-{datetime.datetime.now(datetime.UTC):%Y%m%d-%H%M%S}.log"
    with dg.DagsterInstance.get() as instance:
        sync_pool_limits(instance)
        progress = FlowProgress(instance, log_path)
        if not args.verbose:
            print(f"Dagster's event log: {log_path}  (--verbose streams it here)", flush=True)
        try:
            result = run(defs, instance, watch=progress.watch, console_log_level=None if args.verbose else "CRITICAL")
        except FlowFailed as e:
            print(f"\nfailed: {e.label} (run {e.run_id})\n{e.why}\n\nevent log: {log_path}", file=sys.stderr)
            return None
        finally:
            progress.close()
    print()
    return home, result


def _cmd_flow(args: argparse.Namespace) -> int:
    from gpudoor_pipelines.cli.flow import run_flow

    run_config = {"dataset_shards": {"num_images": args.images}} if args.images is not None else None
    done = _watched(args, "flow", lambda *a, **kw: run_flow(*a, run_config=run_config, **kw))
    if done is None:
        return 1
    home, summary = done
    print(f"best checkpoint : {summary.best_checkpoint}")
    print(f"accuracy        : {summary.accuracy:.3f} (held-out)")
    print(f"demo            : {summary.demo_url}  (cluster {summary.demo_cluster})")
    print(f"runs recorded in: {home}  (open them with: dagster dev)")
    print(f"stop the demo   : gpudoor demo stop {summary.demo_cluster}")
    return 0


def _cmd_caption(args: argparse.Namespace) -> int:
    from gpudoor_pipelines.cli.flow import run_caption

    done = _watched(
        args,
        "caption",
        lambda *a, **kw: run_caption(*a, source=args.source, name=args.name, shard_size=args.shard_size, **kw),
    )
    if done is None:
        return 1
    home, summary = done
    print(f"captions        : {summary.dataset_uri}")
    print(
        f"images          : {summary.rows} ({summary.images_skipped} skipped), in {summary.shards} shards "
        f"({summary.shards_captioned_now} captioned now)"
    )
    if summary.shards_missing:
        print(f"not captioned   : {summary.shards_missing} shards (run the command again to finish them)")
    print(f"runs recorded in: {home}  (open them with: dagster dev)")
    return 1 if summary.shards_missing else 0


def _dagster_home() -> Path:
    """``$DAGSTER_HOME``, or ``~/.gpudoor/dagster_home`` with the project's instance settings."""
    import shutil

    from gpudoor_pipelines.launch.backends.local_state import default_home
    from gpudoor_pipelines.launch.resolve.fleet import PROJECT_ROOT

    home = Path(os.environ.get("DAGSTER_HOME") or default_home() / "dagster_home")
    home.mkdir(parents=True, exist_ok=True)
    os.environ["DAGSTER_HOME"] = str(home)
    if not (home / "dagster.yaml").exists():
        shutil.copy(PROJECT_ROOT / "dagster.yaml", home / "dagster.yaml")
    return home


def _cmd_pools(args: argparse.Namespace) -> int:
    import dagster as dg

    from gpudoor_pipelines.assets.concurrency import sync_pool_limits

    home = _dagster_home()
    with dg.DagsterInstance.get() as instance:
        for name, limit in sorted(sync_pool_limits(instance).items()):
            print(f"{name}: {limit} concurrent step(s)")
    print(f"DAGSTER_HOME={home}")
    return 0


def _cmd_where(args: argparse.Namespace) -> int:
    import json

    from gpudoor_pipelines.cli.explain import explain

    try:
        print(
            explain(
                args.spec,
                step=args.step,
                pool=args.pool,
                infra=args.infra,
                cost_owner=args.cost_owner,
                as_json=args.json,
                fleet_file=args.fleet,
                env=args.env,
            )
        )
    except LaunchConfigError as e:
        if not args.json:
            raise
        problems = [p.as_dict() for p in e.problems]
        print(json.dumps({"error": "refused before launch", **problems[0], "problems": problems}, indent=2))
        return 2
    return 0


def _cmd_check(args: argparse.Namespace) -> int:
    from gpudoor_pipelines.launch.resolve.fleet import DEFAULT_SPECS_DIR, load_fleet
    from gpudoor_pipelines.launch.resolve.routing import route
    from gpudoor_pipelines.launch.resolve.specs import load_spec

    specs_dir = Path(args.specs_dir) if args.specs_dir else DEFAULT_SPECS_DIR
    fleet = load_fleet(specs_dir / "fleet.yaml")
    for path in sorted(specs_dir.glob("*.yaml")):
        if path.name == "fleet.yaml":
            continue
        r = route(load_spec(path, skypilot=True), fleet, step=path.stem)
        print(f"ok  {path.name:12s} → {r.pool.name} ({r.infra}, {r.describe()})")
    return 0


def _cmd_rules(args: argparse.Namespace) -> int:
    from gpudoor_pipelines.cli.rules_page import DEFAULT_RULES_PAGE, render_file

    out = Path(args.out) if args.out else DEFAULT_RULES_PAGE
    page = render_file(args.fleet)
    if args.check:
        if not out.is_file() or out.read_text() != page:
            command = " ".join(
                [
                    "gpudoor rules",
                    *(["--fleet", args.fleet] if args.fleet else []),
                    *(["--out", args.out] if args.out else []),
                ]
            )
            print(f"{args.out or 'docs/rules.md'} is stale: run `{command}` and commit it", file=sys.stderr)
            return 1
        return 0
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(page)
    print(f"wrote {out}")
    return 0


def _answer(args: argparse.Namespace, payload: dict, human: str, code: int = 0) -> int:
    import json

    print(json.dumps(payload, default=str) if args.json else human, file=args.answers, flush=True)
    return code


def _door(args: argparse.Namespace, fn) -> int:
    """Runs an agent command; a refusal, an unreachable server or an unknown job is an answer, not a traceback.

    With ``--json`` stdout holds only the answers, one JSON object a line: what the SDK and libraries print
    goes to stderr, and their logging is off unless ``--verbose``."""
    import contextlib
    import json
    import logging

    from gpudoor_pipelines.cli.agent import DoorError

    args.answers = sys.stdout
    with contextlib.ExitStack() as stack:
        if args.json:
            stack.enter_context(contextlib.redirect_stdout(sys.stderr))
            if not args.verbose:
                logging.disable(logging.INFO)
                stack.callback(logging.disable, logging.NOTSET)
        try:
            return fn()
        except DoorError as e:
            error = e
    p = error.payload
    if args.json:
        print(json.dumps(p, default=str), file=args.answers, flush=True)
        return error.code
    where = f"{p['file']}: field '{p['field']}': " if p.get("file") else ""
    print(
        f"error: {p['error']}: {where}{p['problem']}" + (f". Fix: {p['fix']}" if p.get("fix") else ""), file=sys.stderr
    )
    for extra in (p.get("problems") or [])[1:]:
        print(f"  also: field '{extra['field']}': {extra['problem']}. Fix: {extra['fix']}", file=sys.stderr)
    return error.code


def _cmd_launch(args: argparse.Namespace) -> int:
    from gpudoor_pipelines.cli import agent

    def run() -> int:
        launched = agent.launch(
            args.spec,
            step=args.step,
            pool=args.pool,
            infra=args.infra,
            cost_owner=args.cost_owner,
            env=args.env,
            fleet_file=args.fleet,
        )
        what = launched["accelerators"] or "CPU-only"
        code = _answer(
            args,
            launched,
            f"launched job {launched['job_id']} on {launched['pool']} ({launched['infra']}, {what}) "
            f"as {launched['user']}, paid by {launched['cost_owner']}",
        )
        if args.follow:
            return _follow(args, launched["job_id"])
        return code

    return _door(args, run)


def _follow(args: argparse.Namespace, job_id: str) -> int:
    import json

    from gpudoor_pipelines.cli import agent

    def show(line: str) -> None:
        print(json.dumps({"job_id": job_id, "line": line}) if args.json else line, file=args.answers, flush=True)

    info = agent.follow(job_id, show)
    human = f"job {job_id} ended {info['state']}" + (f": {info['meaning']}" if info["failed"] else "")
    _answer(args, info, human)
    return agent.final_code(info)


def _cmd_status(args: argparse.Namespace) -> int:
    from gpudoor_pipelines.cli import agent

    def run() -> int:
        if args.job is not None:  # an empty id (a variable an agent left unset) is no job, not the list
            info = agent.status(args.job)
            human = f"{info['job_id']}  {info['state']}  {info['name']}  {info['infra']}" + (
                f"  ({info['meaning']})" if info["failed"] else ""
            )
            return _answer(args, info, human)
        jobs = agent.recent_jobs(days=args.days)
        human = "\n".join(f"{j['job_id']}  {j['state']:<12} {j['pool']:<10} {j['name']}" for j in jobs) or "no jobs"
        return _answer(args, {"jobs": jobs}, human)

    return _door(args, run)


def _cmd_logs(args: argparse.Namespace) -> int:
    from gpudoor_pipelines.cli import agent

    def run() -> int:
        if args.follow:
            return _follow(args, args.job)
        lines = list(agent.logs(args.job, tail=args.tail))
        return _answer(args, {"job_id": args.job, "lines": lines}, "\n".join(lines))

    return _door(args, run)


def _cmd_cancel(args: argparse.Namespace) -> int:
    from gpudoor_pipelines.cli import agent

    def run() -> int:
        info = agent.cancel(args.job, wait_s=args.wait)
        human = f"job {args.job}: {info['state']}" + (
            "" if info["cancel_confirmed"] else f" (not ended after {args.wait:.0f} s)"
        )
        return _answer(args, info, human)

    return _door(args, run)


def _cmd_demo_stop(args: argparse.Namespace) -> int:
    import dagster as dg

    from gpudoor_pipelines.definitions import defs

    with dg.build_resources({"skypilot": defs.resources["skypilot"]}) as resources:
        stopped = resources.skypilot.stop_service(args.name)
    print(f"stopped {args.name}" if stopped else f"no demo running on {args.name}")
    return 0


def _fleet_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--fleet",
        metavar="FILE",
        help="the team's fleet file, the one its API server's policy reads (default: $GPUDOOR_FLEET_FILE, "
        "else task_specs/fleet.yaml)",
    )


def _image_count(text: str) -> int:
    """``--images N``: a whole number of at least 1 (0 would make no dataset, not the default sample)."""
    try:
        count = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of images") from None
    if count < 1:
        raise argparse.ArgumentTypeError(f"{count}: give at least 1 image (leave --images out for the 96-image sample)")
    return count


class _EnvValue(argparse.Action):
    """``--env NAME=VALUE``, repeatable, into a mapping (an empty value is ``NAME=``)."""

    def __call__(self, parser, namespace, value, option_string=None) -> None:  # noqa: ANN001 - argparse's signature
        name, sep, given = str(value).partition("=")
        if not sep or not name.strip():
            parser.error(f"{option_string} {value!r}: write NAME=VALUE (an empty value: NAME=)")
        setattr(namespace, self.dest, {**(getattr(namespace, self.dest) or {}), name.strip(): given})


def _env_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--env",
        action=_EnvValue,
        default=None,
        metavar="NAME=VALUE",
        help="value for an env the task declares (repeatable); required ones are declared with no value",
    )


def _agent_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="only JSON on stdout, one object a line (for agents)")
    p.add_argument("--verbose", action="store_true", help="with --json: the libraries' logging on stderr")


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``gpudoor`` command."""
    import warnings

    # Dagster's notices that an API of this package's code is in beta or preview are for its authors.
    warnings.filterwarnings("ignore", message=r".* is currently in (beta|preview)")
    parser = argparse.ArgumentParser(prog="gpudoor", description="One door to every GPU.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("flow", help="materialize the whole flow on the configured backend (default: this machine)")
    p.add_argument("--images", type=_image_count, default=None, help="size of the generated dataset (default 96)")
    p.add_argument(
        "--verbose", action="store_true", help="stream Dagster's event log here instead of one line per step"
    )
    p.set_defaults(func=_cmd_flow)
    p = sub.add_parser(
        "caption",
        help="caption a folder, S3 prefix or table of images now: register, caption (the night's waves), merge",
    )
    p.add_argument("source", help="a folder, file:///…, s3://bucket/prefix, or a .parquet/.csv table of image URIs")
    p.add_argument("--name", required=True, help="the dataset's name (lowercase, digits, '-'): shards are NAME-NNNNN")
    p.add_argument("--shard-size", type=_image_count, default=None, help="images per new shard (default 24)")
    p.add_argument(
        "--verbose", action="store_true", help="stream Dagster's event log here instead of one line per step"
    )
    p.set_defaults(func=_cmd_caption)
    p = sub.add_parser("where", help="explain where a task spec would run, and what it would get")
    p.add_argument("spec", help="a task spec: task_specs/eval.yaml or just eval")
    p.add_argument("--step", help="step kind whose route to use (default: route by the GPU the task needs)")
    p.add_argument("--pool", help="explicit pool override")
    p.add_argument("--infra", help="explicit SkyPilot infra override")
    p.add_argument("--cost-owner", help="cost owner label")
    _env_flag(p)
    p.add_argument("--json", action="store_true", help="machine-readable output (for agents)")
    _fleet_flag(p)
    p.set_defaults(func=_cmd_where)
    p = sub.add_parser("pools", help="set Dagster's concurrency pools from the fleet's GPU caps")
    p.set_defaults(func=_cmd_pools)
    p = sub.add_parser("check", help="check every task spec and the fleet file")
    p.add_argument("--specs-dir", default=None)
    p.set_defaults(func=_cmd_check)
    p = sub.add_parser("rules", help="write docs/rules.md: the fleet's pools, routes and rules as one page")
    p.add_argument("--fleet", default=None, help="the fleet file (default task_specs/fleet.yaml)")
    p.add_argument("--out", default=None, help="where to write the page (default docs/rules.md)")
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 if the page differs from a fresh one")
    p.set_defaults(func=_cmd_rules)
    p = sub.add_parser("demo", help="manage demos")
    demo_sub = p.add_subparsers(dest="demo_command", required=True)
    q = demo_sub.add_parser("stop", help="stop a demo")
    q.add_argument("name", nargs="?", default="lab-gpudoor-demo")
    q.set_defaults(func=_cmd_demo_stop)
    p = sub.add_parser("launch", help="launch a task file as an ad-hoc job through the same route, rules and labels")
    p.add_argument("spec", help="a task file (any SkyPilot task YAML) or a shipped spec's name")
    p.add_argument("--step", help="step kind whose route to use (default: route by the GPU the task needs)")
    p.add_argument("--pool", help="explicit pool override")
    p.add_argument("--infra", help="explicit SkyPilot infra override")
    p.add_argument("--cost-owner", help="cost owner label (default: the file's, else the fleet's)")
    _env_flag(p)
    p.add_argument("--follow", action="store_true", help="stream the log until the job ends; exit 3 if it fails")
    _fleet_flag(p)
    _agent_flags(p)
    p.set_defaults(func=_cmd_launch)
    p = sub.add_parser("status", help="a job's state, or your jobs of the last days")
    p.add_argument("job", nargs="?", help="a job id (default: list your recent jobs)")
    p.add_argument("--days", type=float, default=7.0, help="how far back the list goes")
    _agent_flags(p)
    p.set_defaults(func=_cmd_status)
    p = sub.add_parser("logs", help="a job's log")
    p.add_argument("job")
    p.add_argument("--follow", action="store_true", help="stream from the start until the job ends; exit 3 if it fails")
    p.add_argument("--tail", type=int, default=100, help="how many last lines (without --follow)")
    _agent_flags(p)
    p.set_defaults(func=_cmd_logs)
    p = sub.add_parser("cancel", help="cancel a job and wait until it has ended")
    p.add_argument("job")
    p.add_argument("--wait", type=float, default=60.0, help="seconds to wait for the job to end")
    _agent_flags(p)
    p.set_defaults(func=_cmd_cancel)
    housekeeping.add_parser(sub, _dagster_home)
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
