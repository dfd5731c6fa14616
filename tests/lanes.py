"""``make test``: the test lanes, in two stages, each lane with a bound, and a report that names what failed.

First the tests that need no test bed, in three lanes (a pytest process keeps about half a core busy: its
tests mostly wait on the processes they start); then the bed's tests (``tests/slurm``) in two lanes of their
own, split by the GPUs they hold (``BED_LANES``) so that neither lane's jobs change where the other's land.
The two kinds do not run side by side: the bed's waiting is not free (every look SkyPilot takes at a job is a
Python process), so beside the bed the rest was starved for minutes on a slow runner and missed its bounds, or
took the CPU the bed's timing needed. Each kind alone behaves as it does on a quiet machine, whatever the
runner's speed.

Each lane writes ``<reports>/<lane>.log`` (its whole output) and ``<reports>/<lane>.xml`` (JUnit); at the end
this prints, for every lane that failed, its failures, then one summary: each lane's seconds, CPU-seconds and outcome,
every failed test with the file that holds its log, the reruns, and the ten slowest tests. The summary is also
written to ``<reports>/summary.txt``.

Only a bed lane may rerun a test, once, and only when it failed because the bed's API server refused the
connection (a loaded machine); an assertion failure is never rerun, and a rerun is listed.

When a bed lane runs and the bed is not up, it is brought up first (``testbed/up.sh``, needs root) and taken
down again at the end, so ``make test`` leaves the machine as it found it.

Usage: ``python tests/lanes.py [--reports DIR] [--only LANE ...]``
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
TESTBED = REPO_ROOT / "testbed"
#: Each lane is cut off after this; a test has its own bound (pytest-timeout in pyproject.toml).
LANE_TIMEOUT_S = float(os.environ.get("GPUDOOR_LANE_TIMEOUT_S", "2700"))
#: What a bed test may be rerun for, once: the bed's API server refusing the connection, nothing else.
BED_RERUN = [
    "--reruns",
    "1",
    "--only-rerun",
    r"^(ApiServerConnectionError|ConnectionError|ConnectionRefusedError): .*(refused|Could not connect)",
    "--rerun-except",
    r"^(AssertionError|Failed|Timeout)",
]
SLURM = "tests/slurm"


@dataclasses.dataclass
class Lane:
    """One pytest process: its name, what it runs, and whether it needs the test bed."""

    name: str
    args: list[str]
    bed: bool = False
    proc: subprocess.Popen | None = None
    started: float = 0.0
    seconds: float = 0.0
    #: CPU seconds of the lane's pytest and every process of it that was waited for (a bed lane's SkyPilot
    #: server and jobs are not its own); None when the lane was cut off.
    cpu_s: float | None = None
    code: int | None = None
    cut_off: bool = False


#: The bed's tests in two lanes of about the same length, by the GPUs they hold, so that neither lane's jobs change
#: where the other's land: ``bed-onprem`` holds the onprem pool (a caption night's warm pool, the shard that must
#: find onprem full and spill to inference) and one H200 of the h200 pool for a smoke step; ``bed-h200`` holds
#: the rest of the h200 pool (trainings, the killed run worker's jobs) and the inference GPU a job is evicted
#: from (it moves to spare, the second L4). What both lanes hold at once stays within each pool's cap
#: (testbed/fleet.yaml).
BED_LANES = {
    "bed-onprem": ["test_client_on_slurm.py", "test_step_cluster_on_slurm.py", "test_warm_pool_night_on_slurm.py"],
    "bed-h200": [
        "test_eviction_on_slurm.py",
        "test_preemption_on_slurm.py",
        "test_reconciler_on_slurm.py",
        "test_sharing_on_slurm.py",
    ],
}


#: The rest in three lanes of about the same length: the flows and the programs the jobs run with the transit
#: bucket (``unit-io``), the caption nights and the launcher (``unit-night``), and everything else (``unit``),
#: whose browser tests come last. (Session fixtures stay in one lane: the job environments of tests/workloads,
#: the webserver of tests/e2e.)
IO_TESTS = ["tests/workloads", "tests/transit", "tests/test_flow.py"]
NIGHT_TESTS = ["tests/test_caption_night.py", "tests/launch"]
LAST_TESTS = ["tests/e2e"]
#: Files of the io lane's folders that run in ``unit`` instead, to even the lanes out (no session fixture of theirs).
TO_UNIT = ["tests/transit/test_transit_pipes.py", "tests/transit/test_housekeeping.py"]


def lanes() -> list[Lane]:
    """The lanes, in the order they run: the rest in three lanes, then the bed's tests in two lanes."""
    placed = {name for files in BED_LANES.values() for name in files}
    unplaced = sorted(p.name for p in (REPO_ROOT / SLURM).glob("test_*.py") if p.name not in placed)
    if unplaced:  # a new bed test file must say which lane's GPUs it holds
        raise SystemExit(f"tests/lanes.py: no bed lane for {', '.join(unplaced)}; add it to BED_LANES")
    tests = REPO_ROOT / "tests"
    first = sorted(
        str(p.relative_to(REPO_ROOT))
        for p in [*tests.glob("test_*.py"), *(d for d in tests.iterdir() if d.is_dir() and any(d.rglob("test_*.py")))]
        if str(p.relative_to(REPO_ROOT)) not in (*IO_TESTS, *NIGHT_TESTS, *LAST_TESTS, SLURM)
    )
    return [
        Lane("unit", [*first, *TO_UNIT, *LAST_TESTS]),
        Lane("unit-io", [*IO_TESTS, *(f"--ignore={path}" for path in TO_UNIT)]),
        Lane("unit-night", NIGHT_TESTS),
        *(Lane(name, [f"{SLURM}/{f}" for f in files], bed=True) for name, files in BED_LANES.items()),
    ]


def _bed_is_up() -> bool:
    env = TESTBED / ".state" / "env"
    if not env.is_file():
        return False
    endpoint = next(
        (
            line.split("=", 1)[1]
            for line in env.read_text().splitlines()
            if line.startswith("export SKYPILOT_API_SERVER_ENDPOINT=")
        ),
        "",
    )
    try:
        with urllib.request.urlopen(f"{endpoint}/api/health", timeout=5) as response:
            return response.status == 200
    except (OSError, ValueError):
        return False


def _bring_up_bed(reports: Path) -> bool:
    """Brings the bed up when it is down; returns whether this did (False when it was up, or cannot be)."""
    if os.environ.get("GPUDOOR_SKIP_SLURM") == "1" or _bed_is_up():
        return False
    if os.geteuid() != 0:
        print("the Slurm test bed is down and testbed/up.sh needs root: its tests will skip", flush=True)
        return False
    log = reports / "bed-up.log"
    print(f"bringing the Slurm test bed up (log: {log}) ...", flush=True)
    started = time.monotonic()
    with open(log, "w") as out:
        code = subprocess.call(
            ["bash", "-c", f"bash {TESTBED / 'up.sh'} && bash {TESTBED / 'node_env.sh'}"],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    print(
        f"test bed {'up' if code == 0 else f'FAILED to come up (exit {code})'} in {time.monotonic() - started:.0f} s",
        flush=True,
    )
    return True


def _start(lane: Lane, reports: Path) -> None:
    args = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-rfER",
        "--durations=0",
        f"--junitxml={reports / (lane.name + '.xml')}",
        *lane.args,
        *(BED_RERUN if lane.bed else []),
    ]
    env = {**os.environ, "GPUDOOR_LANE_EVENTS": str(reports / f"{lane.name}.events")}
    out = open(reports / f"{lane.name}.log", "w")  # noqa: SIM115 - closed when the lane ends
    lane.started = time.monotonic()

    def prepare() -> None:
        # A lane started from a background shell would inherit SIGINT ignored, and the Ctrl-C that cuts it
        # off (``_cut_off``) would do nothing.
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)

    lane.proc = subprocess.Popen(
        args,
        cwd=REPO_ROOT,
        stdout=out,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
        preexec_fn=prepare,
    )
    out.close()


def _cut_off(proc: subprocess.Popen) -> int:
    """Stops a lane past its bound: Ctrl-C first (pytest then prints what failed so far), harder after."""
    for sig, grace in ((signal.SIGINT, 60), (signal.SIGTERM, 30), (signal.SIGKILL, 30)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            return proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            continue
    return proc.wait()


def _reap(lane: Lane) -> int | None:
    """The lane's exit code once it ended (None before), and its CPU time from the kernel's account."""
    pid, status, usage = os.wait4(lane.proc.pid, os.WNOHANG)
    if pid == 0:
        return None
    lane.proc.returncode = os.waitstatus_to_exitcode(status)
    lane.cpu_s = usage.ru_utime + usage.ru_stime
    return lane.proc.returncode


def _wait(lane_list: list[Lane]) -> None:
    while any(lane.code is None for lane in lane_list):
        for lane in lane_list:
            if lane.code is not None or lane.proc is None:
                continue
            code = _reap(lane)
            elapsed = time.monotonic() - lane.started
            if code is None and elapsed > LANE_TIMEOUT_S:
                lane.cut_off = True
                code = _cut_off(lane.proc)
            if code is not None:
                lane.code, lane.seconds = code, elapsed
                state = (
                    "passed"
                    if code == 0
                    else f"CUT OFF after {LANE_TIMEOUT_S:.0f} s"
                    if lane.cut_off
                    else f"FAILED (exit {code})"
                )
                print(f"lane {lane.name}: {state} in {elapsed:.0f} s", flush=True)
        time.sleep(1)


@dataclasses.dataclass
class Outcome:
    """What the lanes' JUnit files and logs say."""

    failed: list[tuple[str, str, str]]  # (lane, test id, first line of the failure)
    reruns: list[tuple[str, str]]  # (lane, test id)
    slowest: list[tuple[float, str]]  # (seconds, test id)
    counts: dict[str, dict[str, int]]  # lane -> {passed, failed, skipped, ...}


def read_outcome(lane_list: list[Lane], reports: Path) -> Outcome:
    """What the lanes' event files say (written as each test ends, so a lane cut off says it too)."""
    failed, reruns, times = [], [], []
    counts: dict[str, dict[str, int]] = {}
    for lane in lane_list:
        tally = {"passed": 0, "failed": 0, "skipped": 0}
        events = reports / f"{lane.name}.events"
        lines = events.read_text(errors="replace").splitlines() if events.is_file() else []
        started, ended = [], set()
        setups: dict[str, float] = {}
        for line in lines:
            outcome, when, seconds, test, why = (line.split("\t", 4) + ["", "", "0", "", ""])[:5]
            if outcome == "started":
                started.append(test)
                continue
            if when == "setup" and outcome == "passed":  # a long setup: counted with its test's call
                setups[test] = float(seconds or 0.0)
                continue
            if when == "call" or outcome == "failed":
                ended.add(test)
            if outcome == "rerun":
                reruns.append((lane.name, test))
            elif outcome == "failed":
                tally["failed"] += 1
                failed.append((lane.name, test, (f"in {when}: " if when != "call" else "") + (why or "failed")))
            elif when == "call":
                tally["passed" if outcome == "passed" else "skipped"] += 1
                times.append((float(seconds or 0.0) + setups.get(test, 0.0), test))
        running = next((t for t in reversed(started) if t not in ended), None)
        if lane.cut_off and running:
            failed.append((lane.name, running, f"cut off while it ran (the lane's bound is {LANE_TIMEOUT_S:.0f} s)"))
        elif lane.code not in (0, None) and tally["failed"] == 0:
            failed.append(
                (lane.name, f"(lane {lane.name})", "cut off" if lane.cut_off else f"pytest exited {lane.code}")
            )
        counts[lane.name] = tally
    times.sort(reverse=True)
    return Outcome(failed=failed, reruns=reruns, slowest=times[:10], counts=counts)


def _section(text: str, title: str) -> str:
    """A ``=== title ===`` section of a pytest log (empty when there is none)."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("=") and f" {title} " in line), None)
    if start is None:
        return ""
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("====")), len(lines))
    return "\n".join(lines[start:end])


def summary(lane_list: list[Lane], reports: Path, outcome: Outcome) -> str:
    lines = ["== test lanes"]
    for lane in lane_list:
        c = outcome.counts.get(lane.name, {})
        state = "passed" if lane.code == 0 else "CUT OFF" if lane.cut_off else "FAILED"
        cpu = f"{lane.cpu_s:5.0f} CPU-s" if lane.cpu_s is not None else "    ? CPU-s"
        lines.append(
            f"  {lane.name:<10} {lane.seconds:6.0f} s {cpu}  {state:<8} {c.get('passed', 0)} passed, "
            f"{c.get('failed', 0)} failed, {c.get('skipped', 0)} skipped   (log: {reports / (lane.name + '.log')})"
        )
    lines.append("== ten slowest tests")
    lines += [f"  {seconds:7.1f} s  {test}" for seconds, test in outcome.slowest]
    if outcome.reruns:
        lines.append("== rerun once (the bed's API server refused the connection)")
        lines += [f"  {test}   (lane {lane})" for lane, test in outcome.reruns]
    if outcome.failed:
        lines.append(f"== FAILED: {len(outcome.failed)}")
        lines += [
            f"  FAILED {test} - {why}   (full log: {reports / (lane + '.log')})"
            for lane, test, why in outcome.failed[:20]
        ]
        if len(outcome.failed) > 20:
            lines.append(f"  ... and {len(outcome.failed) - 20} more (see the logs)")
    else:
        lines.append("== every lane passed")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reports", default=str(REPO_ROOT / ".test-reports"))
    parser.add_argument("--only", nargs="*", help="run only these lanes")
    args = parser.parse_args(argv)
    reports = Path(args.reports).resolve()
    reports.mkdir(parents=True, exist_ok=True)
    for old in reports.glob("*"):
        if old.suffix in (".log", ".xml", ".txt", ".json", ".events", ".failures"):
            old.unlink()
    lane_list = [lane for lane in lanes() if not args.only or lane.name in args.only]
    brought_up = any(lane.bed for lane in lane_list) and _bring_up_bed(reports)
    try:
        for stage in (
            [lane for lane in lane_list if not lane.bed],
            [lane for lane in lane_list if lane.bed],
        ):
            for lane in stage:
                _start(lane, reports)
                print(f"lane {lane.name}: {' '.join(lane.args)}  (log: {reports / (lane.name + '.log')})", flush=True)
            _wait(stage)
    finally:
        for lane in lane_list:
            if lane.proc is not None and lane.proc.poll() is None:
                os.killpg(lane.proc.pid, signal.SIGKILL)
        if brought_up:
            print("taking the test bed down again (this run brought it up)", flush=True)
            with open(reports / "bed-down.log", "w") as out:
                subprocess.call(["bash", str(TESTBED / "down.sh")], stdout=out, stderr=subprocess.STDOUT)
    outcome = read_outcome(lane_list, reports)
    for lane in lane_list:
        if lane.code != 0:
            text = (reports / f"{lane.name}.log").read_text(errors="replace")
            details = "\n".join(filter(None, (_section(text, "FAILURES"), _section(text, "ERRORS"))))
            if not details and (reports / f"{lane.name}.events.failures").is_file():
                details = (reports / f"{lane.name}.events.failures").read_text(errors="replace")[-20000:]
            print(f"\n===== lane {lane.name} failed: its failures (whole log: {reports / (lane.name + '.log')})")
            print(details or "\n".join(text.splitlines()[-60:]))
    report = summary(lane_list, reports, outcome)
    (reports / "summary.txt").write_text(report + "\n")
    (reports / "outcome.json").write_text(json.dumps(dataclasses.asdict(outcome), indent=1))
    print("\n" + report, flush=True)
    return 0 if all(lane.code == 0 for lane in lane_list) else 1


if __name__ == "__main__":
    sys.exit(main())
