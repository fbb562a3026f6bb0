"""Component 6 (Vertex AI target, optional): register the model just blessed in the Model Registry and deploy it
to an endpoint with all traffic moved to it (``components.endpoint``)."""

from kfp import dsl

from components import BASE_IMAGE


@dsl.component(base_image=BASE_IMAGE, install_kfp_package=False)
def deploy(
    blessed_model: str,
    config: str,
    endpoint: str,
    location: str,
    serving_image: str,
    registry_model: str = "",
    machine_type: str = "n2-standard-4",
    min_replicas: int = 1,
    max_replicas: int = 1,
) -> str:
    """Upload ``blessed_model`` (the blessed copy, gs:// or /gcs/) as a new version of ``registry_model`` (empty:
    a new Registry model named ``persia-<config name>``) with the serving container's spec, then deploy that
    version to ``endpoint`` (resource name or ID) on ``machine_type`` with all of its traffic. The project is the
    run's. Returns ``<model>@<version> -> <endpoint>``."""
    import os

    from components.endpoint import deploy_to_endpoint, upload_model

    name = "persia-" + os.path.splitext(os.path.basename(config.rstrip("/")))[0]
    m = upload_model(blessed_model, name, "", location, serving_image, registry_model, aliases=["blessed"])
    ep = deploy_to_endpoint(
        m.versioned_resource_name, "", location, endpoint, "", machine_type, min_replicas, max_replicas
    )
    return f"{m.versioned_resource_name} -> {ep.resource_name}"
