"""The preprocess step's driver and command line: run the Beam pipeline, check and describe its outputs.

``run_preprocess`` resolves the input files, runs ``transform.Preprocess`` (the pipeline itself; its steps
are listed there), checks the malformed budget and writes ``schema.json`` and ``run_config.yaml``; ``main`` is
its command line, where every flag that is not ours must be a Beam pipeline option.

Usage::

    python -m persia_core.preprocess.pipeline --data data/movielens --output /tmp/ml --config movielens \\
        [--set split.max_rows=1000] [Beam options, e.g. --runner DataflowRunner --project ... --region ...]
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import json
import logging
import os
import time
from typing import Any

import apache_beam as beam
from apache_beam.io.filesystems import FileSystems
from apache_beam.options.pipeline_options import PipelineOptions, StandardOptions

from persia_core import io
from persia_core.config import RunConfig, load_config, parse_overrides
from persia_core.data import schema
from persia_core.logging_utils import setup_logging
from persia_core.preprocess import lines
from persia_core.preprocess.read import first_line, source_names
from persia_core.preprocess.transform import Preprocess
from persia_core.preprocess.write import STATS_FILE

log = logging.getLogger(__name__)

RUN_CONFIG_FILE = "run_config.yaml"


def _match_files(pattern: str) -> list[str]:
    paths = [m.path for m in FileSystems.match([pattern])[0].metadata_list]
    return sorted(p for p in paths if io.is_gcs(p) or not os.path.isdir(p))


def malformed_summary(data_dir: str) -> dict | None:
    """What preprocess set aside in ``data_dir`` (its output folder): ``{"rows": N, "by_reason": {reason: n},
    "dead_letter": folder}``, or None when the folder has no ``preprocess_stats.json``."""
    path = io.join(data_dir, STATS_FILE)
    if not io.exists(path):
        return None
    bad = json.loads(io.read_text(path)).get("malformed", {})
    return {
        "rows": int(bad.get("examples", 0)) + int(bad.get("side_lines", 0)),
        "by_reason": dict(sorted(bad.get("by_reason", {}).items(), key=lambda kv: -kv[1])),
        "dead_letter": io.join(data_dir, schema.DEAD_LETTER_DIR),
    }


def resolve_inputs(config: RunConfig, data: str) -> dict[str, list[str]]:
    """The input files of a run.

    MovieLens: ``data`` is a folder holding ``layout.ratings_file``, ``movies_file`` and ``tags_file`` ->
    ``{"ratings": [path], "movies": [path], "tags": [path]}``. Delimited: ``data`` is a file, a folder (its
    files matching ``layout.file_pattern``) or a glob -> ``{"files": [paths sorted by name]}``.
    Raises ``FileNotFoundError`` naming the missing path or pattern.
    """
    layout = config.layout
    if layout.kind == "movielens":
        if FileSystems.exists(data) and not io.isdir(data):
            raise FileNotFoundError(
                f"preprocess: --data {data!r} is a file, but the MovieLens layout reads a folder "
                f"holding {layout.ratings_file}, {layout.movies_file} and {layout.tags_file}"
            )
        out = {}
        names = {"ratings": layout.ratings_file, "movies": layout.movies_file, "tags": layout.tags_file}
        for name, file in names.items():
            path = FileSystems.join(data, file)
            if not FileSystems.exists(path):
                raise FileNotFoundError(f"preprocess: MovieLens {name} file {path!r} not found")
            out[name] = [path]
        check_movielens_headers(out)
        return out
    if any(c in data for c in "*?["):
        pattern = data
    elif io.isdir(data):
        pattern = FileSystems.join(data, layout.file_pattern)
    else:
        pattern = data
    files = _match_files(pattern)
    if not files:
        raise FileNotFoundError(f"preprocess: no input files match {pattern!r}")
    return {"files": files}


MOVIELENS_HEADERS = {
    "ratings": ["userId", "movieId", "rating", "timestamp"],
    "movies": ["movieId", "title", "genres"],
    "tags": ["userId", "movieId", "tag", "timestamp"],
}
"""The header of each MovieLens file (GroupLens ``ml-latest-small``): its parsers read the fields by position."""


def check_movielens_headers(inputs: dict[str, list[str]]) -> None:
    """Check the first line of each MovieLens file of ``inputs`` (``resolve_inputs``) against
    ``MOVIELENS_HEADERS``, so that columns in another order are not read as others. A file without any line is
    left to the readers (no rows). Raises ``ValueError`` naming the file, its header and the expected one."""
    for name, expected in MOVIELENS_HEADERS.items():
        for path in inputs.get(name, []):
            first = first_line(path)
            if first is None:
                continue
            text = lines.decode_line(first)
            got = None if text is None else [c.strip().strip('"') for c in text.lstrip("\ufeff").split(",")]
            if got != expected:
                raise ValueError(
                    f"{path}:1: the header is {'not UTF-8' if got is None else ','.join(got)!r}, but the MovieLens "
                    f"layout reads {name} as {','.join(expected)!r} (its columns by position)"
                )


def _input_folder(data: str) -> str | None:
    """The folder that ``data`` reads from (a folder, or a glob's fixed prefix), or None for one file."""
    if any(c in data for c in "*?["):
        fixed = data[: min(data.index(c) for c in "*?[" if c in data)]
        return fixed if fixed.endswith("/") else (fixed.rpartition("/")[0] or ".")
    return data if io.isdir(data) else None


def input_root(data: str) -> str:
    """The input root of ``--data``: the folder read (MovieLens or delimited), a glob's fixed prefix, or one
    file's folder. Rows' sources are named relative to it (``read.source_names``)."""
    folder = _input_folder(data)
    if folder is not None:
        return folder
    head = data.rstrip("/").rpartition("/")[0]
    return head or "."


def _normalized(path: str) -> str:
    """``path`` as a comparable folder prefix: gs:// for the /gcs/ mount too, local paths resolved."""
    uri = io.to_uri(path)
    return uri.rstrip("/") + "/" if io.is_gcs(uri) else os.path.realpath(uri) + os.sep


def check_output_outside_input(data: str, output_dir: str) -> None:
    """Raise ``ValueError`` when ``output_dir`` is, or lies inside, the folder that ``data`` reads from (a folder,
    or a glob's fixed prefix): the next run would read the outputs back as input, and every run first removes
    the outputs of the last; or when the input lies in one of the output's ``train/``, ``eval/`` or
    ``dead_letter/`` folders, whose files a run replaces."""
    folder = _input_folder(data)
    if folder is not None and _normalized(output_dir).startswith(_normalized(folder)):
        raise ValueError(
            f"preprocess: the output folder {output_dir} is inside the input folder {folder} (of --data {data}); "
            "write the output elsewhere"
        )
    written = [io.join(output_dir, d) for d in (schema.TRAIN_DIR, schema.EVAL_DIR, schema.DEAD_LETTER_DIR)]
    inside = folder if folder is not None else data
    for d in written:  # the folders whose files a run replaces
        if _normalized(inside).startswith(_normalized(d)):
            raise ValueError(
                f"preprocess: the input {data} lies in {d}, a folder of the output {output_dir} whose files "
                "each run replaces; move the input or write the output elsewhere"
            )


def _clear_outputs(output_dir: str) -> None:
    """Remove what an earlier run left (shards, dead letters, schema) so no stale file is mistaken for output."""
    patterns = [
        FileSystems.join(output_dir, schema.TRAIN_DIR, "*.parquet"),
        FileSystems.join(output_dir, schema.EVAL_DIR, "*.parquet"),
        FileSystems.join(output_dir, schema.DEAD_LETTER_DIR, "dead_letter-*-of-*.jsonl"),  # ours only
        FileSystems.join(output_dir, schema.SCHEMA_FILE),
        FileSystems.join(output_dir, STATS_FILE),
    ]
    for pattern in patterns:
        paths = [m.path for m in FileSystems.match([pattern])[0].metadata_list]
        if paths:
            FileSystems.delete(paths)


def check_malformed(
    stats: dict[str, Any], max_fraction: float, dead_letter_dir: str, inputs: list[str] | None = None
) -> None:
    """Raise ``ValueError`` when malformed rows / rows read > ``max_fraction`` (or no rows were read from
    ``inputs``, the example files, which the message then names).

    The message names the counts, the file with the most malformed lines and the commonest reason.
    """
    read, mal = stats["read"], stats["malformed"]
    if read == 0:
        files = sorted(inputs or [])
        named = f" from {', '.join(files[:5])}{' ...' if len(files) > 5 else ''}" if files else ""
        raise ValueError(f"preprocess: no data rows were read{named} (empty input files?)")
    fraction = mal["examples"] / read
    if fraction <= max_fraction:
        return
    worst_file, file_count = max(mal["by_file"].items(), key=lambda kv: (kv[1], kv[0]))
    kind, kind_count = max(mal["by_reason"].items(), key=lambda kv: (kv[1], kv[0]))
    raise ValueError(
        f"preprocess: {mal['examples']} of {read} rows are malformed ({fraction:.2%} > "
        f"split.max_malformed_fraction={max_fraction}); most in {worst_file} ({file_count} lines); "
        f"commonest reason {kind!r} ({kind_count} lines, e.g. {mal['reason_example'][kind]!r}); "
        f"dead letters in {dead_letter_dir}"
    )


def build_schema(config: RunConfig, stats: dict[str, Any]) -> dict[str, Any]:
    """The ``schema.json`` dict (keys documented in ``persia_core.data.schema``) from the pipeline's stats."""
    split, layout = config.split, config.layout
    plan = stats["plan"]
    by_time = layout.kind == "movielens" or bool(layout.timestamp_column)
    return {
        "slots": config.slot_names,
        "dense": layout.dense_fields(),
        "dense_mean": stats["dense"]["mean"],
        "dense_std": stats["dense"]["std"],
        "rows": {
            "train": plan["train"],
            "eval": plan["eval"],
            "malformed": stats["malformed"]["examples"],
            "read": stats["read"],
        },
        "distinct_ids": stats["distinct_ids"],
        "split": {
            "by": "time" if by_time else "row_order",
            "cutoff": plan["cutoff"],
            "eval_fraction": split.eval_fraction,
        },
        "train_files": [
            schema.shard_file(schema.TRAIN_DIR, i, split.num_train_shards) for i in range(split.num_train_shards)
        ],
        "eval_files": [
            schema.shard_file(schema.EVAL_DIR, i, split.num_eval_shards) for i in range(split.num_eval_shards)
        ],
        "config": config.to_dict(),
    }


def _past_max_rows(paths: list[str], file_rows: dict[str, int], names: dict[str, str], max_rows: int) -> set[str]:
    """The example files of ``paths`` (in reading order) that keep no row because ``max_rows`` rows were kept
    from the files before them (``file_rows``: preprocess_stats' ``files``, by source name, ``names``): not
    empty files, though they count 0 rows. Empty when ``max_rows`` is 0 (no limit)."""
    if not max_rows:
        return set()
    kept, out = 0, set()
    for path in paths:
        n = file_rows.get(names.get(path, path), 0)
        if n == 0 and kept >= max_rows:
            out.add(path)
        kept += n
    return out


def default_runner(options: PipelineOptions):
    """The runner for ``options``: ``None`` (Beam picks ``--runner``) when one is given, else the FnApiRunner.

    The FnApiRunner is the DirectRunner's batch engine; choosing it directly skips the DirectRunner's attempt
    to download and start the Prism runner (a GitHub download, which fails or stalls offline).
    """
    if options.view_as(StandardOptions).runner:
        return None
    from apache_beam.runners.portability.fn_api_runner import FnApiRunner

    return FnApiRunner()


def run_preprocess(config: RunConfig, data: str, output_dir: str, beam_args: list[str] | None = None) -> dict:
    """Run the preprocess pipeline on ``data`` and write its outputs under ``output_dir`` (local or gs://).

    Writes ``train/`` and ``eval/`` Parquet shards, ``dead_letter/*.jsonl``, ``preprocess_stats.json``, then
    (when the malformed share is within budget) ``schema.json`` and ``run_config.yaml``. ``beam_args``:
    Beam ``PipelineOptions`` flags (without ``--runner``: the local FnApiRunner, see ``default_runner``).
    Returns the ``schema.json`` dict.

    Raises ``FileNotFoundError`` for missing inputs and ``ValueError`` when no rows were read or more than
    ``split.max_malformed_fraction`` of them are malformed (naming the worst file, the commonest reason and
    the counts; ``schema.json`` is then not written).
    """
    options = PipelineOptions(list(beam_args or []))
    inputs = resolve_inputs(config, data)  # missing inputs first
    check_output_outside_input(data, output_dir)
    _clear_outputs(output_dir)
    io.makedirs(output_dir)
    started = time.monotonic()
    names = source_names([p for files in inputs.values() for p in files], input_root(data))
    with beam.Pipeline(runner=default_runner(options), options=options) as p:
        _ = p | "Preprocess" >> Preprocess(config, inputs, output_dir, names)
    with FileSystems.open(FileSystems.join(output_dir, STATS_FILE)) as f:
        stats = json.loads(f.read().decode("utf-8"))
    examples = inputs.get("ratings") or inputs.get("files") or []
    past = _past_max_rows(examples, stats["files"], names, config.split.max_rows)
    for name, n in sorted(stats["files"].items()):
        if n == 0:
            path = next((p for p, m in names.items() if m == name), name)
            if path in past:
                log.info("preprocess: no row of %s kept: split.max_rows was reached before it", path)
            else:
                log.warning("preprocess: %s holds no data rows (an empty file?)", path)
    plan = stats["plan"]
    if plan["train"] + plan["eval"] + stats["malformed"]["examples"] != stats["read"]:
        raise RuntimeError(f"preprocess: rows do not add up (train + eval + malformed != read): {stats}")
    check_malformed(
        stats,
        config.split.max_malformed_fraction,
        FileSystems.join(output_dir, schema.DEAD_LETTER_DIR),
        examples,
    )
    result = build_schema(config, stats)
    io.write_text(io.join(output_dir, schema.SCHEMA_FILE), json.dumps(result, indent=1) + "\n")
    io.write_text(io.join(output_dir, RUN_CONFIG_FILE), config.to_yaml())
    log.info("preprocess: %s rows in %.1f s -> %s", result["rows"], time.monotonic() - started, output_dir)
    return result


def unknown_beam_flags(beam_args: list[str]) -> list[str]:
    """The flags of ``beam_args`` that no Beam ``PipelineOptions`` class knows, as typed (``--sett``): Beam only
    logs a warning and drops them, so a mistyped flag of ours would otherwise be ignored without a word."""
    options = PipelineOptions(list(beam_args))
    with _quiet_beam_options():
        names = set(options.get_all_options(retain_unknown_options=True)) - set(options.get_all_options())
    typed = [a.split("=", 1)[0] for a in beam_args if a.startswith("-")]
    return [t for t in typed if t.lstrip("-").replace("-", "_") in names]


def refuse_unknown_flags(parser: argparse.ArgumentParser, beam_args: list[str]) -> None:
    """``parser.error`` (exit 2) listing the flags of ``beam_args`` that are neither ``parser``'s nor Beam
    options, each with the closest of ``parser``'s flags (``--sett: did you mean --set?``); nothing when all are
    known."""
    unknown = unknown_beam_flags(beam_args)
    if not unknown:
        return
    ours = [o for a in parser._actions for o in a.option_strings if o.startswith("--") and o != "--help"]
    hints = []
    for flag in unknown:
        if flag.lstrip("-").replace("-", "_") in ("max_rows", "maxrows"):
            hints.append(f"{flag}: use --set split.max_rows=N")
        else:
            close = difflib.get_close_matches(flag, ours, n=1, cutoff=0.6)
            hints.append(f"{flag}: did you mean {close[0]}?" if close else flag)
    parser.error(
        f"unknown flag(s), neither {parser.prog}'s own ({', '.join(ours)}) nor Apache Beam pipeline "
        f"options (Beam would ignore them): " + "; ".join(hints)
    )


@contextlib.contextmanager
def _quiet_beam_options():
    """Silences Beam's "Discarding unparseable args" warning while the flags are checked here."""
    log_ = logging.getLogger("apache_beam.options.pipeline_options")
    level = log_.level
    log_.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log_.setLevel(level)


def main(argv: list[str] | None = None) -> dict:
    """Command line: ``--data``, ``--output``, ``--config`` (shipped name or YAML path), ``--set key=value``
    (repeatable); every other flag is a Beam pipeline option. Prints the row counts; returns the schema dict."""
    parser = argparse.ArgumentParser(
        prog="persia preprocess",
        allow_abbrev=False,
        description="persia preprocess: raw files -> Parquet shards + schema.json",
    )
    parser.add_argument("--data", required=True, help="MovieLens folder, or a delimited file / folder / glob")
    parser.add_argument("--output", required=True, help="output folder (local or gs://)")
    parser.add_argument("--config", default="movielens", help="shipped config name or a YAML path")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    args, beam_args = parser.parse_known_args(argv)
    refuse_unknown_flags(parser, beam_args)
    setup_logging("preprocess")
    logging.getLogger("apache_beam").setLevel(logging.WARNING)
    config = load_config(args.config, parse_overrides(args.set))
    result = run_preprocess(config, args.data, args.output, beam_args)
    print(json.dumps({"rows": result["rows"], "split": result["split"], "output": args.output}))
    return result


if __name__ == "__main__":
    main()
