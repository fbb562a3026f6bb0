"""Synthetic data in Criteo's Display Advertising Challenge layout, with a planted, learnable label.

``write_criteo_tsv`` writes tab-separated lines ``label, I1..I13, C1..C26`` (the ``criteo`` run config's
layout): ``I*`` are non-negative integer counts (I2 sometimes -1, as in the real data), ``C*`` 8-hex-digit
strings from per-column vocabularies of 3 to 50,000 values drawn with a power-law skew; both are sometimes
empty (missing). The label is Bernoulli(sigmoid(logit)) of a planted logistic model::

    logit = bias + w1[C1] + w2[C2] + w3[C3] + w4[C4] + 0.6 * log1p(I1) - 0.4 * log1p(max(I5, 0)) + 0.3 * [C6 missing]

with per-value weights ``w_k ~ N(0, s_k)`` (missing value: 0), so a model over these slots and dense features can
learn it (and one without them cannot). Optionally some lines are malformed at known positions.
"""

from __future__ import annotations

import gzip
import math

import numpy as np

from persia_core import io

NUM_DENSE = 13
NUM_CATEGORICAL = 26
COLUMNS = ["label", *[f"I{i}" for i in range(1, NUM_DENSE + 1)], *[f"C{i}" for i in range(1, NUM_CATEGORICAL + 1)]]
MALFORMED_KINDS = ("wrong field count", "unparsable number")

_VOCAB = [
    20,
    100,
    1000,
    50,
    5000,
    3,
    300,
    30,
    10,
    2000,
    700,
    50000,
    800,
    60,
    900,
    40000,
    10,
    400,
    1500,
    4,
    30000,
    15,
    10,
    3000,
    50,
    25000,
]
_CAT_MISSING = [
    0.0,
    0.0,
    0.05,
    0.05,
    0.0,
    0.1,
    0.0,
    0.0,
    0.0,
    0.0,
    0.0,
    0.05,
    0.0,
    0.0,
    0.0,
    0.05,
    0.0,
    0.0,
    0.45,
    0.45,
    0.05,
    0.0,
    0.75,
    0.0,
    0.45,
    0.45,
]
_DENSE_MEAN = [3.0, 100.0, 20.0, 7.0, 18000.0, 100.0, 16.0, 12.0, 100.0, 0.6, 2.5, 1.0, 8.0]
_DENSE_MISSING = [0.45, 0.0, 0.2, 0.2, 0.03, 0.22, 0.04, 0.0, 0.04, 0.45, 0.04, 0.76, 0.2]
_WEIGHT_SCALE = {0: 1.2, 1: 0.8, 2: 0.6, 3: 0.5}
_BIAS = -1.6


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def write_criteo_tsv(path: str, num_rows: int, seed: int = 0, malformed_rows: int = 0) -> dict:
    """Write ``num_rows`` valid Criteo-layout lines plus ``malformed_rows`` bad lines to ``path``.

    ``path``: local or gs://; gzip-compressed when it ends in ``.gz``. No header. The bad lines are spread
    over the file at positions drawn from ``seed`` and alternate between a missing last field (``"wrong field
    count"``, 39 != 40) and ``"abc"`` in I3 (``"unparsable number"``). Deterministic for a given seed.

    Returns ``{"rows": num_rows (valid lines), "lines": total lines, "malformed_lines": [1-based line numbers,
    ascending], "malformed_kinds": [kind per malformed line], "positives": number of label-1 valid rows}``.
    Raises ``ValueError`` for negative counts.
    """
    if num_rows < 0 or malformed_rows < 0:
        raise ValueError(f"num_rows and malformed_rows must be >= 0, got {num_rows}, {malformed_rows}")
    rng = np.random.default_rng(seed)
    n = num_rows

    dense = np.zeros((n, NUM_DENSE), np.int64)
    dense_missing = np.zeros((n, NUM_DENSE), bool)
    for j in range(NUM_DENSE):
        dense[:, j] = rng.geometric(1.0 / (1.0 + _DENSE_MEAN[j]), n) - 1
        dense_missing[:, j] = rng.random(n) < _DENSE_MISSING[j]
    dense[rng.random(n) < 0.05, 1] = -1

    vocab = [[f"{v:08x}" for v in rng.integers(0, 1 << 32, size, dtype=np.uint64)] for size in _VOCAB]
    cat = np.zeros((n, NUM_CATEGORICAL), np.int64)
    cat_missing = np.zeros((n, NUM_CATEGORICAL), bool)
    for k, size in enumerate(_VOCAB):
        cat[:, k] = np.minimum((size * rng.random(n) ** 2.5).astype(np.int64), size - 1)
        cat_missing[:, k] = rng.random(n) < _CAT_MISSING[k]

    logit = np.full(n, _BIAS)
    for k, scale in _WEIGHT_SCALE.items():
        weights = rng.normal(0.0, scale, _VOCAB[k])
        logit += np.where(cat_missing[:, k], 0.0, weights[cat[:, k]])
    logit += 0.6 * np.where(dense_missing[:, 0], 0.0, np.log1p(np.maximum(dense[:, 0], 0)))
    logit -= 0.4 * np.where(dense_missing[:, 4], 0.0, np.log1p(np.maximum(dense[:, 4], 0))) - 0.4 * math.log1p(
        _DENSE_MEAN[4]
    )
    logit += 0.3 * cat_missing[:, 5]
    labels = (rng.random(n) < _sigmoid(logit)).astype(np.int64)

    total = n + malformed_rows
    bad_lines = sorted(int(i) + 1 for i in rng.choice(total, malformed_rows, replace=False)) if malformed_rows else []
    bad_kind = {line: MALFORMED_KINDS[i % len(MALFORMED_KINDS)] for i, line in enumerate(bad_lines)}

    out: list[str] = []
    r = 0
    for line_no in range(1, total + 1):
        src = r if line_no not in bad_kind else (r if r < n else max(n - 1, 0))
        if n:
            fields = [str(labels[src])]
            fields += ["" if dense_missing[src, j] else str(dense[src, j]) for j in range(NUM_DENSE)]
            fields += ["" if cat_missing[src, k] else vocab[k][cat[src, k]] for k in range(NUM_CATEGORICAL)]
        else:
            fields = ["0"] + [""] * (NUM_DENSE + NUM_CATEGORICAL)
        kind = bad_kind.get(line_no)
        if kind == "wrong field count":
            fields = fields[:-1]
        elif kind == "unparsable number":
            fields[3] = "abc"
        else:
            r += 1
        out.append("\t".join(fields))
    data = ("\n".join(out) + ("\n" if out else "")).encode("utf-8")
    if path.endswith(".gz"):
        data = gzip.compress(data, mtime=0)
    io.write_bytes(path, data)
    return {
        "rows": n,
        "lines": total,
        "malformed_lines": bad_lines,
        "malformed_kinds": [bad_kind[line] for line in bad_lines],
        "positives": int(labels.sum()),
    }
