"""Errors raised before anything is launched: each names the file, the field and the fix."""

from __future__ import annotations

import re


class LaunchConfigError(ValueError):
    """A task spec, the fleet file or a launch override is wrong; nothing was launched.

    Attributes:
        source: the file (or setting) at fault.
        field: the field inside it, dotted (``resources.accelerators``).
        fix: what the user should change.
    """

    def __init__(self, source: str, field: str, problem: str, fix: str) -> None:
        self.source = source
        self.field = field
        self.problem = problem
        self.fix = fix
        super().__init__(f"{source}: field '{field}': {problem}. Fix: {fix}")

    @property
    def problems(self) -> list[LaunchConfigError]:
        """Every problem this error stands for (one, unless it is a :class:`LaunchConfigErrors`)."""
        return [self]

    def as_dict(self) -> dict[str, str]:
        """``{file, field, problem, fix}``, for JSON output."""
        return {"file": self.source, "field": self.field, "problem": self.problem, "fix": self.fix}

    @staticmethod
    def combine(problems: list[LaunchConfigError]) -> LaunchConfigError:
        """One error for several problems (the single problem itself when there is one)."""
        flat = [p for e in problems for p in e.problems]
        return flat[0] if len(flat) == 1 else LaunchConfigErrors(flat)


class LaunchConfigErrors(LaunchConfigError):
    """Several problems of one request, reported together so one round of fixes is enough."""

    def __init__(self, problems: list[LaunchConfigError]) -> None:
        self._problems = list(problems)
        first = self._problems[0]
        fields = ", ".join(p.field for p in self._problems)
        super().__init__(first.source, fields, f"{len(self._problems)} problems", "fix each one as it says")
        self.args = (f"{len(self._problems)} problems:\n" + "\n".join(f"  - {p}" for p in self._problems),)

    @property
    def problems(self) -> list[LaunchConfigError]:
        return list(self._problems)

    def __str__(self) -> str:
        return str(self.args[0])


class PolicyRejection(LaunchConfigError):
    """A fleet rule (cap, cost owner, GPU type, priority) refused the job."""


class PoolFull(PolicyRejection):
    """The job fits its pool, but not now: the pool (or the user's share of it) is held by running jobs.

    The API server's policy says so with :attr:`MARK` and the pool's name, so a launcher that routed
    without reading what is held can try the next pool of its route.

    Attributes:
        pool: the full pool.
    """

    MARK = "[gpudoor: pool full]"

    def __init__(self, pool: str, source: str, field: str, problem: str, fix: str) -> None:
        self.pool = pool
        super().__init__(source, field, problem, fix)

    def refusal(self) -> str:
        """The policy's rejection text: the mark and the pool first, then the problem and the fix."""
        return f"{self.MARK} pool '{self.pool}': {self.problem}. Fix: {self.fix}"

    @classmethod
    def from_refusal(cls, text: str, source: str) -> PoolFull | None:
        """The error a policy rejection text stands for, if it is a full pool's."""
        m = re.search(re.escape(cls.MARK) + r" pool '([^']+)': (.*)\. Fix: (.*)", text, re.S)
        if m is None:
            return None
        return cls(m.group(1), source, "(admin policy)", m.group(2).strip(), m.group(3).strip())


class JobFailed(RuntimeError):
    """A launched job ended in a failure state.

    Attributes:
        job_id: the backend's job id.
        status: the end state (``FAILED``, ``FAILED_SETUP``, ``CANCELLED``, ...).
        log_tail: the job's last log lines.
    """

    def __init__(self, job_id: str, status: str, detail: str, log_tail: list[str]) -> None:
        self.job_id = job_id
        self.status = status
        self.log_tail = log_tail
        tail = "\n".join(log_tail) if log_tail else "(the job wrote no log lines)"
        super().__init__(f"Job {job_id} ended {status}: {detail}\n--- last log lines ---\n{tail}")
