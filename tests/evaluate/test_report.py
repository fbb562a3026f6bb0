"""Tests for persia_core.evaluate.report: a self-contained HTML file with embedded PNG plots and the metrics."""

from __future__ import annotations

import base64
import re

import numpy as np
import pytest

from persia_core.evaluate.metrics import binary_metrics, group_auc
from persia_core.evaluate.report import write_report

_IMG = re.compile(r'<img[^>]*\ssrc="data:image/png;base64,([A-Za-z0-9+/=]+)"')


def _data(n: int = 2000, seed: int = 0):
    rng = np.random.default_rng(seed)
    preds = rng.uniform(0.01, 0.99, size=n)
    labels = (rng.uniform(size=n) < preds).astype(np.int64)
    return labels, preds


def _history():
    return {
        "samples": [0, 1000, 2000, 3000, 4000],
        "loss": [0.69, 0.61, 0.55, 0.52, 0.5],
        "elapsed_s": [0.0, 0.5, 1.1, 1.5, 2.0],
        "samples_per_s": 2000.0,
        "max_staleness": 3,
        "shards": [{"shard": 0, "rows": 12345, "bytes": 3_000_000}, {"shard": 1, "rows": 12001, "bytes": 2_900_000}],
    }


def test_report_is_self_contained_html_with_plots_and_metric_values(tmp_path):
    labels, preds = _data()
    metrics = binary_metrics(labels, preds)
    metrics["gauc"] = group_auc(labels, preds, np.arange(labels.shape[0]) % 17)
    out = tmp_path / "sub" / "report.html"
    config = {"name": "movielens", "trainer": {"staleness": 3, "lr": np.float32(0.05)}, "tables": ("u", "i")}

    ret = write_report(
        str(out),
        metrics,
        labels,
        preds,
        train_history=_history(),
        config=config,
        extra={"model_uri": "gs://bucket/model", "note": "<b>bold</b> & co"},
    )

    assert ret == str(out) and out.exists()
    text = out.read_text(encoding="utf-8")
    images = _IMG.findall(text)
    assert len(images) >= 3  # ROC, reliability, loss, throughput
    for data in images:
        assert base64.b64decode(data).startswith(b"\x89PNG\r\n\x1a\n")
    for key in ("auc", "logloss", "ne", "calibration", "gauc"):
        assert f"{metrics[key]:.6g}" in text
    assert ">2000<" in text  # count
    assert "Max observed staleness: <b>3</b>" in text
    assert "12345" in text and "2.9 MiB" in text  # shard table
    assert "staleness: 3" in text and "lr: 0.05" in text  # config as YAML
    assert "&lt;b&gt;bold&lt;/b&gt; &amp; co" in text and "<b>bold</b>" not in text
    # nothing is fetched when the file is opened
    assert not re.search(r'(src|href)\s*=\s*["\']?\s*(https?:)?//', text, flags=re.IGNORECASE)
    assert "<script" not in text.lower() and "@import" not in text


def test_report_without_history_or_config_has_roc_and_calibration(tmp_path):
    labels, preds = _data(n=300, seed=1)
    path = write_report(str(tmp_path / "r.html"), binary_metrics(labels, preds), labels, preds)
    text = (tmp_path / "r.html").read_text()
    assert path.endswith("r.html")
    assert len(_IMG.findall(text)) == 2
    assert "Run config" not in text and "Training" not in text


def test_report_with_one_class_notes_undefined_roc_and_auc(tmp_path):
    labels = np.zeros(50, dtype=np.int64)
    preds = np.linspace(0.01, 0.5, 50)
    write_report(str(tmp_path / "r.html"), binary_metrics(labels, preds), labels, preds)
    text = (tmp_path / "r.html").read_text()
    assert "ROC curve undefined" in text
    assert "undefined" in text.split("ROC curve")[0]  # the AUC row
    assert len(_IMG.findall(text)) == 1  # reliability only


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"loss": [0.5]}, "differ in length"),
        ({"max_staleness": "three"}, "max_staleness"),
        ({"shards": [{"shard": 0, "rows": 1}]}, r"shards'\]\[0\] is missing key\(s\): bytes"),
    ],
)
def test_malformed_history_raises_value_error_naming_the_key(tmp_path, change, message):
    labels, preds = _data(n=100)
    history = {**_history(), **change}
    with pytest.raises(ValueError, match=message):
        write_report(str(tmp_path / "r.html"), {}, labels, preds, train_history=history)
    history = _history()
    del history["elapsed_s"]
    with pytest.raises(ValueError, match="missing key.*elapsed_s"):
        write_report(str(tmp_path / "r.html"), {}, labels, preds, train_history=history)
    assert not (tmp_path / "r.html").exists()


def _split_and_coverage(labels, preds):
    from persia_core.evaluate.metrics import subset_metrics

    seen = np.arange(labels.shape[0]) % 3 == 0
    split = {
        "slot": "user",
        "seen": subset_metrics(labels, preds, seen),
        "unseen": subset_metrics(labels, preds, ~seen),
    }
    split["seen"]["gauc"] = 0.61234
    split["unseen"]["gauc"] = None
    coverage = {
        "user": {
            "ids": 200,
            "unseen_ids": 150,
            "unseen_share": 0.75,
            "distinct_ids": 40,
            "unseen_distinct_ids": 30,
            "unseen_distinct_share": 0.75,
        },
        "movie": {
            "ids": 0,
            "unseen_ids": 0,
            "unseen_share": None,
            "distinct_ids": 0,
            "unseen_distinct_ids": 0,
            "unseen_distinct_share": None,
        },
    }
    return split, coverage


def test_report_shows_gate_decision_seen_unseen_split_and_slot_coverage(tmp_path):
    labels, preds = _data(n=600, seed=4)
    metrics = binary_metrics(labels, preds)
    split, coverage = _split_and_coverage(labels, preds)
    gate = {
        "bless": False,
        "decision": "reject",
        "reasons": ["passed: AUC 0.700000 >= min_auc 0.500000", "rejected: AUC < baseline <AUC>"],
        "baseline": {"auc": 0.8, "logloss": 0.4},
    }
    write_report(str(tmp_path / "r.html"), metrics, labels, preds, user_split=split, coverage=coverage, gate=gate)
    text = (tmp_path / "r.html").read_text()
    gate_part = text.split("<h2>Model gate</h2>")[1].split("<h2>")[0]
    assert "Decision: reject" in gate_part and "rejected: AUC &lt; baseline &lt;AUC&gt;" in gate_part
    assert "0.8" in gate_part  # the baseline's AUC
    assert text.index("Model gate") < text.index("ROC curve")
    split_part = text.split("Users seen and not seen in training</h2>")[1].split("<h2>")[0]
    assert "User seen in training" in split_part and "User not seen in training" in split_part
    assert f"{split['seen']['auc']:.6g}" in split_part and f"{split['unseen']['logloss']:.6g}" in split_part
    assert "0.61234" in split_part and "undefined" in split_part  # unseen GAUC
    cov_part = text.split("Per-slot coverage</h2>")[1].split("<h2>")[0]
    assert "75.00%" in cov_part and ">150<" in cov_part and "movie" in cov_part and "undefined" in cov_part


def test_report_every_plot_has_labelled_axes(tmp_path, monkeypatch):
    import persia_core.evaluate.report as R

    figures = []
    real = R._png_img

    def capture(fig, alt):
        figures.append(fig)
        return real(fig, alt)

    monkeypatch.setattr(R, "_png_img", capture)
    labels, preds = _data(n=300, seed=2)
    split, coverage = _split_and_coverage(labels, preds)
    write_report(
        str(tmp_path / "r.html"),
        binary_metrics(labels, preds),
        labels,
        preds,
        train_history=_history(),
        user_split=split,
        coverage=coverage,
        gate={"decision": "bless", "reasons": []},
    )
    assert len(figures) == 4  # ROC, reliability (+ histogram), loss, throughput
    for fig in figures:
        for ax in fig.axes:
            assert ax.get_xlabel() and ax.get_ylabel(), f"unlabelled axes in {ax.get_title()!r}"


def test_report_of_an_epochs_auto_run_shows_the_validation_curve_and_the_kept_epoch(tmp_path):
    labels, preds = _data(n=300, seed=2)
    h = _history()
    h["step"] = [0, 1, 2, 3, 4]  # steps trained after each point: 1..5
    h["validation"] = [
        {"epoch": 1, "step": 2, "logloss": 0.61, "rows": 77},
        {"epoch": 2, "step": 4, "logloss": 0.58, "rows": 77},
        {"epoch": 3, "step": 5, "logloss": 0.63, "rows": 77},
    ]
    h.update(best_epoch=2, best_step=4, stopped_early=True)
    h["validation_pass"] = {"rows": 77, "steps": 2, "loss": 0.57, "seconds": 0.1, "max_staleness": 0}
    write_report(str(tmp_path / "r.html"), binary_metrics(labels, preds), labels, preds, train_history=h)
    text = (tmp_path / "r.html").read_text()
    assert "logloss per epoch 0.61, 0.58, 0.63; kept epoch <b>2</b> (logloss 0.58), stopped early" in text
    assert "one pass over the validation slice (<code>trainer.train_on_validation</code>): 2 steps" in text
    assert "77 rows" in text and len(_IMG.findall(text)) == 4


def test_report_of_a_refit_run_says_the_model_was_trained_again_on_every_row(tmp_path):
    labels, preds = _data(n=300, seed=3)
    h = _history()
    h["validation"] = [
        {"epoch": 1, "step": 2, "logloss": 0.61, "rows": 77},
        {"epoch": 2, "step": 4, "logloss": 0.64, "rows": 77},
    ]
    h.update(best_epoch=1, best_step=2, stopped_early=True)
    h["refit"] = {
        "epochs": 1,
        "rows": 420,
        "steps": 3,
        "loss": 0.55,
        "seconds": 0.2,
        "samples_per_s": 2100.0,
        "max_staleness": 0,
    }
    write_report(str(tmp_path / "r.html"), binary_metrics(labels, preds), labels, preds, train_history=h)
    text = (tmp_path / "r.html").read_text()
    assert "kept epoch <b>1</b> (logloss 0.61)" in text
    assert "trained again from its initial state for <b>1</b> epoch on every row" in text
    assert "(<code>trainer.refit</code>): 3 steps, last epoch's train logloss 0.55" in text
    assert "train_on_validation" not in text
