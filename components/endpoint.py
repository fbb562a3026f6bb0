"""The Model Registry upload of a blessed model and its deployment to an endpoint (Vertex AI), shared by
``pipelines.submit register-model`` / ``deploy`` and the pipeline's optional ``deploy`` step.

``project`` may be empty: the Vertex AI SDK then takes the environment's (inside a pipeline step, the project the
run belongs to)."""

from __future__ import annotations

import re

from persia_core import io
from persia_core.model_store import latest_blessed_model

SERVING_COMMAND = ("python", "-m", "persia_core", "serve", "--host", "0.0.0.0")
SERVING_PORT = 8080
SERVING_PREDICT_ROUTE = "/predict"
SERVING_HEALTH_ROUTE = "/health"
MODEL_NAME = re.compile(r"^projects/[^/]+/locations/([^/]+)/models/[^/@]+(?:@[^/@]+)?$")
"""A registered model version's resource name; group 1 is its region."""


def upload_model(
    artifact_uri: str,
    display_name: str,
    project: str,
    location: str,
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
    ``AIP_HEALTH_ROUTE`` and ``AIP_STORAGE_URI``, which ``persia serve`` reads). Raises ``ValueError`` for a
    folder not on Cloud Storage or a missing name or image."""
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
        project=project or None,
        location=location,
        credentials=credentials,
        sync=True,
    )


def deploy_to_endpoint(
    model: str,
    project: str,
    location: str,
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

    m = MODEL_NAME.match(model)
    if m is None:
        raise ValueError(f"--model {model!r}: expected projects/P/locations/R/models/ID[@VERSION]")
    if m.group(1) != location:
        raise ValueError(
            f"--model {model!r} is in {m.group(1)}, not in the region {location!r}: give --region {m.group(1)}"
        )
    if min_replicas < 1 or max_replicas < min_replicas:
        raise ValueError(f"replicas: need 1 <= --min-replicas <= --max-replicas, got {min_replicas}, {max_replicas}")
    where = {"project": project or None, "location": location, "credentials": credentials}
    registered = aiplatform.Model(model_name=model, **where)
    ep = (
        aiplatform.Endpoint(endpoint, **where)
        if endpoint
        else aiplatform.Endpoint.create(
            display_name=endpoint_display_name or registered.display_name, sync=True, **where
        )
    )
    registered.deploy(
        endpoint=ep,
        deployed_model_display_name=registered.display_name,
        traffic_percentage=100,
        machine_type=machine_type,
        min_replica_count=min_replicas,
        max_replica_count=max_replicas,
        service_account=service_account or None,
        sync=True,
    )
    return ep
