"""The LR reference (persia_core.evaluate.lr_reference) against an independent scikit-learn fit, and the gate's
refusal of a model below it."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import pytest
from support import write_dataset

import persia_core.evaluate.lr_reference as lr_module
from persia_core.data.reader import ParquetExamples, shard_files
from persia_core.evaluate.decision import check_thresholds, decide
from persia_core.evaluate.gate import evaluate_gate, gate
from persia_core.evaluate.lr_reference import C_GRID, lr_reference


def _independent(files: list[str], slots: list[str], mean, std):
    """The design matrix, labels and timestamps of Parquet ``files`` built row by row from the raw columns."""
    from scipy import sparse

    tables = [pq.read_table(f) for f in files]
    data, ri, ci, labels, ts, r = [], [], [], [], [], 0
    dense_rows = []
    for t in tables:
        d = t.to_pydict()
        for k in range(t.num_rows):
            counts: dict[int, int] = {}
            for s in slots:
                for v in d[f"slot_{s}"][k]:
                    counts[v % 2**20] = counts.get(v % 2**20, 0) + 1
            for c, n in counts.items():
                ri.append(r)
                ci.append(c)
                data.append(float(n))
            dense_rows.append(
                [(x - m) / (sd if sd > 0 else 1.0) for x, m, sd in zip(d["dense"][k], mean, std, strict=True)]
            )
            labels.append(d["label"][k])
            ts.append(d["ts"][k])
            r += 1
    onehot = sparse.csr_matrix((data, (ri, ci)), shape=(r, 2**20))
    return sparse.hstack([onehot, sparse.csr_matrix(np.array(dense_rows))], format="csr"), np.array(labels), ts


@pytest.mark.parametrize("parallel", [False, True], ids=["serial", "parallel"])
def test_the_lr_reference_equals_an_independent_scikit_learn_fit_on_the_same_rows(tmp_path, monkeypatch, parallel):
    from sklearn.linear_model import LogisticRegression
    from sklearn.metrics import log_loss, roc_auc_score

    data = write_dataset(str(tmp_path / "data"), rows=600, eval_rows=200)
    slots, mean, std = ["a", "b", "tags"], [0.1], [2.0]
    train = ParquetExamples(shard_files(data, "train"), slots)
    evals = ParquetExamples(shard_files(data, "eval"), slots)
    # the C grid's fits in worker processes (as for a large train split) or in this one
    monkeypatch.setattr(lr_module, "PARALLEL_MIN_NNZ", 0 if parallel else 10**12)
    got = lr_reference(train, evals, mean, std)

    x, y, ts = _independent(shard_files(data, "train"), slots, mean, std)
    # the same features, exactly, as the reference's own design matrix
    assert (lr_module.design_matrix(train, np.arange(600), mean, std) != x).nnz == 0
    order = sorted(range(len(ts)), key=lambda i: ts[i])
    n_val = round(0.1 * len(order))
    fit, val = order[:-n_val], order[-n_val:]
    val_ll = {
        c: log_loss(y[val], LogisticRegression(C=c, max_iter=300).fit(x[fit], y[fit]).predict_proba(x[val])[:, 1])
        for c in C_GRID
    }
    best = min(C_GRID, key=lambda c: val_ll[c])
    assert got["C"] == best and got["train_rows"] == 600 and not got["sampled"]
    assert all(abs(got["validation_logloss"][str(c)] - val_ll[c]) < 1e-9 for c in C_GRID)
    # the fit on every row starts from its C's fit on the rows before the slice: the same strictly convex optimum,
    # reached to lbfgs's tolerance, so it is held to a fit far tighter than its own, to 1e-4
    xe, ye, _ = _independent(shard_files(data, "eval"), slots, mean, std)
    p = LogisticRegression(C=best, max_iter=10_000, tol=1e-10).fit(x, y).predict_proba(xe)[:, 1]
    assert abs(got["auc"] - roc_auc_score(ye, p)) < 1e-4
    assert abs(got["logloss"] - log_loss(ye, p)) < 1e-4
    assert 0.5 < got["auc"] < 1.0  # the planted signal is found, not a degenerate fit


def test_the_lr_reference_samples_beyond_max_rows_and_says_so(tmp_path):
    data = write_dataset(str(tmp_path / "data"), rows=400, eval_rows=100)
    slots = ["a", "b", "tags"]
    train = ParquetExamples(shard_files(data, "train"), slots)
    evals = ParquetExamples(shard_files(data, "eval"), slots)
    got = lr_reference(train, evals, [0.0], [1.0], max_rows=150)
    assert got["sampled"] and got["train_rows"] == 150


def test_a_model_below_the_lr_reference_is_refused_by_the_gate_unless_within_lr_margin():
    new = {"auc": 0.700, "logloss": 0.50, "ne": 0.9, "lr_auc": 0.720, "lr_logloss": 0.49}
    out = decide(new, None, min_auc=0.5)  # lr_margin 0 by default: not lower than the reference
    assert out == decide(new, None, min_auc=0.5, lr_margin=0.0)
    assert not out["bless"]
    assert any("rejected" in r and "LR reference" in r for r in out["reasons"])
    assert decide(new, None, min_auc=0.5, lr_margin=0.03)["bless"]
    assert decide({**new, "lr_auc": 0.690}, None, min_auc=0.5, lr_margin=0.0)["bless"]
    assert decide({k: v for k, v in new.items() if not k.startswith("lr_")}, None, min_auc=0.5, lr_margin=0.0)["bless"]
    assert decide(new, None, min_auc=0.5, lr_margin=None)["bless"]  # None: reported, not enforced (the Python API)
    with pytest.raises(ValueError, match="lr_margin must be >= 0"):
        check_thresholds(lr_margin=-0.01)


def test_the_gate_step_applies_lr_margin_from_its_caller(tmp_path):
    new = {"auc": 0.700, "logloss": 0.50, "ne": 0.9, "lr_auc": 0.720, "lr_logloss": 0.49}
    assert not gate(new, str(tmp_path / "blessed"))["bless"]
    assert gate(new, str(tmp_path / "blessed"), lr_margin=0.05)["bless"]
    decision, _ = evaluate_gate(new, str(tmp_path / "blessed"), str(tmp_path), lr_margin=0.05)
    assert decision["bless"]


@pytest.mark.processes
def test_evaluate_reports_the_lr_reference_and_the_models_lift_over_it(trained):
    from persia_core.evaluate.run import evaluate, flat_metrics

    model, data = trained
    r = evaluate(model, data)
    slots = ["a", "b", "tags"]
    want = lr_reference(
        ParquetExamples(shard_files(data, "train"), slots),
        ParquetExamples(shard_files(data, "eval"), slots),
        [0.0],
        [1.0],
    )
    m = r["metrics"]
    assert r["lr_reference"]["C"] == want["C"]
    assert m["lr_auc"] == pytest.approx(want["auc"], abs=1e-12) and m["lr_logloss"] == pytest.approx(want["logloss"])
    assert m["lr_auc_lift"] == pytest.approx(m["auc"] - want["auc"])
    assert m["lr_relative_logloss"] == pytest.approx(m["logloss"] / want["logloss"])
    assert {"lr_auc", "lr_logloss", "lr_auc_lift", "lr_relative_logloss"} <= set(flat_metrics(r))
    assert evaluate(model, data, lr_reference=False)["lr_reference"] is None
