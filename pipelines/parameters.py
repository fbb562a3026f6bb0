"""What a Vertex AI run is given, checked before anything is sent: where it goes (``Target``), the compiled
template (loaded, and refused when compiled for the local target), its parameters (checked against the template's
``root.inputDefinitions`` and converted to their types; values that would only fail on Vertex AI refused), and
the Dataflow options of the preprocess step (the ``beam_args`` parameter)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import yaml

from components import LOCAL_IMAGE
from components.data_path import check_cloud_folders, resolve_data_path
from persia_core import io
from persia_core.config import is_config_name, shipped_configs
from persia_core.config.trainer import AUTO_EPOCHS, check_delta_period
from persia_core.evaluate.decision import DEFAULT_LR_MARGIN, DEFAULT_MAX_NE, DEFAULT_MIN_AUC, check_thresholds

_REGION = re.compile(r"^[a-z]+-[a-z]+\d+$")
_PROJECT = re.compile(r"^[a-z][a-z0-9-]{4,28}[a-z0-9]$")


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
    if not io.exists(path):
        raise FileNotFoundError(f"compiled pipeline {path!r} not found (run `make compile TARGET=vertex`)")
    spec = yaml.safe_load(io.read_text(path))
    if not isinstance(spec, dict) or "root" not in spec or "pipelineInfo" not in spec:
        raise ValueError(f"{path}: not a compiled KFP pipeline (no root / pipelineInfo)")
    return spec


def check_vertex_template(spec: dict, path: str) -> None:
    """Refuse a template compiled for the local target (its images exist only on a laptop)."""
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

    ``blessed_dir`` (given or the template's default) and a non-empty ``warm_start_from`` must be Cloud Storage folders
    (a path inside a run's container is gone when the run ends, so nothing would ever be warm-started), and so must
    a non-empty ``delta_dir``; ``{...}`` tokens of ``data`` must be date tokens
    (``components.data_path.resolve_data_path``). Raises ``ValueError`` naming the parameter."""

    def value(name: str) -> str:
        return str(values.get(name, specs.get(name, {}).get("defaultValue", "")))

    if "blessed_dir" in specs:
        check_cloud_folders(value("blessed_dir"), value("warm_start_from") if "warm_start_from" in specs else "")
    if "delta_every_s" in specs:
        check_delta_period(float(value("delta_every_s") or 0))
    delta_dir = value("delta_dir") if "delta_dir" in specs else ""
    if delta_dir and not delta_dir.startswith(("gs://", "/gcs/")):
        raise ValueError(
            f"delta_dir {delta_dir!r} is a folder inside the run's container, gone when it ends: set it to a "
            "gs:// (or /gcs/) folder, or leave it empty for <model>/deltas"
        )
    data = value("data") if "data" in specs else ""
    for name in ("num_parameter_servers", "num_nn_workers", "epochs", "max_rows"):
        least = AUTO_EPOCHS if name == "epochs" else 0
        if name in specs and float(value(name) or 0) < least:
            auto = f", or {AUTO_EPOCHS} for epochs: auto" if name == "epochs" else ""
            raise ValueError(f"{name} must be >= 0 (0 = the run config's value{auto}), got {value(name)}")
    if "embedding_staleness" in specs and float(value("embedding_staleness") or 0) < -1:
        raise ValueError(
            f"embedding_staleness must be >= 0, or -1 for the run config's value, got {value('embedding_staleness')}"
        )
    if "config" in specs:
        cfg = value("config")
        if cfg and is_config_name(cfg) and cfg not in shipped_configs():
            raise ValueError(
                f"config {cfg!r} is not a shipped run config {shipped_configs()} (or give a gs:// YAML path)"
            )
    check_thresholds(
        min_auc=float(value("min_auc") or 0) if "min_auc" in specs else DEFAULT_MIN_AUC,
        max_ne=float(value("max_ne")) if "max_ne" in specs and value("max_ne") else DEFAULT_MAX_NE,
        lr_margin=float(value("lr_margin") or 0) if "lr_margin" in specs else DEFAULT_LR_MARGIN,
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
