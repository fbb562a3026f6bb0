"""The Vertex AI requests: a pipeline run (``PipelineJob``, built from a checked template and parameters, then
submitted) and a template upload to a KFP registry; the Model Registry upload and the endpoint deployment are
``components.endpoint``'s (the pipeline's deploy step makes them too)."""

from __future__ import annotations

import datetime as _dt
from typing import Any

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
