"""Component 3: hybrid training (async embeddings on parameter servers, sync dense DDP)."""

from kfp import dsl
from kfp.dsl import Artifact, Dataset, Input, Metrics, Model, Output

from components import BASE_IMAGE


@dsl.component(base_image=BASE_IMAGE, install_kfp_package=False)
def train(dataset: Input[Dataset], shards: Input[Artifact], model: Output[Model], metrics: Output[Metrics]):
    """Start the parameter servers and NN workers of the run config, train, and write the Model artifact
    (dense weights, embedding shard dumps, manifest, training metrics) into ``model``."""
    import os

    from persia_core.config import load_config
    from persia_core.train.launcher import train as run

    cfg = load_config(os.path.join(shards.path, "run_config.yaml"))
    manifest = run(cfg, dataset.path, model.path, init_dir=shards.path)
    summary = manifest["summary"]
    metrics.log_metric("samples_per_s", summary["samples_per_s"])
    metrics.log_metric("max_staleness", summary["max_staleness"])
    metrics.log_metric("final_loss", summary["final_loss"])
    metrics.log_metric("wall_seconds", summary["wall_seconds"])
    model.metadata["framework"] = "persia-kfp"
    model.metadata["num_shards"] = manifest["num_shards"]
