"""The batch type: per-slot jagged feature IDs, dense floats and labels.

``IdBatch`` holds the ID features of B examples over S slots, slot-major, like TorchRec's ``KeyedJaggedTensor``.
Bag ``s * B + b`` holds the IDs of example ``b`` in slot ``s``::

                  example 0     example 1      example 2
    slot "user"   [u0]          [u1]           [u2]
    slot "genres" [g0, g1]      []             [g2]
    slot "tags"   []            [t0, t1, t2]   []

    values  = [u0, u1, u2, g0, g1, g2, t0, t1, t2]        uint64[N]
    offsets = [0, 1, 2, 3, 5, 5, 6, 6, 9, 9]              int64[S*B + 1]

An empty bag (``genres`` of example 1) pools to an exact zero vector with zero gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class IdBatch:
    """Jagged ID features of one batch.

    keys: the S slot names. values: ``uint64[N]``. offsets: ``int64[S*B + 1]``, ``offsets[0] == 0``,
    non-decreasing, ``offsets[-1] == N``. batch_size: B.
    """

    keys: list[str]
    values: np.ndarray
    offsets: np.ndarray
    batch_size: int

    def __post_init__(self) -> None:
        if self.values.dtype != np.uint64:
            raise ValueError(f"IdBatch.values must be uint64, got {self.values.dtype}")
        if len(self.offsets) != len(self.keys) * self.batch_size + 1:
            raise ValueError(
                f"IdBatch.offsets has {len(self.offsets)} entries, expected S*B+1 = "
                f"{len(self.keys) * self.batch_size + 1}"
            )
        if len(self.offsets) and (self.offsets[0] != 0 or self.offsets[-1] != len(self.values)):
            raise ValueError("IdBatch.offsets must start at 0 and end at len(values)")

    @property
    def lengths(self) -> np.ndarray:
        """``int64[S*B]``: number of IDs in each bag."""
        return np.diff(self.offsets)

    def slot(self, key: str) -> tuple[np.ndarray, np.ndarray]:
        """IDs of one slot: (``uint64[n]`` values, ``int64[B+1]`` offsets starting at 0)."""
        s = self.keys.index(key)
        b = self.batch_size
        off = self.offsets[s * b : (s + 1) * b + 1]
        return self.values[off[0] : off[-1]], off - off[0]

    def select_slots(self, keys: list[str]) -> IdBatch:
        """The sub-batch of the named slots, in that order."""
        vals, offs = [], [np.zeros(1, dtype=np.int64)]
        total = 0
        for k in keys:
            v, o = self.slot(k)
            vals.append(v)
            offs.append(o[1:] + total)
            total += len(v)
        return IdBatch(
            list(keys),
            np.concatenate(vals) if vals else np.zeros(0, np.uint64),
            np.concatenate(offs),
            self.batch_size,
        )


@dataclass
class Batch:
    """One training or evaluation batch.

    ids: the ID features (S slots, B examples). dense: ``float32[B, F]``. labels: ``float32[B]`` in {0, 1}.
    """

    ids: IdBatch
    dense: np.ndarray
    labels: np.ndarray

    @property
    def size(self) -> int:
        return self.ids.batch_size


def jagged_take(values: np.ndarray, offsets: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Gather the bags ``rows`` of one jagged column, vectorized (no Python loop per row).

    values: ``T[N]``; offsets: ``int64[R+1]``; rows: ``int64[B]`` -> (``T[n]``, ``int64[B+1]``).
    """
    starts = offsets[rows]
    lengths = offsets[rows + 1] - starts
    new_off = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum(lengths, out=new_off[1:])
    total = int(new_off[-1])
    if total == 0:
        return values[:0], new_off
    # index of each output element = start of its bag + position within the bag
    idx = np.repeat(starts - new_off[:-1], lengths) + np.arange(total, dtype=np.int64)
    return values[idx], new_off
