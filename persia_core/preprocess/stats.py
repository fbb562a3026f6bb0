"""Statistics of the preprocess pipeline as Beam ``CombineFn``s: the split plan, dense mean/std, distinct IDs
per slot (HyperLogLog) and the malformed-line summary.

Each is a pure combine over plain values (no I/O), so it can be tested by calling ``create_accumulator``,
``add_input``, ``merge_accumulators`` and ``extract_output`` directly.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable
from typing import Any

import apache_beam as beam
import numpy as np

from persia_core import hashing
from persia_core.preprocess.rows import SLOTS

_CHUNK_ROWS = 1 << 16


# --------------------------------------------------------------------------------------------- split plan


class _Int64Pairs:
    """Append-only pairs of int64 columns, kept as numpy chunks (16 bytes a pair) with a Python tail."""

    __slots__ = ("chunks", "a", "b")

    def __init__(self) -> None:
        self.chunks: list[tuple[np.ndarray, np.ndarray]] = []
        self.a: list[int] = []
        self.b: list[int] = []

    def add(self, x: int, y: int) -> None:
        self.a.append(x)
        self.b.append(y)
        if len(self.a) >= _CHUNK_ROWS:
            self.compact()

    def compact(self) -> None:
        if self.a:
            self.chunks.append((np.array(self.a, np.int64), np.array(self.b, np.int64)))
            self.a, self.b = [], []

    def merge(self, other: _Int64Pairs) -> None:
        other.compact()
        self.compact()
        self.chunks.extend(other.chunks)

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        self.compact()
        if not self.chunks:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        return np.concatenate([c[0] for c in self.chunks]), np.concatenate([c[1] for c in self.chunks])


def split_cutoff(ts: np.ndarray, eval_fraction: float) -> int:
    """``sorted(ts)[floor((1 - eval_fraction) * n)]``: rows with ts >= it are eval (0 when ``ts`` is empty)."""
    n = len(ts)
    if n == 0:
        return 0
    k = min(n - 1, int(math.floor((1.0 - eval_fraction) * n + 1e-9)))
    return int(np.partition(ts, k)[k])


def shard_bounds(keys: np.ndarray, num_shards: int) -> list[int]:
    """Shard boundaries: ``sorted(keys)[floor(j * m / S)]`` for j = 1..S-1; shard = ``bisect_right(bounds, key)``.

    With m >= S distinct keys every shard gets floor(m/S) or ceil(m/S) of them (none is empty).
    """
    m = len(keys)
    if m == 0:
        return []
    keys = np.sort(keys)
    return [int(keys[(j * m) // num_shards]) for j in range(1, num_shards)]


class SplitPlanFn(beam.CombineFn):
    """``(ts, key)`` of every row -> the split plan: ``{"cutoff", "rows", "train", "eval", "train_bounds",
    "eval_bounds"}`` (see ``split_cutoff`` and ``shard_bounds``). Exact; holds 16 bytes per row."""

    def __init__(self, eval_fraction: float, num_train_shards: int, num_eval_shards: int) -> None:
        self.eval_fraction = eval_fraction
        self.num_train_shards = num_train_shards
        self.num_eval_shards = num_eval_shards

    def create_accumulator(self) -> _Int64Pairs:
        return _Int64Pairs()

    def add_input(self, acc: _Int64Pairs, element: tuple[int, int]) -> _Int64Pairs:
        acc.add(element[0], element[1])
        return acc

    def merge_accumulators(self, accumulators: Iterable[_Int64Pairs]) -> _Int64Pairs:
        out = _Int64Pairs()
        for acc in accumulators:
            out.merge(acc)
        return out

    def compact(self, acc: _Int64Pairs) -> _Int64Pairs:
        acc.compact()
        return acc

    def extract_output(self, acc: _Int64Pairs) -> dict[str, Any]:
        ts, keys = acc.arrays()
        cutoff = split_cutoff(ts, self.eval_fraction)
        is_eval = ts >= cutoff
        train_keys, eval_keys = keys[~is_eval], keys[is_eval]
        return {
            "cutoff": cutoff,
            "rows": int(len(ts)),
            "train": int(len(train_keys)),
            "eval": int(len(eval_keys)),
            "train_bounds": shard_bounds(train_keys, self.num_train_shards),
            "eval_bounds": shard_bounds(eval_keys, self.num_eval_shards),
        }


# --------------------------------------------------------------------------------------------- malformed lines


class MalformedSummaryFn(beam.CombineFn):
    """Dead letters -> ``{"examples": n, "side_lines": n, "by_file": {path: n}, "by_reason": {kind: n},
    "reason_example": {kind: a full reason}}`` (``examples``: malformed rows that count against the budget)."""

    def create_accumulator(self) -> dict[str, Any]:
        return {"examples": 0, "side_lines": 0, "by_file": Counter(), "by_reason": Counter(), "reason_example": {}}

    def add_input(self, acc: dict[str, Any], dead: dict[str, Any]) -> dict[str, Any]:
        acc["examples" if dead["example"] else "side_lines"] += 1
        acc["by_file"][dead["file"]] += 1
        acc["by_reason"][dead["kind"]] += 1
        acc["reason_example"].setdefault(dead["kind"], dead["reason"])
        return acc

    def merge_accumulators(self, accumulators: Iterable[dict[str, Any]]) -> dict[str, Any]:
        out = self.create_accumulator()
        for acc in accumulators:
            out["examples"] += acc["examples"]
            out["side_lines"] += acc["side_lines"]
            out["by_file"].update(acc["by_file"])
            out["by_reason"].update(acc["by_reason"])
            for k, v in acc["reason_example"].items():
                out["reason_example"].setdefault(k, v)
        return out

    def extract_output(self, acc: dict[str, Any]) -> dict[str, Any]:
        return {
            "examples": acc["examples"],
            "side_lines": acc["side_lines"],
            "by_file": dict(acc["by_file"]),
            "by_reason": dict(acc["by_reason"]),
            "reason_example": dict(acc["reason_example"]),
        }


# --------------------------------------------------------------------------------------------- dense and IDs


class DenseStatsFn(beam.CombineFn):
    """Dense vectors (float32[F] as bytes) -> ``{"count": n, "mean": [F], "std": [F]}`` in float64.

    Population std, merged with Chan et al.'s parallel variance update (batches of 4096 rows); a feature whose
    std is 0 (or < 1e-12 * max(1, |mean|), float noise of a constant) gets std 1.0; no rows: mean 0, std 1.
    """

    def __init__(self, num_dense: int) -> None:
        self.num_dense = num_dense

    def create_accumulator(self) -> list:
        f = self.num_dense
        return [0, np.zeros(f), np.zeros(f), []]

    @staticmethod
    def _merge(acc: list, n: int, mean: np.ndarray, m2: np.ndarray) -> None:
        total = acc[0] + n
        if n == 0:
            return
        delta = mean - acc[1]
        acc[1] = acc[1] + delta * (n / total)
        acc[2] = acc[2] + m2 + delta * delta * (acc[0] * n / total)
        acc[0] = total

    def _flush(self, acc: list) -> None:
        if not acc[3]:
            return
        if self.num_dense == 0:
            n = len(acc[3])
            acc[3] = []
            self._merge(acc, n, acc[1], acc[2] * 0)
            return
        x = np.frombuffer(b"".join(acc[3]), np.float32).reshape(-1, self.num_dense).astype(np.float64)
        acc[3] = []
        mean = x.mean(axis=0)
        self._merge(acc, len(x), mean, ((x - mean) ** 2).sum(axis=0))

    def add_input(self, acc: list, dense: bytes) -> list:
        acc[3].append(dense)
        if len(acc[3]) >= 4096:
            self._flush(acc)
        return acc

    def merge_accumulators(self, accumulators: Iterable[list]) -> list:
        out = self.create_accumulator()
        for acc in accumulators:
            self._flush(acc)
            self._merge(out, acc[0], acc[1], acc[2])
        return out

    def compact(self, acc: list) -> list:
        self._flush(acc)
        return acc

    def extract_output(self, acc: list) -> dict[str, Any]:
        self._flush(acc)
        n = acc[0]
        if n == 0:
            return {"count": 0, "mean": [0.0] * self.num_dense, "std": [1.0] * self.num_dense}
        mean = acc[1]
        std = np.sqrt(np.maximum(acc[2] / n, 0.0))
        std = np.where(std < 1e-12 * np.maximum(1.0, np.abs(mean)), 1.0, std)
        return {"count": int(n), "mean": [float(v) for v in mean], "std": [float(v) for v in std]}


def _bit_length(x: np.ndarray) -> np.ndarray:
    """Bit length of each ``uint64`` (0 for 0), exact, vectorized."""
    x = x.copy()
    n = np.zeros(len(x), np.int64)
    for s in (32, 16, 8, 4, 2, 1):
        hi = x >= np.uint64(1 << s)
        n[hi] += s
        x[hi] >>= np.uint64(s)
    return n + (x > 0)


class DistinctIdsFn(beam.CombineFn):
    """Encoded rows -> ``{slot: estimated number of distinct feature IDs}`` (HyperLogLog, Flajolet et al. 2007).

    2^p registers per slot (p = 14: 16 KiB a slot, ~0.8% standard error; linear counting below 2.5 * 2^p, so
    small counts are nearly exact). IDs are re-mixed with ``hashing.splitmix64`` before bucketing.
    """

    def __init__(self, slot_names: list[str], precision: int = 14) -> None:
        self.slot_names = list(slot_names)
        self.p = precision

    def create_accumulator(self) -> list:
        s = len(self.slot_names)
        return [np.zeros((s, 1 << self.p), np.uint8), [[] for _ in range(s)], 0]

    def _flush(self, acc: list) -> None:
        if not acc[2]:
            return
        p = self.p
        for i, blobs in enumerate(acc[1]):
            if not blobs:
                continue
            z = hashing.splitmix64(np.frombuffer(b"".join(blobs), np.uint64))
            idx = (z >> np.uint64(64 - p)).astype(np.intp)
            rank = np.minimum(64 - _bit_length(z << np.uint64(p)) + 1, 64 - p + 1).astype(np.uint8)
            np.maximum.at(acc[0][i], idx, rank)
        acc[1] = [[] for _ in self.slot_names]
        acc[2] = 0

    def add_input(self, acc: list, row: tuple) -> list:
        for pending, blob in zip(acc[1], row[SLOTS], strict=True):
            if blob:
                pending.append(blob)
        acc[2] += 1
        if acc[2] >= 8192:
            self._flush(acc)
        return acc

    def merge_accumulators(self, accumulators: Iterable[list]) -> list:
        out = self.create_accumulator()
        for acc in accumulators:
            self._flush(acc)
            np.maximum(out[0], acc[0], out=out[0])
        return out

    def compact(self, acc: list) -> list:
        self._flush(acc)
        return acc

    def extract_output(self, acc: list) -> dict[str, int]:
        self._flush(acc)
        m = 1 << self.p
        alpha = 0.7213 / (1.0 + 1.079 / m)
        out = {}
        for name, reg in zip(self.slot_names, acc[0], strict=True):
            estimate = alpha * m * m / float(np.sum(np.ldexp(1.0, -reg.astype(np.int64))))
            zeros = int(np.count_nonzero(reg == 0))
            if estimate <= 2.5 * m and zeros:
                estimate = m * math.log(m / zeros)
            out[name] = int(round(estimate))
        return out
