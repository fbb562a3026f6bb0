"""The LR reference: hashed logistic regression trained on a model's own train split and slots, the fair opponent a
deep CTR model must beat (McMahan et al., KDD 2013, "Ad click prediction: a view from the trenches", for hashed LR
as the field's workhorse; issue "Model quality").

Features: one column per hashed feature ID, ``ID mod 2^20`` (the feature ID already hashes slot and value,
``persia_core.hashing``, so this is the hashing trick of scikit-learn's ``FeatureHasher`` on ``slot:value`` with
XXH3 for MurmurHash3 and no sign flip; crosses are slots of their own as the config declares them), valued by the
ID's count in the row, then the dense features standardized by the train split's mean and std. scikit-learn's
``LogisticRegression`` (L2, lbfgs) for each C of ``C_GRID``, fitted on the train split less its validation slice
(the last ``VALIDATION_FRACTION`` of its rows by timestamp), C chosen by the slice's logloss, then fitted again
with that C on the whole train split, lbfgs starting from that C's fit (the objective is strictly convex: the
start changes the iterations, not the optimum, which the two reach to lbfgs's tolerance). Beyond ``MAX_ROWS``
training rows, a uniform sample of them (seeded). The grid's fits run in parallel processes (scikit-learn's
joblib, one per CPU this process may use) where the train split has ``PARALLEL_MIN_NNZ`` nonzeros or more; each
fit is the one it would be alone.
"""

from __future__ import annotations

import numpy as np

from persia_core.host import usable_cpus

HASH_BITS = 20
C_GRID = (0.01, 0.1, 1.0, 10.0)
MAX_ROWS = 1_000_000
VALIDATION_FRACTION = 0.1
MAX_ITER = 300
PARALLEL_MIN_NNZ = 1_000_000


def design_matrix(examples, rows: np.ndarray, dense_mean, dense_std, bits: int = HASH_BITS):
    """``float64[len(rows), 2^bits + F]`` (scipy CSR) of ``examples`` (``ParquetExamples``) at ``rows: int64[n]``:
    per row, the count of each hashed feature ID over all slots, then the F dense features standardized
    (``(x - mean) / std``, std 0 read as 1)."""
    from scipy import sparse

    rows = np.asarray(rows, dtype=np.int64)
    batch = examples.batch(rows)
    ids = batch.ids
    n, width = len(rows), 1 << bits
    row_of = np.repeat(np.tile(np.arange(n, dtype=np.int64), len(ids.keys)), np.diff(ids.offsets))
    cols = (ids.values & np.uint64(width - 1)).astype(np.int64)
    onehot = sparse.csr_matrix((np.ones(len(cols)), (row_of, cols)), shape=(n, width))  # duplicates summed
    std = np.asarray(dense_std, dtype=np.float64)
    dense = (batch.dense.astype(np.float64) - np.asarray(dense_mean, dtype=np.float64)) / np.where(std > 0, std, 1.0)
    return sparse.hstack([onehot, sparse.csr_matrix(dense)], format="csr")


def _fit(x, y, c: float, start=None):
    """``LogisticRegression`` (L2, lbfgs) with ``C = c`` fitted on ``x, y``; ``start``: a fitted model over the same
    columns whose weights lbfgs starts from (None: from zero)."""
    from sklearn.linear_model import LogisticRegression

    model = LogisticRegression(C=c, max_iter=MAX_ITER, warm_start=start is not None)
    if start is not None:
        model.coef_, model.intercept_ = start.coef_.copy(), start.intercept_.copy()
    return model.fit(x, y)


def _fit_grid(x, y) -> list:
    """One fit per C of ``C_GRID`` (in its order), in parallel processes for a large ``x``."""
    jobs = min(len(C_GRID), usable_cpus()) if x.nnz >= PARALLEL_MIN_NNZ else 1
    if jobs == 1:
        return [_fit(x, y, c) for c in C_GRID]
    from sklearn.utils.parallel import Parallel, delayed

    return Parallel(n_jobs=jobs)(delayed(_fit)(x, y, c) for c in C_GRID)


def lr_reference(train, eval_, dense_mean, dense_std, seed: int = 0, max_rows: int = MAX_ROWS) -> dict | None:
    """Fit the LR reference on ``train`` and score ``eval_`` (both ``ParquetExamples`` of the model's slots).

    Returns ``{"auc", "logloss", "C", "validation_logloss": {C: logloss}, "train_rows", "sampled"}`` (``auc``
    None for one class in ``eval_``), or None where it cannot be fitted: a train split or validation slice of
    one class, or no eval rows."""
    from sklearn.metrics import log_loss, roc_auc_score

    total = len(train)
    if total < 2 or len(eval_) == 0:
        return None
    rows = np.arange(total, dtype=np.int64)
    sampled = total > max_rows
    if sampled:
        rows = np.sort(np.random.default_rng(seed).choice(total, max_rows, replace=False))
    by_time = rows[np.argsort(np.asarray(train.ts)[rows], kind="stable")]
    cut = len(by_time) - max(1, int(round(VALIDATION_FRACTION * len(by_time))))
    fit_rows, val_rows = by_time[:cut], by_time[cut:]
    y_fit, y_val = train.labels[fit_rows], train.labels[val_rows]
    if len(np.unique(y_fit)) < 2 or len(np.unique(y_val)) < 2:
        return None
    # only the columns the training rows use: under L2 a column that is zero in every training row keeps weight 0,
    # so the fits and predictions are those over all 2^20 columns, without optimizing a million zeros
    x_all = design_matrix(train, rows, dense_mean, dense_std)
    used = np.unique(x_all.indices)
    x_all = x_all[:, used]
    at = np.empty(total, dtype=np.int64)
    at[rows] = np.arange(len(rows))
    x_fit, x_val = x_all[at[fit_rows]], x_all[at[val_rows]]
    fits = dict(zip(C_GRID, _fit_grid(x_fit, y_fit), strict=True))
    val_ll = {c: float(log_loss(y_val, m.predict_proba(x_val)[:, 1], labels=[0, 1])) for c, m in fits.items()}
    best = min(C_GRID, key=lambda c: (val_ll[c], c))
    model = _fit(x_all, train.labels[rows], best, start=fits[best])
    y = eval_.labels
    p = model.predict_proba(design_matrix(eval_, np.arange(len(eval_)), dense_mean, dense_std)[:, used])[:, 1]
    auc = float(roc_auc_score(y, p)) if len(np.unique(y)) == 2 else None
    return {
        "auc": auc,
        "logloss": float(log_loss(y, p, labels=[0, 1])),
        "C": best,
        "validation_logloss": {str(c): v for c, v in val_ll.items()},
        "train_rows": int(len(rows)),
        "sampled": bool(sampled),
    }
