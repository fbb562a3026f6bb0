"""Recurring runs on Vertex AI: the cron (five fields, checked) with its time zone, and creating, listing,
pausing, resuming and deleting the pipeline's schedules."""

from __future__ import annotations

import zoneinfo
from typing import Any

from components.data_path import parse_schedule_time
from pipelines.jobs import build_pipeline_job
from pipelines.parameters import Target

_MONTHS = ("jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec")
_DAYS = ("sun", "mon", "tue", "wed", "thu", "fri", "sat")
_CRON_FIELDS = (
    ("minute", 0, 59, ()),
    ("hour", 0, 23, ()),
    ("day-of-month", 1, 31, ()),
    ("month", 1, 12, _MONTHS),
    ("day-of-week", 0, 7, _DAYS),
)


def _check_cron_field(cron: str, field: str, name: str, lo: int, hi: int, names: tuple) -> None:
    """One field of a standard 5-field cron: ``*``, ``N``, ``N-M``, lists of those, each with an optional
    ``/STEP``; month and weekday names (``jan``, ``mon``) where cron takes them. Raises ``ValueError`` naming the
    field and its range."""

    def number(text: str) -> int:
        if text.lower() in names:
            return names.index(text.lower()) + (1 if name == "month" else 0)
        if not text.isdigit() or not lo <= int(text) <= hi:
            raise ValueError(f"--cron {cron!r}: {name} {field!r} must lie in {lo}-{hi}")
        return int(text)

    for part in field.split(","):
        base, slash, step = part.partition("/")
        if slash and (not step.isdigit() or int(step) < 1):
            raise ValueError(f"--cron {cron!r}: {name} {field!r} has a bad step {step!r}")
        if base == "*":
            continue
        first, dash, last = base.partition("-")
        if number(first) > (number(last) if dash else number(first)):
            raise ValueError(f"--cron {cron!r}: {name} range {base!r} runs backwards")


def cron_with_time_zone(cron: str, time_zone: str) -> str:
    """``"TZ=<zone> <cron>"`` as Vertex AI schedules take it. Raises ``ValueError`` for a cron that is not five
    fields or an unknown IANA time zone."""
    fields = cron.split()
    if fields and fields[0].startswith(("TZ=", "CRON_TZ=")):
        raise ValueError("give the time zone with --time-zone, not inside --cron")
    if len(fields) != 5:
        raise ValueError(f"--cron {cron!r}: expected 5 fields (minute hour day-of-month month day-of-week)")
    for field, (name, lo, hi, names) in zip(fields, _CRON_FIELDS, strict=True):
        _check_cron_field(cron, field, name, lo, hi, names)
    try:
        zoneinfo.ZoneInfo(time_zone)
    except (zoneinfo.ZoneInfoNotFoundError, ValueError):
        raise ValueError(f"--time-zone {time_zone!r} is not an IANA time zone such as Europe/Berlin") from None
    return f"TZ={time_zone} {' '.join(fields)}"


def create_schedule(
    template: str,
    target: Target,
    cron: str,
    time_zone: str,
    display_name: str,
    parameter_values: dict[str, Any] | None = None,
    max_concurrent_run_count: int = 1,
    max_run_count: int | None = None,
    start_time: str = "",
    end_time: str = "",
    allow_queueing: bool = False,
    service_account: str = "",
    network: str = "",
    enable_caching: bool | None = None,
    labels: dict[str, str] | None = None,
    credentials=None,
    from_text: bool = False,
):
    """Create a recurring schedule of the pipeline; returns the ``PipelineJobSchedule``."""
    if max_concurrent_run_count < 1:
        raise ValueError(f"--max-concurrent-runs must be >= 1, got {max_concurrent_run_count}")
    if max_run_count is not None and max_run_count < 1:
        raise ValueError(f"--max-runs must be >= 1, got {max_run_count}")
    if not display_name:
        raise ValueError("--name (the schedule's display name) is required")
    cron_tz = cron_with_time_zone(cron, time_zone)
    for value in (start_time, end_time):
        if value:
            parse_schedule_time(value)  # RFC 3339 or ValueError
    job = build_pipeline_job(
        template, target, parameter_values, enable_caching, display_name, labels, credentials, from_text
    )
    return job.create_schedule(
        cron=cron_tz,
        display_name=display_name,
        start_time=start_time or None,
        end_time=end_time or None,
        allow_queueing=allow_queueing,
        max_run_count=max_run_count,
        max_concurrent_run_count=max_concurrent_run_count,
        service_account=service_account or None,
        network=network or None,
    )


def _schedule(name_or_id: str, target: Target, credentials=None):
    from google.cloud import aiplatform

    return aiplatform.PipelineJobSchedule.get(
        name_or_id, project=target.project, location=target.region, credentials=credentials
    )


def list_schedules(target: Target, filter: str = "", credentials=None) -> list:
    """The project's pipeline schedules in the region (optionally filtered, e.g. ``display_name="nightly"``)."""
    from google.cloud import aiplatform

    return aiplatform.PipelineJobSchedule.list(
        filter=filter or None, project=target.project, location=target.region, credentials=credentials
    )


def pause_schedule(name_or_id: str, target: Target, credentials=None) -> None:
    _schedule(name_or_id, target, credentials).pause()


def resume_schedule(name_or_id: str, target: Target, credentials=None) -> None:
    _schedule(name_or_id, target, credentials).resume()


def delete_schedule(name_or_id: str, target: Target, credentials=None) -> None:
    _schedule(name_or_id, target, credentials).delete()
