"""What the ``persia`` subcommands share: exit codes, the run config from ``--config``/``--set``, JSON output."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

from persia_core import io
from persia_core.config import RunConfig, load_config, parse_overrides

EXIT_OK, EXIT_FAILURE, EXIT_BAD_INPUT, EXIT_INTERRUPTED, EXIT_TERMINATED = 0, 1, 2, 130, 143
"""Exit codes of ``persia``: success, any other failure, bad input, interrupted (Ctrl-C), terminated (SIGTERM)."""

AddCommand = Callable[..., argparse.ArgumentParser]
"""``add(name, help, func, **parser_kwargs)``: registers subcommand ``name`` (run by ``func(args, extra)``) and
returns its parser."""


def overrides(items: list[str]) -> dict[str, Any]:
    """``["trainer.epochs=1"]`` -> ``{"trainer.epochs": 1}``; see ``config.parse_overrides``."""
    return parse_overrides(items)


def run_config(name_or_path: str | None, fallbacks: list[str], overrides_: list[str]) -> RunConfig:
    """Load the run config ``name_or_path``, else the first existing of ``fallbacks``, with ``--set`` overrides."""
    path = name_or_path or next((f for f in fallbacks if f and io.exists(f)), None)
    if path is None:
        raise FileNotFoundError(f"no run config given (--config) and none found at {[f for f in fallbacks if f]}")
    return load_config(path, overrides(overrides_) or None)


def print_json(obj: dict) -> None:
    print(json.dumps(obj, indent=None, default=str))


def config_flags(sp: argparse.ArgumentParser, default_help: str, default: str | None = None) -> None:
    """Add ``--config`` (default ``default``; ``default_help`` says what it is) and the repeatable ``--set``."""
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
