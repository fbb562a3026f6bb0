"""Which rows every NN worker trains on at every step: a function of the row counts, seed, epoch and rank only, so
every process of a job (NN workers, their embedding workers, a resumed run) computes the same batches."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class Schedule:
    """Which rows every worker trains on at every step.

    ``rows[r][t]``: ``int64[b]`` row indices of worker r's batch at step t (b <= batch size; 0 when r is out of
    data); ``global_batch[t]``: rows over all workers at step t; ``steps_per_epoch``: the steps of each epoch."""

    rows: list[list[np.ndarray]]
    global_batch: list[int] = field(default_factory=list)
    steps_per_epoch: int = 0


def make_schedule(
    rows_per_worker: list[int], batch_size: int, epochs: int, seed: int, shuffle: bool, rank: int | None = None
) -> Schedule:
    """Every worker's batches for all epochs: each epoch permutes a worker's own rows (seeded by seed, epoch,
    rank) and cuts them into batches; all workers run ``max_r ceil(n_r / batch)`` steps per epoch.

    ``rank``: compute the rows of that worker only (the others' ``rows`` stay empty; ``global_batch`` is the
    same), so a process of a job of M workers permutes its own rows, not all M workers'."""
    steps = max((n + batch_size - 1) // batch_size for n in rows_per_worker) if rows_per_worker else 0
    out: list[list[np.ndarray]] = [[] for _ in rows_per_worker]
    # rows of step t over all workers: each worker's min(batch, rows left), the same every epoch
    starts = np.arange(steps, dtype=np.int64) * batch_size
    counts = np.asarray(rows_per_worker, dtype=np.int64).reshape(-1, 1)
    per_epoch = np.clip(counts - starts, 0, batch_size).sum(axis=0) if steps else np.zeros(0, np.int64)
    gbs = [int(x) for x in per_epoch] * epochs
    mine = range(len(rows_per_worker)) if rank is None else [rank]
    for epoch in range(epochs):
        for r in mine:
            n = rows_per_worker[r]
            p = np.random.default_rng([seed, epoch, r]).permutation(n) if shuffle else np.arange(n, dtype=np.int64)
            out[r].extend(p[t * batch_size : (t + 1) * batch_size] for t in range(steps))
    return Schedule(out, gbs, steps)
