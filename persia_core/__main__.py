"""The ``persia`` command line: run each pipeline step outside KFP on local (or gs://) files.

    python -m persia_core <command> [options]      (or the installed ``persia`` command)

Commands call the same ``persia_core`` functions as the KFP components:

    preprocess    raw files -> Parquet shards + schema.json      persia_core.preprocess.pipeline.run_preprocess
    init-shards   shard plan + initial shard state               persia_core.embedding.plan.init_shards
    train         hybrid training -> Model folder                persia_core.train.launcher.train
    evaluate      metrics + HTML report (+ model gate)           persia_core.evaluate.run.evaluate, report, gate
    predict       score Parquet / raw rows with a Model          persia_core.evaluate.predict.predict
    plan          capacity planning                              persia_core.planner.main
    serve-shards  N parameter-server shards until Ctrl-C         persia_core.train.local_cluster.LocalCluster

Exit codes: 0 success; 2 bad input (a usage error, an invalid config or argument: ``ValueError``, a missing
file: ``FileNotFoundError``); 1 any other failure (e.g. a training process died); 130 interrupted (Ctrl-C); 143
terminated (SIGTERM, how Kubernetes and Vertex AI cancel: ``persia train`` stops its processes first).
"""

import argparse
import json
import logging
import os
import signal
import sys
import time
from typing import Any

from persia_core.argchecks import check_output_file, float_in, int_at_least, storage_root

log = logging.getLogger("persia.cli")

EXIT_OK, EXIT_FAILURE, EXIT_BAD_INPUT, EXIT_INTERRUPTED, EXIT_TERMINATED = 0, 1, 2, 130, 143


def _overrides(items: list[str]) -> dict[str, Any]:
    """``["trainer.epochs=1"]`` -> ``{"trainer.epochs": 1}``; see ``config.parse_overrides``."""
    from persia_core.config import parse_overrides

    return parse_overrides(items)


def _config(name_or_path: str | None, fallbacks: list[str], overrides: list[str]):
    """Load the run config ``name_or_path``, else the first existing of ``fallbacks``, with ``--set`` overrides."""
    from persia_core import io
    from persia_core.config import load_config

    path = name_or_path or next((f for f in fallbacks if f and io.exists(f)), None)
    if path is None:
        raise FileNotFoundError(f"no run config given (--config) and none found at {[f for f in fallbacks if f]}")
    return load_config(path, _overrides(overrides) or None)


def _print(obj: dict) -> None:
    print(json.dumps(obj, indent=None, default=str))


# ------------------------------------------------------------------------------------------------ commands


def cmd_preprocess(args, beam_args: list[str]) -> int:
    from persia_core.preprocess.pipeline import run_preprocess

    config = _config(args.config, [], args.set)
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
    _print({"output": args.output, "rows": schema["rows"], "split": schema["split"]})
    return EXIT_OK


def cmd_init_shards(args, _extra) -> int:
    from persia_core import io
    from persia_core.embedding.plan import init_shards

    config = _config(args.config, [io.join(args.data, "run_config.yaml")], args.set)
    if args.warm_start_from and not args.cold_start_if_missing and not io.isdir(args.warm_start_from):
        # a typo would start every scheduled run cold
        raise FileNotFoundError(
            f"--warm-start-from {args.warm_start_from!r}: nothing there (a typo would start "
            f"every scheduled run cold; for a blessed-model location that may hold nothing yet, "
            f"the first run of a schedule, add --cold-start-if-missing)"
        )
    plan = init_shards(config, args.data, args.output, warm_start_from=args.warm_start_from)
    _print(
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
    from persia_core import io
    from persia_core.train.launcher import train

    fallbacks = [io.join(args.init, "run_config.yaml") if args.init else "", io.join(args.data, "run_config.yaml")]
    config = _config(args.config, fallbacks, args.set)
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
        from persia_core.logging_utils import write_tensorboard

        history = json.loads(io.read_text(io.join(args.output, "train_metrics.json")))
        out["tensorboard"] = write_tensorboard(history, args.tensorboard)
    _print(out)
    return EXIT_OK


def cmd_evaluate(args, _extra) -> int:
    from persia_core import io
    from persia_core.evaluate.gate import bless, evaluate_gate
    from persia_core.evaluate.report import write_report
    from persia_core.evaluate.run import evaluate
    from persia_core.model_store import read_marker

    # flag combinations and outputs first: the evaluation may take long
    if args.bless and not args.blessed_dir:
        raise ValueError("--bless needs --blessed-dir (the latest-blessed-model location to copy the model to)")
    check_output_file("--report", args.report)
    check_output_file("--metrics-json", args.metrics_json)
    read_marker(args.blessed_dir)  # an unreadable BLESSED.json: refused now, naming it
    r = evaluate(args.model, args.data, batch_size=args.batch_size, user_slot=args.user_slot)
    m = r["metrics"]
    decision, _ = evaluate_gate(
        m,
        args.blessed_dir,
        args.data,
        args.min_auc,
        args.max_auc_drop,
        args.max_logloss_increase,
        args.max_ne,
        args.batch_size,
    )  # blessed model, same rows
    write_report(
        args.report,
        m,
        r["labels"],
        r["preds"],
        r["train_history"],
        r["config"],
        {"model": args.model, "dataset": args.data, "blessed_dir": args.blessed_dir or "(none)"},
        user_split=r["user_split"],
        coverage=r["coverage"],
        gate=decision,
    )
    out = {
        "metrics": m,
        "user_split": r["user_split"],
        "coverage": r["coverage"],
        "report": args.report,
        "gate": {"decision": decision["decision"], "reasons": decision["reasons"], "baseline": decision["baseline"]},
    }
    if args.bless:
        if decision["bless"]:
            marker = bless(r["model_dir"], m, args.blessed_dir, decision)  # a blessed location: the model scored
            out["blessed_model"] = io.join(args.blessed_dir, marker["model"])
    if args.metrics_json:
        io.write_text(args.metrics_json, json.dumps(out, indent=1, default=str) + "\n")
    _print(out)
    return EXIT_OK


def cmd_predict(args, _extra) -> int:
    from persia_core.evaluate.predict import predict

    r = predict(
        args.model,
        args.input,
        args.output,
        config=args.config,
        batch_size=args.batch_size,
        dead_letter=args.dead_letter,
    )
    _print({"output": r["output"], "rows": r["rows"], "malformed": r["malformed"]})
    return EXIT_OK


def cmd_plan(args, extra: list[str]) -> int:
    import importlib

    try:
        planner = importlib.import_module("persia_core.planner")
    except ModuleNotFoundError as e:
        if e.name != "persia_core.planner":
            raise
        print(
            "persia plan: error: the capacity planner (persia_core.planner) is not available in this installation",
            file=sys.stderr,
        )
        return EXIT_FAILURE
    try:
        rc = planner.main(list(extra))
    except SystemExit as e:  # the planner's argparse: --help (0) or a usage error (2)
        rc = e.code if isinstance(e.code, int) else (EXIT_OK if e.code is None else EXIT_BAD_INPUT)
    return rc if isinstance(rc, int) else EXIT_OK


def cmd_serve_shards(args, _extra) -> int:
    import tempfile

    from persia_core.train.local_cluster import LocalCluster

    config = _config(args.config, [], args.set)
    n = args.num_shards or config.embedding.num_shards
    if args.plan and not os.path.exists(args.plan):
        raise FileNotFoundError(f"--plan {args.plan} not found")
    if args.init and not os.path.isdir(args.init):
        raise FileNotFoundError(f"--init {args.init} is not a folder")
    if args.init:
        import glob

        from persia_core.model_store import is_blessed_location, latest_blessed_model

        if is_blessed_location(args.init):  # a blessed-model location: its latest blessed model
            args.init = latest_blessed_model(args.init)
            log.info("serving the latest blessed model, %s", args.init)
        have = len(glob.glob(os.path.join(args.init, "shards", "shard-*.npz")))
        if have == 0:  # every server would start empty, and nothing would say so
            raise FileNotFoundError(
                f"--init {args.init}: no shard files (shards/shard-*.npz); give an init-shards "
                f"output, a Model folder or a blessed-model location"
            )
        if have != n:  # each server loads the file of its own shard number: the others would be lost
            raise ValueError(
                f"--init {args.init} holds {have} shard files but {n} shards were asked: serve it with "
                f"--num-shards {have}, or re-shard it first (init-shards warm-started from it)"
            )

    own_work_dir = not args.work_dir  # a temporary folder: removed on a clean stop, kept (and named) on a failure
    work_dir = args.work_dir or tempfile.mkdtemp(prefix="persia-serve-")
    os.makedirs(work_dir, exist_ok=True)
    cfg_path = os.path.join(work_dir, "run_config.yaml")
    with open(cfg_path, "w") as f:
        f.write(config.to_yaml())
    token_file = os.path.join(work_dir, "ps_token")

    def _stop(*_):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, _stop)
    clean = False
    try:
        dumps = os.path.join(work_dir, "dumps")  # default storage root: beside, not over, the token and config
        if not args.storage_root:
            os.makedirs(dumps, exist_ok=True)
        with LocalCluster(
            cfg_path, n, 0, work_dir, args.plan or "", args.init or "", storage_roots=args.storage_root or [dumps]
        ) as cluster:
            addresses = cluster.start_servers()
            try:  # from here on a stop signal is a clean stop, even one that comes as the addresses are printed
                fd = os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                with os.fdopen(fd, "w") as f:
                    f.write(cluster.token)
                _print(
                    {
                        "addresses": addresses,
                        "token_file": token_file,
                        "logs": os.path.join(work_dir, "logs"),
                        "storage_roots": cluster.storage_roots,
                    }
                )
                sys.stdout.flush()
                log.info("serving %d shard(s); Ctrl-C stops them", n)
                while True:
                    for p in cluster.servers:
                        rc = p.popen.poll()
                        if rc is not None:
                            raise RuntimeError(f"{p.name} exited with code {rc}; last log lines:\n{p.tail()}")
                    time.sleep(0.5)
            except KeyboardInterrupt:
                log.info("stopping the parameter servers")
                clean = True
    finally:
        signal.signal(signal.SIGTERM, previous)
        if os.path.exists(token_file):  # the servers are gone: their token opens nothing, and is not left lying
            os.remove(token_file)
        kept_dumps = os.path.isdir(dumps) and bool(os.listdir(dumps))
        if os.path.isdir(dumps) and not kept_dumps:
            os.rmdir(dumps)  # empty: kept only when it holds files
        if own_work_dir and clean and not kept_dumps:
            import shutil

            shutil.rmtree(work_dir, ignore_errors=True)
        elif own_work_dir and clean:
            print(f"persia serve-shards: the shard files dumped are kept in {dumps}", file=sys.stderr)
        elif own_work_dir:
            print(
                f"persia serve-shards: the servers' logs are kept in {os.path.join(work_dir, 'logs')}", file=sys.stderr
            )
    return EXIT_OK


# ------------------------------------------------------------------------------------------------ parser


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``persia`` and its subcommands."""
    from persia_core.evaluate import gate as G

    p = argparse.ArgumentParser(
        prog="persia",
        description="Run the persia-kfp steps outside KFP on local (or gs://) files.",
        epilog="Exit codes: 0 success, 2 bad input (usage, invalid config, missing file), 1 other failures, "
        "130 interrupted (Ctrl-C), 143 terminated (SIGTERM).",
        allow_abbrev=False,
    )
    p.add_argument(
        "--log-level",
        default="INFO",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="log level of the messages on stderr (default INFO)",
    )
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)
    p.commands = {}  # name -> its parser, so that a command's usage error shows the command's own usage

    def add(name: str, help_: str, func, **kw) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help_, description=help_, allow_abbrev=False, **kw)
        sp.set_defaults(func=func)
        p.commands[name] = sp
        return sp

    def config_flags(sp, default_help: str, default: str | None = None) -> None:
        sp.add_argument(
            "--config",
            default=default,
            help=f"run config: a shipped name (movielens, criteo) or a YAML path; {default_help}",
        )
        sp.add_argument(
            "--set",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help="override one config field, e.g. --set trainer.epochs=1 (repeatable; value as YAML)",
        )

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

    sp = add(
        "evaluate",
        "Evaluate a Model on the eval split: metrics, seen/unseen users, coverage, HTML report, model gate.",
        cmd_evaluate,
    )
    sp.add_argument("--model", required=True, help="Model folder (from train), or a blessed-model location")
    sp.add_argument("--data", required=True, help="preprocess output folder (its eval split is scored)")
    sp.add_argument("--report", default="report.html", help="HTML report to write (default report.html)")
    sp.add_argument("--metrics-json", default="", help="also write the results as JSON to this file")
    sp.add_argument(
        "--user-slot",
        default="user",
        help="slot that names the user, for GAUC and the "
        "seen/unseen-user split (default user, skipped when the "
        "model has no such slot; '' skips it; another name that "
        "is not a slot of the model is refused)",
    )
    sp.add_argument("--batch-size", type=int_at_least(1), default=4096, help="rows scored per batch (default 4096)")
    sp.add_argument(
        "--blessed-dir",
        default="",
        help="latest-blessed-model location to compare with (local or gs://); empty: only --min-auc applies",
    )
    sp.add_argument(
        "--min-auc",
        type=float_in(0.0, 1.0),
        default=G.DEFAULT_MIN_AUC,
        help=f"gate: AUC needed at least (default {G.DEFAULT_MIN_AUC})",
    )
    sp.add_argument(
        "--max-auc-drop",
        type=float_in(0.0),
        default=G.DEFAULT_MAX_AUC_DROP,
        help=f"gate: allowed AUC drop below the blessed model's (default {G.DEFAULT_MAX_AUC_DROP})",
    )
    sp.add_argument(
        "--max-logloss-increase",
        type=float_in(0.0),
        default=G.DEFAULT_MAX_LOGLOSS_INCREASE,
        help="gate: allowed logloss increase over the blessed model's, in nats "
        f"(default {G.DEFAULT_MAX_LOGLOSS_INCREASE})",
    )
    sp.add_argument(
        "--max-ne",
        type=float_in(1e-9),
        default=G.DEFAULT_MAX_NE,
        help="gate: normalized entropy the model must stay below, baseline or not (default "
        f"{G.DEFAULT_MAX_NE:g}: better than predicting the base rate)",
    )
    sp.add_argument("--bless", action="store_true", help="copy the model to --blessed-dir when the gate blesses it")

    sp = add(
        "predict",
        "Score rows with a Model: a Parquet file/folder of preprocessed rows, or a file of raw "
        "rows of the layout; writes source,probability[,label] as CSV or Parquet.",
        cmd_predict,
    )
    sp.add_argument("--model", required=True, help="Model folder (from train), or a blessed-model location")
    sp.add_argument("--input", required=True, help=".parquet file or folder of preprocessed rows, or a raw file")
    sp.add_argument("--output", required=True, help="predictions file: .parquet for Parquet, else CSV")
    sp.add_argument("--config", default=None, help="run config whose layout parses raw rows (default: the model's own)")
    sp.add_argument("--batch-size", type=int_at_least(1), default=4096, help="rows scored per batch (default 4096)")
    sp.add_argument(
        "--dead-letter",
        default="",
        help="JSON-lines file for raw rows that do not parse: they are "
        "counted and set aside, the rest scored (default: the first "
        "one stops the run, naming file:line)",
    )

    add(
        "plan",
        "Capacity planning (persia_core.planner); every argument after 'plan' is passed to it as it is "
        "(try: persia plan --help).",
        cmd_plan,
        add_help=False,
    )

    sp = add(
        "serve-shards",
        "Start N embedding parameter-server shards on 127.0.0.1, print their addresses "
        "and the token file, and serve until Ctrl-C.",
        cmd_serve_shards,
    )
    sp.add_argument("--config", required=True, help="run config: a shipped name or a YAML path")
    sp.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="override one config field (repeatable)"
    )
    sp.add_argument(
        "--num-shards", type=int_at_least(0), default=0, help="shards to start (default: embedding.num_shards)"
    )
    sp.add_argument("--plan", default="", help="shard_plan.json from init-shards (row capacities)")
    sp.add_argument(
        "--init",
        default="",
        help="init-shards output, Model folder or blessed-model location: the shards/shard-*.npz to load",
    )
    sp.add_argument("--work-dir", default="", help="folder for logs, port files and the token file")
    sp.add_argument(
        "--storage-root",
        action="append",
        default=[],
        metavar="DIR",
        type=storage_root,
        help="a folder (or gs:// prefix) under which the servers' Dump and Load may write and read; "
        "repeatable (default: <work dir>/dumps, kept after a stop when it holds files)",
    )
    return p


def _split_passthrough(argv: list[str]) -> tuple[list[str], list[str] | None]:
    """``(head, rest)``: for ``[global options] plan ARGS...`` the ARGS go to the planner untouched (rest);
    otherwise rest is None."""
    i = 0
    while i < len(argv) and argv[i].startswith("-"):
        i += 2 if argv[i] == "--log-level" else 1
    if i < len(argv) and argv[i] == "plan":
        return argv[: i + 1], argv[i + 1 :]
    return argv, None


def main(argv: list[str] | None = None) -> int:
    """Run one command; returns the exit code (0 ok, 2 bad input, 1 failure). See the module docstring."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    head, passthrough = _split_passthrough(argv)
    try:
        args, extra = parser.parse_known_args(head)
        if passthrough is not None:
            extra = passthrough
        elif extra and args.command != "preprocess":
            parser.commands[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
        if extra and args.command == "preprocess":  # Beam's options pass through; anything else is a typo
            from persia_core.preprocess.pipeline import refuse_unknown_flags

            refuse_unknown_flags(parser.commands["preprocess"], extra)
    except SystemExit as e:  # argparse: --help (0) or a usage error (2)
        return e.code if isinstance(e.code, int) else (EXIT_OK if e.code is None else EXIT_BAD_INPUT)
    from persia_core.logging_utils import setup_logging

    handler = setup_logging(args.command, None, args.log_level)
    try:
        return int(args.func(args, extra) or EXIT_OK)
    except (ValueError, FileNotFoundError) as e:
        log.debug("bad input", exc_info=True)
        print(f"persia {args.command}: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt as e:  # Ctrl-C: the shell's convention, 128 + SIGINT; SIGTERM (a cancel): 128 + 15
        from persia_core.train.processes import Terminated

        if isinstance(e, Terminated):
            print(f"persia {args.command}: terminated (SIGTERM)", file=sys.stderr)
            return EXIT_TERMINATED
        print(f"persia {args.command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as e:  # any other failure: exit 1 with the message (traceback with --log-level DEBUG)
        log.debug("failure", exc_info=True)
        print(f"persia {args.command}: failed: {type(e).__name__}: {e}", file=sys.stderr)
        return EXIT_FAILURE
    finally:
        logging.getLogger().removeHandler(handler)  # leave an embedding process (a test) as it was


if __name__ == "__main__":
    sys.exit(main())
