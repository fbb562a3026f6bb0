"""Submit the compiled pipeline to Vertex AI Pipelines, manage recurring schedules, register the blessed model.

    python -m pipelines.submit run      --project P --region R --pipeline-root gs://B/root [--param k=v ...]
    python -m pipelines.submit schedule create --cron "0 3 * * *" --time-zone Europe/Berlin --name nightly ...
    python -m pipelines.submit schedule list|pause|resume|delete ...
    python -m pipelines.submit register-model --artifact-uri gs://B/blessed/current --display-name persia-ctr ...
    python -m pipelines.submit upload-template --host https://REGION-kfp.pkg.dev/P/REPO --tag v1
    python -m pipelines.submit dataflow-args --project P --region R --temp-location gs://B/tmp ...

Everything is checked before a request is sent: parameters against the compiled YAML's
``root.inputDefinitions`` (unknown names and ill-typed values are errors naming the parameter), the pipeline
root (gs://), the cron's time zone, and that the template was compiled for the Vertex AI target. A scheduled
run needs no edits: give ``data`` with ``{date-1d}`` tokens (filled from the run's scheduled time, see
``components.data_path``) and point the warm-start parameter at the blessed-model folder (its marker names the
latest blessed model); both are passed through as parameters.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import re
import sys
from dataclasses import dataclass
from typing import Any

DEFAULT_TEMPLATE = "pipelines/persia_pipeline_vertex.yaml"
_REGION = re.compile(r"^[a-z]+-[a-z]+\d+$")
_PROJECT = re.compile(r"^[a-z][a-z0-9-]{4,28}[a-z0-9]$")


# ------------------------------------------------------------------------------------------- validation


@dataclass(frozen=True)
class Target:
    """Where runs go: a Google Cloud project, a Vertex AI region and the pipeline root (gs://)."""

    project: str
    region: str
    pipeline_root: str = ""

    def __post_init__(self) -> None:
        if not _PROJECT.match(self.project or ""):
            raise ValueError(f"--project: {self.project!r} is not a Google Cloud project ID")
        if not _REGION.match(self.region or ""):
            raise ValueError(f"--region: {self.region!r} is not a region such as us-central1")
        if self.pipeline_root and not self.pipeline_root.startswith("gs://"):
            raise ValueError(f"--pipeline-root: {self.pipeline_root!r} must be a gs:// URI")


def load_template(path: str) -> dict:
    """The compiled pipeline YAML (local, gs:// or /gcs/). Raises ``FileNotFoundError`` / ``ValueError``."""
    import yaml

    from persia_core import io

    if not io.exists(path):
        raise FileNotFoundError(f"compiled pipeline {path!r} not found (run `make compile TARGET=vertex`)")
    spec = yaml.safe_load(io.read_text(path))
    if not isinstance(spec, dict) or "root" not in spec or "pipelineInfo" not in spec:
        raise ValueError(f"{path}: not a compiled KFP pipeline (no root / pipelineInfo)")
    return spec


def check_vertex_template(spec: dict, path: str) -> None:
    """Refuse a template compiled for the local target (its images exist only on a laptop)."""
    from components import LOCAL_IMAGE

    images = {e.get("container", {}).get("image") for e in spec.get("deploymentSpec", {}).get("executors", {}).values()}
    if LOCAL_IMAGE in images:
        raise ValueError(
            f"{path} was compiled for the local target (image {LOCAL_IMAGE}); compile the Vertex AI "
            f"target: PERSIA_BASE_IMAGE=... make compile TARGET=vertex"
        )


def parameter_specs(spec: dict) -> dict[str, dict]:
    """``name -> {parameterType, defaultValue?, isOptional?}`` of the pipeline's parameters."""
    return dict(spec["root"].get("inputDefinitions", {}).get("parameters", {}))


def _convert(name: str, value: Any, ptype: str, from_text: bool) -> Any:
    def bad(expected: str) -> ValueError:
        return ValueError(f"parameter {name!r}: expected {expected} ({ptype}), got {value!r}")

    if ptype == "STRING":
        if not isinstance(value, str):
            raise bad("a string")
        return value
    if ptype == "NUMBER_INTEGER":
        if from_text and isinstance(value, str):
            try:
                return int(value.strip())
            except ValueError:
                raise bad("an integer") from None
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise bad("an integer")
        return value
    if ptype == "NUMBER_DOUBLE":
        if from_text and isinstance(value, str):
            try:
                return float(value.strip())
            except ValueError:
                raise bad("a number") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad("a number")
        return float(value)
    if ptype == "BOOLEAN":
        if from_text and isinstance(value, str) and value.strip().lower() in ("true", "false"):
            return value.strip().lower() == "true"
        if not isinstance(value, bool):
            raise bad("true or false")
        return value
    if ptype in ("LIST", "STRUCT"):
        want = list if ptype == "LIST" else dict
        if from_text and isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError:
                raise bad("JSON") from None
        if not isinstance(value, want):
            raise bad("a JSON list" if want is list else "a JSON object")
        return value
    raise ValueError(f"parameter {name!r}: unsupported parameter type {ptype}")


def check_parameters(values: dict[str, Any], specs: dict[str, dict], from_text: bool = False) -> dict[str, Any]:
    """``values`` checked against the pipeline's parameter specs and converted to their types (``from_text``:
    values are CLI strings). Raises ``ValueError`` naming an unknown or ill-typed parameter, or a required one
    left out."""
    unknown = sorted(set(values) - set(specs))
    if unknown:
        raise ValueError(f"unknown pipeline parameter(s) {unknown}; the pipeline takes {sorted(specs)}")
    out = {name: _convert(name, v, specs[name].get("parameterType", "STRING"), from_text) for name, v in values.items()}
    missing = sorted(
        n for n, s in specs.items() if n not in out and "defaultValue" not in s and not s.get("isOptional")
    )
    if missing:
        raise ValueError(f"pipeline parameter(s) {missing} have no default and must be given")
    return out


def check_cloud_values(values: dict[str, Any], specs: dict[str, dict]) -> None:
    """Checks of parameter values that only fail at run time on Vertex AI, made before anything is sent.

    ``blessed_dir`` (given or the template's default) and a non-empty ``warm_start_from`` must be Cloud
    Storage folders (a path inside a run's container is gone when the run ends, so nothing would ever be
    warm-started); ``{...}`` tokens of ``data`` must be date tokens (``components.data_path.resolve_data_path``).
    Raises ``ValueError`` naming the parameter."""
    import re

    from components.data_path import resolve_data_path

    def value(name: str) -> str:
        return str(values.get(name, specs.get(name, {}).get("defaultValue", "")))

    from components.data_path import check_cloud_folders

    if "blessed_dir" in specs:
        check_cloud_folders(value("blessed_dir"), value("warm_start_from") if "warm_start_from" in specs else "")
    data = value("data") if "data" in specs else ""
    for name in ("num_parameter_servers", "num_nn_workers", "epochs", "max_rows"):
        if name in specs and float(value(name) or 0) < 0:
            raise ValueError(f"{name} must be >= 0 (0 = the run config's value), got {value(name)}")
    if "embedding_staleness" in specs and float(value("embedding_staleness") or 0) < -1:
        raise ValueError(
            f"embedding_staleness must be >= 0, or -1 for the run config's value, got {value('embedding_staleness')}"
        )
    if "config" in specs:
        from persia_core.config import is_config_name, shipped_configs

        cfg = value("config")
        if cfg and is_config_name(cfg) and cfg not in shipped_configs():
            raise ValueError(
                f"config {cfg!r} is not a shipped run config {shipped_configs()} (or give a gs:// YAML path)"
            )
    from persia_core.evaluate.decision import DEFAULT_MAX_NE, DEFAULT_MIN_AUC, check_thresholds

    check_thresholds(
        min_auc=float(value("min_auc") or 0) if "min_auc" in specs else DEFAULT_MIN_AUC,
        max_ne=float(value("max_ne")) if "max_ne" in specs and value("max_ne") else DEFAULT_MAX_NE,
    )
    resolved = resolve_data_path(data, "2026-01-01T00:00:00Z")  # raises on a malformed {date...} token
    left = re.findall(r"\{[^}]*\}", resolved)
    if left:
        raise ValueError(
            f"data path {data!r}: {left[0]} is not a token (use {{date}}, {{date:%Y%m%d}}, "
            f"{{date-1d}}, {{date+3h:%H}}; times are UTC)"
        )


def parse_key_values(items: list[str] | None, what: str) -> dict[str, str]:
    """``["k=v", ...]`` -> dict. Raises ``ValueError`` naming ``what`` for an item without ``=``."""
    out = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"{what} expects NAME=VALUE, got {item!r}")
        out[key.strip()] = value
    return out


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
    import zoneinfo

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


def dataflow_beam_args(
    project: str,
    region: str,
    temp_location: str,
    machine_type: str = "n2-standard-4",
    max_num_workers: int = 10,
    sdk_container_image: str = "",
    staging_location: str = "",
    service_account: str = "",
    subnetwork: str = "",
    job_name: str = "",
) -> list[str]:
    """Beam options for the preprocess step on Dataflow (the pipeline's ``beam_args`` parameter, as a list).

    ``sdk_container_image`` (the project image, so Dataflow workers can import ``persia_core``) is required for
    this project's transforms. Raises ``ValueError`` naming a bad setting."""
    Target(project, region)
    if not temp_location.startswith("gs://"):
        raise ValueError(f"--temp-location {temp_location!r} must be a gs:// URI")
    if staging_location and not staging_location.startswith("gs://"):
        raise ValueError(f"--staging-location {staging_location!r} must be a gs:// URI")
    if max_num_workers < 1:
        raise ValueError(f"--max-workers must be >= 1, got {max_num_workers}")
    if not sdk_container_image:
        raise ValueError(
            "Dataflow workers need the project image: --dataflow-image on run / schedule create, "
            "--sdk-container-image on dataflow-args (e.g. $PERSIA_BASE_IMAGE)"
        )
    args = [
        "--runner=DataflowRunner",
        f"--project={project}",
        f"--region={region}",
        f"--temp_location={temp_location}",
        f"--staging_location={staging_location or temp_location}",
        f"--machine_type={machine_type}",
        f"--max_num_workers={max_num_workers}",
        f"--sdk_container_image={sdk_container_image}",
        "--experiments=use_runner_v2",
    ]
    if service_account:
        args.append(f"--service_account_email={service_account}")
    if subnetwork:
        args.append(f"--subnetwork={subnetwork}")
    if job_name:
        args.append(f"--job_name={job_name}")
    return args


# ------------------------------------------------------------------------------------------- requests


def build_pipeline_job(
    template: str,
    target: Target,
    parameter_values: dict[str, Any] | None = None,
    enable_caching: bool | None = None,
    display_name: str = "",
    labels: dict[str, str] | None = None,
    credentials=None,
    from_text: bool = False,
):
    """A ``google.cloud.aiplatform.PipelineJob`` for ``template`` with checked parameters (nothing sent yet)."""
    from google.cloud import aiplatform

    if not target.pipeline_root:
        raise ValueError("--pipeline-root (gs://...) is required to run the pipeline")
    spec = load_template(template)
    check_vertex_template(spec, template)
    values = check_parameters(parameter_values or {}, parameter_specs(spec), from_text)
    check_cloud_values(values, parameter_specs(spec))
    name = spec["pipelineInfo"]["name"]
    stamp = _dt.datetime.now(_dt.UTC).strftime("%Y%m%d-%H%M%S")
    return aiplatform.PipelineJob(
        display_name=display_name or f"{name}-{stamp}",
        template_path=template,
        pipeline_root=target.pipeline_root,
        parameter_values=values,
        enable_caching=enable_caching,
        labels=labels or None,
        project=target.project,
        location=target.region,
        credentials=credentials,
    )


def submit(
    template: str,
    target: Target,
    parameter_values: dict[str, Any] | None = None,
    service_account: str = "",
    network: str = "",
    enable_caching: bool | None = None,
    display_name: str = "",
    labels: dict[str, str] | None = None,
    credentials=None,
    from_text: bool = False,
):
    """Submit one run (returns at once); returns the ``PipelineJob``."""
    job = build_pipeline_job(
        template, target, parameter_values, enable_caching, display_name, labels, credentials, from_text
    )
    job.submit(service_account=service_account or None, network=network or None)
    return job


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
    for flag, value in (("--start-time", start_time), ("--end-time", end_time)):
        if value:
            from components.data_path import parse_schedule_time

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


def register_model(
    artifact_uri: str,
    display_name: str,
    target: Target,
    serving_image: str,
    parent_model: str = "",
    aliases: list[str] | None = None,
    labels: dict[str, str] | None = None,
    description: str = "",
    credentials=None,
):
    """Upload the blessed Model folder to the Vertex AI Model Registry (a new version of ``parent_model`` when
    given); returns the ``aiplatform.Model``. The folder must be on Cloud Storage and hold ``manifest.json``, or
    be a blessed-model location (``blessed_dir``), whose latest blessed model is then uploaded."""
    from google.cloud import aiplatform

    from persia_core import io

    uri = io.to_uri(artifact_uri).rstrip("/")
    if not uri.startswith("gs://"):
        raise ValueError(f"--artifact-uri {artifact_uri!r} must be a gs:// (or /gcs/) folder")
    from persia_core.model_store import MANIFEST, is_blessed_location, latest_blessed_model

    if not io.exists(io.join(uri, MANIFEST)) and is_blessed_location(uri):
        uri = io.to_uri(latest_blessed_model(uri)).rstrip("/")  # a blessed-model location: its latest model
    if not display_name:
        raise ValueError("--display-name is required")
    if not serving_image:
        raise ValueError(
            "--serving-image is required (the Model Registry needs a container; the project image is the usual choice)"
        )
    return aiplatform.Model.upload(
        display_name=display_name,
        artifact_uri=uri,
        serving_container_image_uri=serving_image,
        parent_model=parent_model or None,
        is_default_version=True,
        version_aliases=aliases or None,
        version_description=description or None,
        description=description or None,
        labels={"framework": "persia-kfp", **(labels or {})},
        project=target.project,
        location=target.region,
        credentials=credentials,
        sync=True,
    )


def upload_template(
    host: str, template: str, tags: list[str] | None = None, description: str = "", auth=None
) -> tuple[str, str]:
    """Upload the compiled YAML to a KFP registry (Artifact Registry: ``https://REGION-kfp.pkg.dev/P/REPO``);
    returns ``(package name, version)``. Runs can then use ``HOST/PACKAGE/TAG`` as their template."""
    from kfp.registry import RegistryClient

    check_vertex_template(load_template(template), template)
    client = RegistryClient(host=host, auth=auth)
    headers = {"description": description} if description else None
    return client.upload_pipeline(file_name=template, tags=tags or None, extra_headers=headers)


# ------------------------------------------------------------------------------------------- CLI


def _add_target(p: argparse.ArgumentParser, root: bool = False) -> None:
    p.add_argument("--project", required=True, help="Google Cloud project ID")
    p.add_argument("--region", required=True, help="Vertex AI region, e.g. us-central1")
    if root:
        p.add_argument("--pipeline-root", required=True, help="gs:// folder for the runs' artifacts")


def _add_run(p: argparse.ArgumentParser) -> None:
    _add_target(p, root=True)
    p.add_argument("--template", default=DEFAULT_TEMPLATE, help="compiled pipeline YAML (Vertex AI target)")
    p.add_argument("--param", action="append", metavar="NAME=VALUE", help="pipeline parameter (repeat)")
    p.add_argument("--service-account", default="", help="service account the run uses")
    p.add_argument("--network", default="", help="VPC network (projects/NUMBER/global/networks/NAME)")
    p.add_argument("--cache", dest="cache", action="store_true", default=None, help="enable step caching")
    p.add_argument("--no-cache", dest="cache", action="store_false", help="disable step caching")
    p.add_argument("--display-name", default="", help="run (or schedule) display name")
    p.add_argument("--label", action="append", metavar="KEY=VALUE", help="label (repeat)")
    d = p.add_argument_group("Dataflow (fills the beam_args parameter)")
    d.add_argument("--dataflow", action="store_true", help="run preprocess on Dataflow")
    d.add_argument("--dataflow-region", default="", help="Dataflow region (default --region)")
    d.add_argument("--dataflow-temp-location", default="", help="gs:// temp folder (default PIPELINE_ROOT/tmp)")
    d.add_argument("--dataflow-machine-type", default="n2-standard-4")
    d.add_argument("--dataflow-max-workers", type=int, default=10)
    d.add_argument("--dataflow-image", default="", help="SDK container image (the project image)")
    d.add_argument("--dataflow-service-account", default="")
    d.add_argument("--dataflow-subnetwork", default="")


def _run_params(args) -> dict[str, str]:
    params = parse_key_values(args.param, "--param")
    if args.dataflow:
        if "beam_args" in params:
            raise ValueError("give either --dataflow or --param beam_args=..., not both")
        params["beam_args"] = json.dumps(
            dataflow_beam_args(
                args.project,
                args.dataflow_region or args.region,
                args.dataflow_temp_location or args.pipeline_root.rstrip("/") + "/tmp",
                args.dataflow_machine_type,
                args.dataflow_max_workers,
                args.dataflow_image,
                service_account=args.dataflow_service_account,
                subnetwork=args.dataflow_subnetwork,
            )
        )
    return params


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pipelines.submit", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    _add_run(sub.add_parser("run", help="submit one run"))
    sched = sub.add_parser("schedule", help="recurring runs").add_subparsers(dest="action", required=True)
    c = sched.add_parser("create", help="create a schedule")
    _add_run(c)
    c.add_argument("--name", required=True, help="schedule display name")
    c.add_argument("--cron", required=True, help='five-field cron, e.g. "0 3 * * *"')
    c.add_argument("--time-zone", default="UTC", help="IANA time zone of the cron, e.g. Europe/Berlin")
    c.add_argument("--max-concurrent-runs", type=int, default=1, help="runs of this schedule at once")
    c.add_argument("--max-runs", type=int, default=None, help="stop after this many runs")
    c.add_argument("--start-time", default="", help="RFC 3339 start (default: now)")
    c.add_argument("--end-time", default="", help="RFC 3339 end (default: never)")
    c.add_argument("--allow-queueing", action="store_true", help="queue a run when the limit is reached")
    ls = sched.add_parser("list", help="list schedules")
    _add_target(ls)
    ls.add_argument("--filter", default="", help='e.g. display_name="nightly"')
    for action in ("pause", "resume", "delete"):
        a = sched.add_parser(action, help=f"{action} a schedule")
        _add_target(a)
        a.add_argument("schedule", help="schedule ID or projects/P/locations/R/schedules/ID")
    r = sub.add_parser("register-model", help="upload the blessed model to the Vertex AI Model Registry")
    _add_target(r)
    r.add_argument("--artifact-uri", required=True, help="gs:// Model folder (the blessed copy)")
    r.add_argument("--display-name", required=True)
    r.add_argument("--serving-image", required=True, help="container image recorded with the model")
    r.add_argument("--parent-model", default="", help="register as a new version of this model")
    r.add_argument("--alias", action="append", help="version alias, e.g. blessed (repeat)")
    r.add_argument("--label", action="append", metavar="KEY=VALUE")
    r.add_argument("--description", default="")
    u = sub.add_parser("upload-template", help="upload the compiled YAML to a KFP / Artifact Registry host")
    u.add_argument("--host", required=True, help="https://REGION-kfp.pkg.dev/PROJECT/REPOSITORY")
    u.add_argument("--template", default=DEFAULT_TEMPLATE)
    u.add_argument("--tag", action="append", help="tag, e.g. v1 or latest (repeat)")
    u.add_argument("--description", default="")
    df = sub.add_parser("dataflow-args", help="print the beam_args JSON for Dataflow")
    _add_target(df)
    df.add_argument("--temp-location", required=True)
    df.add_argument("--machine-type", default="n2-standard-4")
    df.add_argument("--max-workers", type=int, default=10)
    df.add_argument("--sdk-container-image", required=True)
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    try:
        if args.command in ("run", "schedule"):
            target = Target(args.project, args.region, getattr(args, "pipeline_root", ""))
        elif args.command in ("register-model", "dataflow-args"):
            target = Target(args.project, args.region)
        if args.command == "run":
            job = submit(
                args.template,
                target,
                _run_params(args),
                args.service_account,
                args.network,
                args.cache,
                args.display_name,
                parse_key_values(args.label, "--label"),
                from_text=True,
            )
            print(job.resource_name)
        elif args.command == "schedule" and args.action == "create":
            s = create_schedule(
                args.template,
                target,
                args.cron,
                args.time_zone,
                args.name,
                _run_params(args),
                args.max_concurrent_runs,
                args.max_runs,
                args.start_time,
                args.end_time,
                args.allow_queueing,
                args.service_account,
                args.network,
                args.cache,
                parse_key_values(args.label, "--label"),
                from_text=True,
            )
            print(s.resource_name)
        elif args.command == "schedule" and args.action == "list":
            for s in list_schedules(target, args.filter):
                print(f"{s.resource_name}\t{s.display_name}\t{s.state.name}\t{s.cron}")
        elif args.command == "schedule":
            {"pause": pause_schedule, "resume": resume_schedule, "delete": delete_schedule}[args.action](
                args.schedule, target
            )
            print(f"{args.action}d {args.schedule}")
        elif args.command == "register-model":
            m = register_model(
                args.artifact_uri,
                args.display_name,
                target,
                args.serving_image,
                args.parent_model,
                args.alias,
                parse_key_values(args.label, "--label"),
                args.description,
            )
            print(m.versioned_resource_name)
        elif args.command == "upload-template":
            name, version = upload_template(args.host, args.template, args.tag, args.description)
            print(f"{args.host.rstrip('/')}/{name}/{version}")
        elif args.command == "dataflow-args":
            print(
                json.dumps(
                    dataflow_beam_args(
                        args.project,
                        args.region,
                        args.temp_location,
                        args.machine_type,
                        args.max_workers,
                        args.sdk_container_image,
                    )
                )
            )
    except (ValueError, FileNotFoundError) as e:
        p.error(str(e))
    except Exception as e:  # no credentials, no permission, API errors: one line, not a traceback
        if type(e).__module__.startswith(("google.auth", "google.api_core")):
            print(
                f"pipelines.submit: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''} (for "
                "credentials: gcloud auth application-default login, or a service account)",
                file=sys.stderr,
            )
            return 1
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
