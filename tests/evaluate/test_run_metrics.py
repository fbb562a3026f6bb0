"""evaluate(): per-slot coverage, the seen/unseen-user split and GAUC on a tiny hand-made model and eval set."""

from __future__ import annotations

import numpy as np
import pytest
from sklearn.metrics import roc_auc_score
from support import tiny_config

from persia_core.evaluate.metrics import binary_metrics, id_coverage, subset_metrics, undefined_metrics
from persia_core.evaluate.run import LoadedModel, evaluate, flat_metrics

SLOTS = ["a", "b", "tags"]
# Trained rows: a in {1, 2}, b in {x}, tags in {t1}. Slot "a" plays the user.
SEEN = {"a": ["1", "2"], "b": ["x"], "tags": ["t1"]}
ROWS = [
    {"label": 1, "x": 0.5, "a": ["1"], "b": ["x"], "tags": ["t1", "t2"]},  # user seen
    {"label": 0, "x": -1.0, "a": ["2"], "b": ["y"], "tags": []},  # user seen
    {"label": 1, "x": 2.0, "a": ["3"], "b": ["x"], "tags": ["t2"]},  # user not seen
    {"label": 0, "x": 0.1, "a": ["3"], "b": ["y"], "tags": ["t1"]},  # user not seen
    {"label": 1, "x": 1.5, "a": [], "b": ["x"], "tags": ["t3", "t3"]},  # no user: not seen, no GAUC group
    {"label": 0, "x": -0.3, "a": ["1"], "b": ["z"], "tags": []},  # user seen
]


@pytest.fixture(scope="module")
def hand_made(tmp_path_factory, model_factory, eval_rows_writer):
    root = tmp_path_factory.mktemp("hand")
    model = model_factory(str(root / "model"), tiny_config(), SEEN)
    data = eval_rows_writer(str(root / "data"), ROWS, SLOTS)
    return model, data


def test_metric_coverage_per_slot_counts_ids_without_a_trained_row(hand_made):
    r = evaluate(*hand_made, user_slot="a")
    cov = r["coverage"]
    assert list(cov) == SLOTS
    assert cov["a"] == {
        "ids": 5,
        "unseen_ids": 2,
        "unseen_share": 0.4,
        "distinct_ids": 3,
        "unseen_distinct_ids": 1,
        "unseen_distinct_share": pytest.approx(1 / 3),
    }
    assert cov["b"]["ids"] == 6 and cov["b"]["unseen_ids"] == 3 and cov["b"]["unseen_share"] == 0.5
    assert cov["b"]["unseen_distinct_share"] == pytest.approx(2 / 3)
    assert cov["tags"]["ids"] == 6 and cov["tags"]["unseen_ids"] == 4
    assert cov["tags"]["unseen_distinct_ids"] == 2 and cov["tags"]["distinct_ids"] == 3
    flat = flat_metrics(r)
    assert flat["unseen_share_a"] == 0.4 and flat["unseen_share_b"] == 0.5


def test_coverage_off_skips_it_and_leaves_the_metrics_as_they_are(hand_made):
    full, bare = evaluate(*hand_made, user_slot="a"), evaluate(*hand_made, user_slot="a", coverage=False)
    assert bare["coverage"] is None and full["coverage"]
    assert bare["metrics"] == full["metrics"]
    assert "unseen_share_a" not in flat_metrics(bare) and "unseen_share_a" in flat_metrics(full)


def test_metric_split_by_seen_user_and_gauc_on_hand_made_rows(hand_made):
    r = evaluate(*hand_made, user_slot="a")
    y, p = r["labels"], r["preds"].astype(np.float64)
    seen = np.array([True, True, False, False, False, True])
    split = r["user_split"]
    assert split["slot"] == "a"
    for side, mask in (("seen", seen), ("unseen", ~seen)):
        expected = binary_metrics(y[mask], p[mask])
        got = {k: v for k, v in split[side].items() if k != "gauc"}
        assert got == expected
    auc_user1 = roc_auc_score(y[[0, 5]], p[[0, 5]])  # user "1": rows 0 and 5, both classes
    auc_user3 = roc_auc_score(y[[2, 3]], p[[2, 3]])  # user "3": rows 2 and 3; user "2" has one class only
    assert r["metrics"]["gauc"] == pytest.approx((2 * auc_user1 + 2 * auc_user3) / 4, abs=1e-12)
    assert split["seen"]["gauc"] == pytest.approx(auc_user1, abs=1e-12)
    assert split["unseen"]["gauc"] == pytest.approx(auc_user3, abs=1e-12)
    # the overall metrics are unchanged by the split
    assert {k: v for k, v in r["metrics"].items() if k != "gauc"} == binary_metrics(y, p)
    flat = flat_metrics(r)
    assert flat["seen_user_count"] == 3.0 and flat["unseen_user_count"] == 3.0 and "gauc" in flat


def test_metric_split_is_skipped_without_the_user_slot_and_evaluation_inserts_no_rows(hand_made):
    model_dir, data = hand_made
    r = evaluate(model_dir, data)  # default user_slot "user" is not a slot of this model
    assert r["user_split"] is None and "gauc" not in r["metrics"]
    assert set(r) >= {"metrics", "roc", "labels", "preds", "config", "train_history", "coverage", "user_split"}
    m = LoadedModel(model_dir)
    assert sum(t.stats()["rows"] for tables in m.embedding.shards for t in tables.values()) == 4  # 1,2,x,t1


def test_metric_helpers_report_undefined_not_placeholders():
    y = np.array([1, 0, 1])
    p = np.array([0.9, 0.2, 0.4])
    assert subset_metrics(y, p, np.zeros(3, bool)) == undefined_metrics()
    one_class = subset_metrics(y, p, np.array([True, False, True]))
    assert one_class["auc"] is None and one_class["count"] == 2
    empty = id_coverage(np.zeros(0, np.uint64), np.zeros(0, bool))
    assert empty["unseen_share"] is None and empty["unseen_distinct_share"] is None
    with pytest.raises(ValueError, match="mask must be bool"):
        subset_metrics(y, p, np.ones(3))
