"""Component 1: preprocess raw files with Apache Beam into Parquet shards, statistics and a dead-letter folder."""

from kfp import dsl
from kfp.dsl import Dataset, Metrics, Output

from components import BASE_IMAGE


@dsl.component(base_image=BASE_IMAGE, install_kfp_package=False)
def preprocess(
    data: str,
    config: str,
    num_parameter_servers: int,
    num_nn_workers: int,
    embedding_staleness: int,
    epochs: int,
    max_rows: int,
    beam_args: str,
    dataset: Output[Dataset],
    stats: Output[Metrics],
):
    """Parse, validate and hash the raw data at ``data`` with the run config ``config`` (a shipped name or a
    YAML path), overriding its cluster and trainer settings (0 = keep the config's value; ``epochs`` -1:
    ``epochs: auto``); Beam runner options
    (JSON list, e.g. ``["--runner=DataflowRunner", ...]``) pass through. Writes train/eval Parquet shards,
    ``schema.json``, ``run_config.yaml`` and ``dead_letter/`` into ``dataset``."""
    from persia_core.train.processes import die_with_local_runner

    die_with_local_runner()  # a task of run_local ends with it, even a SIGKILLed one, not running on orphaned

    import json

    from persia_core.config import load_config
    from persia_core.config.loading import pipeline_overrides
    from persia_core.preprocess.pipeline import run_preprocess

    overrides = pipeline_overrides(num_parameter_servers, num_nn_workers, embedding_staleness, epochs, max_rows)
    cfg = load_config(config, overrides)
    from persia_core import io

    # Dataflow workers cannot see the /gcs/ mount of this container: hand Beam gs:// URIs
    schema = run_preprocess(cfg, io.to_uri(data), io.to_uri(dataset.path), json.loads(beam_args) if beam_args else None)
    for k, v in schema["rows"].items():
        stats.log_metric(f"rows_{k}", v)
    for k, v in schema["distinct_ids"].items():
        stats.log_metric(f"distinct_ids_{k}", v)
