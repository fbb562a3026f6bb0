"""The preprocess step: raw files -> Parquet train/eval shards + ``schema.json``, as one Apache Beam pipeline.

Steps (each a composite ``PTransform``; runs on the DirectRunner here and on Dataflow with runner options)::

    1. ReadNumberedLines   each input file read in order with FileSystems (local or gs://), so every line keeps
                           "<file>:<line>" (1-based, the header counts) and its global row number
    2. ParseDelimited /    lines -> records (``layouts``) -> encoded rows; MovieLens joins ratings with movies
       JoinMovieLens       and tags by movieId (CoGroupByKey; tags per rating by sort + bisect + one sweep) and,
                           with ``layout.history_length > 0``, adds each rating's user history (GroupByKey by
                           userId; sort + bisect per user); see ``movielens``
    3. SplitAndShard       eval = rows with ts >= cutoff, cutoff = sorted_ts[floor((1 - eval_fraction) * n)];
                           each split is cut into shards at order statistics of a hash of ``source``, so shards
                           are balanced (sizes differ by at most one row) and deterministic
    4. WriteShards         one Parquet file per shard (``schema.arrow_schema``), rows sorted by that hash
    5. WriteDeadLetters    malformed lines -> dead_letter/*.jsonl {"source", "reason", "raw"}, counted by file
                           and reason
    6. statistics          dense mean/std over train, distinct IDs per slot (HyperLogLog), row counts ->
                           ``preprocess_stats.json`` (the CombineFns are in ``stats``); the driver then checks
                           the malformed budget and writes ``schema.json`` and ``run_config.yaml``

Inside the pipeline an example is an encoded row, a compact tuple (``rows``). The names of ``rows``,
``stats`` and ``movielens`` used by callers stay importable from here.

Usage::

    python -m persia_core.preprocess.pipeline --data data/movielens --output /tmp/ml --config movielens \\
        [--set split.max_rows=1000] [Beam options, e.g. --runner DataflowRunner --project ... --region ...]
"""

from __future__ import annotations

import argparse
import base64
import bisect
import contextlib
import difflib
import functools
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterable
from typing import Any

import apache_beam as beam
import numpy as np
from apache_beam.io.filesystems import FileSystems
from apache_beam.options.pipeline_options import PipelineOptions, StandardOptions
from apache_beam.pvalue import AsDict, AsSingleton, TaggedOutput

from persia_core import io
from persia_core.config import RunConfig, load_config, parse_overrides
from persia_core.data import schema
from persia_core.preprocess import layouts

# Re-exported: callers and tests import these names from here.
from persia_core.preprocess.movielens import JoinMovieLens
from persia_core.preprocess.rows import (
    DEAD,
    DENSE,
    KEY,
    LABEL,
    SLOTS,
    SOURCE,
    TS,
    counter,
    dead_letter,
    encode_row,
    slot_specs,
)
from persia_core.preprocess.stats import (
    DenseStatsFn,
    DistinctIdsFn,
    MalformedSummaryFn,
    SplitPlanFn,
)

log = logging.getLogger(__name__)

STATS_FILE = "preprocess_stats.json"
RUN_CONFIG_FILE = "run_config.yaml"
DEAD_LETTER_PREFIX = "dead_letter"

_dead_letter = dead_letter  # the name callers used before ``rows`` existed
_COUNTS = "counts"
_TRAIN_DENSE = "train_dense"
_BATCH_ROWS = 1 << 16


# --------------------------------------------------------------------------------------------- rows


def rows_to_table(rows: list[tuple], slot_names: list[str], num_dense: int):
    """Encoded rows -> a ``pyarrow.Table`` with ``schema.arrow_schema(slot_names)``, built column-wise."""
    import pyarrow as pa

    n = len(rows)
    arrow_schema = schema.arrow_schema(slot_names)
    columns = [pa.array(np.fromiter((r[LABEL] for r in rows), np.float32, n), pa.float32())]
    dense_values = np.frombuffer(b"".join(r[DENSE] for r in rows), np.float32)
    dense_offsets = (np.arange(n + 1, dtype=np.int64) * num_dense).astype(np.int32)
    columns.append(pa.ListArray.from_arrays(pa.array(dense_offsets), pa.array(dense_values, pa.float32())))
    for i in range(len(slot_names)):
        blobs = [r[SLOTS][i] for r in rows]
        offsets = np.zeros(n + 1, np.int64)
        np.cumsum(np.fromiter((len(b) >> 3 for b in blobs), np.int64, n), out=offsets[1:])
        values = np.frombuffer(b"".join(blobs), np.uint64)
        columns.append(pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(values, pa.uint64())))
    columns.append(pa.array(np.fromiter((r[TS] for r in rows), np.int64, n), pa.int64()))
    columns.append(pa.array([r[SOURCE] for r in rows], pa.string()))
    return pa.Table.from_arrays(columns, schema=arrow_schema)


def shard_file(split: str, shard: int, num_shards: int) -> str:
    """A shard's path relative to the output folder: ``train/train-00001-of-00004.parquet``."""
    return f"{split}/{split}-{shard:05d}-of-{num_shards:05d}.parquet"


# --------------------------------------------------------------------------------------------- reading


class ReadFileLinesFn(beam.DoFn):
    """``(file_index, path)`` -> ``(file_index, path, line_no, data_index, text, ok)`` per data line.

    Lines are read in order with ``FileSystems.open`` (local, gs://; ``.gz`` by extension); ``line_no`` is
    1-based and counts the header, ``data_index`` is 0-based over the file's data lines; ``text`` has no line
    end; ``ok`` is False for a line that is not UTF-8 (``text`` is then its bytes, which the dead letter keeps).
    Line ends are ``\\n`` or ``\\r\\n``; in a file without any ``\\n``, a lone ``\\r`` (classic Mac files: before,
    such a file was one line; a ``\\r`` inside a line of any other file stays in its line). Stops after
    ``max_lines`` data lines (0 = all). A blank (whitespace-only) line holds no data and is not a row: it is
    skipped, counted by the ``blank_lines`` counter, and keeps its place in the line numbers. Emits ``(file_index,
    data lines read)`` on the ``counts`` output.
    """

    def __init__(self, skip_header: bool, max_lines: int) -> None:
        self.skip_header = skip_header
        self.max_lines = max_lines
        self.lines_read = counter("lines_read")
        self.blank_lines = counter("blank_lines")

    def process(self, element: tuple[int, str]):
        index, path = element
        n = 0
        line_no = 0
        with FileSystems.open(path) as f:
            for chunk in iter(f.readline, b""):
                # a first readline that reached the end of the file without a LF but holds a CR: a file with
                # CR-only line ends (read whole; a CR inside a line of a LF file stays part of its line)
                cr_only = line_no == 0 and not chunk.endswith(b"\n") and b"\r" in chunk.rstrip(b"\r")
                pieces = chunk.splitlines() if cr_only else (chunk,)
                for raw in pieces:
                    line_no += 1
                    if line_no == 1 and self.skip_header:
                        continue
                    if self.max_lines and n >= self.max_lines:
                        break
                    try:
                        text, ok = layouts.strip_line_end(raw.decode("utf-8")), True
                    except UnicodeDecodeError:
                        text, ok = raw.rstrip(b"\r\n"), False  # its bytes, for the dead letter
                    if ok and not text.strip():
                        self.blank_lines.inc()  # no data, so not a row (as predict reads them too)
                        continue
                    yield index, path, line_no, n, text, ok
                    n += 1
                if self.max_lines and n >= self.max_lines:
                    break
        self.lines_read.inc(n)
        yield TaggedOutput(_COUNTS, (index, n))


class NumberRowsFn(beam.DoFn):
    """Gives each line its global row number (file order, headers excluded) and drops rows past ``max_rows``.

    Input ``(file_index, path, line_no, data_index, text, ok)`` with side input ``counts`` ``{file_index: n}``;
    output ``(path, line_no, row_number, text)``, or a dead letter ``"not utf-8"`` on the ``dead`` output.
    """

    def __init__(self, max_rows: int, example: bool) -> None:
        self.max_rows = max_rows
        self.example = example
        self.malformed = counter("malformed" if example else "malformed_side_lines")
        self._offsets: dict[int, int] | None = None

    def process(self, element: tuple, counts: dict[int, int]):
        index, path, line_no, data_index, text, ok = element
        if self._offsets is None or len(self._offsets) != len(counts):
            total, self._offsets = 0, {}
            for i in sorted(counts):
                self._offsets[i] = total
                total += counts[i]
        row_number = self._offsets[index] + data_index
        if self.max_rows and row_number >= self.max_rows:
            return
        if not ok:
            self.malformed.inc()
            raw = text  # the line's bytes, as read
            dead = dead_letter(
                path, line_no, raw.decode("utf-8", errors="replace"), layouts.ParseError("not utf-8"), self.example
            )
            dead["raw_base64"] = base64.b64encode(raw).decode("ascii")
            yield TaggedOutput(DEAD, dead)
            return
        yield path, line_no, row_number, text


def _rows_read(counts: Iterable[int], max_rows: int) -> int:
    total = sum(counts)
    return min(total, max_rows) if max_rows else total


class ReadNumberedLines(beam.PTransform):
    """Read files in order into numbered lines: ``PBegin`` -> ``{"lines", "dead", "read"}``.

    ``lines``: ``(path, line_no, row_number, text)`` (``row_number`` 0-based over the data lines of all
    ``files`` in list order; only rows with ``row_number < max_rows`` when ``max_rows > 0``); ``dead``:
    dead letters of undecodable lines; ``read``: one int, the number of data rows kept (lines + dead).
    ``example``: whether these lines are examples (count towards the malformed budget) or side data.
    """

    def __init__(
        self, files: list[str], has_header: bool, max_rows: int = 0, example: bool = True, redistribute: bool = False
    ) -> None:
        super().__init__()
        self.files = list(files)
        self.has_header = has_header
        self.max_rows = max_rows
        self.example = example
        self.redistribute = redistribute

    def expand(self, pbegin):
        read = (
            pbegin
            | "ListFiles" >> beam.Create(list(enumerate(self.files)))
            | "ReadFiles"
            >> beam.ParDo(ReadFileLinesFn(self.has_header, self.max_rows)).with_outputs(_COUNTS, main="lines")
        )
        lines = read.lines
        if self.redistribute:
            lines = lines | "Redistribute" >> beam.Reshuffle()
        numbered = lines | "NumberRows" >> beam.ParDo(
            NumberRowsFn(self.max_rows, self.example), counts=AsDict(read[_COUNTS])
        ).with_outputs(DEAD, main="lines")
        max_rows = self.max_rows
        total = (
            read[_COUNTS]
            | "FileCounts" >> beam.Map(lambda kv: kv[1])
            | "CountRowsRead" >> beam.CombineGlobally(functools.partial(_rows_read, max_rows=max_rows))
        )
        return {"lines": numbered.lines, "dead": numbered[DEAD], "read": total}


# --------------------------------------------------------------------------------------------- parsing


class ParseDelimitedFn(beam.DoFn):
    """``(path, line_no, row_number, text)`` -> an encoded row, or a dead letter on the ``dead`` output.

    ``ts`` is the layout's timestamp column, else the global row number.
    """

    def __init__(self, config: RunConfig) -> None:
        self.layout = config.layout
        self.specs = slot_specs(config)
        self.rows = counter("rows")
        self.malformed = counter("malformed")

    def process(self, element: tuple):
        path, line_no, row_number, text = element
        try:
            record = layouts.parse_delimited(text, self.layout)
        except layouts.ParseError as e:
            self.malformed.inc()
            yield TaggedOutput(DEAD, dead_letter(path, line_no, text, e, True))
            return
        self.rows.inc()
        ts = record["ts"] if record["ts"] is not None else row_number
        yield encode_row(record, self.specs, f"{path}:{line_no}", ts)


class ParseDelimited(beam.PTransform):
    """Numbered lines of a delimited layout -> ``{"rows": encoded rows, "dead": dead letters}``."""

    def __init__(self, config: RunConfig) -> None:
        super().__init__()
        self.config = config

    def expand(self, lines):
        out = lines | "ParseLines" >> beam.ParDo(ParseDelimitedFn(self.config)).with_outputs(DEAD, main="rows")
        return {"rows": out.rows, "dead": out[DEAD]}


# --------------------------------------------------------------------------------------------- split


class AssignShardFn(beam.DoFn):
    """An encoded row + the split plan -> ``((split, shard), row)``; train rows' dense bytes also go to the
    ``train_dense`` output (for the mean/std)."""

    def __init__(self) -> None:
        self.train = counter("train_rows")
        self.eval = counter("eval_rows")

    def process(self, row: tuple, plan: dict[str, Any]):
        if row[TS] >= plan["cutoff"]:
            self.eval.inc()
            yield (schema.EVAL_DIR, bisect.bisect_right(plan["eval_bounds"], row[KEY])), row
        else:
            self.train.inc()
            yield TaggedOutput(_TRAIN_DENSE, row[DENSE])
            yield (schema.TRAIN_DIR, bisect.bisect_right(plan["train_bounds"], row[KEY])), row


class SplitAndShard(beam.PTransform):
    """Encoded rows -> ``{"keyed": ((split, shard), row), "plan": one plan dict, "train_dense": bytes}``.

    Eval = rows with ``ts >= cutoff``, ``cutoff = sorted_ts[floor((1 - eval_fraction) * n)]`` (ties at the
    cutoff all go to eval). Within a split, rows are cut into shards at order statistics of their source hash.
    """

    def __init__(self, eval_fraction: float, num_train_shards: int, num_eval_shards: int) -> None:
        super().__init__()
        self.eval_fraction = eval_fraction
        self.num_train_shards = num_train_shards
        self.num_eval_shards = num_eval_shards

    def expand(self, rows):
        plan = (
            rows
            | "TsAndKey" >> beam.Map(lambda r: (r[TS], r[KEY]))
            | "PlanSplit"
            >> beam.CombineGlobally(SplitPlanFn(self.eval_fraction, self.num_train_shards, self.num_eval_shards))
        )
        keyed = rows | "AssignShards" >> beam.ParDo(AssignShardFn(), plan=AsSingleton(plan)).with_outputs(
            _TRAIN_DENSE, main="keyed"
        )
        return {"keyed": keyed.keyed, "plan": plan, "train_dense": keyed[_TRAIN_DENSE]}


# --------------------------------------------------------------------------------------------- writing


class WriteShardFn(beam.DoFn):
    """``((split, shard), rows)`` -> one Parquet file ``<output_dir>/<split>/<split>-SSSSS-of-NNNNN.parquet``.

    Rows are written sorted by their source hash (deterministic, and not in user or time order) in row groups
    of 65536; a shard without rows is an empty file with the schema. A shard must fit in a worker's memory:
    use more shards for bigger data. Yields ``(split, shard, rows written)``.
    """

    def __init__(self, output_dir: str, slot_names: list[str], num_dense: int, num_shards: dict[str, int]) -> None:
        self.output_dir = output_dir
        self.slot_names = list(slot_names)
        self.num_dense = num_dense
        self.num_shards = dict(num_shards)

    def process(self, element: tuple):
        (split, shard), rows = element
        rows = sorted((r for r in rows if r is not None), key=lambda r: (r[KEY], r[SOURCE]))
        path = FileSystems.join(self.output_dir, shard_file(split, shard, self.num_shards[split]))
        if "://" in path:  # remote (gs://): write a local file, then copy it with FileSystems
            with tempfile.TemporaryDirectory() as tmp:
                local = os.path.join(tmp, "shard.parquet")
                self._write(local, rows)
                with open(local, "rb") as src, FileSystems.create(path) as dst:
                    shutil.copyfileobj(src, dst, 1 << 22)
        else:
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            self._write(path, rows)
        yield split, shard, len(rows)

    def _write(self, path: str, rows: list[tuple]) -> None:
        import pyarrow.parquet as pq

        arrow_schema = schema.arrow_schema(self.slot_names)
        with pq.ParquetWriter(path, arrow_schema) as writer:
            if not rows:
                writer.write_table(arrow_schema.empty_table())
            for start in range(0, len(rows), _BATCH_ROWS):
                writer.write_table(rows_to_table(rows[start : start + _BATCH_ROWS], self.slot_names, self.num_dense))


class WriteShards(beam.PTransform):
    """``((split, shard), row)`` -> Parquet shards, every one of ``num_shards[split]`` written (empty or not).

    Returns a PCollection of ``(split, shard, rows written)``.
    """

    def __init__(self, output_dir: str, slot_names: list[str], num_dense: int, num_shards: dict[str, int]) -> None:
        super().__init__()
        self.output_dir = output_dir
        self.slot_names = list(slot_names)
        self.num_dense = num_dense
        self.num_shards = dict(num_shards)

    def expand(self, keyed):
        all_keys = [((split, i), None) for split, n in self.num_shards.items() for i in range(n)]
        every_shard = keyed.pipeline | "ShardKeys" >> beam.Create(all_keys)
        return (
            (keyed, every_shard)
            | "WithEveryShard" >> beam.Flatten()
            | "GroupByShard" >> beam.GroupByKey()
            | "WriteParquet"
            >> beam.ParDo(WriteShardFn(self.output_dir, self.slot_names, self.num_dense, self.num_shards))
        )


def dead_letter_json(dead: dict[str, Any]) -> str:
    """A dead letter as its JSON line: ``{"source": "<file>:<line>", "reason": ..., "raw": <the line>}``, plus
    ``"raw_base64"``, the line's exact bytes, for a line that is not UTF-8 (its ``raw`` shows U+FFFD for them)."""
    out = {"source": dead["source"], "reason": dead["reason"], "raw": dead["raw"]}
    if "raw_base64" in dead:
        out["raw_base64"] = dead["raw_base64"]
    return json.dumps(out, ensure_ascii=False)


class WriteDeadLetters(beam.PTransform):
    """Dead letters -> ``<output_dir>/dead_letter/dead_letter-00000-of-00001.jsonl`` (JSON lines).

    Returns one summary dict (``MalformedSummaryFn``).
    """

    def __init__(self, output_dir: str) -> None:
        super().__init__()
        self.output_dir = output_dir

    def expand(self, dead):
        _ = (
            dead
            | "ToJson" >> beam.Map(dead_letter_json)
            | "WriteJsonLines"
            >> beam.io.WriteToText(
                FileSystems.join(self.output_dir, schema.DEAD_LETTER_DIR, DEAD_LETTER_PREFIX),
                file_name_suffix=".jsonl",
                num_shards=1,
                shard_name_template="-SSSSS-of-NNNNN",
            )
        )
        return dead | "SummarizeMalformed" >> beam.CombineGlobally(MalformedSummaryFn())


class WriteStatsFn(beam.DoFn):
    """Gathers the pipeline's statistics (side inputs) into one dict, written to ``<output_dir>/preprocess_stats.json``.

    The dict: ``{"plan": SplitPlanFn output, "dense": DenseStatsFn output, "distinct_ids": {slot: n}, "read": n,
    "malformed": MalformedSummaryFn output, "shard_rows": {"train/0": n, ...}}``.
    """

    def __init__(self, output_dir: str) -> None:
        self.output_dir = output_dir

    def process(self, _, plan, dense, distinct, read, malformed, shards):
        stats = {
            "plan": plan,
            "dense": dense,
            "distinct_ids": distinct,
            "read": int(read),
            "malformed": malformed,
            "shard_rows": {f"{split}/{shard}": n for split, shard, n in shards},
        }
        with FileSystems.create(FileSystems.join(self.output_dir, STATS_FILE)) as f:
            f.write(json.dumps(stats, indent=1, sort_keys=True).encode("utf-8"))
        yield stats


class Preprocess(beam.PTransform):
    """The whole preprocess step: ``PBegin`` -> Parquet shards, dead letters and ``preprocess_stats.json``.

    ``inputs``: from ``resolve_inputs`` (``{"ratings"|"movies"|"tags": [path]}`` for MovieLens,
    ``{"files": [paths in name order]}`` for delimited). Returns the stats PCollection (one dict).
    """

    def __init__(self, config: RunConfig, inputs: dict[str, list[str]], output_dir: str) -> None:
        super().__init__()
        self.config = config
        self.inputs = inputs
        self.output_dir = output_dir

    def expand(self, pbegin):
        config, layout, split = self.config, self.config.layout, self.config.split
        if layout.kind == "movielens":
            reads = {
                name: pbegin
                | f"Read{name.title()}"
                >> ReadNumberedLines(
                    self.inputs[name], True, split.max_rows if name == "ratings" else 0, example=name == "ratings"
                )
                for name in ("ratings", "movies", "tags")
            }
            parsed = {name: r["lines"] for name, r in reads.items()} | "JoinMovieLens" >> JoinMovieLens(config)
            read_dead = [r["dead"] for r in reads.values()]
            read_count = reads["ratings"]["read"]
        else:
            read = pbegin | "ReadLines" >> ReadNumberedLines(
                self.inputs["files"], layout.has_header, split.max_rows, example=True, redistribute=True
            )
            parsed = read["lines"] | "ParseDelimited" >> ParseDelimited(config)
            read_dead = [read["dead"]]
            read_count = read["read"]
        rows = parsed["rows"]
        dead = (*read_dead, parsed["dead"]) | "AllDeadLetters" >> beam.Flatten()
        malformed = dead | "WriteDeadLetters" >> WriteDeadLetters(self.output_dir)

        split_out = rows | "SplitAndShard" >> SplitAndShard(
            split.eval_fraction, split.num_train_shards, split.num_eval_shards
        )
        num_dense = len(layout.dense_fields())
        shards = split_out["keyed"] | "WriteShards" >> WriteShards(
            self.output_dir,
            config.slot_names,
            num_dense,
            {schema.TRAIN_DIR: split.num_train_shards, schema.EVAL_DIR: split.num_eval_shards},
        )
        dense = split_out["train_dense"] | "DenseStats" >> beam.CombineGlobally(DenseStatsFn(num_dense))
        distinct = rows | "DistinctIds" >> beam.CombineGlobally(DistinctIdsFn(config.slot_names))
        return (
            pbegin
            | "StatsTrigger" >> beam.Create([None])
            | "WriteStats"
            >> beam.ParDo(
                WriteStatsFn(self.output_dir),
                plan=AsSingleton(split_out["plan"]),
                dense=AsSingleton(dense),
                distinct=AsSingleton(distinct),
                read=AsSingleton(read_count),
                malformed=AsSingleton(malformed),
                shards=beam.pvalue.AsList(shards),
            )
        )


# --------------------------------------------------------------------------------------------- driver


def _match_files(pattern: str) -> list[str]:
    paths = [m.path for m in FileSystems.match([pattern])[0].metadata_list]
    return sorted(p for p in paths if io.is_gcs(p) or not os.path.isdir(p))


def malformed_summary(data_dir: str) -> dict | None:
    """What preprocess set aside in ``data_dir`` (its output folder): ``{"rows": N, "by_reason": {reason: n},
    "dead_letter": folder}``, or None when the folder has no ``preprocess_stats.json``."""
    from persia_core import io

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
        files = {"ratings": layout.ratings_file, "movies": layout.movies_file, "tags": layout.tags_file}
        for name, file in files.items():
            path = FileSystems.join(data, file)
            if not FileSystems.exists(path):
                raise FileNotFoundError(f"preprocess: MovieLens {name} file {path!r} not found")
            out[name] = [path]
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


def _clear_outputs(output_dir: str) -> None:
    """Remove what an earlier run left (shards, dead letters, schema) so no stale file is mistaken for output."""
    patterns = [
        FileSystems.join(output_dir, schema.TRAIN_DIR, "*.parquet"),
        FileSystems.join(output_dir, schema.EVAL_DIR, "*.parquet"),
        FileSystems.join(output_dir, schema.DEAD_LETTER_DIR, "*"),
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
        "train_files": [shard_file(schema.TRAIN_DIR, i, split.num_train_shards) for i in range(split.num_train_shards)],
        "eval_files": [shard_file(schema.EVAL_DIR, i, split.num_eval_shards) for i in range(split.num_eval_shards)],
        "config": config.to_dict(),
    }


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
    inputs = resolve_inputs(config, data)
    _clear_outputs(output_dir)
    io.makedirs(output_dir)
    started = time.monotonic()
    with beam.Pipeline(runner=default_runner(options), options=options) as p:
        _ = p | "Preprocess" >> Preprocess(config, inputs, output_dir)
    with FileSystems.open(FileSystems.join(output_dir, STATS_FILE)) as f:
        stats = json.loads(f.read().decode("utf-8"))
    plan = stats["plan"]
    if plan["train"] + plan["eval"] + stats["malformed"]["examples"] != stats["read"]:
        raise RuntimeError(f"preprocess: rows do not add up (train + eval + malformed != read): {stats}")
    check_malformed(
        stats,
        config.split.max_malformed_fraction,
        FileSystems.join(output_dir, schema.DEAD_LETTER_DIR),
        inputs.get("ratings") or inputs.get("files"),
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
    from persia_core.logging_utils import setup_logging

    setup_logging("preprocess")
    logging.getLogger("apache_beam").setLevel(logging.WARNING)
    config = load_config(args.config, parse_overrides(args.set))
    result = run_preprocess(config, args.data, args.output, beam_args)
    print(json.dumps({"rows": result["rows"], "split": result["split"], "output": args.output}))
    return result


if __name__ == "__main__":
    main()
