"""``make bench-ckpt``: checkpoint dump and load of one parameter-server shard against plain sequential I/O.

A table of ``--rows`` rows (default 10M) of dim ``--dim`` (16) with row-wise Adagrad is filled with random IDs and
touched again in random order (so its recency list is scattered, as after training). Then, ``--reps`` times,
interleaved so that both see the same disk and page-cache weather:

    dump      ``write_shard_file``: rows, optimizer state and recency list, CRC-32C computed on the way, fsync
    seq write the same bytes written plainly to another file with one ``write`` and fsync
    load      ``load_shard_file`` into a fresh table: read, CRC-32C verified against the dump's, the stored hash
              index checked (entries in range, one per row, sampled keys found at their rows) and installed with
              the arrays in the table, ready to serve lookups
    load with index rebuilt   the same, but the hash index rebuilt from the keys (as for a re-sharded state or
              a file without a stored index)
    seq read  the plain file read into a fresh buffer

Each round runs the two writes, then the three reads, each group in an order rotated every round (so no
measurement always follows the same neighbour), with ``sync`` and a short pause between the groups. Before every
read the file is dropped from the page cache (``posix_fadvise(POSIX_FADV_DONTNEED)``). The medians
are printed as a table and, as the last line, one JSON object with at least ``dump_mb_per_s``,
``load_mb_per_s``, ``seq_write_mb_per_s`` and ``seq_read_mb_per_s`` (MB = 10^6 bytes): each the best of
``--reps`` rounds (as ``timeit`` reports; a shared virtual disk's throughput swings widely from one second to
the next), with the medians beside them (``*_median_mb_per_s``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np

from persia_core.config import OptimizerConfig
from persia_core.embedding.shard_file import read_shard_file
from persia_core.embedding.shard_tables import load_shard_file, restore_table, write_shard_file
from persia_core.embedding.table import EmbeddingTable


def _drop_cache(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _seq_write(path: str, data: np.ndarray) -> float:
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        f.write(data.data)
        f.flush()
        os.fsync(f.fileno())
    return time.perf_counter() - t0


def _seq_read(path: str, nbytes: int) -> float:
    _drop_cache(path)
    t0 = time.perf_counter()
    buf = np.empty(nbytes, dtype=np.uint8)
    mv = buf.data
    got = 0
    with open(path, "rb", buffering=0) as f:
        while got < nbytes:
            n = f.readinto(mv[got:])
            if not n:
                raise RuntimeError(f"{path}: ended at {got} of {nbytes} bytes")
            got += n
    return time.perf_counter() - t0


def build_table(rows: int, dim: int, seed: int = 0) -> EmbeddingTable:
    """A full table of ``rows`` random IDs, every row touched twice, the second time in random order."""
    t = EmbeddingTable(dim, OptimizerConfig(name="rowwise_adagrad"), rows, init_scale=0.01, seed=seed)
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 2**64 - 1, rows, dtype=np.uint64, endpoint=True)
    step = 1 << 20
    for i in range(0, rows, step):
        t.lookup(ids[i : i + step])
    ids = ids[rng.permutation(rows)]
    for i in range(0, rows, step):
        part = np.sort(ids[i : i + step])  # (np.unique without return_inverse is slow for uint64 in numpy 2.4)
        part = part[np.concatenate(([True], part[1:] != part[:-1]))]
        t.apply_gradients(part, rng.normal(size=(len(part), dim)).astype(np.float32))
        t.lookup(part)
    return t


def _rounds(
    table: EmbeddingTable, dim: int, rows: int, reps: int, warmup: int, workdir: str
) -> tuple[dict[str, list[float]], int]:
    """The timed rounds of ``run`` (see the module docstring): seconds of each measurement per round, warm-up
    rounds included, and the bytes of the dump. The files are removed, and the plain copy's buffer freed, on
    return."""
    dump_path, plain_path = os.path.join(workdir, "shard.npz"), os.path.join(workdir, "plain.bin")
    times: dict[str, list[float]] = {"dump": [], "load": [], "load_rebuild_index": [], "seq_write": [], "seq_read": []}
    nbytes = crc = 0
    probe = np.random.default_rng(1).choice(table.state_dict()["keys"], 1000) if rows else np.zeros(0, np.uint64)
    expected = table.lookup_readonly(probe)
    nbytes, crc = write_shard_file(dump_path, {"default": table})
    with open(dump_path, "rb") as f:
        same = np.frombuffer(f.read(), dtype=np.uint8)  # the same bytes, for the plain write

    def dump() -> float:
        nonlocal nbytes, crc
        t0 = time.perf_counter()
        nbytes, crc = write_shard_file(dump_path, {"default": table})
        return time.perf_counter() - t0

    def load(rebuild_index: bool) -> float:
        _drop_cache(dump_path)
        fresh = EmbeddingTable(dim, OptimizerConfig(name="rowwise_adagrad"), rows, init_scale=0.01)
        t0 = time.perf_counter()
        if rebuild_index:
            ta = read_shard_file(dump_path, nbytes, crc).tables["default"]
            ta.arrays.pop("index")
            ta.index = None
            restore_table(fresh, ta, dump_path, "default")
        else:
            load_shard_file(dump_path, {"default": fresh}, expect_size=nbytes, expect_crc32c=crc)
        dt = time.perf_counter() - t0
        if fresh.size != table.size or not np.array_equal(fresh.lookup_readonly(probe), expected):
            raise RuntimeError("the loaded table differs from the dumped one")
        return dt

    writes = {"dump": dump, "seq_write": lambda: _seq_write(plain_path, same)}
    reads = {
        "load": lambda: load(False),
        "load_rebuild_index": lambda: load(True),
        "seq_read": lambda: _seq_read(plain_path, nbytes),
    }
    for i in range(warmup + reps):
        # rotate the order every round, and let the disk settle after the writes, so that no measurement
        # always follows the same neighbour (a read right after a 1 GB write is slower on a shared disk)
        for group in (writes, reads):
            names = list(group)
            for name in names[i % len(names) :] + names[: i % len(names)]:
                times[name].append(group[name]())
            os.sync()
            time.sleep(0.5)
    for p in (dump_path, plain_path):
        os.remove(p)
    return times, nbytes


def run(rows: int, dim: int, reps: int, workdir: str, warmup: int = 1) -> dict:
    """Measure (see module docstring); returns the figures (medians over ``reps``, after ``warmup`` rounds that
    are not counted: the first touches of fresh memory and of the disk are slow on virtual machines)."""
    t_build = time.perf_counter()
    table = build_table(rows, dim)
    build_s = time.perf_counter() - t_build
    times, nbytes = _rounds(table, dim, rows, reps, warmup, workdir)
    times = {k: v[warmup:] for k, v in times.items()}
    best = {k: min(v) for k, v in times.items()}
    med = {k: statistics.median(v) for k, v in times.items()}
    mb = nbytes / 1e6
    out = {
        "rows": rows,
        "dim": dim,
        "optimizer": "rowwise_adagrad",
        "bytes": nbytes,
        "reps": reps,
        "warmup": warmup,
        "build_s": round(build_s, 3),
    }
    for k in times:
        out[f"{k}_s"] = round(best[k], 4)
        out[f"{k}_mb_per_s"] = round(mb / best[k], 1)
        out[f"{k}_median_mb_per_s"] = round(mb / med[k], 1)
    out["dump_vs_seq_write"] = round(best["seq_write"] / best["dump"], 3)
    out["load_vs_seq_read"] = round(best["seq_read"] / best["load"], 3)
    out["dump_vs_seq_write_median"] = round(med["seq_write"] / med["dump"], 3)
    out["load_vs_seq_read_median"] = round(med["seq_read"] / med["load"], 3)
    out["all_s"] = {k: [round(x, 4) for x in v] for k, v in times.items()}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="persia_core.bench.ckpt", description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=10_000_000, help="rows in the table (default 10M)")
    p.add_argument("--dim", type=int, default=16, help="embedding dim (default 16)")
    p.add_argument("--reps", type=int, default=5, help="counted rounds (default 5)")
    p.add_argument("--warmup", type=int, default=1, help="uncounted rounds before them (default 1)")
    p.add_argument("--dir", default="", help="folder for the files (default: a temporary folder)")
    args = p.parse_args(argv)
    if args.rows < 1 or args.dim < 1 or args.reps < 1 or args.warmup < 0:
        raise ValueError("--rows, --dim and --reps must be >= 1, --warmup >= 0")
    workdir = args.dir or tempfile.mkdtemp(prefix="persia-bench-ckpt-")
    os.makedirs(workdir, exist_ok=True)
    r = run(args.rows, args.dim, args.reps, workdir, args.warmup)
    print(
        f"checkpoint of one shard: {r['rows']:,} rows, dim {r['dim']}, {r['optimizer']}, {r['bytes'] / 1e6:.1f} MB "
        f"(best and median of {r['reps']} rounds; MB = 1e6 bytes)"
    )
    print(f"  {'':18s} {'seconds':>9s} {'MB/s':>9s} {'median MB/s':>12s}")
    for k in ("dump", "seq_write", "load", "load_rebuild_index", "seq_read"):
        print(f"  {k:18s} {r[k + '_s']:9.3f} {r[k + '_mb_per_s']:9.1f} {r[k + '_median_mb_per_s']:12.1f}")
    print(
        f"  dump / sequential write: {r['dump_vs_seq_write']:.0%} (median {r['dump_vs_seq_write_median']:.0%})   "
        f"load / sequential read: {r['load_vs_seq_read']:.0%} (median {r['load_vs_seq_read_median']:.0%})"
    )
    print(json.dumps(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
