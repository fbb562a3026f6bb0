"""Step 1 of the preprocess pipeline: input files -> numbered lines, each keeping its ``"<file>:<line>"``.

``ReadNumberedLines`` reads each file in order with ``FileSystems`` (local or gs://; ``ReadFileLinesFn``), then
gives every data line its global row number over all files (``NumberRowsFn``, with the per-file line counts as
a side input). Lines that are not UTF-8 become dead letters here; parsing is the next step's.
"""

from __future__ import annotations

import base64
import functools
import os
import posixpath
from collections.abc import Iterable, Iterator

import apache_beam as beam
from apache_beam.io.filesystem import CompressionTypes
from apache_beam.io.filesystems import FileSystems
from apache_beam.pvalue import AsDict, TaggedOutput

from persia_core.config.schema import LayoutConfig
from persia_core.preprocess import layouts, lines
from persia_core.preprocess.counters import counter
from persia_core.preprocess.rows import DEAD, dead_letter

_COUNTS = "counts"


class ReadFileLinesFn(beam.DoFn):
    """``(file_index, path)`` -> ``(file_index, path, line_no, data_index, text, ok)`` per data line.

    Lines are read in order with ``FileSystems.open`` (local, gs://; decompressed by extension) by the rule of
    ``persia_core.preprocess.lines`` (``\\n`` ends a line, a BOM is dropped); ``line_no`` is 1-based and counts
    the header, ``data_index`` is 0-based over the file's data lines; ``text`` has no line end; ``ok`` is False
    for a line that is not UTF-8 (``text`` is then its bytes, which the dead letter keeps). Stops after
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
        with FileSystems.open(path, compression_type=CompressionTypes.UNCOMPRESSED) as f:
            for line_no, raw in lines.numbered_lines(f, path):  # decompressed there, as predict reads them
                if line_no == 1 and self.skip_header:
                    continue
                if self.max_lines and n >= self.max_lines:
                    break
                text = lines.decode_line(raw)
                if text is not None and not text.strip():
                    self.blank_lines.inc()  # no data, so not a row (as predict reads them too)
                    continue
                yield index, path, line_no, n, (raw if text is None else text), text is not None  # bytes: dead
                n += 1
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
            self._offsets = _offsets(counts)
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


def _offsets(counts: dict[int, int]) -> dict[int, int]:
    """``{file_index: data lines}`` -> ``{file_index: global row number of its first data line}`` (file order)."""
    total, out = 0, {}
    for i in sorted(counts):
        out[i] = total
        total += counts[i]
    return out


def _rows_kept(counts: list[tuple[int, int]], files: list[str], max_rows: int) -> Iterator[tuple[str, int]]:
    """``[(file_index, data lines read)]`` of all files -> ``(path, data rows kept)`` per file: its data lines with
    a global row number below ``max_rows`` (all when 0), from the file's offset (``_offsets``), so that they add up
    to ``_rows_read``. (Each file is read up to ``max_rows`` lines, so its lines read are not its rows kept.)"""
    offsets = _offsets(dict(counts))
    for i, n in sorted(counts):
        yield files[i], (max(0, min(n, max_rows - offsets[i])) if max_rows else n)


def _rows_read(counts: Iterable[int], max_rows: int) -> int:
    total = sum(counts)
    return min(total, max_rows) if max_rows else total


class ReadNumberedLines(beam.PTransform):
    """Read files in order into numbered lines: ``PBegin`` -> ``{"lines", "dead", "read"}``.

    ``lines``: ``(path, line_no, row_number, text)`` (``row_number`` 0-based over the data lines of all
    ``files`` in list order; only rows with ``row_number < max_rows`` when ``max_rows > 0``); ``dead``:
    dead letters of undecodable lines; ``read``: one int, the number of data rows kept (lines + dead);
    ``file_rows``: ``(path, data rows kept)`` per file (``_rows_kept``; they add up to ``read``), 0 for a file
    without any or past ``max_rows``.
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
        file_rows = (
            read[_COUNTS]
            | "AllFileCounts" >> beam.combiners.ToList()
            | "RowsPerFile" >> beam.FlatMap(functools.partial(_rows_kept, files=self.files, max_rows=max_rows))
        )
        return {"lines": numbered.lines, "dead": numbered[DEAD], "read": total, "file_rows": file_rows}


def source_names(files: list[str], root: str) -> dict[str, str]:
    """Each of ``files`` -> its name relative to the input root ``root`` (the folder read, or a glob's fixed
    prefix), normalized (no ``./``, ``/`` as separator): the file part of every row's ``source``, so that a path
    typed another way (``data/*.tsv``, ``./data/*.tsv``, an absolute path) or a moved input folder gives the
    same sources, hence the same shards and row order. A file outside ``root`` keeps its normalized path.
    Local paths are compared absolute; gs:// paths by prefix."""
    out = {}
    for path in files:
        if "://" in path or "://" in root:
            prefix = root.rstrip("/") + "/"
            rel = path[len(prefix) :] if path.startswith(prefix) else path
        else:
            rel = os.path.relpath(os.path.abspath(path), os.path.abspath(root or "."))
            if rel == os.pardir or rel.startswith(os.pardir + os.sep):
                rel = os.path.abspath(path)
        out[path] = posixpath.normpath(rel.replace(os.sep, "/"))
    return out


def first_line(path: str) -> bytes | None:
    """The first line of the file ``path`` (decompressed by its extension, ``lines.numbered_lines``) without its
    line end, or None for a file without any line."""
    with FileSystems.open(path, compression_type=CompressionTypes.UNCOMPRESSED) as f:
        first = next(lines.numbered_lines(f, path), None)
    return None if first is None else first[1]


def header_orders(files: list[str], layout: LayoutConfig) -> dict[str, lines.ColumnOrder]:
    """Check the header line of each of ``files`` (a delimited layout with ``has_header``) against
    ``layout.columns`` before any row is read (``lines.header_order``). Returns the files whose fields must be
    reordered (``map_header_by_name``), with their order. A file without any line (0 bytes, or compressed
    nothing) has no header to check and no rows: it is skipped here (and read as a file without data rows).
    Raises ``ValueError`` naming the first file whose header differs, or is empty (blank) or not UTF-8."""
    orders = {}
    for path in files:
        first = first_line(path)
        if first is None:
            continue
        text = lines.decode_line(first)
        if text is None or not text.strip():
            raise ValueError(
                f"{path}:1: layout.has_header is set, but the first line is {'not UTF-8' if text is None else 'empty'}"
            )
        order = lines.header_order(text, layout, path)
        if order is not None:
            orders[path] = order
    return orders
