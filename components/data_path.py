"""The scheduled run's input path: ``{date}`` tokens of a data path filled from the run's scheduled time, and the
check that the blessed-model and warm-start folders of a Vertex AI run are on Cloud Storage.

Used by the ``resolve_data`` component (the Vertex AI pipeline's first step), by ``pipelines.submit`` (checks made
before a request is sent) and by ``pipelines.run_local`` (a ``{date}`` path filled from the current time).
"""

import datetime as _dt
import re

_DATE_TOKEN = re.compile(r"\{date(?:([+-])(\d+)([dh]))?(?::([^{}]*))?\}")


def parse_schedule_time(value: str, now: _dt.datetime | None = None) -> _dt.datetime:
    """The run's scheduled time (UTC) from ``dsl.PIPELINE_JOB_SCHEDULE_TIME_UTC_PLACEHOLDER``'s value
    (RFC 3339, e.g. ``2025-03-02T03:00:00Z``); a run that was not scheduled (empty or unresolved value) uses
    ``now`` (default: the current UTC time). Raises ``ValueError`` for an unparsable time."""
    value = (value or "").strip()
    if not value or value.startswith("{{"):
        return (now or _dt.datetime.now(_dt.UTC)).astimezone(_dt.UTC)
    m = re.fullmatch(r"(\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}:\d{2})(\.\d+)?(Z|[+-]\d{2}:\d{2})?", value)
    if not m:
        raise ValueError(f"schedule time {value!r} is not an RFC 3339 time")
    frac = (m.group(2) or "")[:7]  # Python keeps microseconds
    tz = m.group(3) or "Z"
    t = _dt.datetime.fromisoformat(m.group(1) + frac + ("+00:00" if tz == "Z" else tz))
    return t.astimezone(_dt.UTC)


def resolve_data_path(template: str, schedule_time: str, now: _dt.datetime | None = None) -> str:
    """Fill ``{date}`` tokens of a data path from the scheduled time, so a recurring run reads its own partition.

    Tokens: ``{date}`` (``%Y-%m-%d``), ``{date:FORMAT}`` (strftime), ``{date-1d}`` / ``{date+2h:FORMAT}``
    (offset in days or hours). E.g. ``gs://b/criteo/dt={date-1d}/`` at 2025-03-02T03:00Z is
    ``gs://b/criteo/dt=2025-03-01/``. A path without tokens is returned unchanged."""
    if "{date" not in template:
        return template
    t = parse_schedule_time(schedule_time, now)

    def fill(m: re.Match) -> str:
        sign, amount, unit, fmt = m.groups()
        when = t
        if amount:
            delta = _dt.timedelta(days=int(amount)) if unit == "d" else _dt.timedelta(hours=int(amount))
            when = t + delta if sign == "+" else t - delta
        return when.strftime(fmt or "%Y-%m-%d")

    try:
        out = _DATE_TOKEN.sub(fill, template)
    except OverflowError:
        raise ValueError(f"data path {template!r}: a date offset beyond the calendar") from None
    if "{date" in out:
        raise ValueError(
            f"data path {template!r}: unrecognized date token (use {{date}}, {{date:%Y%m%d}}, "
            f"{{date-1d}}, {{date+3h:%H}})"
        )
    return out


def check_cloud_folders(blessed_dir: str, warm_start_from: str) -> None:
    """Raises ``ValueError`` unless ``blessed_dir`` is a Cloud Storage folder (gs:// or /gcs/) and
    ``warm_start_from`` is empty or one."""
    cloud = ("gs://", "/gcs/")
    if not blessed_dir.startswith(cloud):
        raise ValueError(
            f"blessed_dir {blessed_dir!r} is a folder inside the run's container, gone when it ends: "
            "set blessed_dir to gs://BUCKET/blessed/<config> (and, for daily retraining, "
            "warm_start_from to the same folder)"
        )
    if warm_start_from and not warm_start_from.startswith(cloud):
        raise ValueError(f"warm_start_from {warm_start_from!r} must be a gs:// (or /gcs/) folder on Vertex AI")
