"""The one rule for reading a text input, shared by preprocess (``read.ReadFileLinesFn``) and predict, and the
check of a delimited file's header against ``layout.columns``.

Lines end at ``\\n`` only (``\\r\\n`` loses its ``\\r``); a file without any ``\\n`` but with a ``\\r`` has
classic-Mac ``\\r`` line ends. Any other character (``\\x0c``, ``\\x1c``-``\\x1e``, ``\\x85``, U+2028, U+2029,
which ``str.splitlines`` would break at) stays inside its line. A UTF-8 byte-order mark at the start of a file is
dropped. Lines are decoded one by one, so an undecodable line is one bad row (its bytes kept), not a bad file.
Compressed files (``.gz``, ``.bz2``, ``.xz``, ``.lzma``, by extension) are decompressed here, the same way for
both; a truncated or corrupt one fails the run naming it, never ends its rows early.
Leaf module: no Beam, so that predict (and serving) read rows without importing it.
"""

from __future__ import annotations

import bz2
import gzip
import lzma
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import BinaryIO, Protocol

from persia_core.config.schema import LayoutConfig
from persia_core.preprocess.layouts import ParseError

BOM = b"\xef\xbb\xbf"


class LineSource(Protocol):
    """What ``read_lines`` reads from: a binary file (or decompressing stream) with ``readline``."""

    def readline(self, size: int = -1, /) -> bytes: ...


COMPRESSED: dict[str, Callable[[BinaryIO], LineSource]] = {
    ".gz": lambda f: gzip.GzipFile(fileobj=f, mode="rb"),
    ".bz2": lambda f: bz2.BZ2File(f, mode="rb"),
    ".xz": lambda f: lzma.LZMAFile(f, mode="rb"),
    ".lzma": lambda f: lzma.LZMAFile(f, mode="rb"),
}
"""Compression read by file extension: a streaming decompressor over the file's bytes."""
UNREAD = (".zst", ".zstd", ".deflate", ".zip", ".snappy", ".lz4", ".br")
"""Compressed formats refused by name rather than read as text."""


def read_lines(f: LineSource) -> Iterator[tuple[int, bytes]]:
    """``(line_no, raw)`` for every line of the binary file ``f``: ``line_no`` 1-based, ``raw`` the line's bytes
    without its line end (module docstring: the rule). Blank lines are yielded too (the caller skips them)."""
    line_no = 0
    for chunk in iter(f.readline, b""):
        if line_no == 0 and chunk.startswith(BOM):
            chunk = chunk[len(BOM) :]
        # a first readline that reached the end of the file without a LF but holds a CR: a file with CR-only line
        # ends (read whole); a CR inside a line of a LF file stays part of its line
        if line_no == 0 and not chunk.endswith(b"\n") and b"\r" in chunk.rstrip(b"\r"):
            for piece in chunk.replace(b"\r\n", b"\n").replace(b"\r", b"\n").split(b"\n"):
                line_no += 1
                yield line_no, piece
            return
        line_no += 1
        if chunk.endswith(b"\n"):
            chunk = chunk[:-2] if chunk.endswith(b"\r\n") else chunk[:-1]
        yield line_no, chunk


def decode_line(raw: bytes) -> str | None:
    """``raw`` decoded as UTF-8, or None when it is not UTF-8."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return None


def compression_of(path: str) -> str:
    """The compression that ``path``'s extension names (``COMPRESSED``, case-insensitive), "" for none. Raises
    ``ValueError`` naming ``path`` for a compressed format that is not read (``.zst``, ``.deflate``, ...)."""
    lower = path.lower()
    for ext in COMPRESSED:
        if lower.endswith(ext):
            return ext
    for ext in UNREAD:
        if lower.endswith(ext):
            raise ValueError(
                f"{path}: {ext} files are not read; decompress it, or compress it as one of {', '.join(COMPRESSED)}"
            )
    return ""


def numbered_lines(raw: BinaryIO, path: str) -> Iterator[tuple[int, bytes]]:
    """``read_lines`` of the file ``path`` whose bytes ``raw`` yields, decompressed by its extension
    (``compression_of``). Raises ``ValueError`` naming ``path`` for a compressed file that is truncated or
    corrupt (its rows so far have been yielded; the caller's run fails, it does not end early)."""
    ext = compression_of(path)
    if not ext:
        yield from read_lines(raw)
        return
    try:
        yield from read_lines(COMPRESSED[ext](raw))
    except (EOFError, OSError, zlib.error, lzma.LZMAError) as e:
        raise ValueError(f"{path}: not a valid {ext} file (truncated or corrupt): {e}") from None


@dataclass(frozen=True)
class ColumnOrder:
    """Where a file's fields sit, from its header (``layout.map_header_by_name``)."""

    index: tuple[int, ...]
    """For each column of the config, the index of its field in the file's lines."""
    width: int
    """The file's field count (its header's)."""


def header_order(header: str, layout: LayoutConfig, path: str, columns: list[str] | None = None) -> ColumnOrder | None:
    """Check the header line ``header`` of the delimited file ``path`` against ``columns`` (default
    ``layout.columns``). Returns None when the header names exactly those columns in that order, else (with
    ``layout.map_header_by_name``) for each of ``columns`` its index among the file's fields, for ``reorder``.

    Raises ``ValueError`` naming ``path``, line 1 and the first difference (a column in another place, a missing
    or repeated name, another column count)."""
    columns = list(layout.columns if columns is None else columns)
    names = [n.strip() for n in header.split(layout.delimiter)]
    if names == columns:
        return None
    where = f"{path}:1: the header"
    if layout.map_header_by_name:
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"{where} names {', '.join(repr(n) for n in twice)} twice")
        missing = [c for c in columns if c not in names]
        if missing:
            raise ValueError(f"{where} has no column {missing[0]!r} of layout.columns (it names {names})")
        return ColumnOrder(tuple(names.index(c) for c in columns), len(names))
    hint = " (set layout.map_header_by_name: true to read the columns by their header names)"
    for i, (got, want) in enumerate(zip(names, columns, strict=False)):
        if got != want:
            raise ValueError(f"{where}'s column {i + 1} is {got!r}, but layout.columns[{i}] is {want!r}{hint}")
    raise ValueError(f"{where} has {len(names)} columns, layout.columns {len(columns)}{hint}")


def reorder(line: str, order: ColumnOrder, layout: LayoutConfig) -> str:
    """``line`` (fields in its file's order) with its fields in the config's order (``header_order``). Raises
    ``ParseError`` for a line with another field count than its header (never read positionally instead)."""
    fields = line.split(layout.delimiter)
    if len(fields) != order.width:
        raise ParseError(f"wrong field count: {len(fields)} != {order.width} (this file's header)", "wrong field count")
    return layout.delimiter.join([fields[i] for i in order.index])
