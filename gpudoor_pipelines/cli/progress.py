"""One live line per step for ``gpudoor flow``, and the whole Dagster event log in a file.

While a step's run executes, a watcher reads the run's events from the Dagster instance (the same
events the UI shows) and keeps one line up to date: the step (asset and partition), the pool, the
job id, the state and the time elapsed. Every event goes to the log file, in Dagster's own words.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import re
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

import dagster as dg

_LAUNCHING = re.compile(r"[Ll]aunching .*?(?: \((\w+) step\))? on pool '([^']+)'")
#: Steps a step's line names while their job runs: a step that launches more than one job (training's smoke
#: test, then its run) shows which one it is at.
_NAMED_STEPS = {"smoke": "smoke test"}
_SUBMITTED = re.compile(r"Submitted jobs? (\S+?)\.?$")
_STATE = re.compile(r"\b(PENDING|STARTING|RUNNING|RECOVERING|CANCELLING|SUCCEEDED|FAILED\w*|CANCELLED)\b")


class FlowProgress:
    """Watches each run of the flow: a live line on ``out``, every event in ``log_path``."""

    def __init__(
        self, instance: dg.DagsterInstance, log_path: Path, out: TextIO | None = None, poll_s: float = 0.5
    ) -> None:
        self.instance = instance
        self.log_path = log_path
        self.out = out or sys.stdout
        self.poll_s = poll_s
        self.live = self.out.isatty()
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = log_path.open("a", encoding="utf-8")

    def close(self) -> None:
        """Closes the log file."""
        self._log.close()

    @contextlib.contextmanager
    def watch(self, label: str, run_id: str) -> Iterator[None]:
        """Keeps the step's line current while the run with ``run_id`` executes."""
        state = {"pool": "", "job": "", "what": "", "state": "starting", "seen": 0}
        started = time.monotonic()
        stop = threading.Event()
        last: list[str] = [""]

        def render() -> str:
            parts = [f"[{time.monotonic() - started:5.0f}s]", label]
            if state["what"]:
                parts.append(state["what"])
            if state["pool"]:
                parts.append(f"pool {state['pool']}")
            if state["job"]:
                parts.append(f"job {state['job']}")
            parts.append(state["state"])
            return "  ".join(parts)

        def show(final: bool = False) -> None:
            line = render()
            what = line.split("]", 1)[1]
            if self.live:
                self.out.write("\r\033[K" + line + ("\n" if final else ""))
                self.out.flush()
            elif what != last[0]:  # not a terminal: a line each time something changes
                self.out.write(line + "\n")
                self.out.flush()
            last[0] = what

        def read() -> None:
            records = self.instance.all_logs(run_id)
            for record in records[state["seen"] :]:
                self._write(record)
                message = record.user_message or ""
                if m := _LAUNCHING.search(message):
                    state["what"] = _NAMED_STEPS.get(m.group(1) or "", "")
                    state["pool"] = m.group(2)
                    state["job"] = ""
                    state["state"] = "launching"
                elif m := _SUBMITTED.search(message):
                    state["job"] = m.group(1)
                    state["state"] = "submitted"
                elif record.dagster_event is not None and record.dagster_event.is_step_success:
                    state["what"] = ""
                    state["state"] = "done"
                elif record.dagster_event is not None and record.dagster_event.is_step_failure:
                    state["state"] = "failed"
                elif state["job"] and (m := _STATE.search(message)):
                    state["state"] = m.group(1).lower()
            state["seen"] = len(records)

        def loop() -> None:
            while not stop.wait(self.poll_s):
                try:
                    read()
                    show()
                except Exception:  # noqa: BLE001 - the line is a view; the run itself reports its errors
                    continue

        watcher = threading.Thread(target=loop, daemon=True, name=f"progress-{run_id[:8]}")
        show()
        watcher.start()
        try:
            yield
        finally:
            stop.set()
            watcher.join()
            read()
            if state["state"] not in ("done", "failed"):
                state["state"] = "done" if self._succeeded(run_id) else "failed"
            show(final=True)

    def _succeeded(self, run_id: str) -> bool:
        run = self.instance.get_run_by_id(run_id)
        return run is not None and run.status == dg.DagsterRunStatus.SUCCESS

    def _write(self, record) -> None:
        when = datetime.datetime.fromtimestamp(record.timestamp, datetime.UTC).strftime("%Y-%m-%d %H:%M:%S")
        kind = (
            record.dagster_event.event_type_value
            if record.dagster_event is not None
            else logging.getLevelName(record.level)
        )
        step = record.step_key or ""
        self._log.write(f"{when} {record.run_id[:8]} {step} {kind} {record.user_message}\n")
        self._log.flush()
