"""Services the door does not own going away for a while: the transit bucket, the SkyPilot API server.

One rule, in one place. A failure of a service that answered before is *transient* when the service's own
client says so (connection refused or reset, a timeout, a 5xx, throttling): the call is made again, with
backoff and jitter, until the service answers or it has been unreachable for ``GPUDOOR_OUTAGE_TOLERANCE_S``
seconds (default 300), when :class:`ServiceUnavailable` says which service and for how long. A service
that never answered is not waited for: a wrong endpoint fails at once, as a configuration error.

"Answered before" is remembered per process and, for a day, on the machine (``$GPUDOOR_HOME/answered/``), so
a step that starts during an outage waits like the ones already running. The bound counts from the
service's first failure, whoever saw it: fifty threads of one run share one outage. A warning goes to the
``gpudoor_pipelines.outage`` logger when the waiting starts and when the service is back (Dagster shows both
in the run: ``python_logs.managed_python_loggers`` in ``dagster.yaml``).

No Dagster: GPU nodes import this.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import logging
import os
import random
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")
TOLERANCE_ENV = "GPUDOOR_OUTAGE_TOLERANCE_S"
DEFAULT_TOLERANCE_S = 300.0
#: How long a machine remembers that a service answered (a step starting during an outage waits it out).
REMEMBER_S = 86400.0
#: Tries come 1 s, 2 s, 4 s, then every 5 s (less a random part of up to half): a service back is seen within
#: seconds, and a refused connection costs it nothing (one busy with 5xx has botocore's or SkyPilot's own backoff
#: inside each try).
FIRST_WAIT_S, MOST_WAIT_S = 1.0, 5.0


_DEADLINE: contextvars.ContextVar[float | None] = contextvars.ContextVar("gpudoor_outage_deadline", default=None)


@contextlib.contextmanager
def waiting_at_most(seconds: float) -> Iterator[None]:
    """Calls in this block (this thread) wait out an outage for at most ``seconds`` in all (a sensor's tick
    stays short; the outage itself is still bounded by the tolerance)."""
    token = _DEADLINE.set(time.monotonic() + seconds)
    try:
        yield
    finally:
        _DEADLINE.reset(token)


def tolerance_s() -> float:
    """``GPUDOOR_OUTAGE_TOLERANCE_S``: how long an outage is waited out (0 = not at all)."""
    raw = os.environ.get(TOLERANCE_ENV, "").strip()
    if not raw:
        return DEFAULT_TOLERANCE_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if value < 0:
        raise ValueError(f"{TOLERANCE_ENV}={raw!r}: set it to a number of seconds (0 or more), or unset it")
    return value


class ServiceUnavailable(ConnectionError):
    """A service that answered before has not answered for ``down_s`` seconds.

    ``past_bound`` is False when only the caller's own wait ran out (a sensor's tick), True when the outage
    itself is longer than the tolerance.
    """

    def __init__(self, service: str, down_s: float, cause: BaseException, *, past_bound: bool, bound_s: float):
        self.service, self.down_s, self.past_bound = service, down_s, past_bound
        why = (
            f"longer than {TOLERANCE_ENV}={bound_s:g} s; nothing is lost: the next run resumes where this one stopped"
            if past_bound
            else "still waiting"
        )
        super().__init__(f"{service} has not answered for {down_s:.0f} s ({type(cause).__name__}: {cause}); {why}")


def _home() -> Path:
    home = os.environ.get("GPUDOOR_HOME")
    return (Path(home).expanduser() if home else Path.home() / ".gpudoor") / "answered"


class Service:
    """A service reached by this process (one per name: :func:`service`)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._lock = threading.Lock()
        self._answered = False
        self._marker = _home() / hashlib.sha256(name.encode()).hexdigest()[:24]
        self.down_since: float | None = None  # monotonic time of the first failure of the current outage
        self.waits = 0  # waits in the current outage

    @property
    def answered(self) -> bool:
        """Whether the service answered this process, or any on this machine within the last day."""
        if not self._answered:
            try:
                self._answered = time.time() - self._marker.stat().st_mtime < REMEMBER_S
            except OSError:
                pass
        return self._answered

    def ok(self) -> None:
        """The service answered."""
        if not self._answered:
            self._answered = True
            try:
                self._marker.parent.mkdir(parents=True, exist_ok=True)
                self._marker.touch()
            except OSError:  # a read-only home: remembered by this process only
                pass
        if self.down_since is not None:
            with self._lock:
                down, self.down_since, self.waits = self.down_since, None, 0
            if down is not None:
                logger.warning("%s is back after %.0f s", self.name, time.monotonic() - down)

    def failed(self, error: BaseException, doing: str) -> float:
        """Records a transient failure; returns how long to wait before trying again, or raises
        :class:`ServiceUnavailable` when the outage is over the bound, or the caller's own wait
        (:func:`waiting_at_most`) is."""
        now, bound = time.monotonic(), tolerance_s()
        with self._lock:
            first = self.down_since is None
            if first:
                self.down_since = now
            down = now - self.down_since
        if first:
            logger.warning(
                "%s did not answer while %s (%s: %s); waiting up to %g s for it to come back",
                self.name,
                doing,
                type(error).__name__,
                error,
                bound,
            )
        wait = min(MOST_WAIT_S, FIRST_WAIT_S * 2 ** min(self.waits, 8)) * random.uniform(0.5, 1.0)
        if down + wait > bound:
            raise ServiceUnavailable(self.name, down, error, past_bound=True, bound_s=bound) from error
        deadline = _DEADLINE.get()
        if deadline is not None and now + wait > deadline:
            raise ServiceUnavailable(self.name, down, error, past_bound=False, bound_s=bound) from error
        self.waits += 1
        return wait

    def call(
        self,
        fn: Callable[[], T],
        transient: Callable[[BaseException], bool],
        doing: str,
        *,
        progress: Callable[[], int] | None = None,
    ) -> T:
        """``fn()``, made again while it fails transiently (see the module docstring).

        Args:
            progress: a count that grows while ``fn`` gets somewhere (lines of a stream): a failure after
                progress starts a new outage rather than continuing the last one.
        """
        seen = progress() if progress else 0
        while True:
            try:
                out = fn()
            except Exception as e:
                if isinstance(e, ServiceUnavailable) or not transient(e) or not self.answered:
                    raise  # (a service given up on inside fn is not waited for twice)
                if progress is not None and progress() != seen:
                    seen = progress()
                    self.ok()  # it answered meanwhile: a new outage, if any, starts now
                time.sleep(self.failed(e, doing))
                continue
            self.ok()
            return out


_SERVICES: dict[str, Service] = {}
_LOCK = threading.Lock()


def service(name: str) -> Service:
    """The process's :class:`Service` of this name (for example ``the transit bucket s3://b/p at http://…``)."""
    with _LOCK:
        found = _SERVICES.get(name)
        if found is None:
            found = _SERVICES[name] = Service(name)
        return found
