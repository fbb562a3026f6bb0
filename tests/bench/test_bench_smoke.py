"""Smoke test of ``make bench`` at a tiny size: every contestant runs and reports its figures (no timing checks)."""

import json
import os

import numpy as np
import pytest
from support import write_dataset

from persia_core.bench import hybrid
from persia_core.bench.baselines import load_indexed
from persia_core.bench.criteo_synth import NUM_DENSE, SLOTS, write_criteo_synth
from persia_core.data.reader import ParquetExamples, shard_files
from persia_core.hashing import feature_id


def test_criteo_synth_writes_one_hashed_id_per_slot_and_a_learnable_label(tmp_path):
    schema = write_criteo_synth(str(tmp_path), train_rows=2003, eval_rows=1000, vocab=300)
    assert schema["rows"]["train"] == 2003 and len(schema["train_files"]) == 4
    ex = ParquetExamples(shard_files(str(tmp_path), "train"), SLOTS)
    assert len(ex) == 2003 and ex.dense.shape == (2003, NUM_DENSE)
    values, offsets = ex.ids["C7"]
    assert np.array_equal(offsets, np.arange(2004))
    vocab = {feature_id("C7", f"{v:08x}") for v in range(300)}
    assert set(values.tolist()) <= vocab
    assert 0.1 < ex.labels.mean() < 0.4
    assert schema["synthetic"]["planted_auc"] > 0.75
    indexed = load_indexed(str(tmp_path))
    assert indexed.train.fixed.shape == (2003, 26) and max(indexed.vocab) <= 300


@pytest.mark.processes
def test_bench_reports_every_contestant_and_null_torchrec_without_its_environment(tmp_path, capsys):
    rc = hybrid.main(
        [
            "--datasets",
            "criteo",
            "--samples",
            "3000",
            "--eval-rows",
            "2000",
            "--vocab",
            "400",
            "--seeds",
            "1",
            "--layouts",
            "1x1",
            "--baseline-threads",
            "1",
            "--batch-size",
            "500",
            "--delay",
            "0.001",
            "--work",
            str(tmp_path / "w"),
            "--torchrec-python",
            str(tmp_path / "no-venv" / "python"),
            "--out",
            str(tmp_path / "bench.jsonl"),
        ]
    )
    assert rc == 0
    out = capsys.readouterr().out.strip().splitlines()
    line = json.loads(out[-1])
    assert line == json.loads((tmp_path / "bench.jsonl").read_text().strip().splitlines()[-1])
    assert line["dataset"] == "criteo_synth" and line["samples"] == 3000
    for who in ("hybrid", "sync", "plain_torch"):
        assert line[f"{who}_sps"] > 0
        assert 0.0 <= line[f"{who}_auc"] <= 1.0
        assert line[f"{who}_logloss"] > 0
    assert line["hybrid_delay_sps"] > 0 and line["sync_delay_sps"] > 0
    assert line["max_staleness"] <= 4 and line["sync_max_staleness"] == 0
    assert line["torchrec_sps"] is None and line["torchrec_auc"] is None
    assert "not found" in line["torchrec_error"]
    assert line["hybrid_vs_plain_torch"] == pytest.approx(line["hybrid_sps"] / line["plain_torch_sps"], rel=1e-3)
    assert not os.path.exists(tmp_path / "w" / "criteo_synth-hybrid-1x1-s0")  # models cleaned up


def test_layouts_must_be_workers_x_threads():
    assert hybrid.parse_layouts("1x2, 2x1") == [(1, 2), (2, 1)]
    with pytest.raises(ValueError, match="MxT"):
        hybrid.parse_layouts("two")


def test_indexing_drops_eval_ids_never_seen_in_training_from_their_bags(tmp_path):
    tiny_data = write_dataset(str(tmp_path), rows=16, shards=2, eval_rows=64)
    data = load_indexed(tiny_data)
    raw = ParquetExamples(shard_files(tiny_data, "eval"), data.slots)
    train = ParquetExamples(shard_files(tiny_data, "train"), data.slots)
    s = data.slots.index("b")
    vocab = np.unique(train.ids["b"][0])
    v, o = raw.ids["b"]
    rows = np.arange(len(raw))
    values, lengths = data.eval.batch(rows)
    got = np.split(values, np.cumsum(lengths)[:-1])[s * len(rows) : (s + 1) * len(rows)]
    for r in rows:
        want = [int(np.searchsorted(vocab, x)) for x in v[o[r] : o[r + 1]] if x in set(vocab.tolist())]
        assert got[r].tolist() == want
    assert data.vocab[s] == len(vocab)
    assert sum(len(g) for g in got) < len(v)  # some eval IDs were unseen


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the machine without CUDA")
def test_device_check_without_cuda_says_so_writes_its_json_and_exits_0(tmp_path, capsys):
    from persia_core.bench import device_check

    assert device_check.main(["--out", str(tmp_path)]) == 0
    written = json.loads((tmp_path / "device_check.json").read_text())
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert json.loads(last) == written
    assert written["skipped"] == "CUDA is not available on this machine" and written["gpu"] is None


@pytest.mark.processes
def test_device_check_with_a_python_without_torch_names_what_it_needs(tmp_path):
    # the device machine runs it with its own python3; one without torch gets a sentence, not a traceback
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['torch'] = None; from persia_core.bench import device_check; "
        f"sys.exit(device_check.main(['--out', {str(tmp_path)!r}]))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    written = json.loads((tmp_path / "device_check.json").read_text())
    assert "has no torch: run with a python3 that has a CUDA build of torch" in written["skipped"]
    assert "Traceback" not in r.stderr


def test_bench_preprocess_reports_each_runs_seconds_and_the_rows_as_a_json_last_line(tmp_path, capsys):
    from persia_core.bench import preprocess as bench_preprocess

    folder = tmp_path / "ml"
    folder.mkdir()
    (folder / "movies.csv").write_text("movieId,title,genres\n1,A (1999),Drama\n2,B (2001),Comedy|Drama\n")
    (folder / "ratings.csv").write_text(
        "userId,movieId,rating,timestamp\n" + "".join(f"{u},{u % 2 + 1},4.0,{1000 + u}\n" for u in range(1, 11))
    )
    (folder / "tags.csv").write_text("userId,movieId,tag,timestamp\n")
    assert bench_preprocess.main(["--data", str(folder), "--repeats", "1"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    out = json.loads(lines[-1])
    assert out["rows"] == {"train": 8, "eval": 2, "malformed": 0, "read": 10}
    assert len(out["seconds"]) == 1 and out["median_seconds"] == out["seconds"][0] > 0
    # median_seconds is rounded to 0.01 s, rows_per_s from the unrounded median
    assert out["rows_per_s"] == pytest.approx(10 / out["median_seconds"], rel=0.01, abs=0.1)
    assert lines[0].startswith("run 1: 10 rows read, 8 train, 2 eval in ")
