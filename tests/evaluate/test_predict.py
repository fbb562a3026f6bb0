"""Serving export: predict() on preprocessed Parquet reproduces evaluate(), and raw rows score like their
preprocessed form (delimited layout, and MovieLens joined with movies/tags)."""

from __future__ import annotations

import csv
import math
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from sklearn.metrics import roc_auc_score

from persia_core.config import RunConfig, load_config
from persia_core.data import schema as S
from persia_core.evaluate.metrics import binary_metrics
from persia_core.evaluate.predict import predict
from persia_core.evaluate.run import evaluate
from persia_core.hashing import feature_ids


@pytest.mark.processes
def test_predict_on_the_eval_split_reproduces_the_evaluate_auc_exactly(trained, tmp_path):
    model, data = trained
    r = evaluate(model, data)
    eval_file = os.path.join(data, "eval", "eval-00000-of-00001.parquet")

    out = predict(model, eval_file, str(tmp_path / "p.parquet"))
    table = pq.read_table(tmp_path / "p.parquet")
    assert table.column_names == ["source", "probability", "label"]
    probs = table.column("probability").to_numpy()
    labels = table.column("label").to_numpy()
    assert out["rows"] == len(r["preds"]) == 200
    assert np.array_equal(probs, r["preds"]) and np.array_equal(labels, r["labels"])
    assert roc_auc_score(labels, probs) == r["metrics"]["auc"]
    model_only = {k: v for k, v in r["metrics"].items() if k != "gauc" and not k.startswith("lr_")}  # no LR reference
    assert binary_metrics(labels, probs) == model_only
    assert table.column("source").to_pylist()[:2] == ["synthetic:256", "synthetic:257"]

    predict(model, os.path.join(data, "eval"), str(tmp_path / "p.csv"), batch_size=4096)  # a folder, CSV out
    with open(tmp_path / "p.csv") as f:
        rows = list(csv.DictReader(f))
    csv_probs = np.array([float(x["probability"]) for x in rows], dtype=np.float32)
    assert np.array_equal(csv_probs, r["preds"])  # 9 significant digits round-trip float32
    assert roc_auc_score([float(x["label"]) for x in rows], csv_probs) == r["metrics"]["auc"]


def _raw_and_parquet(tmp_path, rows):
    """The same examples as raw tab-separated lines of tiny_config's layout and as preprocessed Parquet."""
    raw = tmp_path / "raw.tsv"
    raw.write_text("".join("\t".join(r) + "\n" for r in rows))
    cols = {
        S.LABEL: pa.array([float(r[0]) for r in rows], pa.float32()),
        S.DENSE: pa.array([[math.log1p(max(float(r[1] or 0), 0.0))] for r in rows], pa.list_(pa.float32())),
        S.slot_column("a"): pa.array([feature_ids("a", [r[2]] if r[2] else []) for r in rows], pa.list_(pa.uint64())),
        S.slot_column("b"): pa.array([feature_ids("b", [r[3]] if r[3] else []) for r in rows], pa.list_(pa.uint64())),
        S.slot_column("tags"): pa.array(
            [feature_ids("tags", [r[4]] if r[4] else []) for r in rows], pa.list_(pa.uint64())
        ),
        S.TS: pa.array(range(len(rows)), pa.int64()),
        S.SOURCE: pa.array([f"row{i}" for i in range(len(rows))], pa.string()),
    }
    pq.write_table(pa.table(cols, schema=S.arrow_schema(["a", "b", "tags"])), tmp_path / "rows.parquet")
    return str(raw), str(tmp_path / "rows.parquet")


@pytest.mark.processes
def test_predict_raw_delimited_rows_score_like_their_preprocessed_form(trained, tmp_path):
    model, _ = trained
    rows = [["1", "0.5", "3", "17", "4"], ["0", "", "19", "", ""], ["1", "2.5", "7", "1", "9"]]
    raw, parquet = _raw_and_parquet(tmp_path, rows)
    from_raw = predict(model, raw, str(tmp_path / "raw_out.csv"))
    from_parquet = predict(model, parquet, str(tmp_path / "pq_out.csv"))
    assert np.array_equal(from_raw["probability"], from_parquet["probability"])
    assert list(from_raw["label"]) == [1.0, 0.0, 1.0]
    with open(tmp_path / "raw_out.csv") as f:
        out = list(csv.DictReader(f))
    assert [o["source"] for o in out] == [f"{raw}:1", f"{raw}:2", f"{raw}:3"]

    # rows to serve have no label column: same probabilities, no label in the output
    unlabelled = tmp_path / "serve.tsv"
    unlabelled.write_text("".join("\t".join(r[1:]) + "\n" for r in rows))
    served = predict(model, str(unlabelled), str(tmp_path / "served.parquet"))
    assert served["label"] is None
    assert pq.read_table(tmp_path / "served.parquet").column_names == ["source", "probability"]
    assert np.array_equal(served["probability"], from_parquet["probability"])


@pytest.mark.processes
def test_predict_rejects_a_bad_raw_row_naming_file_and_line_and_missing_input(trained, tmp_path):
    model, _ = trained
    bad = tmp_path / "bad.tsv"
    bad.write_text("1\t0.5\t3\t17\t4\n1\tabc\t3\t17\t4\n")
    with pytest.raises(ValueError, match=r"bad.tsv:2: .*x"):
        predict(model, str(bad), str(tmp_path / "o.csv"))
    with pytest.raises(FileNotFoundError):
        predict(model, str(tmp_path / "missing.parquet"), str(tmp_path / "o.csv"))
    other = load_config("movielens")
    with pytest.raises(ValueError, match="differ from the model"):
        predict(model, str(bad), str(tmp_path / "o.csv"), config=other)


def _predict_setting_aside(model: str, tmp_path, name: str, text: str):
    """Write ``text`` to ``tmp_path/name``, score it with a dead-letter file; returns (path, result, dead letters)."""
    import json

    rows = tmp_path / name
    rows.write_text(text)
    dead = tmp_path / f"{name}.dead.jsonl"
    out = predict(model, str(rows), str(tmp_path / f"{name}.csv"), dead_letter=str(dead))
    return rows, out, [json.loads(line) for line in dead.read_text().splitlines()]


@pytest.mark.processes
def test_predict_with_a_dead_letter_file_sets_malformed_rows_aside_and_scores_the_rest(trained, tmp_path):
    model, _ = trained
    rows, out, set_aside = _predict_setting_aside(
        model, tmp_path, "rows.tsv", "1\t0.5\t3\t17\t4\n1\tabc\t3\t17\t4\nshort\n0\t1.5\t2\t18\t5\n"
    )
    assert out["rows"] == 2 and out["malformed"] == 2
    assert [b["source"] for b in set_aside] == [f"{rows}:2", f"{rows}:3"]
    assert set_aside[1]["raw"] == "short" and all(b["reason"] for b in set_aside)
    with open(tmp_path / "rows.tsv.csv") as f:
        sources = [r["source"] for r in csv.DictReader(f)]
    assert sources == [f"{rows}:1", f"{rows}:4"]  # the scored rows keep their own file:line
    only_bad = tmp_path / "only_bad.tsv"  # nothing to score: it fails, but the reasons are kept
    only_bad.write_text("short\n1\tabc\t3\t17\t4\n")
    with pytest.raises(ValueError, match="holds no rows"):
        predict(model, str(only_bad), str(tmp_path / "x.csv"), dead_letter=str(tmp_path / "d3.jsonl"))
    assert len((tmp_path / "d3.jsonl").read_text().splitlines()) == 2
    good = tmp_path / "good.tsv"  # the well-formed rows alone score the same
    good.write_text("1\t0.5\t3\t17\t4\n0\t1.5\t2\t18\t5\n")
    alone = predict(model, str(good), str(tmp_path / "p.csv"))
    assert np.array_equal(alone["probability"], out["probability"]) and alone["malformed"] == 0


RATINGS = [
    "userId,movieId,rating,timestamp",
    "1,1,4.0,1000000000",
    "1,2,3.5,1000000100",
    "2,1,5.0,1000000200",
    "2,3,2.0,1000000300",
    "3,2,4.5,1000000400",
    "3,1,1.0,1000000500",
]
MOVIES = [
    "movieId,title,genres",
    "1,Toy Story (1995),Adventure|Comedy",
    '2,"Babe Ruth Story, The (1948) ",Drama',
    "3,Li'l Quinquin,(no genres listed)",
]
TAGS = ["userId,movieId,tag,timestamp", "5,1,Pixar,999999000", "7,1,Funny,1000000000", "8,1,Later,1000000300"]


def test_predict_raw_movielens_ratings_join_movies_and_tags_like_preprocess(tmp_path, model_factory):
    from persia_core.preprocess.pipeline import run_preprocess

    folder = tmp_path / "ml"
    folder.mkdir()
    for name, lines in (("ratings.csv", RATINGS), ("movies.csv", MOVIES), ("tags.csv", TAGS)):
        (folder / name).write_bytes(("\r\n".join(lines) + "\r\n").encode())
    cfg = RunConfig.from_dict(
        {
            "layout": {"kind": "movielens"},
            "split": {"num_train_shards": 1},
            "slots": [
                {"name": "user", "source": "userId"},
                {"name": "movie", "source": "movieId"},
                {"name": "genres", "source": "genres"},
                {"name": "tags", "source": "tags"},
                {"name": "year", "source": "year"},
                {"name": "user_x_genre", "cross": ["userId", "genres"]},
            ],
            "embedding": {"tables": [{"name": "default", "dim": 4}], "num_shards": 2, "shard_memory_bytes": 1 << 22},
            "model": {"kind": "dnn", "hidden": [8], "bottom": [4]},
        }
    )
    seen = {"user": ["1", "2"], "movie": ["1"], "genres": ["Comedy"], "tags": ["pixar"], "year": ["1995"]}
    model = model_factory(str(tmp_path / "model"), cfg, seen, num_dense=len(cfg.layout.dense_fields()))
    out = tmp_path / "pre"
    run_preprocess(cfg, str(folder), str(out))
    expected = {}
    for split in ("train", "eval"):
        r = predict(model, str(out / split), str(tmp_path / f"{split}.csv"))
        with open(tmp_path / f"{split}.csv") as f:
            for row, p in zip(csv.DictReader(f), r["probability"], strict=True):
                expected[int(row["source"].rsplit(":", 1)[1])] = p
    raw = predict(model, str(folder / "ratings.csv"), str(tmp_path / "raw.csv"))
    assert raw["rows"] == 6 and sorted(expected) == [2, 3, 4, 5, 6, 7]
    assert np.array_equal(raw["probability"], np.array([expected[i] for i in range(2, 8)], dtype=np.float32))
    assert len(set(raw["probability"].tolist())) > 1


@pytest.mark.processes
def test_a_blessed_model_location_serves_like_the_model_it_names(trained, tmp_path):
    """predict and evaluate take the gate's blessed-model location (what daily runs warm-start from) and use its
    latest blessed model."""
    from persia_core.evaluate.gate import bless

    model, data = trained
    r = evaluate(model, data)
    blessed = str(tmp_path / "blessed")
    bless(model, r["metrics"], blessed)
    again = evaluate(blessed, data)
    assert np.array_equal(again["preds"], r["preds"])
    eval_file = os.path.join(data, "eval", "eval-00000-of-00001.parquet")
    predict(blessed, eval_file, str(tmp_path / "p.parquet"))
    assert np.array_equal(pq.read_table(tmp_path / "p.parquet").column("probability").to_numpy(), r["preds"])
    with pytest.raises(FileNotFoundError, match="nor a blessed-model location"):
        evaluate(str(tmp_path), data)


@pytest.mark.processes
def test_predict_decides_once_per_file_whether_rows_carry_a_label(trained, tmp_path):
    # a row one field short in a labelled file is malformed, never read as an unlabelled row with its fields
    # shifted (its label taken for the first feature); and the other way round in an unlabelled file
    model, _ = trained
    labelled, out, (aside,) = _predict_setting_aside(
        model, tmp_path, "labelled.tsv", "1\t0.5\t3\t17\t4\n0\t1.5\t2\t18\n0\t1.5\t2\t18\t5\n"
    )
    assert out["rows"] == 2 and out["malformed"] == 1 and out["label"].tolist() == [1.0, 0.0]
    assert aside["source"] == f"{labelled}:2" and aside["reason"] == "wrong field count: 4 != 5"
    with open(tmp_path / "labelled.tsv.csv") as f:
        assert next(csv.reader(f)) == ["source", "probability", "label"]
    with pytest.raises(ValueError, match=r"labelled.tsv:2: .*wrong field count: 4 != 5"):
        predict(model, str(labelled), str(tmp_path / "o2.csv"))
    unlabelled = tmp_path / "unlabelled.tsv"
    unlabelled.write_text("0.5\t3\t17\t4\n1\t1.5\t2\t18\t5\n1.5\t2\t18\t5\n")
    with pytest.raises(
        ValueError,
        match=r"unlabelled.tsv:2: .*wrong field count: 5 != 4 \(this file's rows have "
        r"no label column",
    ):
        predict(model, str(unlabelled), str(tmp_path / "o3.csv"))
    served = predict(model, str(unlabelled), str(tmp_path / "o4.csv"), dead_letter=str(tmp_path / "d4.jsonl"))
    assert served["rows"] == 2 and served["malformed"] == 1 and served["label"] is None
