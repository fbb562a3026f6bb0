"""A table's resident memory follows the rows it holds: filling it to capacity, or refilling it after a restore,
never holds its arrays twice (make soak found parameter servers at twice the plan's per-shard estimate)."""

import os

import numpy as np

from persia_core import memory
from persia_core.config import OptimizerConfig
from persia_core.embedding import shard_tables as T
from persia_core.embedding.table import EmbeddingTable

PAGE = os.sysconf("SC_PAGE_SIZE")
CAP = 6_000_000  # arrays above glibc's 32 MiB mmap threshold, as at scale: freed memory goes back at once
OPT = OptimizerConfig(name="rowwise_adagrad", lr=0.05)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def _reset_peak() -> int:
    """Reset this process's peak RSS (``VmHWM``) to its current RSS (Linux >= 4.0); returns the RSS. The kernels
    are loaded first (their compiled code is this process's memory, not the table's)."""
    EmbeddingTable(16, OPT, 2048).lookup(np.arange(1, 2000, dtype=np.uint64))
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _rss()


def _peak() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def _fill(t: EmbeddingTable, start: int, stop: int) -> None:
    for lo in range(start, stop, 100_000):  # a server's batch: its lookup buffers are not what is measured
        t.lookup(np.arange(lo + 1, min(stop, lo + 100_000) + 1, dtype=np.uint64))


def test_filling_a_table_to_capacity_stays_within_its_estimate():
    estimate = CAP * memory.bytes_per_row("rowwise_adagrad", 16, CAP)
    base = _reset_peak()
    t = EmbeddingTable(16, OPT, CAP)
    _fill(t, 0, CAP)
    assert t.size == CAP
    peak = _peak() - base
    assert peak <= 1.1 * estimate, (peak, estimate)  # before: the old and the grown arrays both held


def test_a_restored_half_full_table_refilled_to_capacity_stays_within_its_estimate(tmp_path):
    estimate = CAP * memory.bytes_per_row("rowwise_adagrad", 16, CAP)
    path = str(tmp_path / "s.npz")
    t = EmbeddingTable(16, OPT, CAP)
    t.lookup(np.arange(1, CAP // 2 + 1, dtype=np.uint64))
    nbytes, crc = T.write_shard_file(path, {"default": t})
    want = t.lookup_readonly(np.arange(1, 1001, dtype=np.uint64)).copy()
    del t
    base = _reset_peak()
    u = EmbeddingTable(16, OPT, CAP)
    T.load_shard_file(path, {"default": u}, nbytes, crc)
    np.testing.assert_array_equal(u.lookup_readonly(np.arange(1, 1001, dtype=np.uint64)), want)
    _fill(u, CAP // 2, CAP)
    assert u.size == CAP
    peak = _peak() - base
    assert peak <= 1.1 * estimate, (peak, estimate)  # before: the file's arrays adopted, then grown
