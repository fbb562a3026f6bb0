"""persia_core.data.tfrecord: tf.train.Example records become the same delimited lines, and through preprocess
the same Parquet rows, as the equivalent CSV. Runs in .venv-tfrecord; preprocess runs in the main .venv."""

import json
import os
import subprocess

import numpy as np
import pytest
import tensorflow as tf

from persia_core.config import RunConfig
from persia_core.data import tfrecord
from persia_core.preprocess.layouts import parse_delimited

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MAIN_PYTHON = os.environ.get("PERSIA_MAIN_PYTHON", os.path.join(ROOT, ".venv", "bin", "python"))
COLUMNS = ["label", "I1", "I2", "F1", "C1", "C2", "C3"]


def _config_dict():
    return {
        "layout": {
            "kind": "delimited",
            "delimiter": "\t",
            "columns": COLUMNS,
            "label_column": "label",
            "dense_columns": ["I1", "I2", "F1"],
            "dense_transform": "log1p",
        },
        "split": {"eval_fraction": 0.25, "num_train_shards": 2, "num_eval_shards": 1},
        "slots": [
            {"name": "C1", "source": "C1"},
            {"name": "C2", "source": "C2"},
            {"name": "C1xC3", "cross": ["C1", "C3"]},
        ],
        "embedding": {"tables": [{"name": "default", "dim": 4}], "num_shards": 1},
        "trainer": {"num_workers": 1, "epochs": 1},
    }


def _rows(n=240, seed=0):
    """Rows as (CSV fields, Example features); None = missing."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        label = int(rng.random() < 0.3)
        i1 = None if rng.random() < 0.1 else int(rng.integers(0, 1000))
        i2 = int(rng.integers(-5, 50))
        f1 = None if rng.random() < 0.2 else float(np.float32(rng.choice([0.1, 0.25, 2.5, 1e-3, 17.0])))
        c1 = f"{rng.integers(0, 2**32):08x}"
        c2 = None if rng.random() < 0.15 else f"v{rng.integers(0, 40)}"
        c3 = f"é{rng.integers(0, 5)}"
        out.append({"label": label, "I1": i1, "I2": i2, "F1": f1, "C1": c1, "C2": c2, "C3": c3})
    return out


def _csv_line(row):
    def text(name, v):
        if v is None:
            return ""
        return tfrecord.format_float32(v) if name == "F1" else str(v)

    return "\t".join(text(c, row[c]) for c in COLUMNS)


def _example(row, empty_lists=False):
    feats = {}
    for name, v in row.items():
        if v is None:
            if empty_lists:  # present but empty: also missing
                feats[name] = tf.train.Feature(bytes_list=tf.train.BytesList(value=[]))
            continue
        if name == "F1":
            feats[name] = tf.train.Feature(float_list=tf.train.FloatList(value=[v]))
        elif isinstance(v, int):
            feats[name] = tf.train.Feature(int64_list=tf.train.Int64List(value=[v]))
        else:
            feats[name] = tf.train.Feature(bytes_list=tf.train.BytesList(value=[v.encode("utf-8")]))
    return tf.train.Example(features=tf.train.Features(feature=feats)).SerializeToString()


@pytest.fixture
def data(tmp_path):
    """The same rows as a CSV folder and as a TFRecord folder (one GZIP file), plus the run config YAML."""
    import yaml

    rows = _rows()
    csv_dir, tf_dir = tmp_path / "csv", tmp_path / "tfrecord"
    csv_dir.mkdir()
    tf_dir.mkdir()
    halves = [rows[:120], rows[120:]]
    for k, part in enumerate(halves):
        (csv_dir / f"day_{k}.tsv").write_text("".join(_csv_line(r) + "\n" for r in part), encoding="utf-8")
        name = f"day_{k}.tfrecord" + (".gz" if k == 1 else "")
        opts = tf.io.TFRecordOptions(compression_type="GZIP" if k == 1 else "")
        with tf.io.TFRecordWriter(str(tf_dir / name), opts) as w:
            for i, r in enumerate(part):
                w.write(_example(r, empty_lists=bool(i % 2)))
    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump(_config_dict()))
    return {"csv": str(csv_dir), "tfrecord": str(tf_dir), "config": str(cfg), "tmp": tmp_path}


def test_tfrecord_examples_become_the_lines_of_the_equivalent_csv(data):
    out = str(data["tmp"] / "converted")
    written = tfrecord.convert(data["tfrecord"], out, data["config"])
    assert [os.path.basename(p) for p in written] == ["day_0.tsv", "day_1.tsv"]
    layout = RunConfig.from_dict(_config_dict()).layout
    for name in ("day_0.tsv", "day_1.tsv"):
        got = open(os.path.join(out, name), encoding="utf-8").read()
        want = open(os.path.join(data["csv"], name), encoding="utf-8").read()
        assert got == want
        for a, b in zip(got.splitlines(), want.splitlines(), strict=True):
            assert parse_delimited(a, layout) == parse_delimited(b, layout)


def _parquet_rows(folder):
    import pyarrow.parquet as pq

    schema = json.load(open(os.path.join(folder, "schema.json")))
    out = {}
    for split in ("train", "eval"):
        rows = []
        for f in schema[f"{split}_files"]:
            t = pq.read_table(os.path.join(folder, f)).to_pylist()
            for r in t:
                line = r.pop("source").rsplit(":", 1)
                r["source"] = (os.path.basename(line[0]), int(line[1]))
                rows.append(json.dumps(r, sort_keys=True, default=str))
        out[split] = sorted(rows)
    return schema, out


@pytest.mark.timeout(600)
def test_tfrecord_input_gives_the_same_parquet_rows_as_the_equivalent_csv(data):
    if not os.path.exists(MAIN_PYTHON):
        pytest.fail(f"the main environment's python {MAIN_PYTHON} is missing (make venv); set PERSIA_MAIN_PYTHON")
    converted = str(data["tmp"] / "converted")
    tfrecord.convert(os.path.join(data["tfrecord"], "day_*"), converted, data["config"])
    results = {}
    for name, src in (("csv", data["csv"]), ("tfrecord", converted)):
        out = str(data["tmp"] / f"pre-{name}")
        subprocess.run(
            [
                MAIN_PYTHON,
                "-m",
                "persia_core.preprocess.pipeline",
                "--data",
                src,
                "--output",
                out,
                "--config",
                data["config"],
            ],
            check=True,
            cwd=ROOT,
            capture_output=True,
            timeout=500,
        )
        results[name] = _parquet_rows(out)
    (schema_csv, rows_csv), (schema_tf, rows_tf) = results["csv"], results["tfrecord"]
    assert rows_csv == rows_tf
    assert len(rows_csv["train"]) + len(rows_csv["eval"]) == 240
    for key in ("rows", "distinct_ids", "dense_mean", "dense_std", "split"):
        assert schema_csv[key] == schema_tf[key]


def test_tfrecord_features_without_a_delimited_form_fail_naming_the_record(data, tmp_path):
    layout = RunConfig.from_dict(_config_dict()).layout
    row = _rows(1)[0]
    multi = tf.train.Example.FromString(_example(row))
    multi.features.feature["C2"].bytes_list.value[:] = [b"a", b"b"]
    with pytest.raises(ValueError, match="record 0: feature 'C2' has 2 values"):
        list(tfrecord.examples_to_lines([multi.SerializeToString()], layout, "f: "))
    tab = dict(row, C3="a\tb")
    with pytest.raises(ValueError, match="'C3' holds the delimiter"):
        list(tfrecord.examples_to_lines([_example(tab)], layout))
    with pytest.raises(FileNotFoundError, match="no TFRecord files"):
        tfrecord.convert(str(tmp_path / "nothing" / "*.tfrecord"), str(tmp_path / "o"), data["config"])
    with pytest.raises(ValueError, match="delimited layout"):
        tfrecord.convert(data["tfrecord"], str(tmp_path / "o"), "movielens")


def test_tfrecord_cli_converts_a_folder(data, capsys):
    out = str(data["tmp"] / "cli")
    assert tfrecord.main(["--input", data["tfrecord"], "--output", out, "--config", data["config"]]) == 0
    assert capsys.readouterr().out.split() == [os.path.join(out, "day_0.tsv"), os.path.join(out, "day_1.tsv")]
    with pytest.raises(SystemExit):
        tfrecord.main(["--input", data["tfrecord"], "--output", out, "--config", "movielens"])


def test_tfrecord_on_gcs_converts_into_a_bucket(data):
    """gs:// in and out, against the Cloud Storage emulator."""
    from gcs.emulator import running_emulator

    from persia_core import io

    with running_emulator():
        io.gcs_client().create_bucket("tfr")
        for name in sorted(os.listdir(data["tfrecord"])):
            io.copy(os.path.join(data["tfrecord"], name), f"gs://tfr/in/{name}")
        written = tfrecord.convert("gs://tfr/in", "gs://tfr/text", data["config"])
        assert written == ["gs://tfr/text/day_0.tsv", "gs://tfr/text/day_1.tsv"]
        assert tfrecord.input_files("gs://tfr/in/*.gz") == ["gs://tfr/in/day_1.tfrecord.gz"]
        for path in written:
            want = open(os.path.join(data["csv"], os.path.basename(path)), encoding="utf-8").read()
            assert io.read_text(path) == want
