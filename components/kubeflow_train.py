"""Component 3, Kubeflow target: hybrid training as a JobSet on the cluster the pipeline runs on
(``components.jobset`` builds it, ``components.k8s_job`` drives it); the same inputs and outputs as
``components.train``."""

from kfp import dsl
from kfp.dsl import Artifact, Dataset, Input, Metrics, Model, Output

from components import BASE_IMAGE


@dsl.component(base_image=BASE_IMAGE, install_kfp_package=False)
def train(
    dataset: Input[Dataset],
    shards: Input[Artifact],
    model: Output[Model],
    metrics: Output[Metrics],
    settings: str,
    checkpoint_every_s: float = 600.0,
    checkpoint_every_steps: int = 0,
    delta_dir: str = "",
    delta_every_s: float = 0.0,
):
    """Hybrid training as one JobSet (a replicated job per role: primary, NN workers, parameter servers, embedding
    workers; ``settings``: the compile-time ``KubeflowSettings`` as JSON) in the step's namespace (or the one
    the settings name), owned by the step's pod; writes the same Model artifact as the local train step. The
    parameter servers' token is a fresh one in a Secret of this attempt. A failed pod fails the step with its
    role, name and last log lines; a retry deletes the previous attempt's JobSet and resumes from the newest
    complete checkpoint in ``<model>/checkpoints``; a cancelled run deletes the JobSet. Bad input found before the
    job starts exits 2 and is recorded in the model folder, so that a retry fails at once
    (``persia_core.bad_input``)."""
    import json
    import os
    import secrets

    from kubernetes import client, config

    from components.custom_job import record_training
    from components.jobset import jobset_manifests, jobset_name, require_cloud_storage, run_key
    from components.k8s_job import owner_reference, run_jobset, step_pod
    from persia_core import io
    from persia_core.bad_input import refusing_bad_input

    require_cloud_storage({"dataset": dataset.uri, "shards": shards.uri, "model": model.uri})
    s = json.loads(settings)
    config.load_incluster_config()
    api = client.ApiClient()
    own_namespace, pod, uid = step_pod()
    namespace = s["namespace"] or own_namespace
    # the step's pod owns the JobSet and its Secret (an owner must be in the same namespace)
    owner = owner_reference(api, own_namespace, pod, uid) if namespace == own_namespace else None
    with refusing_bad_input(model.uri, "train"):  # exit 2, and a retry of this task fails at once
        manifests = jobset_manifests(
            s,
            dataset.uri,
            shards.uri,
            model.uri,
            jobset_name(run_key(model.uri)),
            namespace,
            secrets.token_hex(16),
            owner=owner,
            checkpoint_every_s=checkpoint_every_s,
            checkpoint_every_steps=checkpoint_every_steps,
            delta_dir=delta_dir,
            delta_every_s=delta_every_s,
        )
    run_jobset(api, namespace, manifests)
    os.makedirs(model.path, exist_ok=True)  # the roles wrote the Model at its URI; the launcher uploads this folder
    manifest = json.loads(io.read_text(io.join(io.to_uri(model.uri), "manifest.json")))
    record_training(manifest, metrics, model)
