"""The fleet file's sections besides its pools and routes: the night window, what the checkpoint sensor
evaluates, what the orphan reconciler releases, what housekeeping keeps; and the error a cross-field check
raises (:func:`~gpudoor_pipelines.launch.resolve.fleet.parse_fleet` turns it into a LaunchConfigError naming
the file, the field and the fix).
"""

from __future__ import annotations

import datetime
import re

from pydantic import BaseModel, ConfigDict, Field, model_validator


class FieldError(ValueError):
    """A cross-field problem found by a validator, carrying its own field path and fix."""

    def __init__(self, field: str, problem: str, fix: str) -> None:
        super().__init__(problem)
        self.field, self.problem, self.fix = field, problem, fix


class NightWindow(BaseModel):
    """The off-peak window the nightly captioning runs in (inference GPUs are idle then).

    Attributes:
        start: cron of the window's start (the nightly schedule's cron).
        end: wall-clock end, ``HH:MM`` in ``timezone``: no job starts a new part after it.
        timezone: IANA timezone of ``start`` and ``end``.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    start: str = "0 1 * * *"
    end: str = "06:00"
    timezone: str = "Europe/Paris"

    @model_validator(mode="after")
    def _check(self) -> NightWindow:
        import zoneinfo

        if not re.fullmatch(r"([01]\d|2[0-3]):[0-5]\d", self.end):
            raise FieldError("night_window.end", f"'{self.end}' is not a time of day", "write it as HH:MM, e.g. 06:00")
        try:
            zoneinfo.ZoneInfo(self.timezone)
        except (zoneinfo.ZoneInfoNotFoundError, ValueError):
            raise FieldError(
                "night_window.timezone", f"unknown timezone '{self.timezone}'", "use an IANA name such as Europe/Paris"
            ) from None
        if len(self.start.split()) != 5:
            raise FieldError(
                "night_window.start", f"'{self.start}' is not a 5-field cron", "write it like '0 1 * * *' (01:00 daily)"
            )
        return self

    def end_after(self, start: datetime.datetime) -> datetime.datetime:
        """The first end of the window after ``start`` (the window's end on the night that starts then)."""
        import zoneinfo

        zone = zoneinfo.ZoneInfo(self.timezone)
        local = start.astimezone(zone)
        hour, minute = (int(x) for x in self.end.split(":"))
        end = local.replace(hour=hour, minute=minute, second=0, microsecond=0)
        if end <= local:
            end += datetime.timedelta(days=1)
        return end

    @property
    def end_cron(self) -> str:
        """Cron of the window's end (the morning merge's schedule)."""
        hour, minute = (int(x) for x in self.end.split(":"))
        return f"{minute} {hour} * * *"


class EvalPolicy(BaseModel):
    """What the checkpoint sensor evaluates, and how much at once.

    Attributes:
        backlog_per_training: when the sensor starts over checkpoints written before it was turned on,
            the latest this many of each training are evaluated (0: none); every checkpoint written
            after is evaluated.
        max_runs_per_tick: at most this many eval runs per sensor tick; the rest waits for the next tick.
        checkpoints_per_run: at most this many checkpoints per eval run (one batch of jobs on a warm
            pool sized to the free GPUs, each checkpoint still its own partition).
        forget_training_after_hours: a training that has written nothing for this long and never said
            it ended (its run worker died) is no longer watched; a restart of it is seen again.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    backlog_per_training: int = Field(default=1, ge=0)
    max_runs_per_tick: int = Field(default=4, ge=1)
    checkpoints_per_run: int = Field(default=50, ge=1)
    forget_training_after_hours: float = Field(default=48.0, gt=0)

    @property
    def max_checkpoints_per_tick(self) -> int:
        """Most checkpoints one tick hands to eval runs."""
        return self.max_runs_per_tick * self.checkpoints_per_run


class ReconcilerPolicy(BaseModel):
    """What the orphan reconciler releases, and when.

    Attributes:
        grace_minutes: a job or warm pool whose Dagster run has ended (or that names a run this Dagster
            instance does not know) is released this long after the run's end (or the job's submission).
        interactive_ttl_hours: an interactive cluster (``lab-…``, ``dev-…``) is torn down this long after
            it was launched, unless its launch asked for another time to live.
        max_interactive_ttl_hours: the longest time to live a launch may ask for.
        release_timeout_minutes: how long a release may take to be confirmed (the job terminal, its
            cluster gone) before it is reported as not confirmed.
        dry_run: say what would be released, release nothing.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    grace_minutes: float = Field(default=10.0, ge=0)
    interactive_ttl_hours: float = Field(default=12.0, gt=0)
    max_interactive_ttl_hours: float = Field(default=72.0, gt=0)
    release_timeout_minutes: float = Field(default=5.0, gt=0)
    dry_run: bool = False


class HousekeepingPolicy(BaseModel):
    """What housekeeping keeps in the transit bucket, and when it moves or deletes the rest (docs/operations.md).

    Attributes:
        keep_best, keep_latest: per training, the checkpoints kept whatever their age: the best this many by
            ``metric`` (higher is better), and the latest this many (at least one: a training resumes from it).
        keep: checkpoints (``<training>.step-N``) or whole trainings kept besides, by name.
        cold_after_days: a checkpoint past the keep set moves to ``storage_class`` this long after it was written.
        delete_after_days: ... and is deleted this long after it was written (0: never).
        storage_class: S3's cheaper storage class (one read at once); a cold folder on the embedded default.
        smoke_days, pipes_days: smoke outputs and Pipes sessions untouched this long are deleted.
        leftovers_days: temp files and unfinished multipart uploads this old are removed.
        apply: whether the weekly run applies its plan; off, it only plans.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    keep_best: int = Field(default=3, ge=0)
    keep_latest: int = Field(default=2, ge=1)
    metric: str = "accuracy"
    keep: tuple[str, ...] = ()
    cold_after_days: float = Field(default=30.0, gt=0)
    delete_after_days: float = Field(default=0.0, ge=0)
    storage_class: str = "STANDARD_IA"
    smoke_days: float = Field(default=14.0, gt=0)
    pipes_days: float = Field(default=2.0, gt=0)
    leftovers_days: float = Field(default=1.0, gt=0)
    apply: bool = False

    @model_validator(mode="after")
    def _delete_after_cold(self) -> HousekeepingPolicy:
        from gpudoor_pipelines.transit.tiers import READABLE_CLASSES

        if self.storage_class not in READABLE_CLASSES:
            raise FieldError(
                "housekeeping.storage_class",
                f"'{self.storage_class}' is not read at once (a job would wait hours for a restore)",
                f"use one of {list(READABLE_CLASSES)}",
            )
        if self.delete_after_days and self.delete_after_days < self.cold_after_days:
            raise FieldError(
                "housekeeping.delete_after_days",
                f"{self.delete_after_days:g} is before cold_after_days ({self.cold_after_days:g})",
                "make it 0 (never) or at least cold_after_days",
            )
        return self
