"""Smoke test of ``make bench-quality`` at a tiny size: its lines carry every field, on data cut as it says."""

import csv
import json

import pytest

from persia_core.bench import quality


def test_movielens_subset_keeps_the_first_ratings_by_timestamp_and_the_other_files(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    rows = [
        ["userId", "movieId", "rating", "timestamp"],
        ["1", "5", "4.0", "30"],
        ["2", "6", "3.0", "10"],
        ["3", "7", "2.0", "20"],
        ["4", "8", "5.0", "10"],
    ]
    with open(src / "ratings.csv", "w", newline="") as f:
        csv.writer(f, lineterminator="\n").writerows(rows)
    (src / "movies.csv").write_text("movieId,title,genres\n5,A (1990),Drama\n")
    out = quality.movielens_subset(str(src), str(tmp_path / "out"), 3)
    with open(f"{out}/ratings.csv", newline="") as f:
        got = list(csv.reader(f))
    assert got == [rows[0], rows[2], rows[4], rows[3]]  # by timestamp, ties in file order
    assert (tmp_path / "out" / "movies.csv").read_text() == (src / "movies.csv").read_text()


def test_bench_quality_runs_the_shipped_configs_unless_told_all_or_names():
    assert list(quality.chosen_models("criteo_synth", "")) == ["criteo", "dcnv2", "criteo_before"]
    assert list(quality.chosen_models("movielens", "")) == ["movielens"]
    assert set(quality.chosen_models("criteo_synth", "all")) == {"criteo", "dcnv2", "criteo_before", "criteo_deepfm"}
    assert set(quality.chosen_models("movielens", "all")) == {"movielens", "movielens_dcnv2", "movielens_deepfm"}
    assert list(quality.chosen_models("criteo_synth", "criteo_deepfm,movielens")) == ["criteo_deepfm"]
    assert quality.EXTRA_MODELS <= set(quality.model_configs("criteo_synth")) | set(quality.model_configs("movielens"))
    # criteo_before is the criteo config as shipped before the issue, whatever the shipped one now sets
    before = quality.model_configs("criteo_synth")["criteo_before"][0]
    t = before.trainer
    pinned = (t.epochs, t.dense_lr, t.dense_lr_decay, t.embedding_lr_decay, t.refit, before.model.wide)
    assert pinned == (1, 0.001, 1.0, 1.0, False, False)
    assert [table.name for table in before.embedding.tables] == ["default"]


def test_bench_quality_runs_criteo_before_at_the_largest_size_unless_named():
    models = quality.chosen_models("criteo_synth", "")
    sizes = ["10000", "1000000", "100000"]
    assert list(quality.models_at_size(models, "1000000", sizes, "")) == ["criteo", "dcnv2", "criteo_before"]
    assert list(quality.models_at_size(models, "100000", sizes, "")) == ["criteo", "dcnv2"]
    assert list(quality.models_at_size(models, "10000", sizes, "all")) == ["criteo", "dcnv2"]
    named = quality.chosen_models("criteo_synth", "criteo_before")
    assert list(quality.models_at_size(named, "10000", sizes, "criteo_before")) == ["criteo_before"]
    ml = quality.chosen_models("movielens", "")
    assert list(quality.models_at_size(ml, "10000", ["10000", "all"], "")) == ["movielens"]


@pytest.mark.processes
def test_bench_quality_prints_one_line_per_dataset_size_and_model_with_the_lr_reference(tmp_path, capsys):
    out = tmp_path / "lines.jsonl"
    args = [
        "--movielens-sizes",
        "4000",
        "--criteo-sizes",
        "3000",
        "--eval-rows",
        "2000",
        "--seeds",
        "1",
        "--models",
        "movielens,criteo,criteo_before",
        "--work",
        str(tmp_path / "w"),
        "--out",
        str(out),
    ]
    assert quality.main(args) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    assert lines == [json.loads(x) for x in out.read_text().splitlines()]
    assert [(x["dataset"], x["size"], x["model"], x["default"]) for x in lines] == [
        ("movielens", 4000, "movielens", True),
        ("criteo_synth", 3000, "criteo", True),
        ("criteo_synth", 3000, "criteo_before", False),
    ]
    for x in lines:
        assert x["seeds"] == 1 and len(x["epochs_kept"]) == 1 and x["auc_std"] == 0
        assert 0 < x["auc"] < 1 and 0 < x["logloss"] < 1  # tiny data: any valid AUC
        assert 0.5 < x["lr_auc"] < 1 and 0 < x["lr_logloss"] < 1
        assert x["auc_lift"] == pytest.approx(x["auc"] - x["lr_auc"], abs=2e-5)
        assert x["beats_lr"] == (x["auc"] >= x["lr_auc"] and x["logloss"] <= x["lr_logloss"])
    assert lines[0]["train_rows"] < 4000 and "planted_auc" not in lines[0]
    assert lines[1]["train_rows"] == 3000 and 0.8 < lines[1]["planted_auc"] < 0.95
    assert lines[1]["lr_auc"] == lines[2]["lr_auc"]  # one reference per dataset and size
    assert lines[2]["epochs_kept"] == [1] and lines[2]["epochs_scored"] == [0]  # the pre-issue config: one epoch
    for x in lines[:2]:  # epochs: auto stopped at patience or patience_z after its best epoch, or at max_epochs
        assert x["epochs_kept"][0] <= x["epochs_scored"][0] <= min(x["epochs_kept"][0] + 2, 10), x


@pytest.mark.processes
def test_bench_staleness_reports_both_ks_and_their_gap_per_model(tmp_path, capsys):
    from persia_core.bench import staleness_auc

    args = ["--models", "deepfm", "--samples", "3000", "--eval-rows", "1000", "--seeds", "1", "--batch-size", "512"]
    assert staleness_auc.main([*args, "--work", str(tmp_path)]) == 0
    (line,) = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    assert (line["model"], line["samples"], line["seeds"], line["staleness"]) == ("deepfm", 3000, 1, 4)
    # a few steps on 3,000 rows: AUCs anywhere in (0, 1); the figures are the full benchmark's
    assert 0 < line["auc_stale"] < 1 and 0 < line["auc_sync"] < 1 and line["logloss_sync"] > 0
    assert line["auc_gap"] == pytest.approx(line["auc_sync"] - line["auc_stale"], abs=2e-5)
    assert line["auc_gap_per_seed"] == [line["auc_gap"]]
