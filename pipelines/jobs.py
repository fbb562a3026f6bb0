"""The Vertex AI requests: a pipeline run (``PipelineJob``, built from a checked template and parameters, then
submitted), a Model Registry upload of the blessed model, its deployment to an endpoint, and a template upload to
a KFP registry."""

from __future__ import annotations

import datetime as _dt
from typing import Any

from persia_core import io
from persia_core.model_store import latest_blessed_model
from pipelines.parameters import (
    Target,
    check_cloud_values,
    check_parameters,
    check_vertex_template,
    load_template,
    parameter_specs,
)


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


SERVING_COMMAND = ("python", "-m", "persia_core", "serve", "--host", "0.0.0.0")
SERVING_PORT = 8080
SERVING_PREDICT_ROUTE = "/predict"
SERVING_HEALTH_ROUTE = "/health"


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
    be a blessed-model location (``blessed_dir``), whose latest blessed model is then uploaded.

    The model's container spec is ``SERVING_COMMAND`` (``persia serve`` on 0.0.0.0) on port ``SERVING_PORT`` with
    ``SERVING_PREDICT_ROUTE`` and ``SERVING_HEALTH_ROUTE``, so that it deploys to an endpoint as it is (Vertex AI
    passes the port, routes and the model's copy as ``AIP_HTTP_PORT``, ``AIP_PREDICT_ROUTE``,
    ``AIP_HEALTH_ROUTE`` and ``AIP_STORAGE_URI``, which ``persia serve`` reads)."""
    from google.cloud import aiplatform

    uri = io.to_uri(artifact_uri).rstrip("/")
    if not uri.startswith("gs://"):
        raise ValueError(f"--artifact-uri {artifact_uri!r} must be a gs:// (or /gcs/) folder")
    if not io.exists(io.join(uri, "manifest.json")):
        latest = latest_blessed_model(uri)  # a blessed-model location (its marker names its latest model)?
        if latest is not None:
            uri = io.to_uri(latest).rstrip("/")
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
        serving_container_command=list(SERVING_COMMAND),
        serving_container_predict_route=SERVING_PREDICT_ROUTE,
        serving_container_health_route=SERVING_HEALTH_ROUTE,
        serving_container_ports=[SERVING_PORT],
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


def deploy_model(
    model: str,
    target: Target,
    endpoint: str = "",
    endpoint_display_name: str = "",
    machine_type: str = "n2-standard-4",
    min_replicas: int = 1,
    max_replicas: int = 1,
    service_account: str = "",
    credentials=None,
):
    """Deploy the registered ``model`` (``projects/P/locations/R/models/ID[@VERSION]``, as ``register-model``
    prints it) to ``endpoint`` (its resource name or ID; empty: a new endpoint named ``endpoint_display_name``, else
    the model's display name) on ``machine_type`` with ``min_replicas`` .. ``max_replicas`` replicas, and move all
    of the endpoint's traffic to it (models deployed there before keep running, at 0% of the traffic, until
    undeployed). Returns the ``aiplatform.Endpoint``. Raises ``ValueError`` for a bad model name or replica
    counts."""
    from google.cloud import aiplatform

    if not model.startswith("projects/") or "/models/" not in model:
        raise ValueError(f"--model {model!r}: expected projects/P/locations/R/models/ID[@VERSION]")
    if min_replicas < 1 or max_replicas < min_replicas:
        raise ValueError(f"replicas: need 1 <= --min-replicas <= --max-replicas, got {min_replicas}, {max_replicas}")
    where = {"project": target.project, "location": target.region, "credentials": credentials}
    m = aiplatform.Model(model_name=model, **where)
    ep = (
        aiplatform.Endpoint(endpoint, **where)
        if endpoint
        else aiplatform.Endpoint.create(display_name=endpoint_display_name or m.display_name, sync=True, **where)
    )
    m.deploy(
        endpoint=ep,
        deployed_model_display_name=m.display_name,
        traffic_percentage=100,
        machine_type=machine_type,
        min_replica_count=min_replicas,
        max_replica_count=max_replicas,
        service_account=service_account or None,
        sync=True,
    )
    return ep


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
