"""Embedding tables sharded by feature ID, in one process (the reference backend), and the shard file format.

``LocalEmbedding`` and the gRPC ``persia_core.ps.client.EmbeddingClient`` share one interface, so the trainer
runs unchanged on either, and a test compares the distributed run to this one:

    lookup(table, ids uint64[U]) -> float32[U, D]               create unseen rows
    lookup_readonly(table, ids uint64[U]) -> float32[U, D]      unseen -> zero row, nothing inserted
    push(table, ids uint64[U], grads float32[U, D], step, sync_workers) -> Future   apply one update
    flush(); stats() -> list[dict]; state_dicts() -> list[dict]

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
"""

from __future__ import annotations

import contextlib
import ctypes
import glob as _glob
import io as _io
import json
import logging
import os
import struct
import zipfile
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
from numpy.lib import format as npy

from persia_core.config import EmbeddingConfig, TableConfig
from persia_core.embedding import kernels as K
from persia_core.embedding import table as table_mod
from persia_core.embedding.table import EmbeddingTable
from persia_core.memory import capacity_for_budget, index_slots, state_shapes

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
log = logging.getLogger("persia.shards")


class ShardFileError(ValueError):
    """A shard file is missing, truncated, corrupt or does not fit the tables; the message names the file."""


# ---- CRC-32C (Castagnoli), as Cloud Storage uses -------------------------------------------------------------
def _native_crc32c():
    """``crc32c_extend(crc, ptr, n)`` of the library bundled with ``google-crc32c`` (hardware CRC32C), or None."""
    try:
        import google_crc32c
    except ImportError:
        return None
    base = os.path.dirname(google_crc32c.__file__)
    for path in sorted(
        _glob.glob(os.path.join(base, os.pardir, "google_crc32c.libs", "libcrc32c*"))
        + _glob.glob(os.path.join(base, "libcrc32c*"))
    ):
        try:
            fn = ctypes.CDLL(path).crc32c_extend
        except (OSError, AttributeError):
            continue
        fn.restype = ctypes.c_uint32
        fn.argtypes = [ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t]
        return fn
    return None


_CRC32C_EXTEND = _native_crc32c()


def crc32c(data, crc: int = 0) -> int:
    """CRC-32C of ``data`` (any C-contiguous buffer: bytes, memoryview, ndarray), continuing from ``crc``.

    Runs on the buffer in place (no copy) through the hardware CRC32C of ``google-crc32c``'s bundled library and
    releases the GIL; falls back to ``google_crc32c.extend`` on copied 8 MiB chunks."""
    mv = memoryview(data)
    if mv.nbytes == 0:
        return crc
    if not mv.c_contiguous:
        raise ValueError("crc32c needs a C-contiguous buffer")
    if _CRC32C_EXTEND is not None:
        arr = np.frombuffer(mv.cast("B"), dtype=np.uint8)
        return int(_CRC32C_EXTEND(crc, arr.ctypes.data, arr.nbytes))
    import google_crc32c

    mv = mv.cast("B")
    for i in range(0, mv.nbytes, 1 << 23):
        crc = google_crc32c.extend(crc, bytes(mv[i : i + (1 << 23)]))
    return crc


def _remote(path: str) -> bool:
    from persia_core import io

    return bool(getattr(io, "is_remote", io.is_gcs)(path))


def file_crc32c(path: str, chunk: int = 1 << 24) -> tuple[int, int]:
    """``(size in bytes, CRC-32C)`` of a whole file (local, ``/gcs/`` or ``gs://``)."""
    from persia_core import io

    if _remote(path):
        data = io.read_bytes(path)
        return len(data), crc32c(data)
    crc, size = 0, 0
    buf = bytearray(chunk)
    mv = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while True:
            n = f.readinto(buf)
            if not n:
                break
            crc = crc32c(mv[:n], crc)
            size += n
    return size, crc


def _flat_bytes(arr: np.ndarray) -> memoryview:
    return memoryview(arr.reshape(-1)).cast("B") if arr.size else memoryview(b"")


# ---- writing ------------------------------------------------------------------------------------------------
_CHUNK = 1 << 20  # 1 MiB: the two checksums and the copy to the page cache find it in cache


class _CrcWriter:
    """Write-only, non-seekable stream that counts bytes and keeps the CRC-32C of everything written.

    Having no ``seek`` makes ``zipfile`` stream (sizes in data descriptors after each member) instead of seeking
    back to patch headers, so the running CRC-32C is the CRC of the finished file. (Starting write-back early
    with ``sync_file_range`` was measured slower on a shared virtual disk: the kernel's own write-back and one
    fsync at the end do better.)"""

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


def _has_internals(t) -> bool:
    need = (
        "keys",
        "weights",
        "last_used",
        "qrow",
        "qstep",
        "qht",
        "state",
        "index",
        "counters",
        "step",
        "lock",
        "capacity",
        "dim",
    )
    return all(hasattr(t, a) for a in need) and isinstance(t.state, dict)


def table_arrays(t: EmbeddingTable) -> TableArrays:
    """The arrays of a table to write, as views of the table's own arrays (layout ``storage``); call with
    ``t.lock`` held until they are written. A table without those arrays gives a copy in recency order
    (``state_dict()``, layout ``lru``; do not hold its lock then)."""
    base = {"dim": t.dim, "optimizer": t.optimizer.name, "dropped_gradients": int(getattr(t, "dropped_gradients", 0))}
    if _has_internals(t):
        n = int(t.counters[0])
        arrays = {"keys": t.keys[:n], "weights": t.weights[:n]}
        arrays.update({k: v[:n] for k, v in t.state.items()})
        arrays.update(
            {
                "last_used": t.last_used[:n],
                "lru_rows": K.queue_order(t.qrow, t.qstep, t.qht, t.last_used, n),
                "counters": t.counters,
                "index": t.index,
            }
        )
        _add_sketch(t, arrays)
        return TableArrays(arrays, {**base, "layout": "storage", "rows": n, "step": int(t.step)})
    sd = t.state_dict()
    _add_sketch(t, sd)
    return TableArrays(sd, {**base, "layout": "lru", "rows": len(sd["keys"]), "step": int(getattr(t, "step", 0))})


def _add_sketch(t, arrays: dict) -> None:
    if getattr(t, "admit_after", 0) > 0:
        arrays["sketch"] = t.sketch


def _restore_sketch(t, arrays: dict) -> None:
    """Take back the admission sketch when both the file and the table count sightings (same size)."""
    sketch = arrays.get("sketch")
    if sketch is not None and getattr(t, "admit_after", 0) > 0 and sketch.shape == t.sketch.shape:
        t.sketch[:] = sketch


@contextlib.contextmanager
def snapshot(tables: dict[str, EmbeddingTable]):
    """A consistent view of a shard's tables to write: every table's lock is held until the block ends (no
    lookup or update runs meanwhile). Yields ``{name: TableArrays}``."""
    with contextlib.ExitStack() as stack:
        if all(_has_internals(t) for t in tables.values()):
            for name in sorted(tables):
                stack.enter_context(tables[name].lock)
        yield {name: table_arrays(tables[name]) for name in tables}


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
    from persia_core import io

    members = _members_of(tables, server)
    if _remote(path):
        buf = _io.BytesIO()
        w = _CrcWriter(buf)
        _write_npz(w, members)
        io.write_bytes(path, buf.getbuffer())
        return w.pos, w.crc
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with io.atomic_local_file(path, fsync) as raw:
        w = _CrcWriter(raw)
        _write_npz(w, members)
    return w.pos, w.crc


def write_shard_file(
    path: str, tables: dict[str, EmbeddingTable], server: dict | None = None, fsync: bool = True
) -> tuple[int, int]:
    """Write the tables of one shard (and the server's bookkeeping ``server``) to ``path`` from a consistent
    ``snapshot``. Returns ``(bytes, CRC-32C)``."""
    with snapshot(tables) as arrays:
        return write_shard_arrays(path, arrays, server, fsync)


def shard_file_bytes(tables: dict[str, EmbeddingTable], server: dict | None = None) -> bytes:
    """The shard file of ``tables`` as bytes (same format as ``write_shard_file``)."""
    buf = _io.BytesIO()
    with snapshot(tables) as arrays:
        _write_npz(_CrcWriter(buf), _members_of(arrays, server))
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


def _build_index(keys: np.ndarray) -> np.ndarray:
    index = table_mod.aligned_array(index_slots(len(keys)), np.int32, -1)
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
    path: str, expect_size: int | None = None, expect_crc32c: int | None = None, build_index: bool = True
) -> ShardContents:
    """Read a shard file, checking its integrity (see module docstring), into fresh arrays.

    Members stream straight from the file into their arrays; checksums and the hash index of every ``storage``
    table (``build_index``) are computed on a helper thread while the rest of the file is read.
    Raises ``FileNotFoundError`` for a missing file, ``ShardFileError`` naming the file and the problem."""
    from persia_core import io

    if _remote(path):
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
        return _read_members(f, size, path, expect_crc32c, build_index)
    finally:
        f.close()


def _read_members(f, size: int, where: str, expect_crc32c: int | None, build_index: bool) -> ShardContents:
    members = _members(f, size, where)
    check_zip = expect_crc32c is None
    state = {"crc": 0, "bad": []}
    helper = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shard-read")
    futs: list[Future] = []

    def crc_part(mv, member: _Member | None, header: bytes | None) -> None:
        if not check_zip:
            state["crc"] = crc32c(mv, state["crc"])
        elif member is not None and zlib.crc32(mv, zlib.crc32(header)) != member.zip_crc:
            state["bad"].append(member.name)

    arrays: dict[str, np.ndarray] = {}
    names = {m.name for m in members}
    layouts: dict[str, str] = {}
    indexes: dict[str, Future] = {}
    meta: dict = {}
    try:
        f.seek(0)
        pos = 0
        for m in members:
            gap = bytearray(m.data - pos)
            _read_exact(f, memoryview(gap), where)
            header = bytes(gap[m.start - pos :])
            futs.append(helper.submit(crc_part, memoryview(gap), None, None))
            arr = table_mod.aligned_array(m.shape, m.dtype)  # may become a table's own array (restore_table)
            _read_exact(f, _flat_bytes(arr), where)
            futs.append(helper.submit(crc_part, _flat_bytes(arr), m, header))
            pos = m.data + m.nbytes
            if m.name == META:
                meta = _parse_meta(arr, where)
                layouts = {n: t.get("layout", "lru") for n, t in meta.get("tables", {}).items()}
                continue
            arrays[m.name] = arr
            table, _, what = m.name.partition(".")
            if build_index and what == "keys" and layouts.get(table) == "storage" and f"{table}.index" not in names:
                indexes[table] = helper.submit(_build_index, arr)
        tail = bytearray(size - pos)
        _read_exact(f, memoryview(tail), where)
        futs.append(helper.submit(crc_part, memoryview(tail), None, None))
        for fu in futs:
            fu.result()
        built = {t: fu.result() for t, fu in indexes.items()}
    finally:
        helper.shutdown(wait=True)
    if not check_zip and state["crc"] != int(expect_crc32c):
        raise ShardFileError(
            f"{where}: CRC-32C {state['crc']:08x} does not match the manifest's {int(expect_crc32c):08x} (corrupt file)"
        )
    if state["bad"]:
        raise ShardFileError(f"{where}: zip CRC-32 mismatch in {state['bad']} (corrupt file)")
    out = ShardContents(server=meta.get("server", {}), size=size, crc32c=state["crc"] if not check_zip else None)
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
        out.tables[name] = TableArrays(arrs, tmeta, built.get(name))
    return out


def _parse_meta(arr: np.ndarray, where: str) -> dict:
    try:
        meta = json.loads(arr.tobytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ShardFileError(f"{where}: unreadable {META}: {e}") from e
    if meta.get("format") not in READ_FORMATS:
        raise ShardFileError(f"{where}: unknown shard file format {meta.get('format')!r}")
    return meta


# ---- restoring ----------------------------------------------------------------------------------------------
def _state_names(arrays: dict) -> set[str]:
    return set(arrays) - {"keys", "weights", "last_used", *RECENCY_ARRAYS, *EXTRA_ARRAYS}


def index_consistent(index: np.ndarray, keys: np.ndarray, samples: int = 4096) -> bool:
    """Whether a stored hash index serves ``keys`` (its row of key i is i): a power-of-two int32 array with one
    entry per row, entries in range, and ``samples`` evenly spread keys found at their rows. A table built by a
    changed hash function fails this and gets its index rebuilt."""
    n = len(keys)
    if index.dtype != np.int32 or index.ndim != 1 or len(index) & (len(index) - 1) or len(index) * 0.75 < n:
        return False
    if n == 0:
        return bool((index == -1).all())
    if int(index.max()) >= n or int(np.count_nonzero(index >= 0)) != n:
        return False
    rows = np.unique(np.linspace(0, n - 1, min(samples, n)).astype(np.int64))
    return bool((K.find_rows(np.ascontiguousarray(keys[rows]), index, keys) == rows).all())


def lru_state_dict(ta: TableArrays) -> dict[str, np.ndarray]:
    """A table's arrays as ``EmbeddingTable.state_dict()`` would give them: rows most recently used first."""
    a = ta.arrays
    names = ["keys", "weights", "last_used", *sorted(_state_names(a))]
    if ta.meta.get("layout") != "storage":
        out = {k: a[k] for k in names if k in a}
        out.setdefault("last_used", np.zeros(len(a["keys"]), np.int32))
        return out
    n = len(a["keys"])
    order = _lru_first(a, n)[::-1] if n else np.zeros(0, np.int64)
    if len(order) != n:
        raise ShardFileError(f"recency list covers {len(order)} of {n} rows")
    return {k: a[k][order] for k in names}


def _lru_first(a: dict, n: int) -> np.ndarray:
    """Rows of a layout-``storage`` table from least to most recently used (format 3: ``lru_rows``; format 2:
    its linked list)."""
    if "lru_rows" in a:
        return np.asarray(a["lru_rows"])
    return K.list_order(int(a["head_tail"][0]), a["nxt"], n)[::-1]


def restore_table(t: EmbeddingTable, ta: TableArrays, where: str = "", name: str = "") -> None:
    """Replace a table's contents with ``ta`` (read by ``read_shard_file``).

    Layout ``storage`` into a table of the same kind and enough capacity: the arrays become the table's own (no
    copy) and the index built while reading is used. Otherwise the rows go in through ``load_state_dict`` in
    recency order; rows beyond the table's capacity (least recently used first) are dropped with a warning.
    Raises ``ShardFileError`` naming the table when the dim or the optimizer state do not match."""
    a, label = ta.arrays, f"{where}: table {name!r}"
    n = len(a["keys"])
    _check_table_arrays(t, ta, label)
    expected = set(state_shapes(t.optimizer.name, t.dim))
    fast = (
        ta.meta.get("layout") == "storage"
        and _has_internals(t)
        and n <= t.capacity
        and n >= 1024
        and all(a[k].dtype == getattr(t, k).dtype for k in ("keys", "weights", "last_used"))
        and all(a[k].dtype == t.state[k].dtype for k in expected)
    )
    if fast:
        index = a.get("index")
        if index is None or not index_consistent(index, a["keys"]):
            index = ta.index if ta.index is not None else _build_index(a["keys"])
        order = _lru_first(a, n)
        if len(order) != n:
            raise ShardFileError(f"{label}: recency order covers {len(order)} of {n} rows")
        with t.lock:
            t.keys, t.weights, t.last_used, t.index = a["keys"], a["weights"], a["last_used"], index
            t.state = {k: a[k] for k in t.state}
            t.qrow = table_mod.aligned_array(K.queue_size(n), np.int32, 0)
            t.qstep = table_mod.aligned_array(K.queue_size(n), np.int32, 0)
            K.queue_from_order(np.ascontiguousarray(order, dtype=np.int32), t.last_used, t.qrow, t.qstep, t.qht)
            t.counters[:] = a["counters"]
            t.counters[0] = n
            t.step = int(ta.meta.get("step", 0))
            t.dropped_gradients = int(ta.meta.get("dropped_gradients", 0))
            _restore_sketch(t, a)
        return
    sd = lru_state_dict(ta)
    if n > t.capacity:
        log.warning(
            "%s: %d rows do not fit the capacity %d; the %d least recently used are dropped",
            label,
            n,
            t.capacity,
            n - t.capacity,
        )
        sd = {k: v[: t.capacity] for k, v in sd.items()}
    try:
        t.load_state_dict(sd)
    except ValueError as e:
        raise ShardFileError(f"{label}: {e}") from e
    t.step = max(int(ta.meta.get("step", 0)), int(sd["last_used"].max()) if len(sd["last_used"]) else 0)
    t.dropped_gradients = int(ta.meta.get("dropped_gradients", 0))
    _restore_sketch(t, a)


def load_shard_file(
    path: str, tables: dict[str, EmbeddingTable], expect_size: int | None = None, expect_crc32c: int | None = None
) -> dict:
    """Load a shard file into ``tables`` (every table in the file must be defined by the run config; tables the
    file lacks are left as they are). Returns the server bookkeeping stored with it.

    Raises ``FileNotFoundError``, or ``ShardFileError`` (a ``ValueError``) naming the file and the table that
    does not fit or the check that failed."""
    contents = read_shard_file(path, expect_size, expect_crc32c)
    check_shard_contents(contents, tables, path)
    restore_shard_contents(contents, tables, path)
    return contents.server


def check_shard_contents(contents: ShardContents, tables: dict[str, EmbeddingTable], path: str = "") -> None:
    """Check every table of ``contents`` against ``tables`` before any is replaced, so that a file that does not
    fit replaces nothing: tables the run config defines, rows of its dim, its optimizer's state, and, for a table
    not in the ``storage`` layout (it goes in through ``load_state_dict``), no feature ID twice. A ``storage``
    table keeps its fast path: its hash index is checked (``index_consistent``) or rebuilt, not its keys one by
    one. Raises ``ShardFileError`` naming the file, table and check."""
    unknown = sorted(set(contents.tables) - set(tables))
    if unknown:
        raise ShardFileError(f"{path}: holds tables {unknown} that the run config does not define")
    for name, ta in contents.tables.items():
        _check_table_arrays(tables[name], ta, f"{path}: table {name!r}", duplicates=ta.meta.get("layout") != "storage")


def restore_shard_contents(contents: ShardContents, tables: dict[str, EmbeddingTable], path: str = "") -> None:
    """Replace the tables of ``contents`` (checked by ``check_shard_contents``) with its rows."""
    for name, ta in contents.tables.items():
        restore_table(tables[name], ta, path, name)


def _check_table_arrays(t: EmbeddingTable, ta: TableArrays, label: str, duplicates: bool = False) -> None:
    a = ta.arrays
    n = len(a["keys"])
    if a["weights"].shape != (n, t.dim):
        raise ShardFileError(f"{label}: rows have dim {a['weights'].shape[1:]} but the run config says {t.dim}")
    expected = set(state_shapes(t.optimizer.name, t.dim))
    present = _state_names(a)
    if present != expected:
        raise ShardFileError(
            f"{label}: optimizer state {sorted(present)} (optimizer "
            f"{ta.meta.get('optimizer', '?')}) does not match {t.optimizer.name} {sorted(expected)}"
        )
    if duplicates and n > 1 and len(K.dedup(np.ascontiguousarray(a["keys"], dtype=np.uint64))[0]) != n:
        raise ShardFileError(f"{label}: a feature ID appears in more than one row")


# ---- in-process backend -------------------------------------------------------------------------------------
def make_tables(
    tables: list[TableConfig],
    shard_memory_bytes: int,
    seed: int = 0,
    capacities: dict[str, int] | None = None,
    storage: str = "fp32",
) -> dict[str, EmbeddingTable]:
    """One ``EmbeddingTable`` per table config for one shard, weights stored at ``storage`` precision. The
    shard's memory budget is split evenly between tables unless ``capacities`` (rows per table) is given."""
    out = {}
    for t in tables:
        if capacities and t.name in capacities:
            cap = int(capacities[t.name])
        else:
            cap = capacity_for_budget(shard_memory_bytes // len(tables), t.optimizer.name, t.dim, storage)
        out[t.name] = EmbeddingTable(
            t.dim,
            t.optimizer,
            cap,
            t.init_scale,
            seed,
            t.admit_probability,
            t.admit_after_sightings,
            t.expire_after_steps,
            storage,
        )
    return out


def positions_by_shard(ids: np.ndarray, num_shards: int) -> list[np.ndarray]:
    """Positions in ``ids: uint64[N]`` owned by each shard (``hashing.shard_of``), as ``num_shards`` int64
    arrays, each in increasing order (compiled counting sort, ``kernels.route``)."""
    order, bounds = K.route(np.ascontiguousarray(ids, dtype=np.uint64), num_shards)
    return [order[bounds[s] : bounds[s + 1]] for s in range(num_shards)]


def _done(value=None) -> Future:
    f: Future = Future()
    f.set_result(value)
    return f


class LocalEmbedding:
    """All shards' tables in this process; routing as in the distributed case (``hashing.shard_of``).

    Pushes are applied immediately (and the returned future is already done)."""

    def __init__(self, config: EmbeddingConfig, num_shards: int | None = None, seed: int = 0):
        self.config = config
        self.num_shards = num_shards or config.num_shards
        self.shards = [
            make_tables(config.tables, config.shard_memory_bytes, seed, storage=config.storage)
            for _ in range(self.num_shards)
        ]
        self.dims = {t.name: t.dim for t in config.tables}

    def load(self, paths: list[str]) -> None:
        """Load one shard file per shard (``paths[i]`` into shard i)."""
        if len(paths) != self.num_shards:
            raise ValueError(f"{len(paths)} shard files for {self.num_shards} shards")
        for p, tables in zip(paths, self.shards, strict=True):
            load_shard_file(p, tables)

    def _route(self, ids: np.ndarray) -> list[np.ndarray]:
        return positions_by_shard(ids, self.num_shards)

    def _gather(self, table: str, ids: np.ndarray, readonly: bool) -> np.ndarray:
        ids = np.ascontiguousarray(ids, dtype=np.uint64)
        out = np.empty((len(ids), self.dims[table]), dtype=np.float32)
        for s, pos in enumerate(self._route(ids)):
            if len(pos):
                t = self.shards[s][table]
                out[pos] = t.lookup_readonly(ids[pos]) if readonly else t.lookup(ids[pos])
        return out

    def lookup(self, table: str, ids: np.ndarray) -> np.ndarray:
        return self._gather(table, ids, readonly=False)

    def lookup_readonly(self, table: str, ids: np.ndarray) -> np.ndarray:
        return self._gather(table, ids, readonly=True)

    def contains(self, table: str, ids: np.ndarray) -> np.ndarray:
        out = np.zeros(len(ids), dtype=bool)
        for s, pos in enumerate(self._route(ids)):
            if len(pos):
                out[pos] = self.shards[s][table].contains(ids[pos])
        return out

    def push(
        self,
        table: str,
        ids: np.ndarray,
        grads: np.ndarray,
        step: int = 0,
        sync_workers: int = 0,
        step_fraction: float = 1.0,
    ) -> Future:
        for s, pos in enumerate(self._route(ids)):
            if len(pos):
                self.shards[s][table].apply_gradients(ids[pos], grads[pos], step_fraction)
        return _done()

    def flush(self) -> None:
        pass

    def stats(self) -> list[dict]:
        return [{name: t.stats() for name, t in tables.items()} for tables in self.shards]

    def state_dicts(self) -> list[dict]:
        """Per shard, per table: ``EmbeddingTable.state_dict()``."""
        return [{name: t.state_dict() for name, t in tables.items()} for tables in self.shards]

    def dump(self, paths: list[str]) -> list[tuple[int, int]]:
        """Write shard i to ``paths[i]``; returns ``(bytes, CRC-32C)`` of each shard file."""
        return [write_shard_file(p, tables) for p, tables in zip(paths, self.shards, strict=True)]

    def close(self) -> None:
        pass
