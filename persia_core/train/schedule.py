"""Which rows every NN worker trains on at every step: a function of the row counts, seed, epoch and rank only, so
every process of a job (NN workers, their embedding workers, a resumed run) computes the same batches."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class Schedule:
    """Which rows every worker trains on at every step.

    ``rows[r][t]``: ``int64[b]`` row indices of worker r's batch at step t (b <= batch size; 0 when r is out of
    data); ``global_batch[t]``: rows over all workers at step t."""

    rows: list[list[np.ndarray]]
    global_batch: list[int] = field(default_factory=list)


def make_schedule(rows_per_worker: list[int], batch_size: int, epochs: int, seed: int, shuffle: bool) -> Schedule:
    """Every worker's batches for all epochs: each epoch permutes a worker's own rows (seeded by seed, epoch,
    rank) and cuts them into batches; all workers run ``max_r ceil(n_r / batch)`` steps per epoch."""
    steps = max((n + batch_size - 1) // batch_size for n in rows_per_worker) if rows_per_worker else 0
    out: list[list[np.ndarray]] = [[] for _ in rows_per_worker]
    gbs = []
    for epoch in range(epochs):
        perms = []
        for r, n in enumerate(rows_per_worker):
            perms.append(
                np.random.default_rng([seed, epoch, r]).permutation(n) if shuffle else np.arange(n, dtype=np.int64)
            )
        for t in range(steps):
            total = 0
            for r, p in enumerate(perms):
                rows = p[t * batch_size : (t + 1) * batch_size]
                out[r].append(rows)
                total += len(rows)
            gbs.append(total)
    return Schedule(out, gbs)
