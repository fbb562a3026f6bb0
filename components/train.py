"""Component 3: hybrid training (async embeddings on parameter servers, sync dense DDP)."""

from kfp import dsl
from kfp.dsl import Artifact, Dataset, Input, Metrics, Model, Output

from components import BASE_IMAGE


@dsl.component(base_image=BASE_IMAGE, install_kfp_package=False)
def train(
    dataset: Input[Dataset],
    shards: Input[Artifact],
    model: Output[Model],
    metrics: Output[Metrics],
    checkpoint_every_steps: int = 0,
    checkpoint_every_s: float = 600.0,
    checkpoint_dir: str = "",
    delta_every_s: float = 0.0,
    delta_dir: str = "",
):
    """Start the parameter servers and NN workers of the run config, train, and write the Model artifact
    (dense weights, embedding shard dumps, manifest, training metrics) into ``model``.

    Checkpoints go to ``checkpoint_dir`` (empty: ``<model>/checkpoints``, which a retry of this task finds again) every
    ``checkpoint_every_steps`` steps and/or ``checkpoint_every_s`` seconds (0 = off) and at the end; a retried task
    resumes from the newest complete one. ``delta_every_s > 0`` also writes incremental exports to ``delta_dir``
    (empty: ``<model>/deltas``). Bad input (a config that does not fit the data or the shards) exits 2 and is
    recorded in ``<model>/bad_input.json``, so that a retry fails at once (``persia_core.bad_input``)."""
    from persia_core.train.processes import die_with_local_runner

    die_with_local_runner()  # a task of run_local ends with it, even a SIGKILLed one, not running on orphaned

    import os

    from persia_core.bad_input import refusing_bad_input
    from persia_core.checkpoints import CheckpointSettings
    from persia_core.config import load_config
    from persia_core.logging_utils import setup_logging
    from persia_core.train.launcher import train as run

    setup_logging("train")  # the launcher's progress lines (NN worker 0's step, loss, samples/s) in the task log
    with refusing_bad_input(model.path, "train"):  # exit 2, and a retry of this task fails at once
        cfg = load_config(os.path.join(shards.path, "run_config.yaml"))
        settings = CheckpointSettings(
            dir=checkpoint_dir, every_steps=checkpoint_every_steps, every_s=checkpoint_every_s, at_end=True
        )
        manifest = run(
            cfg,
            dataset.path,
            model.path,
            init_dir=shards.path,
            checkpoint=settings,
            resume_from="auto",
            delta_every_s=delta_every_s,
            delta_dir=delta_dir,
        )
    summary = manifest["summary"]
    metrics.log_metric("samples_per_s", summary["samples_per_s"])
    metrics.log_metric("max_staleness", summary["max_staleness"])
    metrics.log_metric("final_loss", summary["final_loss"])
    metrics.log_metric("wall_seconds", summary["wall_seconds"])
    metrics.log_metric("resumed", manifest["resumed_from"] is not None)
    model.metadata["framework"] = "persia-kfp"
    model.metadata["num_shards"] = manifest["num_shards"]
    model.metadata["warm_start"] = (manifest.get("warm_start") or {}).get("from", "")
