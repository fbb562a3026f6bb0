"""Tests for persia_core.evaluate.metrics: agreement with sklearn, NE by hand, undefined cases, streaming, GAUC."""

from __future__ import annotations

import math

import numpy as np
import pytest
from sklearn.metrics import log_loss, roc_auc_score, roc_curve

from persia_core.evaluate.metrics import (
    StreamingMetrics,
    binary_metrics,
    group_auc,
    reliability,
    roc_points,
)


def _random_data(n: int = 5000, seed: int = 0):
    rng = np.random.default_rng(seed)
    preds = rng.uniform(0.01, 0.99, size=n)
    labels = (rng.uniform(size=n) < preds * 0.6).astype(np.int64)
    return labels, preds


def test_auc_and_logloss_match_sklearn_on_random_data():
    labels, preds = _random_data()
    m = binary_metrics(labels, preds)
    assert m["auc"] == pytest.approx(roc_auc_score(labels, preds), abs=1e-9)
    assert m["logloss"] == pytest.approx(log_loss(labels, preds), abs=1e-9)
    assert m["count"] == 5000
    assert m["base_rate"] == pytest.approx(labels.mean(), abs=1e-12)
    assert m["mean_prediction"] == pytest.approx(preds.mean(), abs=1e-12)
    assert m["calibration"] == pytest.approx(preds.mean() / labels.mean(), abs=1e-12)


def test_ne_is_logloss_over_base_rate_entropy_in_float64():
    labels, preds = _random_data(seed=3)
    preds = preds.astype(np.float32)
    m = binary_metrics(labels, preds)
    y = labels.astype(np.float64)
    q = np.clip(preds.astype(np.float64), 1e-7, 1 - 1e-7)
    logloss = -np.mean(y * np.log(q) + (1 - y) * np.log(1 - q))
    p = y.mean()
    h = -(p * math.log(p) + (1 - p) * math.log(1 - p))
    assert m["logloss"] == pytest.approx(logloss, abs=1e-9)
    assert m["ne"] == pytest.approx(logloss / h, abs=1e-9)


def test_predicting_the_base_rate_gives_ne_of_one():
    labels = np.array([1, 0, 0, 0, 1, 0, 0, 0])
    m = binary_metrics(labels, np.full(8, 0.25))
    assert m["ne"] == pytest.approx(1.0, abs=1e-12)
    assert m["calibration"] == pytest.approx(1.0, abs=1e-12)


def test_one_class_makes_auc_and_ne_undefined_not_zero():
    preds = np.array([0.2, 0.4, 0.9])
    pos = binary_metrics(np.ones(3), preds)
    assert pos["auc"] is None and pos["ne"] is None
    assert pos["calibration"] == pytest.approx(0.5)
    assert pos["logloss"] == pytest.approx(-np.mean(np.log(preds)), abs=1e-12)
    neg = binary_metrics(np.zeros(3, dtype=np.int32), preds)
    assert neg["auc"] is None and neg["ne"] is None and neg["calibration"] is None
    assert neg["logloss"] == pytest.approx(-np.mean(np.log(1 - preds)), abs=1e-12)


def test_confident_misses_are_clipped_to_a_finite_logloss():
    m = binary_metrics(np.array([1, 0]), np.array([0.0, 1.0]))
    assert m["logloss"] == pytest.approx(-math.log(1e-7), rel=1e-9)
    assert m["auc"] == 0.0


def test_column_inputs_are_flattened():
    labels, preds = _random_data(n=50)
    assert binary_metrics(labels[:, None], preds[:, None]) == binary_metrics(labels, preds)


@pytest.mark.parametrize(
    ("labels", "preds", "message"),
    [
        ([0, 1, 1], [0.1, 0.2], "differ in length: 3 labels, 2 preds"),
        ([], [], "empty"),
        ([0, 1, 1, 0], [0.1, np.nan, np.nan, 0.3], "2 NaN"),
        ([0, 1, 2, 3, 1], [0.1, 0.2, 0.3, 0.4, 0.5], "labels must be 0 or 1: 2 of 5"),
        ([0, 1, np.nan], [0.1, 0.2, 0.3], "1 of 3"),
        ([0, 1, 1], [0.1, 1.5, -0.2], "2 of 3 are outside"),
        (np.zeros((2, 2)), np.zeros((2, 2)), "must be 1-D"),
    ],
)
def test_bad_inputs_raise_value_error_saying_what_offends(labels, preds, message):
    with pytest.raises(ValueError, match=message):
        binary_metrics(np.asarray(labels), np.asarray(preds))


def test_streaming_over_uneven_batches_equals_all_at_once_exactly():
    labels, preds = _random_data(n=1003, seed=7)
    preds = preds.astype(np.float32)
    sm = StreamingMetrics()
    cuts = [0, 1, 1, 100, 357, 358, 900, 1003]  # includes an empty batch and a batch of one
    for a, b in zip(cuts[:-1], cuts[1:], strict=True):
        sm.update(labels[a:b], preds[a:b])
    assert sm.count == 1003
    assert sm.compute() == binary_metrics(labels, preds)
    sm.reset()
    with pytest.raises(ValueError, match="before any"):
        sm.compute()


def test_streaming_rejects_a_bad_batch_at_update():
    sm = StreamingMetrics()
    with pytest.raises(ValueError, match="1 NaN"):
        sm.update(np.array([0, 1]), np.array([0.5, np.nan]))
    assert sm.count == 0


def _pairwise_auc(y: np.ndarray, p: np.ndarray) -> float:
    """Float64 reference: fraction of (positive, negative) pairs ranked right, ties counting one half."""
    pos, neg = p[y == 1], p[y == 0]
    wins = sum(1.0 if a > b else 0.5 if a == b else 0.0 for a in pos for b in neg)
    return wins / (len(pos) * len(neg))


def test_group_auc_is_impression_weighted_mean_over_two_class_groups():
    # rows of users "a", "b", "c", "d" interleaved; "c" has only clicks and "d" only non-clicks: both left out.
    groups = np.array(["a", "b", "c", "a", "b", "d", "b", "a", "b", "c", "b"])
    labels = np.array([1, 1, 1, 0, 0, 0, 1, 0, 0, 1, 0])
    preds = np.array([0.9, 0.2, 0.6, 0.8, 0.5, 0.3, 0.7, 0.1, 0.1, 0.4, 0.2])
    expected_a = _pairwise_auc(np.array([1, 0, 0]), np.array([0.9, 0.8, 0.1]))  # 1.0
    expected_b = _pairwise_auc(np.array([1, 0, 1, 0, 0]), np.array([0.2, 0.5, 0.7, 0.1, 0.2]))  # 4.5 / 6 (one tie)
    assert expected_a == 1.0 and expected_b == 0.75
    expected = (3 * expected_a + 5 * expected_b) / (3 + 5)
    assert group_auc(labels, preds, groups) == pytest.approx(expected, abs=1e-12)
    # integer user IDs group the same way
    ids = np.unique(groups, return_inverse=True)[1] * 1000 + 7
    assert group_auc(labels, preds, ids) == pytest.approx(expected, abs=1e-12)


def test_group_auc_is_none_when_no_group_has_both_classes():
    assert group_auc(np.array([1, 0]), np.array([0.3, 0.4]), np.array([1, 2])) is None


def test_group_auc_rejects_groups_of_another_length():
    with pytest.raises(ValueError, match="groups and labels differ in length"):
        group_auc(np.array([1, 0]), np.array([0.3, 0.4]), np.array([1, 2, 3]))


def test_roc_points_are_thinned_keeping_ends_and_finite_thresholds():
    labels, preds = _random_data(n=5000, seed=11)
    full_fpr, full_tpr, _ = roc_curve(labels, preds)
    assert len(full_fpr) > 200
    pts = roc_points(labels, preds, max_points=200)
    assert 2 <= len(pts["fpr"]) == len(pts["tpr"]) == len(pts["thresholds"]) <= 200
    assert (pts["fpr"][0], pts["tpr"][0]) == (0.0, 0.0)
    assert (pts["fpr"][-1], pts["tpr"][-1]) == (1.0, 1.0)
    assert pts["thresholds"][0] == 1.0 and all(math.isfinite(t) for t in pts["thresholds"])
    assert np.all(np.diff(pts["fpr"]) >= 0) and np.all(np.diff(pts["tpr"]) >= 0)


def test_roc_points_small_curve_is_kept_whole_and_one_class_raises():
    pts = roc_points(np.array([0, 1, 1, 0]), np.array([0.1, 0.4, 0.35, 0.8]))
    assert pts == {
        "fpr": [0.0, 0.5, 0.5, 1.0],
        "tpr": [0.0, 0.0, 1.0, 1.0],
        "thresholds": [1.0, 0.8, 0.35, 0.1],
    }
    with pytest.raises(ValueError, match="undefined"):
        roc_points(np.ones(3), np.array([0.1, 0.2, 0.3]))
    with pytest.raises(ValueError, match="max_points"):
        roc_points(np.array([0, 1]), np.array([0.1, 0.2]), max_points=1)


def test_reliability_bins_counts_rates_and_ece():
    labels = np.array([0, 0, 1, 1, 1, 0])
    preds = np.array([0.05, 0.15, 0.12, 0.55, 1.0, 0.95])  # 1.0 goes to the last bin
    rel = reliability(labels, preds, bins=4)
    assert rel["bin_edges"] == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert rel["count"] == [3, 0, 1, 2]
    assert rel["mean_prediction"][0] == pytest.approx((0.05 + 0.15 + 0.12) / 3)
    assert rel["mean_prediction"][1] is None and rel["observed_rate"][1] is None
    assert rel["observed_rate"] == [pytest.approx(1 / 3), None, 1.0, 0.5]
    ece = (3 * abs(0.32 / 3 - 1 / 3) + 1 * abs(0.55 - 1.0) + 2 * abs(0.975 - 0.5)) / 6
    assert rel["ece"] == pytest.approx(ece, abs=1e-12)
    with pytest.raises(ValueError, match="bins"):
        reliability(labels, preds, bins=0)
