"""``persia preprocess``, ``init-shards`` and ``train``: the pipeline's steps on local (or gs://) files."""

from __future__ import annotations

import json
import logging

from persia_core import io
from persia_core.cli.common import EXIT_OK, AddCommand, config_flags, print_json, run_config
from persia_core.logging_utils import write_tensorboard


def cmd_preprocess(args, beam_args: list[str]) -> int:
    from persia_core.preprocess.pipeline import run_preprocess

    config = run_config(args.config, [], args.set)
    # Beam logs at INFO per transform (e.g. ~130 apache_beam.typehints.native_type_compatibility lines on a tiny
    # input): only its warnings unless --log-level DEBUG asks for everything
    beam_log = logging.getLogger("apache_beam")
    previous = beam_log.level
    # (and everything with DEBUG, whatever level an earlier caller in this process left on Beam's logger)
    beam_log.setLevel(logging.NOTSET if logging.getLogger().isEnabledFor(logging.DEBUG) else logging.WARNING)
    try:
        schema = run_preprocess(config, args.data, args.output, beam_args or None)
    finally:
        beam_log.setLevel(previous)  # leave an embedding process (a test) as it was
    print_json({"output": args.output, "rows": schema["rows"], "split": schema["split"]})
    return EXIT_OK


def cmd_init_shards(args, _extra) -> int:
    from persia_core.embedding.plan import init_shards

    config = run_config(args.config, [io.join(args.data, "run_config.yaml")], args.set)
    if args.warm_start_from and not args.cold_start_if_missing and not io.isdir(args.warm_start_from):
        # a typo would start every scheduled run cold
        raise FileNotFoundError(
            f"--warm-start-from {args.warm_start_from!r}: nothing there (a typo would start "
            f"every scheduled run cold; for a blessed-model location that may hold nothing yet, "
            f"the first run of a schedule, add --cold-start-if-missing)"
        )
    plan = init_shards(config, args.data, args.output, warm_start_from=args.warm_start_from)
    print_json(
        {
            "output": args.output,
            "num_shards": plan["num_shards"],
            "estimated_bytes_per_shard": plan["estimated_bytes_per_shard"],
            "shard_memory_bytes": plan["shard_memory_bytes"],
            "warm_start": plan.get("warm_start"),
        }
    )
    return EXIT_OK


def cmd_train(args, _extra) -> int:
    from persia_core.train.launcher import train

    fallbacks = [io.join(args.init, "run_config.yaml") if args.init else "", io.join(args.data, "run_config.yaml")]
    config = run_config(args.config, fallbacks, args.set)
    manifest = train(
        config,
        args.data,
        args.output,
        init_dir=args.init or "",
        work_dir=args.work_dir or "",
        resume_from=args.resume_from,
    )
    out = {"output": args.output, "summary": manifest["summary"]}
    if args.tensorboard:
        history = json.loads(io.read_text(io.join(args.output, "train_metrics.json")))
        out["tensorboard"] = write_tensorboard(history, args.tensorboard)
    print_json(out)
    return EXIT_OK


def add_commands(add: AddCommand) -> None:
    """Add the parsers of ``preprocess``, ``init-shards`` and ``train``."""
    sp = add(
        "preprocess",
        "Raw files -> Parquet train/eval shards, schema.json and dead letters (Apache Beam). "
        "Flags not listed here are passed to Beam as pipeline options (e.g. --runner DataflowRunner).",
        cmd_preprocess,
    )
    sp.add_argument(
        "--data",
        required=True,
        help="raw data: a MovieLens folder, or a delimited file, folder or glob (local or gs://)",
    )
    sp.add_argument("--output", required=True, help="output folder for the shards and schema.json")
    config_flags(sp, "default movielens", "movielens")

    sp = add(
        "init-shards", "Plan the embedding shards (memory per shard) and write their initial state.", cmd_init_shards
    )
    sp.add_argument("--data", required=True, help="preprocess output folder (holds schema.json)")
    sp.add_argument("--output", required=True, help="folder for shard_plan.json, run_config.yaml, shards/")
    sp.add_argument(
        "--warm-start-from",
        default="",
        help="start from a previous Model, checkpoint or "
        "blessed-model location (re-sharded if needed; an empty "
        "folder, nothing blessed yet: cold start; a path where "
        "nothing exists: refused)",
    )
    sp.add_argument(
        "--cold-start-if-missing",
        action="store_true",
        help="a --warm-start-from where nothing exists yet is a cold start (a schedule's first run, "
        "before its blessed-model location holds anything; also on Cloud Storage, which has no "
        "empty folders)",
    )
    config_flags(sp, "default: <data>/run_config.yaml")

    sp = add(
        "train", "Hybrid training on this machine: N parameter servers + M NN workers -> a Model folder.", cmd_train
    )
    sp.add_argument("--data", required=True, help="preprocess output folder")
    sp.add_argument("--output", required=True, help="Model folder to write (manifest.json, dense.pt, shards/)")
    sp.add_argument("--init", default="", help="init-shards output folder (shard plan and initial state); optional")
    config_flags(sp, "default: <init>/run_config.yaml, else <data>/run_config.yaml")
    sp.add_argument("--work-dir", default="", help="folder for process logs and port files (default: a temp dir)")
    sp.add_argument(
        "--resume-from",
        default="auto",
        help="'auto' (default): continue from the newest complete checkpoint in the checkpoint folder "
        "(trainer.checkpoint_dir, else <output>/checkpoints), if any; a checkpoint folder: exactly "
        "that one; '' : start afresh (checkpoints of another run are refused, naming the change)",
    )
    sp.add_argument(
        "--tensorboard",
        default="",
        metavar="DIR",
        help="also write the training metrics as TensorBoard event files to DIR (needs tensorboard)",
    )
