"""The shard file format: one shard's tables as arrays, written to and read from a file with its checks.

Shard file (one per shard: Model artifact, checkpoint, initial state): a standard uncompressed ``.npz`` (readable
with ``np.load``, no pickles) whose members are::

    __meta__                 uint8[]   JSON: {"format", "tables": {name: {layout, rows, dim, optimizer, step, ...}},
                                              "server": {applied-push records, ...}}
    <table>.keys             uint64[R]
    <table>.weights          float32[R, D]
    <table>.<state>          optimizer state per row (acc | m, v, steps)
    <table>.last_used        int32[R]
    <table>.lru_rows         int32[R]  rows from least to most recently used (layout "storage": rows in table
                                       order, as held; format persia-shard/2 had a linked list: .prev, .nxt,
                                       .head_tail, still read)
    <table>.counters         int64[4]
    <table>.sketch           uint8[2^20]  admission sketch (only tables with admit_after_sightings > 0)

Layout ``storage`` is the table's own arrays written as they are (no gather), so a dump runs at the disk's
sequential rate; layout ``lru`` (older files, ``EmbeddingTable.state_dict()``) has rows most recent first and no
recency arrays. Array data starts 64-byte aligned in the file (a zip extra field pads the local header), so a
reader can stream every member straight into its destination array. A file's integrity is checked on load:
against the size and CRC-32C a manifest gives (``expect_size``, ``expect_crc32c``), else against the zip CRC-32
of every member.

This module handles arrays only (``TableArrays``); ``persia_core.embedding.shard_tables`` takes them from and
puts them into a shard's ``EmbeddingTable``s.
"""

from __future__ import annotations

import io as _io
import json
import os
import struct
import zipfile
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
from numpy.lib import format as npy

from persia_core import io
from persia_core.embedding import kernels as K
from persia_core.embedding.buffers import aligned_array
from persia_core.embedding.checksums import crc32c
from persia_core.memory import index_slots

SHARD_FORMAT = "persia-shard/3"
READ_FORMATS = ("persia-shard/2", SHARD_FORMAT)
META = "__meta__"
_ALIGN = 64
_PAD_EXTRA_ID = 0xD935  # the extra-field id zipalign uses for padding
_LOCAL_HEADER = 30
_ZIP64_EXTRA = 20  # what zipfile appends to a local header written with force_zip64
RECENCY_ARRAYS = ("lru_rows", "prev", "nxt", "head_tail", "counters", "index")
EXTRA_ARRAYS = ("sketch",)
"""Per-table arrays that are neither rows nor optimizer state: the admission sketch (sightings of IDs not yet
admitted, tables with ``admit_after_sightings``), so a restarted shard keeps counting where it stopped."""


class ShardFileError(ValueError):
    """A shard file is missing, truncated, corrupt or does not fit the tables; the message names the file."""


def _flat_bytes(arr: np.ndarray) -> memoryview:
    return arr.reshape(-1).data.cast("B") if arr.size else memoryview(b"")


# ---- writing ------------------------------------------------------------------------------------------------
_CHUNK = 1 << 20  # 1 MiB: the two checksums and the copy to the page cache find it in cache


class _CrcWriter:
    """Write-only, non-seekable stream that counts bytes and keeps the CRC-32C of everything written.

    Having no ``seek`` makes ``zipfile`` stream (sizes in data descriptors after each member) instead of seeking
    back to patch headers, so the running CRC-32C is the CRC of the finished file. (Write-back is left to the
    kernel, with one fsync at the end: see docs/design-figures.md.)"""

    def __init__(self, raw):
        self.raw = raw
        self.pos = 0
        self.crc = 0

    def write(self, data) -> int:
        mv = memoryview(data).cast("B")
        self.crc = crc32c(mv, self.crc)
        self.raw.write(mv)
        self.pos += mv.nbytes
        return mv.nbytes

    def tell(self) -> int:
        return self.pos

    def flush(self) -> None:
        self.raw.flush()

    def close(self) -> None:
        """Nothing to close: ``raw`` is the caller's (``zipfile`` never closes a stream it was given)."""


def _npy_header(arr: np.ndarray) -> bytes:
    buf = _io.BytesIO()
    npy.write_array_header_1_0(buf, npy.header_data_from_array_1_0(arr))
    return buf.getvalue()


def _write_npz(out: _CrcWriter, members: list[tuple[str, np.ndarray]]) -> None:
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED, allowZip64=True) as zf:
        for name, arr in members:
            arr = np.ascontiguousarray(arr)
            zi = zipfile.ZipInfo(name + ".npy", date_time=(1980, 1, 1, 0, 0, 0))
            zi.compress_type = zipfile.ZIP_STORED
            fixed = out.tell() + _LOCAL_HEADER + len(zi.filename.encode("utf-8")) + _ZIP64_EXTRA + 4
            pad = (-fixed) % _ALIGN
            zi.extra = struct.pack("<HH", _PAD_EXTRA_ID, pad) + b"\0" * pad
            with zf.open(zi, "w", force_zip64=True) as w:
                w.write(_npy_header(arr))
                data = _flat_bytes(arr)
                for i in range(0, data.nbytes, _CHUNK):
                    w.write(data[i : i + _CHUNK])


@dataclass
class TableArrays:
    """One table's arrays in a shard file and their description (``layout``: ``storage`` or ``lru``)."""

    arrays: dict[str, np.ndarray]
    meta: dict
    index: np.ndarray | None = None  # hash index built while reading (layout storage)
    reserved: dict[str, np.ndarray] = field(default_factory=dict)
    """Per-row arrays read into the first rows of larger zeroed ones (``read_shard_file``'s ``reserve``): the
    larger arrays, which ``arrays`` holds views of."""


def _members_of(tables: dict[str, TableArrays], server: dict | None) -> list[tuple[str, np.ndarray]]:
    meta = {"format": SHARD_FORMAT, "tables": {n: ta.meta for n, ta in tables.items()}, "server": server or {}}
    members = [(META, np.frombuffer(json.dumps(meta).encode("utf-8"), dtype=np.uint8))]
    for name, ta in tables.items():
        if "." in name or name.startswith("__"):
            raise ValueError(f"table name {name!r} cannot be written to a shard file ('.' or leading '__')")
        members += [(f"{name}.{k}", v) for k, v in ta.arrays.items()]
    return members


def write_shard_arrays(
    path: str, tables: dict[str, TableArrays], server: dict | None = None, fsync: bool = True
) -> tuple[int, int]:
    """Write a shard file (see module docstring) from arrays. Local files go to a temporary name, are fsynced
    and renamed into place. Returns ``(bytes written, CRC-32C of the file)``."""
    members = _members_of(tables, server)
    if io.is_remote(path):
        buf = _io.BytesIO()
        w = _CrcWriter(buf)
        _write_npz(w, members)
        io.write_bytes(path, buf.getvalue())
        return w.pos, w.crc
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with io.atomic_local_file(path, fsync) as raw:
        w = _CrcWriter(raw)
        _write_npz(w, members)
    return w.pos, w.crc


def shard_arrays_bytes(tables: dict[str, TableArrays], server: dict | None = None) -> bytes:
    """The shard file of ``tables`` as bytes (same format as ``write_shard_arrays``)."""
    buf = _io.BytesIO()
    _write_npz(_CrcWriter(buf), _members_of(tables, server))
    return buf.getvalue()


# ---- reading ------------------------------------------------------------------------------------------------
@dataclass
class _Member:
    name: str
    dtype: np.dtype
    shape: tuple
    start: int  # first byte of the zip member's data (the npy header)
    data: int  # first byte of the array data
    nbytes: int
    zip_crc: int


def _members(f, size: int, where: str) -> list[_Member]:
    try:
        zf = zipfile.ZipFile(f)
        infos = zf.infolist()
    except (zipfile.BadZipFile, OSError, EOFError) as e:
        raise ShardFileError(f"{where}: not a complete shard file ({e})") from e
    out = []
    for zi in infos:
        if zi.compress_type != zipfile.ZIP_STORED:
            raise ShardFileError(f"{where}: member {zi.filename} is compressed; shard files are stored")
        f.seek(zi.header_offset)
        lh = f.read(_LOCAL_HEADER)
        if len(lh) < _LOCAL_HEADER or lh[:4] != b"PK\x03\x04":
            raise ShardFileError(f"{where}: bad local header of {zi.filename}")
        nlen, elen = struct.unpack("<HH", lh[26:30])
        start = zi.header_offset + _LOCAL_HEADER + nlen + elen
        f.seek(start)
        try:
            version = npy.read_magic(f)
            shape, fortran, dtype = npy.read_array_header_1_0(f) if version == (1, 0) else npy.read_array_header_2_0(f)
        except ValueError as e:
            raise ShardFileError(f"{where}: member {zi.filename} is not an array: {e}") from e
        if fortran or dtype.hasobject:
            raise ShardFileError(f"{where}: member {zi.filename}: only C-order plain arrays are read")
        data = f.tell()
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if data - start + nbytes != zi.file_size or data + nbytes > size:
            raise ShardFileError(f"{where}: member {zi.filename} has inconsistent sizes")
        name = zi.filename[:-4] if zi.filename.endswith(".npy") else zi.filename
        out.append(_Member(name, dtype, tuple(shape), start, data, nbytes, zi.CRC))
    return sorted(out, key=lambda m: m.start)


def _read_exact(f, mv: memoryview, where: str) -> None:
    got = 0
    while got < mv.nbytes:
        n = f.readinto(mv[got:])
        if not n:
            raise ShardFileError(f"{where}: file ended early")
        got += n


def build_key_index(keys: np.ndarray) -> np.ndarray:
    """A fresh hash index of ``keys: uint64[R]`` whose row of key i is i: ``int32[memory.index_slots(R)]``,
    64-byte aligned, -1 in empty slots."""
    index = aligned_array(index_slots(len(keys)), np.int32)  # the kernel empties it, releasing the GIL
    K.rebuild_index(index, keys, K.shift_of(index), len(keys))
    return index


@dataclass
class ShardContents:
    """What a shard file holds: per table its arrays, and the server's bookkeeping."""

    tables: dict[str, TableArrays] = field(default_factory=dict)
    server: dict = field(default_factory=dict)
    size: int = 0
    crc32c: int | None = None


def read_shard_file(
    path: str,
    expect_size: int | None = None,
    expect_crc32c: int | None = None,
    build_index: bool = True,
    reserve: dict[str, int] | None = None,
) -> ShardContents:
    """Read a shard file, checking its integrity (see module docstring), into fresh arrays.

    Members stream straight from the file into their arrays; checksums and the hash index of every ``storage``
    table (``build_index``) are computed on a helper thread while the rest of the file is read. ``reserve``: rows
    per table to size its per-row arrays (keys, weights, optimizer state, recency steps) for, zeroed beyond the
    file's rows (``TableArrays.reserved``), so that a table restored from them holds its capacity without a copy;
    no index is built for those tables (the table builds its own, sized for its capacity).
    Raises ``FileNotFoundError`` for a missing file, ``ShardFileError`` naming the file and the problem."""
    f: _io.BytesIO | _io.FileIO
    if io.is_remote(path):
        if not io.exists(path):
            raise FileNotFoundError(f"shard file not found: {path}")
        data = io.read_bytes(path)
        size, f = len(data), _io.BytesIO(data)
    else:
        if not os.path.exists(path):
            raise FileNotFoundError(f"shard file not found: {path}")
        size, f = os.path.getsize(path), open(path, "rb", buffering=0)
    try:
        if expect_size is not None and size != int(expect_size):
            raise ShardFileError(
                f"{path}: {size} bytes, but the manifest says {expect_size} (partial or overwritten file)"
            )
        return _read_members(f, size, path, expect_crc32c, build_index, reserve or {})
    finally:
        f.close()


def _read_members(
    f, size: int, where: str, expect_crc32c: int | None, build_index: bool, reserve: dict[str, int]
) -> ShardContents:
    members = _members(f, size, where)
    check_zip = expect_crc32c is None
    crc = [0]  # the running CRC-32C of the whole file (checked against the manifest's)
    bad: list[str] = []  # members whose zip CRC-32 differs (checked without a manifest)
    helper = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shard-read")
    futs: list[Future] = []

    def crc_part(mv, member: _Member | None, header: bytes | None) -> None:
        if not check_zip:
            crc[0] = crc32c(mv, crc[0])
        elif member is not None and header is not None and zlib.crc32(mv, zlib.crc32(header)) != member.zip_crc:
            bad.append(member.name)

    arrays: dict[str, np.ndarray] = {}
    names = {m.name for m in members}
    layouts: dict[str, str] = {}
    indexes: dict[str, Future] = {}
    reserved: dict[str, dict[str, np.ndarray]] = {}
    meta: dict = {}
    try:
        f.seek(0)
        pos = 0
        for m in members:
            gap = bytearray(m.data - pos)
            _read_exact(f, memoryview(gap), where)
            header = bytes(gap[m.start - pos :])
            futs.append(helper.submit(crc_part, memoryview(gap), None, None))
            table, _, what = m.name.partition(".")
            rows = reserve.get(table, 0)
            per_row = layouts.get(table) == "storage" and what not in (*RECENCY_ARRAYS, *EXTRA_ARRAYS)
            if per_row and len(m.shape) >= 1 and rows > m.shape[0]:
                full = aligned_array((rows, *m.shape[1:]), m.dtype, 0)  # resident only as far as it is read
                reserved.setdefault(table, {})[what] = full
                arr = full[: m.shape[0]]
            else:
                arr = aligned_array(m.shape, m.dtype)  # may become a table's own array (restore_table)
            _read_exact(f, _flat_bytes(arr), where)
            futs.append(helper.submit(crc_part, _flat_bytes(arr), m, header))
            pos = m.data + m.nbytes
            if m.name == META:
                meta = _parse_meta(arr, where)
                layouts = {n: t.get("layout", "lru") for n, t in meta.get("tables", {}).items()}
                continue
            arrays[m.name] = arr
            if (
                build_index
                and what == "keys"
                and layouts.get(table) == "storage"
                and f"{table}.index" not in names
                and table not in reserved
            ):
                indexes[table] = helper.submit(build_key_index, arr)
        tail = bytearray(size - pos)
        _read_exact(f, memoryview(tail), where)
        futs.append(helper.submit(crc_part, memoryview(tail), None, None))
        for fu in futs:
            fu.result()
        built = {t: fu.result() for t, fu in indexes.items()}
    finally:
        helper.shutdown(wait=True)
    if expect_crc32c is not None and crc[0] != int(expect_crc32c):
        raise ShardFileError(
            f"{where}: CRC-32C {crc[0]:08x} does not match the manifest's {int(expect_crc32c):08x} (corrupt file)"
        )
    if bad:
        raise ShardFileError(f"{where}: zip CRC-32 mismatch in {bad} (corrupt file)")
    out = ShardContents(server=meta.get("server", {}), size=size, crc32c=crc[0] if not check_zip else None)
    by_table: dict[str, dict[str, np.ndarray]] = {}
    for key, arr in arrays.items():
        table, _, name = key.partition(".")
        by_table.setdefault(table, {})[name] = arr
    for name, arrs in by_table.items():
        tmeta = dict(meta.get("tables", {}).get(name, {}))
        tmeta.setdefault("layout", "lru")
        tmeta.setdefault("rows", len(arrs.get("keys", ())))
        if "keys" not in arrs or "weights" not in arrs:
            raise ShardFileError(f"{where}: table {name!r} lacks keys or weights")
        out.tables[name] = TableArrays(arrs, tmeta, built.get(name), reserved.get(name, {}))
    return out


def _parse_meta(arr: np.ndarray, where: str) -> dict:
    try:
        meta = json.loads(arr.tobytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ShardFileError(f"{where}: unreadable {META}: {e}") from e
    if meta.get("format") not in READ_FORMATS:
        raise ShardFileError(f"{where}: unknown shard file format {meta.get('format')!r}")
    return meta
