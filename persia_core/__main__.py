"""The ``persia`` command line: run each pipeline step outside KFP on local (or gs://) files.

    python -m persia_core <command> [options]      (or the installed ``persia`` command)

Commands call the same ``persia_core`` functions as the KFP components (each group of commands is a module of
``persia_core.cli``; this module parses the command line and dispatches):

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

from __future__ import annotations

import argparse
import logging
import sys

from persia_core.cli import scoring, serving, shards, steps
from persia_core.cli.common import (
    EXIT_BAD_INPUT,
    EXIT_FAILURE,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_TERMINATED,
)
from persia_core.logging_utils import setup_logging
from persia_core.process_exit import exit_now

log = logging.getLogger("persia.cli")


class PersiaParser(argparse.ArgumentParser):
    """The ``persia`` parser; ``commands`` maps each subcommand to its parser, so that a command's usage error
    shows the command's own usage."""

    commands: dict[str, argparse.ArgumentParser]


def build_parser() -> PersiaParser:
    """The argument parser of ``persia`` and its subcommands."""
    p = PersiaParser(
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
    p.commands = {}

    def add(name: str, help_: str, func, **kw) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help_, description=help_, allow_abbrev=False, **kw)
        sp.set_defaults(func=func)
        p.commands[name] = sp
        return sp

    steps.add_commands(add)
    scoring.add_commands(add)
    shards.add_commands(add)
    serving.add_commands(add)
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
    exit_now(main())
