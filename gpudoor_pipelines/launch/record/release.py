"""Verified release: a job cancelled, a pool or a cluster given back, and then *seen* to hold nothing.

A cancel request is not a release. After asking, :func:`release_and_verify` looks at every holding
until the backend shows nothing held (the job terminal and its cluster gone, the pool gone, the
process group gone on the local backend) or until the bound passes; the outcome says what was looked
at, so a run's record shows why the GPUs are known to be free, and a release that was not confirmed
is an error with the job id, not a line in a log.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from gpudoor_pipelines.launch.job import Holding, ReleaseCheck
from gpudoor_pipelines.launch.watch import Backoff

if TYPE_CHECKING:
    from gpudoor_pipelines.launch.backends.base import Backend


@dataclasses.dataclass(frozen=True)
class ReleaseOutcome:
    """How the release of one holding went.

    Attributes:
        holding: what was released.
        confirmed: the backend showed nothing held within the bound.
        seconds: from the request to the confirmation (or to the bound).
        seen: what the last look saw, in words.
        error: the release request's own error, if it failed.
    """

    holding: Holding
    confirmed: bool
    seconds: float
    seen: tuple[str, ...] = ()
    error: str = ""

    def summary(self) -> str:
        """One line: what, confirmed or not, in how long, and what was seen."""
        verdict = (
            f"released, confirmed in {self.seconds:.0f} s"
            if self.confirmed
            else f"NOT confirmed released after {self.seconds:.0f} s"
        )
        extra = f"; the request failed: {self.error}" if self.error else ""
        return f"{self.holding.describe()}: {verdict} ({'; '.join(self.seen)}){extra}"

    def to_record(self) -> dict[str, Any]:
        """The outcome as plain data (run metadata, JSON)."""
        return {
            "kind": self.holding.kind,
            "id": self.holding.id,
            "name": self.holding.name,
            "confirmed": self.confirmed,
            "seconds": round(self.seconds, 1),
            "seen": list(self.seen),
            **({"error": self.error} if self.error else {}),
        }


#: The longest wait between two looks at a release: a SkyPilot cancel takes tens of seconds to a few minutes,
#: and each look is a status request the API server answers by starting a process.
MOST_BETWEEN_LOOKS_S = 10.0


def release_and_verify(
    backend: Backend,
    holdings: Sequence[Holding],
    *,
    timeout_s: float,
    poll_s: float = 2.0,
    ask: bool = True,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> list[ReleaseOutcome]:
    """Asks for each holding to be released (``ask=False``: the caller already did), then looks at those
    not yet confirmed, ``poll_s`` after the request and then less and less often (doubling while a look
    confirms nothing new, up to :data:`MOST_BETWEEN_LOOKS_S`), until each shows nothing held or
    ``timeout_s`` has passed.

    Returns one outcome per holding, in order. A failed request is recorded, and the holding is still
    looked at (it may have been released by someone else).
    """
    start = clock()
    errors = backend.release_all(holdings) if ask else {}
    pending = {h.key: h for h in holdings}
    done: dict[str, ReleaseOutcome] = {}
    last: dict[str, ReleaseCheck] = {}
    looks = Backoff(poll_s, max(poll_s, MOST_BETWEEN_LOOKS_S))
    wait: float | None = None
    while True:
        # One look at everything still pending: on SkyPilot a few requests, whatever their number.
        checks = backend.check_released_all(list(pending.values()))
        before = len(pending)
        for key, h in list(pending.items()):
            check = checks.get(key) or ReleaseCheck(False, ("not looked at",))
            last[key] = check
            if check.released:
                done[key] = ReleaseOutcome(h, True, clock() - start, check.seen, errors.get(key, ""))
                del pending[key]
        if not pending or clock() - start >= timeout_s:
            break
        wait = poll_s if wait is None else looks.after(changed=len(pending) < before)
        sleep(min(wait, max(0.0, timeout_s - (clock() - start))))
    for key, h in pending.items():
        done[key] = ReleaseOutcome(h, False, clock() - start, last[key].seen, errors.get(key, ""))
    return [done[h.key] for h in holdings]
