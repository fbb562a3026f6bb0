"""Serving export: score new rows with a trained Model artifact (dense weights + embedding shards).

Inputs (``input_path``, local, ``/gcs/`` or ``gs://``):

* a Parquet file (``.parquet``) or a folder of them holding **preprocessed rows** (the columns of
  ``persia_core.data.schema``, e.g. ``eval/eval-00000-of-00001.parquet`` of a preprocess output);
* any other file holds **raw rows** of the run config's layout, parsed and hashed exactly as the preprocess
  step does (``persia_core.preprocess.layouts`` parsers, ``rows.encode_row``):

  - ``delimited`` (Criteo): one example per line; the label column may be left out (one field fewer), then
    the output has no label. That is decided once per file, by its first row of either width: a row of the other
    width is malformed (never read with its fields shifted). A header line is skipped when
    ``layout.has_header``;
  - ``movielens``: a ratings CSV (``userId,movieId,rating,timestamp``, or ``userId,movieId,timestamp``
    without a rating); it is joined with ``layout.movies_file`` and (if present) ``layout.tags_file`` from the
    same folder, as preprocess does. Configs with ``layout.history_length > 0`` need the user's whole history:
    pass preprocessed Parquet rows instead.

Lookups are read-only (an ID never seen in training gets the zero row), as in evaluation; rows are scored in
order, ``batch_size`` at a time, so the probabilities equal the evaluate step's for the same rows.

Output (``output_path``): ``.parquet`` -> Parquet, anything else -> CSV; columns ``source`` ("<file>:<line>" of
the raw row), ``probability`` (float32) and, when the input has labels, ``label``.
"""

from __future__ import annotations

import base64
import csv
import io as _io
import json
import logging
import os
import tempfile
from collections.abc import Iterator
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from persia_core import io
from persia_core.config import RunConfig, load_config
from persia_core.data import schema as S
from persia_core.data.reader import ParquetExamples
from persia_core.evaluate.run import LoadedModel, score
from persia_core.preprocess import layouts, lines
from persia_core.preprocess.rows import encode_row, rows_to_table, slot_specs

log = logging.getLogger("persia.predict")


def _resolve_config(config, model: LoadedModel) -> RunConfig:
    """The config whose layout parses raw rows: ``config`` (RunConfig, shipped name or YAML path) or the
    model's own. Its slots must be the model's. Raises ``ValueError`` otherwise."""
    if config is None:
        return model.config
    cfg = load_config(config) if isinstance(config, str) else config
    if not isinstance(cfg, RunConfig):
        raise ValueError(f"config must be a RunConfig, a shipped config name or a YAML path, got {type(config)}")
    mine = [(s.name, s.fields()) for s in cfg.slots]
    theirs = [(s.name, s.fields()) for s in model.config.slots]
    if mine != theirs:
        raise ValueError(f"config slots {mine} differ from the model's {theirs}: the feature IDs would not match")
    return cfg


def _parquet_inputs(path: str) -> list[str]:
    if path.endswith(".parquet"):
        if not io.exists(path):
            raise FileNotFoundError(f"predict input not found: {path}")
        return [path]
    files = [io.join(path, n) for n in io.listdir(path) if n.endswith(".parquet")]
    if not files:
        raise FileNotFoundError(f"predict input folder {path} holds no .parquet file")
    return files


def _lines(path: str) -> Iterator[tuple[int, str | None, bytes]]:
    """``(line_no, text or None where not UTF-8, raw bytes)`` per non-blank line of ``path``, by the rule that
    preprocess reads by (``persia_core.preprocess.lines``)."""
    if not io.exists(path):
        raise FileNotFoundError(f"predict input not found: {path}")
    with _io.BytesIO(io.read_bytes(path)) as f:
        for line_no, raw in lines.numbered_lines(f, path):
            text = lines.decode_line(raw)
            if text is None or text.strip():
                yield line_no, text, raw


def _bad(path: str, line_no: int, err: Exception) -> ValueError:
    return ValueError(f"{path}:{line_no}: {err}")


def _set_aside(bad: list | None, path: str, line_no: int, err: Exception, text: str, raw: bytes | None = None) -> None:
    """Record a malformed row in ``bad`` (dead-letter mode), or raise naming ``file:line`` when ``bad`` is None.
    ``raw``: the bytes of a line that is not UTF-8 (kept as ``raw_base64``, as preprocess's dead letters do)."""
    if bad is None:
        raise _bad(path, line_no, err) from err
    letter = {"source": f"{path}:{line_no}", "reason": str(err), "raw": text}  # as preprocess's dead letters
    if raw is not None:
        letter["raw_base64"] = base64.b64encode(raw).decode("ascii")
    bad.append(letter)


def _decoded(bad: list | None, path: str, numbered) -> Iterator[tuple[int, str]]:
    """``(line_no, text)`` of the UTF-8 lines of ``numbered`` (``_lines``); the others are set aside."""
    for line_no, text, raw in numbered:
        if text is None:
            _set_aside(bad, path, line_no, layouts.ParseError("not utf-8"), raw.decode("utf-8", "replace"), raw)
            continue
        yield line_no, text


def _delimited_records(path: str, cfg: RunConfig, bad: list | None = None) -> tuple[list[tuple[dict, str]], bool]:
    layout = cfg.layout
    label_at = layout.columns.index(layout.label_column)
    n = len(layout.columns)
    out = []
    labelled = None  # decided once per file: by its header, else by its first row of n or n - 1 fields
    order = None
    for line_no, raw in _decoded(bad, path, _lines(path)):
        if line_no == 1 and layout.has_header:
            unlabelled = [c for c in layout.columns if c != layout.label_column]
            names = [c.strip() for c in raw.split(layout.delimiter)]
            labelled = layout.label_column in names if layout.map_header_by_name else names != unlabelled
            order = lines.header_order(raw, layout, path, None if labelled else unlabelled)
            continue
        text = raw
        try:
            if order is not None:
                text = lines.reorder(raw, order, layout)
            values = text.split(layout.delimiter)
            if labelled is None and len(values) in (n, n - 1):
                labelled = len(values) == n
            if labelled is False:  # rows to serve, without the label column
                if len(values) != n - 1:
                    raise layouts.ParseError(
                        f"wrong field count: {len(values)} != {n - 1} (this file's rows have no label column: "
                        f"{n - 1} fields, the config's {n} columns less '{layout.label_column}')",
                        "wrong field count",
                    )
                values.insert(label_at, "0")
                text = layout.delimiter.join(values)
            record = layouts.parse_delimited(text, layout)
        except layouts.ParseError as e:
            _set_aside(bad, path, line_no, e, raw)
            continue
        out.append((record, f"{path}:{line_no}"))
    return out, labelled is not False


def _movielens_records(path: str, cfg: RunConfig, bad: list | None = None) -> tuple[list[tuple[dict, str]], bool]:
    layout = cfg.layout
    if layout.history_length > 0:
        raise ValueError(
            "predict: a movielens config with layout.history_length > 0 needs each user's whole "
            "history; run `persia preprocess` and pass the preprocessed Parquet rows instead"
        )
    folder = os.path.dirname(path) if not io.is_gcs(path) else path.rpartition("/")[0]
    movies_path = io.join(folder, layout.movies_file)
    if not io.exists(movies_path):
        raise FileNotFoundError(
            f"predict: raw MovieLens ratings need {movies_path} beside them (or pass preprocessed Parquet rows)"
        )
    movies: dict[str, Any] = {}
    for line_no, line in _decoded(None, movies_path, _lines(movies_path)):
        try:
            m = layouts.parse_movie(line)
        except layouts.ParseError as e:
            if line_no == 1:
                continue  # header
            raise _bad(movies_path, line_no, e) from e
        movies.setdefault(m["movieId"], m)
    events: dict[str, list[tuple[int, str]]] = {}
    tags_path = io.join(folder, layout.tags_file)
    if io.exists(tags_path):
        for line_no, line in _decoded(None, tags_path, _lines(tags_path)):
            try:
                t = layouts.parse_tag(line)
            except layouts.ParseError as e:
                if line_no == 1:
                    continue
                raise _bad(tags_path, line_no, e) from e
            events.setdefault(t["movieId"], []).append((t["timestamp"], t["tag"]))
    ratings, all_labelled = [], True
    for line_no, text in _decoded(bad, path, _lines(path)):
        fields = layouts.split_csv_line(text)
        if len(fields) == 3:  # userId,movieId,timestamp: a row to serve
            text = ",".join([fields[0], fields[1], "0", fields[2]])
            all_labelled = False
        try:
            r = layouts.parse_rating(text, layout)
        except layouts.ParseError as e:
            if line_no == 1:
                continue
            _set_aside(bad, path, line_no, e, text)
            continue
        if r["movieId"] not in movies:
            _set_aside(bad, path, line_no, ValueError(f"unknown movieId: {r['movieId']}"), text)
            continue
        ratings.append((r, f"{path}:{line_no}"))
    by_movie: dict[str, list[int]] = {}
    for i, (r, _) in enumerate(ratings):
        by_movie.setdefault(r["movieId"], []).append(i)
    tags: list[list[str]] = [[] for _ in ratings]
    for movie, idx in by_movie.items():
        lists = layouts.tags_before_each(
            events.get(movie, []), [ratings[i][0]["timestamp"] for i in idx], layout.max_tags
        )
        for i, movie_tags in zip(idx, lists, strict=True):
            tags[i] = movie_tags
    out = [
        (layouts.movielens_record(r, movies[r["movieId"]], t), src) for (r, src), t in zip(ratings, tags, strict=True)
    ]
    return out, all_labelled


def raw_rows_table(path: str, config: RunConfig, bad: list | None = None) -> tuple[pa.Table, bool]:
    """Raw rows of ``config``'s layout in ``path`` -> (a table of preprocessed rows with
    ``schema.arrow_schema(slots)``, whether every row had a label). A row that does not parse raises
    ``ValueError`` naming ``file:line``, or, with ``bad`` (a list), is appended to it as ``{source, reason,
    line}`` and skipped. Raises ``FileNotFoundError`` for missing files."""
    if config.layout.kind == "delimited":
        records, labelled = _delimited_records(path, config, bad)
    else:
        records, labelled = _movielens_records(path, config, bad)
    if not records:
        raise ValueError(f"predict input {path} holds no rows")
    specs = slot_specs(config)
    rows = [
        encode_row(rec, specs, src, rec["ts"] if rec["ts"] is not None else i) for i, (rec, src) in enumerate(records)
    ]
    return rows_to_table(rows, config.slot_names, len(config.layout.dense_fields())), labelled


def _write(output_path: str, table: pa.Table) -> None:
    if output_path.endswith(".parquet"):
        buf = pa.BufferOutputStream()
        pq.write_table(table, buf)
        io.write_bytes(output_path, buf.getvalue().to_pybytes())
        return
    text = _io.StringIO()
    w = csv.writer(text, lineterminator="\n")
    w.writerow(table.column_names)
    cols = [table.column(c).to_pylist() for c in table.column_names]
    for row in zip(*cols, strict=True):
        w.writerow([f"{v:.9g}" if isinstance(v, float) else v for v in row])
    io.write_text(output_path, text.getvalue())


def predict(
    model_dir: str,
    input_path: str,
    output_path: str,
    config: RunConfig | str | None = None,
    batch_size: int = 4096,
    dead_letter: str = "",
) -> dict:
    """Score the rows of ``input_path`` with the Model artifact in ``model_dir`` and write ``output_path``.

    See the module docstring for the input and output formats. ``config``: the run config whose layout parses
    raw rows (a ``RunConfig``, a shipped name or a YAML path); default: the model's own; its slots must be the
    model's. Returns ``{"rows": N, "output": output_path, "probability": float32[N], "label": float32[N] |
    None, "malformed": rows set aside}``. ``model_dir`` may also be a blessed-model location (its latest
    blessed model is used).

    ``dead_letter``: a JSON-lines file (local or gs://) that receives every raw row that does not parse, as
    ``{"source": "file:line", "reason": ..., "raw": <the line>}`` (the keys of preprocess's dead letters); those
    rows are counted and skipped, the others are scored. Without it the first such row stops the run.

    Raises ``FileNotFoundError`` for a missing model or input, ``ValueError`` for an input row that does not
    parse (naming ``file:line``, without ``dead_letter``) or a config whose slots differ from the model's.
    """
    model = LoadedModel(model_dir)
    cfg = _resolve_config(config, model)
    bad: list | None = [] if dead_letter else None
    tmp = None
    try:
        if input_path.endswith(".parquet") or io.isdir(input_path):
            files = _parquet_inputs(input_path)
            labelled = True
            sources = []
            for f in files:
                t = pq.read_table(_io.BytesIO(io.read_bytes(f)) if io.is_gcs(f) else f, columns=[S.SOURCE])
                sources += t.column(S.SOURCE).to_pylist()
        else:
            try:
                table, labelled = raw_rows_table(input_path, cfg, bad)
            except ValueError:
                if bad:  # every row was malformed: keep the reasons before failing
                    io.write_text(dead_letter, "".join(json.dumps(b) + "\n" for b in bad))
                    log.error("predict: all %d rows of %s are malformed; see %s", len(bad), input_path, dead_letter)
                raise
            sources = table.column(S.SOURCE).to_pylist()
            fd, tmp = tempfile.mkstemp(suffix=".parquet", prefix="persia-predict-")
            os.close(fd)
            pq.write_table(table, tmp)
            files = [tmp]
        examples = ParquetExamples(files, model.slots, num_dense=len(model.manifest.dense))
    finally:
        if tmp is not None:
            os.unlink(tmp)
    probs = score(model, examples, batch_size, desc="predict")
    cols = {"source": pa.array(sources, pa.string()), "probability": pa.array(probs, pa.float32())}
    if labelled:
        cols["label"] = pa.array(examples.labels, pa.float32())
    _write(output_path, pa.table(cols))
    if dead_letter and bad is not None:
        io.write_text(dead_letter, "".join(json.dumps(b) + "\n" for b in bad))
        if bad:
            log.warning(
                "predict: %d malformed rows set aside in %s (first: %s: %s)",
                len(bad),
                dead_letter,
                bad[0]["source"],
                bad[0]["reason"],
            )
    log.info("predict: %d rows -> %s", len(probs), output_path)
    return {
        "rows": int(len(probs)),
        "output": output_path,
        "probability": probs,
        "label": examples.labels if labelled else None,
        "malformed": len(bad) if bad is not None else 0,
    }
