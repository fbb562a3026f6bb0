"""Component 3, Vertex AI target: hybrid training as a CustomJob with one worker pool per role
(``components.custom_job``); the same inputs and outputs as ``components.train``."""

from kfp import dsl
from kfp.dsl import Artifact, Dataset, Input, Metrics, Model, Output

from components import BASE_IMAGE


@dsl.component(base_image=BASE_IMAGE, install_kfp_package=False)
def train(
    dataset: Input[Dataset],
    shards: Input[Artifact],
    model: Output[Model],
    metrics: Output[Metrics],
    worker_pool_specs: str,
    location: str,
    project: str = "",
    service_account: str = "",
    network: str = "",
    ps_token_secret: str = "",
    timeout_s: int = 0,
    checkpoint_every_s: float = 600.0,
    checkpoint_every_steps: int = 0,
    delta_dir: str = "",
    delta_every_s: float = 0.0,
):
    """Hybrid training as a Vertex AI CustomJob (pools: primary, NN workers, parameter servers; see
    ``components.custom_job``); writes the same Model artifact as the local train step. Checkpoints go to
    ``<model>/checkpoints`` every ``checkpoint_every_s`` seconds / ``checkpoint_every_steps`` steps (0: off), and a
    restarted or retried job resumes from the newest complete one. ``delta_every_s > 0``: the parameter servers also
    write incremental exports to ``delta_dir`` (empty: ``<model>/deltas``). Bad input found before the job starts
    exits 2 and is recorded in the model folder, so that a retry fails at once (``persia_core.bad_input``)."""
    from components.custom_job import record_training, run_custom_job
    from persia_core.bad_input import refusing_bad_input

    with refusing_bad_input(model.uri, "train"):  # exit 2, and a retry of this task fails at once
        manifest = run_custom_job(
            worker_pool_specs,
            dataset.uri,
            shards.uri,
            model.uri,
            location,
            project,
            service_account,
            network,
            ps_token_secret,
            timeout_s,
            checkpoint_every_s=checkpoint_every_s,
            checkpoint_every_steps=checkpoint_every_steps,
            delta_dir=delta_dir,
            delta_every_s=delta_every_s,
        )
    record_training(manifest, metrics, model)
