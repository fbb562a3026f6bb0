"""The persia-kfp training pipeline (KFP v2), and its compile entry point.

Steps:
  1. preprocess   Apache Beam: parse, validate, hash feature IDs, dense features, time split -> Parquet shards
  2. init_shards  shard plan, memory estimate and initial state of the embedding parameter servers
  3. train        hybrid training: N parameter servers (async embeddings, staleness K) + M NN workers (DDP)
  4. evaluate     AUC, logloss, normalized entropy, calibration, ROC curve, HTML report
  5. gate         compare with the latest blessed model (or ``min_auc``; never a normalized entropy >= ``max_ne``)
                 and, only if better, bless the model:
                  copy it to ``blessed_dir``, the location the next run warm-starts from (``warm_start_from``)

One pipeline, two compile-time targets (``--target``):
  local   (default) train runs every role as local processes (``components.train``); runs under ``kfp.local``.
          Writes ``pipelines/persia_pipeline.yaml`` (``make compile``).
  vertex  train is a Vertex AI CustomJob with one worker pool per role (``components.vertex_train``), and step 0,
          ``resolve_data``, fills ``{date}`` tokens of ``data`` from the run's scheduled time. Every step runs in
          ``$PERSIA_BASE_IMAGE``. Writes ``pipelines/persia_pipeline_vertex.yaml``
          (``make compile TARGET=vertex``).
  kubeflow train is one JobSet on the Kubernetes cluster of Kubeflow Pipelines, a replicated job per role
          (``components.kubeflow_train``; settings ``pipelines.kubeflow``). Every step runs in ``$PERSIA_K8S_IMAGE``
          (else ``$PERSIA_BASE_IMAGE``). Writes ``pipelines/persia_pipeline_kubeflow.yaml``
          (``make compile TARGET=kubeflow``).

Every parameter has a default that runs on the bundled MovieLens data. Compile with
``python -m pipelines.persia_pipeline [--target vertex] [--output FILE]``.
"""

import argparse
import dataclasses
import json
import sys
from typing import Any

from kfp import compiler, dsl

from components import base_image
from components.deploy import deploy
from components.evaluate import evaluate
from components.gate import bless_model, gate
from components.init_shards import init_shards
from components.kubeflow_train import train as kubeflow_train
from components.preprocess import preprocess
from components.resolve_data import resolve_data
from components.train import train
from components.vertex_train import train as vertex_train
from persia_core.evaluate.decision import (
    DEFAULT_LR_MARGIN,
    DEFAULT_MAX_AUC_DROP,
    DEFAULT_MAX_LOGLOSS_INCREASE,
    DEFAULT_MAX_NE,
    DEFAULT_MIN_AUC,
)
from pipelines import kubeflow, vertex

PIPELINE_NAME = "persia-hybrid-training"
PIPELINE_DESCRIPTION = "PERSIA-style hybrid training of a CTR model with huge embeddings"
DEFAULT_DATA = "data/movielens"
DEFAULT_BLESSED_DIR = "local_outputs/blessed"
TARGETS = ("local", "vertex", "kubeflow")
DEFAULT_OUTPUT = {
    "local": "pipelines/persia_pipeline.yaml",
    "vertex": "pipelines/persia_pipeline_vertex.yaml",
    "kubeflow": "pipelines/persia_pipeline_kubeflow.yaml",
}


@dsl.pipeline(name=PIPELINE_NAME, description=PIPELINE_DESCRIPTION)
def persia_pipeline(
    data: str = DEFAULT_DATA,
    config: str = "movielens",
    num_parameter_servers: int = 0,
    num_nn_workers: int = 0,
    embedding_staleness: int = -1,
    epochs: int = 0,
    max_rows: int = 0,
    beam_args: str = "",
    blessed_dir: str = DEFAULT_BLESSED_DIR,
    warm_start_from: str = "",
    min_auc: float = DEFAULT_MIN_AUC,
    max_auc_drop: float = DEFAULT_MAX_AUC_DROP,
    max_ne: float = DEFAULT_MAX_NE,
    lr_margin: float = DEFAULT_LR_MARGIN,
    checkpoint_every_s: float = 600.0,
    checkpoint_every_steps: int = 0,
    delta_every_s: float = 0.0,
    delta_dir: str = "",
    deploy_endpoint: str = "",
    registry_model: str = "",
    serving_machine_type: str = "n2-standard-4",
) -> str:
    """Args:
    data: raw data (folder, file or glob; local, gs:// or /gcs/). Vertex target: ``{date}``, ``{date-1d}``,
        ``{date:%Y%m%d}`` tokens are filled from the run's scheduled time (see ``components.data_path``).
    config: run config, a shipped name (``movielens``, ``criteo``) or a YAML path.
    num_parameter_servers: embedding parameter-server shards (processes; default 0 = the config's
        ``embedding.num_shards``; on Vertex AI several shards share a server machine, see ``pipelines.vertex``).
    num_nn_workers: NN workers / DDP ranks (default 0 = the config's ``trainer.num_workers``).
    embedding_staleness: K, batches a worker may look up ahead of its oldest unapplied push (0 = fully
        synchronous; default -1 = the config's ``trainer.embedding_staleness``).
    epochs: training epochs (0 = the config's; -1 = ``epochs: auto``: up to ``trainer.max_epochs``, stopping on
        the validation slice's logloss). max_rows: read only this many examples (0 = all).
    beam_args: Beam pipeline options as a JSON list (e.g. DataflowRunner settings); empty = DirectRunner.
    blessed_dir: the stable "latest blessed model" location the gate writes (local path, gs:// or /gcs/).
    warm_start_from: start from a previous model: a Model artifact, a checkpoint, or a blessed-model location
        (daily retraining: the same value as ``blessed_dir``; nothing blessed yet = cold start); empty = cold.
    min_auc: the gate blesses only a model with at least this eval AUC ...
    max_auc_drop: ... and, when a model is already blessed, at most this much below its AUC.
    max_ne: ... and never one whose normalized entropy is at or above this (1: no better than the base rate).
    lr_margin: ... nor one whose AUC is more than this below the LR reference's (hashed logistic regression on the
        same slots and train split, fitted by the evaluate step; 0: not below it; 1: reported, not enforced).
    checkpoint_every_s, checkpoint_every_steps: periodic checkpoints of training (0 = off); the train task is
        retried on failure and resumes from the newest complete checkpoint.
    delta_every_s: the parameter servers' incremental exports (deltas: rows changed and keys evicted), every this
        many seconds of training (0 = none): PERSIA's incremental update for online serving.
    delta_dir: where deltas go, a location that stays the same from run to run (Vertex AI: gs:// or /gcs/);
        empty = ``<model>/deltas`` inside each run's Model artifact.
    deploy_endpoint: Vertex AI target only (ignored by local and Kubeflow runs): an endpoint (resource name or ID)
        that a newly blessed model is deployed to, registered first as a new version of ``registry_model`` (empty: a new
        Registry model ``persia-<config>``), on ``serving_machine_type``, with all traffic moved to it; empty = no
        deploy step.
    Returns the evaluation metrics as a JSON string.
    """
    target = vertex.current_settings()  # compile-time switch: None = local, else the Vertex AI settings
    k8s = kubeflow.current_settings()  # or the Kubeflow settings
    tasks = []
    if target is not None:
        resolved = resolve_data(
            template=data,
            schedule_time=dsl.PIPELINE_JOB_SCHEDULE_TIME_UTC_PLACEHOLDER,
            blessed_dir=blessed_dir,
            warm_start_from=warm_start_from,
        ).set_display_name("resolve data (schedule time)")
        tasks.append(resolved)
        data = resolved.output
    pre = preprocess(
        data=data,
        config=config,
        num_parameter_servers=num_parameter_servers,
        num_nn_workers=num_nn_workers,
        embedding_staleness=embedding_staleness,
        epochs=epochs,
        max_rows=max_rows,
        beam_args=beam_args,
    ).set_display_name("preprocess (Beam)")
    plan = init_shards(dataset=pre.outputs["dataset"], warm_start_from=warm_start_from).set_display_name("init shards")
    if k8s is not None:
        trained = kubeflow_train(
            dataset=pre.outputs["dataset"],
            shards=plan.outputs["shards"],
            settings=json.dumps(k8s.to_json(), sort_keys=True),
            checkpoint_every_s=checkpoint_every_s,
            checkpoint_every_steps=checkpoint_every_steps,
            delta_every_s=delta_every_s,
            delta_dir=delta_dir,
        )
    elif target is None:
        trained = train(
            dataset=pre.outputs["dataset"],
            shards=plan.outputs["shards"],
            checkpoint_every_steps=checkpoint_every_steps,
            checkpoint_every_s=checkpoint_every_s,
            delta_every_s=delta_every_s,
            delta_dir=delta_dir,
        )
    else:
        trained = vertex_train(
            dataset=pre.outputs["dataset"],
            shards=plan.outputs["shards"],
            worker_pool_specs=json.dumps(target.worker_pool_specs()),
            location=target.region,
            service_account=target.service_account,
            network=target.network,
            ps_token_secret=target.ps_token_secret,
            timeout_s=target.timeout_s,
            checkpoint_every_s=checkpoint_every_s,
            checkpoint_every_steps=checkpoint_every_steps,
            delta_every_s=delta_every_s,
            delta_dir=delta_dir,
        )
    trained.set_display_name("train (hybrid)").set_retry(num_retries=2, backoff_duration="60s", backoff_factor=2.0)
    ev = evaluate(
        dataset=pre.outputs["dataset"],
        model=trained.outputs["model"],
        blessed_dir=blessed_dir,
        min_auc=min_auc,
        max_auc_drop=max_auc_drop,
        max_logloss_increase=DEFAULT_MAX_LOGLOSS_INCREASE,
        max_ne=max_ne,
        lr_margin=lr_margin,
    ).set_display_name("evaluate")
    decision = gate(
        metrics_json=ev.outputs["Output"],
        blessed_dir=blessed_dir,
        min_auc=min_auc,
        max_auc_drop=max_auc_drop,
        max_logloss_increase=DEFAULT_MAX_LOGLOSS_INCREASE,
        max_ne=max_ne,
        lr_margin=lr_margin,
    ).set_display_name("model gate")
    tasks += [pre, plan, trained, ev, decision]
    with dsl.If(decision.outputs["Output"] == "bless", name="better-than-blessed"):
        blessed = bless_model(
            model=trained.outputs["model"], metrics_json=ev.outputs["Output"], blessed_dir=blessed_dir
        ).set_display_name("bless model")
        tasks.append(blessed)
        if target is not None:
            with dsl.If(deploy_endpoint != "", name="deploy-requested"):
                deployed = deploy(
                    blessed_model=blessed.output,
                    config=config,
                    endpoint=deploy_endpoint,
                    location=target.region,
                    serving_image=target.image,
                    registry_model=registry_model,
                    machine_type=serving_machine_type,
                ).set_display_name("deploy to endpoint")
                tasks.append(deployed)
    image = target.image if target is not None else k8s.image if k8s is not None else base_image("local")
    for task in tasks:
        task.set_caching_options(False)
        task.set_container_image(image)
    return ev.outputs["Output"]


def compile_pipeline(
    output: str, target: str = "local", settings: "vertex.VertexSettings | kubeflow.KubeflowSettings | None" = None
) -> str:
    """Compile ``persia_pipeline`` for ``target`` (``local`` | ``vertex`` | ``kubeflow``) to a KFP IR YAML file at
    ``output``; returns the path. The Vertex AI and Kubeflow targets take ``settings`` (default: from ``PERSIA_*``
    / ``PERSIA_K8S_*`` variables; raises ``ValueError`` without an image)."""
    if target not in TARGETS:
        raise ValueError(f"unknown target {target!r} (expected one of {TARGETS})")
    if target == "local":
        compiler.Compiler().compile(persia_pipeline, package_path=output)
        return output
    switch: Any
    if target == "vertex":
        switch = vertex.compiling_for(settings or vertex.VertexSettings.from_env())  # type: ignore[arg-type]
    else:
        switch = kubeflow.compiling_for(settings or kubeflow.KubeflowSettings.from_env())  # type: ignore[arg-type]
    with switch:
        pipeline = dsl.pipeline(name=PIPELINE_NAME, description=PIPELINE_DESCRIPTION)(persia_pipeline.pipeline_func)
    compiler.Compiler().compile(pipeline, package_path=output)
    return output


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Compile the persia-kfp pipeline to YAML.")
    p.add_argument(
        "--target",
        choices=TARGETS,
        default="local",
        help="local: train as local processes (kfp.local); vertex: train as a Vertex AI CustomJob; kubeflow: train "
        "as a JobSet on the Kubernetes cluster of Kubeflow Pipelines",
    )
    p.add_argument(
        "--output",
        default="",
        help="YAML file to write (default: " + ", ".join(f"{t}: {o}" for t, o in DEFAULT_OUTPUT.items()) + ")",
    )
    v = p.add_argument_group("vertex target (defaults: the PERSIA_* variables, see pipelines/vertex.py)")
    v.add_argument("--image", help="image of every step and the parameter servers ($PERSIA_BASE_IMAGE)")
    v.add_argument("--cuda-image", help="image of the NN pools ($PERSIA_CUDA_IMAGE; default --image)")
    v.add_argument("--region", help="region of the training CustomJob ($PERSIA_VERTEX_REGION)")
    v.add_argument("--nn-machine-type", help="machine of NN pools 0 and 1")
    v.add_argument("--accelerator-type", help="GPU of an NN machine ('none' for CPU-only NN machines)")
    v.add_argument("--accelerator-count", type=int, help="GPUs per NN machine")
    v.add_argument("--ps-machine-type", help="high-memory machine of the parameter-server pool 2")
    v.add_argument("--shards-per-server", type=int, help="parameter-server shards per pool-2 replica")
    v.add_argument("--ranks-per-replica", type=int, help="NN worker processes (DDP ranks) per NN replica")
    v.add_argument(
        "--embedding-workers",
        type=int,
        help="embedding workers per NN worker on CPU machines of their own, pool 3 (0: beside the NN workers)",
    )
    v.add_argument("--ew-machine-type", help="CPU machine of the embedding-worker pool 3")
    v.add_argument("--embedding-workers-per-replica", type=int, help="embedding-worker processes per pool-3 replica")
    v.add_argument("--service-account", help="service account of the CustomJob")
    v.add_argument("--network", help="VPC network of the CustomJob")
    v.add_argument("--ps-token-secret", help="Secret Manager version of the parameter servers' token")
    v.add_argument("--timeout-s", type=int, help="CustomJob timeout, seconds")
    k = p.add_argument_group("kubeflow target (defaults: the PERSIA_K8S_* variables; see pipelines/kubeflow.py)")
    for f in dataclasses.fields(kubeflow.KubeflowSettings):
        var = kubeflow.KubeflowSettings.ENV[f.name]
        kind = kubeflow.parser(f.type)
        k.add_argument(
            f"--k8s-{f.name.replace('_', '-')}",
            type=kind,
            help=f"${var}" + (", else $PERSIA_BASE_IMAGE" if f.name == "image" else ""),
        )
    args = p.parse_args(argv)
    output = args.output or DEFAULT_OUTPUT[args.target]
    settings: vertex.VertexSettings | kubeflow.KubeflowSettings | None = None
    try:

        def foreign(flag: str) -> bool:  # a setting of another target, which this compile would ignore
            return args.target == "local" or (args.target == "kubeflow") != flag.startswith("k8s_")

        wrong = [
            "--" + k.replace("_", "-")
            for k, v in vars(args).items()
            if v is not None and k not in ("target", "output") and foreign(k)
        ]
        if wrong:
            raise ValueError(f"{', '.join(wrong)}: not a setting of the {args.target} target")
        if args.target == "vertex":
            names = [f.name for f in dataclasses.fields(vertex.VertexSettings)]
            settings = vertex.VertexSettings.from_env(**{k: v for k, v in vars(args).items() if k in names})
        elif args.target == "kubeflow":
            given = {k[len("k8s_") :]: v for k, v in vars(args).items() if k.startswith("k8s_")}
            settings = kubeflow.KubeflowSettings.from_env(**given)
        print(compile_pipeline(output, args.target, settings))
    except ValueError as e:
        p.error(str(e))
    return 0


if __name__ == "__main__":
    sys.exit(main())
