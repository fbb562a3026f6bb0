"""Offline metrics for a click-through-rate (binary) model.

All functions take ``labels``: {0,1}[N] (any int, float or bool dtype) and ``preds``: float[N] probabilities of
the positive class; a column ``[N, 1]`` (a model's output head) is accepted and flattened. Inputs are checked by
one validator, which raises ``ValueError`` naming the argument and how many entries offend when:

* ``labels`` and ``preds`` differ in length, or are empty, or are not 1-D;
* a label is not 0 or 1 (NaN included);
* a prediction is NaN or outside ``[0, 1]``.

Every metric that is undefined on the data (AUC with one class, NE when the base rate is 0 or 1, calibration
with no positives) is ``None``, never a placeholder number such as 0 or 0.5.

Sources: ROC / AUC from scikit-learn (``sklearn.metrics.roc_curve``, ``roc_auc_score``); normalized entropy
from He et al., "Practical Lessons from Predicting Clicks on Ads at Facebook", ADKDD 2014, Sec. 2; group AUC
from Zhou et al., "Deep Interest Network for Click-Through Rate Prediction", KDD 2018, Sec. 6; the expected
calibration error in :func:`reliability` from Guo et al., "On Calibration of Modern Neural Networks", ICML 2017.
"""

from __future__ import annotations

import math

import numpy as np
from sklearn.metrics import log_loss, roc_auc_score, roc_curve

#: Predictions are clipped to ``[PRED_CLIP, 1 - PRED_CLIP]`` before the log loss, so that a confident miss
#: costs at most ``-log(1e-7) ~= 16.1`` nats instead of infinity.
PRED_CLIP = 1e-7


def _as_1d(name: str, x) -> np.ndarray:
    a = np.asarray(x)
    if a.ndim == 2 and a.shape[1] == 1:
        a = a.reshape(-1)
    if a.ndim != 1:
        raise ValueError(f"{name} must be 1-D (or a column [N, 1]); got shape {a.shape}")
    return a


def validate(labels, preds) -> tuple[np.ndarray, np.ndarray]:
    """Check a (labels, preds) pair and return them as ``float64[N]`` arrays.

    ``labels``: {0,1}[N] of any numeric or bool dtype; ``preds``: float[N] in ``[0, 1]``; both may also be
    ``[N, 1]``. The conversion to float64 is exact for float32/float16 predictions and for 0/1 labels.

    Raises ``ValueError`` when the lengths differ, when N = 0, when an array is not 1-D, when a label is not in
    {0, 1} (message: how many and the first offending value), or when a prediction is NaN or outside [0, 1]
    (message: how many).
    """
    y = _as_1d("labels", labels)
    p = _as_1d("preds", preds)
    if y.shape[0] != p.shape[0]:
        raise ValueError(f"labels and preds differ in length: {y.shape[0]} labels, {p.shape[0]} preds")
    if y.shape[0] == 0:
        raise ValueError("labels and preds are empty: metrics need at least one example")
    if not (np.issubdtype(y.dtype, np.number) or y.dtype == np.bool_):
        raise ValueError(f"labels must be numeric 0/1, got dtype {y.dtype}")
    if not (np.issubdtype(p.dtype, np.number) or p.dtype == np.bool_):
        raise ValueError(f"preds must be numeric probabilities, got dtype {p.dtype}")
    y = y.astype(np.float64)
    p = p.astype(np.float64)
    bad_y = ~((y == 0.0) | (y == 1.0))
    n_bad_y = int(bad_y.sum())
    if n_bad_y:
        first = y[np.argmax(bad_y)]
        raise ValueError(f"labels must be 0 or 1: {n_bad_y} of {y.shape[0]} are not (first: {first!r})")
    n_nan = int(np.isnan(p).sum())
    if n_nan:
        raise ValueError(f"preds contain {n_nan} NaN value(s) out of {p.shape[0]}")
    n_out = int(((p < 0.0) | (p > 1.0)).sum())
    if n_out:
        raise ValueError(f"preds must be probabilities in [0, 1]: {n_out} of {p.shape[0]} are outside")
    return y, p


def _entropy(p: float) -> float:
    """Binary entropy in nats, ``H(p) = -(p log p + (1-p) log(1-p))``; 0 at p in {0, 1}."""
    if p <= 0.0 or p >= 1.0:
        return 0.0
    return -(p * math.log(p) + (1.0 - p) * math.log(1.0 - p))


def binary_metrics(labels: np.ndarray, preds: np.ndarray) -> dict:
    """AUC, log loss, normalized entropy and calibration of CTR predictions.

    Args:
        labels: {0,1}[N], int/float/bool (or ``[N, 1]``).
        preds: float[N] predicted click probabilities in [0, 1] (or ``[N, 1]``).

    Returns a dict of Python scalars:
        ``auc``: ``sklearn.metrics.roc_auc_score``; ``None`` when only one class is present (undefined).
        ``logloss``: mean binary cross-entropy in nats, ``sklearn.metrics.log_loss(labels, preds,
        labels=[0, 1])`` after clipping preds (as float64) to ``[1e-7, 1 - 1e-7]`` (``PRED_CLIP``).
        ``ne``: normalized entropy, ``logloss / H(p)`` with ``p = mean(labels)`` and
        ``H(p) = -(p log p + (1-p) log(1-p))``, the log loss relative to always predicting the base rate
        (He et al., ADKDD 2014); lower is better, 1.0 is no better than the base rate. ``None`` when
        ``H(p) = 0`` (all labels equal).
        ``calibration``: ``mean(preds) / mean(labels)`` (1.0 is calibrated on average); ``None`` when there are
        no positives.
        ``base_rate``: ``mean(labels)``; ``mean_prediction``: ``mean(preds)`` (unclipped); ``count``: N (int).

    Raises ``ValueError`` on invalid input (see :func:`validate`).
    """
    y, p = validate(labels, preds)
    n = int(y.shape[0])
    base_rate = float(y.mean())
    mean_pred = float(p.mean())
    one_class = base_rate == 0.0 or base_rate == 1.0
    auc = None if one_class else float(roc_auc_score(y, p))
    ll = float(log_loss(y, np.clip(p, PRED_CLIP, 1.0 - PRED_CLIP), labels=[0, 1]))
    h = _entropy(base_rate)
    return {
        "auc": auc,
        "logloss": ll,
        "ne": ll / h if h > 0.0 else None,
        "calibration": mean_pred / base_rate if base_rate > 0.0 else None,
        "base_rate": base_rate,
        "mean_prediction": mean_pred,
        "count": n,
    }


def roc_points(labels: np.ndarray, preds: np.ndarray, max_points: int = 200) -> dict:
    """ROC curve points, thinned for KFP's ``ClassificationMetrics.log_roc_curve(fpr, tpr, threshold)``.

    Computes ``sklearn.metrics.roc_curve(labels, preds)`` (collinear points already dropped), then, when more
    than ``max_points`` remain, keeps ``max_points`` of them at evenly spaced indices; the first point
    (0, 0) and the last (1, 1) are always kept. sklearn's first threshold is ``+inf`` (nothing predicted
    positive); it is replaced by 1.0 so every threshold is a finite float (KFP stores them as JSON).

    Args:
        labels: {0,1}[N]; preds: float[N] in [0, 1] (see :func:`validate`).
        max_points: most points returned, >= 2.

    Returns ``{"fpr": list[float], "tpr": list[float], "thresholds": list[float]}``, equal lengths <= max_points,
    fpr and tpr non-decreasing, thresholds non-increasing.

    Raises ``ValueError`` on invalid input, when ``max_points < 2``, or when only one class is present (the ROC
    curve is undefined).
    """
    if int(max_points) < 2:
        raise ValueError(f"max_points must be >= 2 to keep the first and last ROC points, got {max_points}")
    y, p = validate(labels, preds)
    if y.min() == y.max():
        raise ValueError(f"ROC curve is undefined: all {y.shape[0]} labels are {int(y[0])}")
    fpr, tpr, thr = roc_curve(y, p)
    if fpr.shape[0] > max_points:
        idx = np.unique(np.round(np.linspace(0, fpr.shape[0] - 1, int(max_points))).astype(np.int64))
        fpr, tpr, thr = fpr[idx], tpr[idx], thr[idx]
    thr = np.where(np.isfinite(thr), thr, 1.0)
    return {"fpr": fpr.tolist(), "tpr": tpr.tolist(), "thresholds": thr.tolist()}


def reliability(labels: np.ndarray, preds: np.ndarray, bins: int = 10) -> dict:
    """Calibration-plot data: observed positive rate per equal-width prediction bin.

    Bin ``b`` (0-based) holds predictions in ``[b/bins, (b+1)/bins)``; the last bin also holds 1.0.

    Args:
        labels: {0,1}[N]; preds: float[N] in [0, 1] (see :func:`validate`).
        bins: number of bins, >= 1.

    Returns a dict of lists, each of length ``bins`` except ``bin_edges`` (``bins + 1``):
        ``bin_edges``: float; ``count``: int examples per bin; ``mean_prediction``: mean of preds in the bin;
        ``observed_rate``: mean of labels in the bin (``None`` for both in an empty bin); plus ``ece``: the
        expected calibration error ``sum_b count_b / N * |mean_prediction_b - observed_rate_b|``
        (Guo et al., ICML 2017, Sec. 2).

    Raises ``ValueError`` on invalid input or ``bins < 1``.
    """
    if int(bins) < 1:
        raise ValueError(f"bins must be >= 1, got {bins}")
    bins = int(bins)
    y, p = validate(labels, preds)
    idx = np.minimum((p * bins).astype(np.int64), bins - 1)
    count = np.bincount(idx, minlength=bins)
    sum_p = np.bincount(idx, weights=p, minlength=bins)
    sum_y = np.bincount(idx, weights=y, minlength=bins)
    nonempty = count > 0
    mean_p = np.divide(sum_p, count, out=np.zeros(bins), where=nonempty)
    rate = np.divide(sum_y, count, out=np.zeros(bins), where=nonempty)
    ece = float(np.sum(count / y.shape[0] * np.abs(mean_p - rate)))
    return {
        "bin_edges": np.linspace(0.0, 1.0, bins + 1).tolist(),
        "count": count.tolist(),
        "mean_prediction": [float(v) if ok else None for v, ok in zip(mean_p, nonempty, strict=True)],
        "observed_rate": [float(v) if ok else None for v, ok in zip(rate, nonempty, strict=True)],
        "ece": ece,
    }


def group_auc(labels: np.ndarray, preds: np.ndarray, groups: np.ndarray) -> float | None:
    """Group AUC (GAUC): impression-weighted mean of per-group AUC (Zhou et al., DIN, KDD 2018, Sec. 6).

    ``GAUC = sum_g n_g * AUC_g / sum_g n_g`` over the groups ``g`` (usually users) that hold both a positive and
    a negative example; ``n_g`` is the group's number of impressions (rows) and ``AUC_g`` is
    ``sklearn.metrics.roc_auc_score`` on its rows. Groups with one class have no AUC and are left out of both
    sums. Rows are grouped with ``np.unique`` and one stable ``argsort``; per-class counts per group come from
    ``np.bincount``.

    Args:
        labels: {0,1}[N]; preds: float[N] in [0, 1] (see :func:`validate`).
        groups: [N] group keys of any sortable dtype (ints, strings).

    Returns the GAUC as a float, or ``None`` when no group has both classes.

    Raises ``ValueError`` on invalid labels/preds, or when ``groups`` is not 1-D of length N.
    """
    y, p = validate(labels, preds)
    g = _as_1d("groups", groups)
    if g.shape[0] != y.shape[0]:
        raise ValueError(f"groups and labels differ in length: {g.shape[0]} groups, {y.shape[0]} labels")
    _, inv = np.unique(g, return_inverse=True)
    inv = inv.reshape(-1)
    n_groups = int(inv.max()) + 1
    size = np.bincount(inv, minlength=n_groups)
    pos = np.bincount(inv, weights=y, minlength=n_groups)
    eligible = np.flatnonzero((pos > 0) & (pos < size))
    if eligible.size == 0:
        return None
    order = np.argsort(inv, kind="stable")
    starts = np.concatenate(([0], np.cumsum(size)))
    ys, ps = y[order], p[order]
    aucs = np.array([roc_auc_score(ys[starts[k] : starts[k + 1]], ps[starts[k] : starts[k + 1]]) for k in eligible])
    w = size[eligible].astype(np.float64)
    return float(np.sum(w * aucs) / np.sum(w))


class StreamingMetrics:
    """Accumulates (label, prediction) pairs over evaluation batches; ``compute()`` gives :func:`binary_metrics`.

    Every pair is kept (memory: 16 bytes per example as float64, less for float32 inputs), and ``compute()``
    concatenates the batches in order and calls :func:`binary_metrics`, so the result equals exactly (``==``)
    ``binary_metrics`` on all pairs at once, whatever the batch sizes. AUC needs the whole ranking, which is why
    no running sums are used.

    Each ``update`` validates its batch (see :func:`validate`), so a bad batch raises ``ValueError`` at once;
    empty batches are allowed and ignored.
    """

    def __init__(self) -> None:
        self._labels: list[np.ndarray] = []
        self._preds: list[np.ndarray] = []
        self._count = 0

    @property
    def count(self) -> int:
        """Number of pairs seen so far."""
        return self._count

    def update(self, labels: np.ndarray, preds: np.ndarray) -> None:
        """Add one batch: ``labels`` {0,1}[B], ``preds`` float[B] (or ``[B, 1]``); B may be 0.

        Raises ``ValueError`` on a malformed batch (same checks as :func:`validate`, except that B = 0 is
        allowed).
        """
        y = _as_1d("labels", labels)
        p = _as_1d("preds", preds)
        if y.shape[0] == 0 and p.shape[0] == 0:
            return
        validate(y, p)
        self._labels.append(y.copy())
        self._preds.append(p.copy())
        self._count += int(y.shape[0])

    def compute(self) -> dict:
        """``binary_metrics`` on every pair seen. Raises ``ValueError`` if no pair was added."""
        if not self._labels:
            raise ValueError("StreamingMetrics.compute() called before any non-empty update()")
        return binary_metrics(np.concatenate(self._labels), np.concatenate(self._preds))

    def reset(self) -> None:
        """Forget every pair."""
        self._labels.clear()
        self._preds.clear()
        self._count = 0


#: Keys of :func:`binary_metrics` (and of :func:`undefined_metrics`), in display order.
METRIC_KEYS = ("auc", "logloss", "ne", "calibration", "base_rate", "mean_prediction", "count")


def undefined_metrics() -> dict:
    """The metrics of an empty set of examples: every value ``None`` except ``count = 0``."""
    return {k: (0 if k == "count" else None) for k in METRIC_KEYS}


def subset_metrics(labels: np.ndarray, preds: np.ndarray, mask: np.ndarray) -> dict:
    """:func:`binary_metrics` on the rows where ``mask: bool[N]`` is true; :func:`undefined_metrics` when none is.

    Raises ``ValueError`` on invalid labels/preds, or when ``mask`` is not bool of length N.
    """
    m = _as_1d("mask", mask)
    if m.dtype != np.bool_:
        raise ValueError(f"mask must be bool, got dtype {m.dtype}")
    y = _as_1d("labels", labels)
    p = _as_1d("preds", preds)
    if m.shape[0] != y.shape[0] or m.shape[0] != p.shape[0]:
        raise ValueError(f"mask has {m.shape[0]} entries for {y.shape[0]} labels and {p.shape[0]} preds")
    if not m.any():
        return undefined_metrics()
    return binary_metrics(y[m], p[m])


def id_coverage(ids: np.ndarray, seen: np.ndarray) -> dict:
    """How many of a slot's evaluation IDs were never seen in training.

    Args:
        ids: ``uint64[n]`` every ID occurrence of the slot in the evaluation rows (an ID may repeat).
        seen: ``bool[n]``: whether the trained model holds a row for ``ids[i]``.

    Returns ``{"ids": n, "unseen_ids": occurrences not seen, "unseen_share": unseen_ids / ids,
    "distinct_ids": distinct IDs, "unseen_distinct_ids": distinct IDs not seen,
    "unseen_distinct_share": unseen_distinct_ids / distinct_ids}``; a share is ``None`` when its denominator
    is 0 (a slot with no IDs in the evaluation rows). Raises ``ValueError`` when the lengths differ.
    """
    ids = np.asarray(ids, dtype=np.uint64).reshape(-1)
    seen = np.asarray(seen, dtype=bool).reshape(-1)
    if ids.shape[0] != seen.shape[0]:
        raise ValueError(f"ids and seen differ in length: {ids.shape[0]} ids, {seen.shape[0]} flags")
    n = int(ids.shape[0])
    unseen = int((~seen).sum())
    distinct = int(np.unique(ids).shape[0])
    unseen_distinct = int(np.unique(ids[~seen]).shape[0])
    return {
        "ids": n,
        "unseen_ids": unseen,
        "unseen_share": unseen / n if n else None,
        "distinct_ids": distinct,
        "unseen_distinct_ids": unseen_distinct,
        "unseen_distinct_share": unseen_distinct / distinct if distinct else None,
    }
