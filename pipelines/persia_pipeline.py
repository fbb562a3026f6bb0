"""The persia-kfp training pipeline (KFP v2), and its compile entry point.

Steps:
  1. preprocess   Apache Beam: parse, validate, hash feature IDs, dense features, time split -> Parquet shards
  2. init_shards  shard plan, memory estimate and initial state of the embedding parameter servers
  3. train        hybrid training: N parameter servers (async embeddings, staleness K) + M NN workers (DDP)
  4. evaluate     AUC, logloss, normalized entropy, calibration, ROC curve, HTML report

Every parameter has a default that runs on the bundled MovieLens data. Compile with
``python -m pipelines.persia_pipeline --output pipelines/persia_pipeline.yaml`` (``make compile``).
"""


import argparse
import sys

from kfp import compiler, dsl

from components.evaluate import evaluate
from components.init_shards import init_shards
from components.preprocess import preprocess
from components.train import train

PIPELINE_NAME = "persia-hybrid-training"
DEFAULT_DATA = "data/movielens"


@dsl.pipeline(name=PIPELINE_NAME, description="PERSIA-style hybrid training of a CTR model with huge embeddings")
def persia_pipeline(
    data: str = DEFAULT_DATA,
    config: str = "movielens",
    num_parameter_servers: int = 2,
    num_nn_workers: int = 2,
    embedding_staleness: int = 4,
    epochs: int = 0,
    max_rows: int = 0,
    beam_args: str = "",
) -> str:
    """Args:
    data: raw data (folder, file or glob; local, gs:// or /gcs/).
    config: run config, a shipped name (``movielens``, ``criteo``) or a YAML path.
    num_parameter_servers: embedding parameter-server shards (0 = the config's).
    num_nn_workers: NN workers / DDP ranks (0 = the config's).
    embedding_staleness: K, batches a worker may look up ahead of its oldest unapplied push (0 = fully
        synchronous; -1 = the config's).
    epochs: training epochs (0 = the config's). max_rows: read only this many examples (0 = all).
    beam_args: Beam pipeline options as a JSON list (e.g. DataflowRunner settings); empty = DirectRunner.
    Returns the evaluation metrics as a JSON string.
    """
    pre = preprocess(
        data=data, config=config, num_parameter_servers=num_parameter_servers, num_nn_workers=num_nn_workers,
        embedding_staleness=embedding_staleness, epochs=epochs, max_rows=max_rows, beam_args=beam_args,
    ).set_display_name("preprocess (Beam)")
    plan = init_shards(dataset=pre.outputs["dataset"]).set_display_name("init shards")
    trained = train(dataset=pre.outputs["dataset"], shards=plan.outputs["shards"]).set_display_name(
        "train (hybrid)")
    ev = evaluate(dataset=pre.outputs["dataset"], model=trained.outputs["model"]).set_display_name("evaluate")
    for task in (pre, plan, trained, ev):
        task.set_caching_options(False)
    return ev.outputs["Output"]


def compile_pipeline(output: str) -> str:
    """Compile ``persia_pipeline`` to a KFP IR YAML file at ``output``; returns the path."""
    compiler.Compiler().compile(persia_pipeline, package_path=output)
    return output


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Compile the persia-kfp pipeline to YAML.")
    p.add_argument("--output", default="pipelines/persia_pipeline.yaml", help="YAML file to write")
    args = p.parse_args(argv)
    print(compile_pipeline(args.output))
    return 0


if __name__ == "__main__":
    sys.exit(main())
