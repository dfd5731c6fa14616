"""Errors raised before anything is launched: each names the file, the field and the fix."""

from __future__ import annotations


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


class PolicyRejection(LaunchConfigError):
    """A fleet rule (cap, cost owner, GPU type, priority) refused the job."""


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
