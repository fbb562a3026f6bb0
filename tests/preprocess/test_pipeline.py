"""The Beam preprocess pipeline (persia_core.preprocess.pipeline) on real files with the DirectRunner."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import apache_beam as beam
import numpy as np
import pyarrow.parquet as pq
import pytest
import yaml
from apache_beam.runners.portability.fn_api_runner import FnApiRunner
from apache_beam.testing import test_pipeline
from apache_beam.testing.util import assert_that, equal_to

from persia_core.config import load_config, parse_overrides
from persia_core.data import schema
from persia_core.data.synthetic import write_criteo_tsv
from persia_core.hashing import cross_values, feature_ids
from persia_core.preprocess import layouts, pipeline
from persia_core.preprocess.delimited import ParseDelimited
from persia_core.preprocess.pipeline import malformed_summary
from persia_core.preprocess.read import ReadFileLinesFn
from persia_core.preprocess.rows import LABEL, SOURCE, TS, dead_letter, decode_row, encode_row, rows_to_table
from persia_core.preprocess.split import SplitAndShard
from persia_core.preprocess.stats import DenseStatsFn, DistinctIdsFn, MalformedSummaryFn, shard_bounds, split_cutoff


def by_line(rows: list[dict]) -> dict[int, dict]:
    return {int(r["source"].rsplit(":", 1)[1]): r for r in rows}


# ----------------------------------------------------------------------------------------------- MovieLens


@pytest.mark.processes
def test_same_slot_value_gives_same_id_in_two_separate_python_processes(tiny_movielens_run, helpers):
    out, _ = tiny_movielens_run
    row = by_line(helpers.read_split(out))[2]  # user 1, movie 1 (Toy Story), genres start with Adventure
    code = (
        "from persia_core.hashing import feature_id, CROSS_SEP;"
        "print(feature_id('user', '1'), feature_id('movie', '1'),"
        "      feature_id('user_x_genre', '1' + CROSS_SEP + 'Adventure'))"
    )
    outputs = []
    for seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
        outputs.append([int(v) for v in res.stdout.split()])
    assert outputs[0] == outputs[1]
    assert outputs[0] == [row["slot_user"][0], row["slot_movie"][0], row["slot_user_x_genre"][0]]


def test_movielens_rating_tags_include_only_tags_strictly_before_its_timestamp(tiny_movielens_run, helpers):
    out, _ = tiny_movielens_run
    rows = by_line(helpers.read_split(out))
    assert rows[2]["slot_tags"] == feature_ids("tags", ["pixar"])  # "Funny" at exactly the rating's second: excluded
    assert rows[4]["slot_tags"] == feature_ids("tags", ["funny", "pixar"])
    assert rows[10]["slot_tags"] == feature_ids("tags", ['dwayne "the rock" johnson', "later", "funny", "pixar"])
    assert rows[3]["slot_tags"] == []  # movie 2 has no tags


def test_missing_year_gives_empty_year_slot_and_is_not_malformed(tiny_movielens_run, helpers):
    out, _ = tiny_movielens_run
    rows = by_line(helpers.read_split(out))
    assert rows[5]["slot_year"] == [] and rows[6]["slot_year"] == []  # "Li'l Quinquin", "Fawlty Towers (1975-1979)"
    assert rows[5]["dense"][2] == 0.0
    assert rows[3]["slot_year"] == feature_ids("year", ["1948"])
    dead_sources = {d["source"] for d in helpers.read_dead_letters(out)}
    assert not any(s.endswith((":5", ":6")) for s in dead_sources)


def test_crossed_user_x_genre_slot_has_one_id_per_genre(tiny_movielens_run, helpers):
    out, _ = tiny_movielens_run
    row = by_line(helpers.read_split(out))[2]
    genres = ["Adventure", "Animation", "Children", "Comedy", "Fantasy"]
    assert row["slot_genres"] == feature_ids("genres", genres)
    assert row["slot_user_x_genre"] == feature_ids("user_x_genre", cross_values([["1"], genres]))
    assert len(row["slot_user_x_genre"]) == len(genres)


def test_empty_multi_hot_list_is_stored_as_an_empty_list_not_null(tiny_movielens_run, helpers):
    out, _ = tiny_movielens_run
    row = by_line(helpers.read_split(out))[5]  # (no genres listed)
    assert row["slot_genres"] == [] and row["slot_user_x_genre"] == [] and row["slot_tags"] == []
    table = helpers.concat(out, "train")
    for name in table.column_names:
        assert table[name].null_count == 0


def test_unknown_movie_id_and_bad_rating_are_dead_letters_with_line_numbers(tiny_movielens_run, helpers):
    out, result = tiny_movielens_run
    dead = sorted(helpers.read_dead_letters(out), key=lambda d: d["source"])
    ratings = os.path.join(os.path.dirname(dead[0]["source"]), "ratings.csv")
    assert dead == [
        {"source": f"{ratings}:7", "reason": "unknown movieId: 99", "raw": "3,99,4.0,1000000500"},
        {"source": f"{ratings}:8", "reason": "unparsable number in rating: 'abc'", "raw": "4,1,abc,1000000600"},
    ]
    assert result["rows"] == {"train": 6, "eval": 2, "malformed": 2, "read": 10}
    assert len(helpers.read_split(out)) == 8


def test_schema_json_and_run_config_yaml_describe_the_output(tiny_movielens_run):
    out, result = tiny_movielens_run
    with open(os.path.join(out, schema.SCHEMA_FILE)) as f:
        on_disk = json.load(f)
    assert on_disk == result
    assert set(result) >= {
        "slots",
        "dense",
        "dense_mean",
        "dense_std",
        "rows",
        "distinct_ids",
        "split",
        "train_files",
        "eval_files",
        "config",
    }
    assert result["slots"] == ["user", "movie", "genres", "tags", "year", "user_x_genre", "history", "liked_history"]
    assert result["dense"] == ["hour", "weekday", "movie_age", "user_prior_ratings", "user_prior_like_rate"]
    assert result["split"] == {"by": "time", "cutoff": 1000000800, "eval_fraction": 0.2}
    assert result["train_files"] == ["train/train-00000-of-00002.parquet", "train/train-00001-of-00002.parquet"]
    assert result["eval_files"] == ["eval/eval-00000-of-00001.parquet"]
    for f in result["train_files"] + result["eval_files"]:
        assert pq.read_schema(os.path.join(out, f)).equals(schema.arrow_schema(result["slots"]))
    assert result["distinct_ids"]["user"] == 5 and result["distinct_ids"]["genres"] == 6
    with open(os.path.join(out, "run_config.yaml")) as f:
        assert yaml.safe_load(f) == result["config"]
    assert load_config(os.path.join(out, "run_config.yaml")).to_dict() == result["config"]


def test_dense_mean_and_std_are_population_statistics_of_the_train_split(tiny_movielens_run, helpers):
    out, result = tiny_movielens_run
    dense = np.array([r["dense"] for r in helpers.read_split(out, "train")], np.float64)
    np.testing.assert_allclose(result["dense_mean"], dense.mean(axis=0), rtol=1e-12)
    std = dense.std(axis=0)
    np.testing.assert_allclose(result["dense_std"], np.where(std == 0, 1.0, std), rtol=1e-12)


def test_time_split_eval_is_the_last_fifth_by_timestamp(movielens_dir, tmp_path, helpers):
    cfg = helpers.config_with("movielens", split__max_rows=3000)
    result = helpers.run(cfg, movielens_dir, str(tmp_path))
    train, evals = helpers.read_split(str(tmp_path), "train"), helpers.read_split(str(tmp_path), "eval")
    assert max(r["ts"] for r in train) < result["split"]["cutoff"] <= min(r["ts"] for r in evals)
    n = len(train) + len(evals)
    assert n == result["rows"]["read"] == 3000
    assert abs(len(evals) - 0.2 * n) <= 1
    lines = sorted(int(r["source"].rsplit(":", 1)[1]) for r in train + evals)
    assert lines == list(range(2, 3002))  # max_rows keeps the first data lines of ratings.csv


def test_ties_at_the_cutoff_all_go_to_eval_in_the_split_composite():
    specs = [("s", ["a"], False)]
    rows = [
        encode_row({"label": 1.0, "dense": [], "fields": {"a": ["x"]}}, specs, f"f:{i}", ts)
        for i, ts in enumerate([1, 2, 3, 3, 3, 4, 5, 6, 7, 8])
    ]
    with test_pipeline.TestPipeline(runner=FnApiRunner()) as p:
        out = p | beam.Create(rows) | SplitAndShard(0.8, 2, 1)
        # n = 10, floor(0.2 * 10) = 2 -> cutoff = sorted_ts[2] = 3: all three rows at ts 3 are eval
        assert_that(
            out["plan"] | beam.Map(lambda plan: (plan["cutoff"], plan["train"], plan["eval"])),
            equal_to([(3, 2, 8)]),
            label="CheckPlan",
        )
        assert_that(
            out["keyed"] | beam.Map(lambda kv: (kv[0][0], kv[1][TS])),
            equal_to([("train", 1), ("train", 2)] + [("eval", t) for t in (3, 3, 3, 4, 5, 6, 7, 8)]),
            label="CheckSplit",
        )


@pytest.mark.processes
def test_full_movielens_preprocess_from_the_command_line_writes_every_rating(movielens_dir, tmp_path, helpers):
    # the time it takes is measured by make bench-preprocess, not here
    out = str(tmp_path / "out")
    cmd = [sys.executable, "-m", "persia_core", "preprocess", "--data", movielens_dir, "--output", out]
    res = subprocess.run([*cmd, "--config", "movielens"], capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stderr[-2000:]
    expected = {"train": 84271, "eval": 21068, "malformed": 0, "read": 105339}
    assert json.loads(res.stdout.strip().splitlines()[-1])["rows"] == expected
    with open(os.path.join(out, schema.SCHEMA_FILE)) as f:
        result = json.load(f)
    assert result["rows"] == expected
    counts = [pq.read_metadata(os.path.join(out, f)).num_rows for f in result["train_files"]]
    assert sum(counts) == 84271 and max(counts) - min(counts) <= 1
    assert pq.read_metadata(os.path.join(out, result["eval_files"][0])).num_rows == 21068
    assert 640 <= result["distinct_ids"]["user"] <= 700  # 668 users; a HyperLogLog estimate
    assert 18 <= result["distinct_ids"]["genres"] <= 20  # 19 genres (+ none for "(no genres listed)")
    assert helpers.read_dead_letters(out) == []


# ----------------------------------------------------------------------------------------------- delimited


@pytest.fixture(scope="module")
def criteo_file(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("criteo") / "day_0.tsv")
    info = write_criteo_tsv(path, 2000, seed=3, malformed_rows=12)
    return path, info


def test_criteo_malformed_rows_go_to_dead_letter_with_line_numbers_and_counts_add_up(criteo_file, tmp_path, helpers):
    path, info = criteo_file
    cfg = helpers.config_with("criteo", split__max_malformed_fraction=0.01)
    result = helpers.run(cfg, path, str(tmp_path))
    dead = helpers.read_dead_letters(str(tmp_path))
    assert sorted(int(d["source"].rsplit(":", 1)[1]) for d in dead) == info["malformed_lines"]
    assert all(d["source"].rsplit(":", 1)[0] == path for d in dead)
    reasons = {int(d["source"].rsplit(":", 1)[1]): d["reason"] for d in dead}
    for line, kind in zip(info["malformed_lines"], info["malformed_kinds"], strict=True):
        expected = "wrong field count: 39 != 40" if kind == "wrong field count" else "unparsable number in I3: 'abc'"
        assert reasons[line] == expected
    with open(path) as f:
        raw = f.read().split("\n")
    assert all(d["raw"] == raw[int(d["source"].rsplit(":", 1)[1]) - 1] for d in dead)
    rows = helpers.read_split(str(tmp_path))
    lines = {int(r["source"].rsplit(":", 1)[1]) for r in rows}
    assert lines == set(range(1, info["lines"] + 1)) - set(info["malformed_lines"])
    assert result["rows"] == {"train": 1600, "eval": 400, "malformed": 12, "read": 2012}
    summary = malformed_summary(str(tmp_path))  # what make run prints and the report shows
    assert summary["rows"] == 12 and sum(summary["by_reason"].values()) == 12
    assert set(summary["by_reason"]) == set(info["malformed_kinds"])
    assert summary["dead_letter"].endswith("dead_letter")
    assert malformed_summary(str(tmp_path / "nothing-here")) is None
    assert result["split"]["by"] == "row_order"
    assert all(r["ts"] == int(r["source"].rsplit(":", 1)[1]) - 1 for r in rows)  # global row number, 0-based
    assert sum(r["label"] for r in rows) == info["positives"]


def test_past_max_malformed_fraction_the_run_raises_naming_file_and_reason(criteo_file, tmp_path, helpers):
    path, _ = criteo_file
    cfg = helpers.config_with("criteo", split__max_malformed_fraction=0.001)
    with pytest.raises(ValueError) as e:
        helpers.run(cfg, path, str(tmp_path))
    msg = str(e.value)
    assert "12 of 2012 rows are malformed" in msg
    assert f"most in {path} (12 lines)" in msg
    # 6 lines of each kind: the tie goes to the kind that sorts last
    assert "commonest reason 'wrong field count' (6 lines, e.g. 'wrong field count: 39 != 40')" in msg
    assert not os.path.exists(os.path.join(str(tmp_path), schema.SCHEMA_FILE))
    assert len(helpers.read_dead_letters(str(tmp_path))) == 12


def test_every_train_shard_is_non_empty_and_balanced_with_few_rows(tmp_path, helpers):
    path = str(tmp_path / "in" / "small.tsv")
    write_criteo_tsv(path, 9, seed=1)
    cfg = helpers.config_with("criteo", split__num_train_shards=7, split__num_eval_shards=3)
    out = str(tmp_path / "out")
    result = helpers.run(cfg, path, out)
    assert result["rows"]["train"] == 7 and result["rows"]["eval"] == 2
    train = [pq.read_table(os.path.join(out, f)).num_rows for f in result["train_files"]]
    evals = [pq.read_table(os.path.join(out, f)).num_rows for f in result["eval_files"]]
    assert train == [1] * 7
    assert sorted(evals) == [0, 1, 1]  # fewer eval rows than shards: an empty shard is still a valid file


def test_folder_input_is_read_in_name_order_with_global_row_numbers_and_max_rows(tmp_path, helpers):
    folder = tmp_path / "days"
    write_criteo_tsv(str(folder / "day_1.tsv"), 30, seed=1)
    write_criteo_tsv(str(folder / "day_0.tsv"), 20, seed=0)
    cfg = helpers.config_with("criteo", split__max_rows=35)
    out = str(tmp_path / "out")
    result = helpers.run(cfg, str(folder), out)
    assert result["rows"]["read"] == 35
    rows = helpers.read_split(out)
    assert [(os.path.basename(r["source"]), r["ts"]) for r in rows] == (
        [(f"day_0.tsv:{i + 1}", i) for i in range(20)] + [(f"day_1.tsv:{i + 1}", 20 + i) for i in range(15)]
    )
    assert min(r["ts"] for r in helpers.read_split(out, "eval")) == 28


def test_gzip_input_and_glob_are_read(tmp_path, odd_files_run, helpers):
    folder, _, out, _ = odd_files_run
    rows = helpers.read_split(out)
    assert len(_of(rows, folder / "d.tsv.gz")) == 40  # a .gz file in a folder, read with the others
    assert {r["source"].rsplit(":", 1)[0] for r in rows} == set(os.listdir(folder))  # named in the input folder
    for name in ("a.tsv.gz", "b.tsv.gz", "c.tsv"):
        (tmp_path / name).write_bytes(b"")
    got = pipeline.resolve_inputs(helpers.config_with("criteo"), str(tmp_path / "*.gz"))
    assert got == {"files": [str(tmp_path / "a.tsv.gz"), str(tmp_path / "b.tsv.gz")]}  # a glob: its matches


def test_parse_delimited_composite_routes_bad_lines_to_dead_letters():
    cfg = load_config("criteo")
    good = "\t".join(["1", *["2"] * 13, *["abcd0123"] * 26])
    lines = [("f.tsv", 1, 0, good), ("f.tsv", 2, 1, "1\t2"), ("f.tsv", 3, 2, good.replace("1", "x", 1))]
    with test_pipeline.TestPipeline(runner=FnApiRunner()) as p:
        out = p | beam.Create(lines) | ParseDelimited(cfg)
        assert_that(
            out["rows"] | beam.Map(lambda r: (r[SOURCE], r[TS], r[LABEL])),
            equal_to([("f.tsv:1", 0, 1.0)]),
            label="CheckRows",
        )
        assert_that(
            out["dead"] | beam.Map(lambda d: (d["source"], d["reason"])),
            equal_to([("f.tsv:2", "wrong field count: 2 != 40"), ("f.tsv:3", "label not 0/1 in label: 'x'")]),
            label="CheckDead",
        )


def test_encoded_row_decodes_to_the_parquet_columns():
    specs = [("a", ["a"], False), ("ab", ["a", "b"], True)]
    record = {"label": 0.0, "dense": [0.5, 2.0], "fields": {"a": ["x", "y"], "b": ["z"]}, "ts": 7}
    row = encode_row(record, specs, "f:3", 7)
    assert decode_row(row, ["a", "ab"]) == {
        "label": 0.0,
        "dense": [0.5, 2.0],
        "slot_a": feature_ids("a", ["x", "y"]),
        "slot_ab": feature_ids("ab", ["x\x1ez", "y\x1ez"]),
        "ts": 7,
        "source": "f:3",
    }
    table = rows_to_table([row, row], ["a", "ab"], 2)
    assert table.schema.equals(schema.arrow_schema(["a", "ab"]))
    assert table.to_pylist()[1] == decode_row(row, ["a", "ab"])


def test_rerun_with_fewer_shards_removes_stale_shard_files_and_output_is_deterministic(tmp_path, helpers):
    path = str(tmp_path / "in.tsv")
    write_criteo_tsv(path, 200, seed=2)
    out = str(tmp_path / "out")
    first = helpers.run(helpers.config_with("criteo", split__num_train_shards=3), path, out)
    tables = [pq.read_table(os.path.join(out, f)) for f in first["train_files"]]
    second = helpers.run(helpers.config_with("criteo", split__num_train_shards=2), path, out)
    assert sorted(os.listdir(os.path.join(out, "train"))) == [os.path.basename(f) for f in second["train_files"]]
    third = helpers.run(helpers.config_with("criteo", split__num_train_shards=3), path, out)
    assert third == first
    assert all(pq.read_table(os.path.join(out, f)).equals(t) for f, t in zip(third["train_files"], tables, strict=True))


def test_main_splits_our_flags_from_beam_options_and_applies_set_overrides(tiny_movielens_run):
    # tiny_movielens_run is pipeline.main's run with TINY_MOVIELENS_ARGS: --set overrides and Beam options
    out, result = tiny_movielens_run
    assert len(result["train_files"]) == 2  # the shipped config has 4
    assert sorted(os.listdir(os.path.join(out, "train"))) == [os.path.basename(f) for f in result["train_files"]]
    assert result["config"]["split"]["max_malformed_fraction"] == 0.5
    assert result["config"]["split"]["num_train_shards"] == 2
    with pytest.raises(ValueError, match="key=value"):
        parse_overrides(["split.max_rows"])


def test_missing_input_raises_file_not_found_naming_the_path(tmp_path, helpers):
    with pytest.raises(FileNotFoundError, match="ratings"):
        helpers.run(helpers.config_with("movielens"), str(tmp_path), str(tmp_path / "out"))
    with pytest.raises(FileNotFoundError, match="no input files"):
        helpers.run(helpers.config_with("criteo"), str(tmp_path / "nothing*.tsv"), str(tmp_path / "out"))


def test_split_cutoff_and_shard_bounds_formulas():
    ts = np.array([5, 1, 4, 2, 3], np.int64)
    assert split_cutoff(ts, 0.2) == 5  # floor(0.8 * 5) = 4 -> sorted[4]
    assert split_cutoff(ts, 0.5) == 3  # floor(2.5) = 2
    assert split_cutoff(np.zeros(0, np.int64), 0.2) == 0
    keys = np.arange(10, dtype=np.int64)[::-1]
    bounds = shard_bounds(keys, 4)
    sizes = np.bincount([np.searchsorted(bounds, k, side="right") for k in keys], minlength=4)
    assert bounds == [2, 5, 7] and sizes.tolist() == [2, 3, 2, 3]


@pytest.fixture(scope="module")
def odd_files_run(tmp_path_factory):
    """One preprocess run over a folder of files with odd bytes, each file a case of its own test: a line that
    is not UTF-8 (bad.tsv), classic-Mac CR-only line ends (cr.tsv), blank lines (blank.tsv), gzip (d.tsv.gz).
    Returns ``(input folder, result, output folder, raw lines of bad.tsv)``."""
    folder = tmp_path_factory.mktemp("odd_files")
    bad = folder / "bad.tsv"
    write_criteo_tsv(str(bad), 300, seed=4)
    raw = bad.read_bytes().split(b"\n")
    raw[9] = raw[9].replace(b"\t", b"\t\xff", 1)
    bad.write_bytes(b"\n".join(raw))
    cr = folder / "cr.tsv"
    write_criteo_tsv(str(cr), 50, seed=5)
    cr.write_bytes(b"\r".join(cr.read_bytes().split(b"\n")))
    blank = folder / "blank.tsv"
    write_criteo_tsv(str(blank), 60, seed=6)
    lines = blank.read_text().splitlines()
    lines[10:10] = ["", "  \t "]
    lines[40] = "1\t2"  # line 41 of the file: malformed
    blank.write_text("\n".join(lines) + "\n\n")
    write_criteo_tsv(str(folder / "d.tsv.gz"), 40, seed=5)
    out = str(tmp_path_factory.mktemp("odd_files_out"))
    result = pipeline.run_preprocess(load_config("criteo", {"split.max_malformed_fraction": 0.05}), str(folder), out)
    return folder, result, out, raw


def _of(records: list[dict], path) -> list[dict]:
    """The records of file ``path``: dead letters name it as found, rows by its name in the input folder."""
    return [r for r in records if r["source"].rsplit(":", 1)[0] in (str(path), path.name)]


def test_not_utf8_line_is_a_dead_letter(odd_files_run, helpers):
    folder, _, out, raw = odd_files_run
    rows, dead = helpers.read_split(out), helpers.read_dead_letters(out)
    path = folder / "bad.tsv"
    assert [(d["source"], d["reason"]) for d in _of(dead, path)] == [(f"{path}:10", "not utf-8")]
    assert len(_of(rows, path)) == 299
    # the line's exact bytes are kept (before: only the text with U+FFFD in place of the bad byte)
    import base64

    bad = _of(dead, path)[0]
    assert base64.b64decode(bad["raw_base64"]) == raw[9] and "\ufffd" in bad["raw"]


def test_cr_only_line_ends_give_one_row_per_line(odd_files_run, helpers):
    # classic Mac files: before, the whole file was one line (1 row read, a dead letter "wrong field count: 201")
    folder, _, out, _ = odd_files_run
    rows, dead = helpers.read_split(out), helpers.read_dead_letters(out)
    path = folder / "cr.tsv"
    assert sorted(int(r["source"].rsplit(":", 1)[1]) for r in _of(rows, path)) == list(range(1, 51))
    assert _of(dead, path) == []


def test_blank_lines_are_not_rows_and_keep_the_line_numbers(odd_files_run, helpers):
    # a blank or whitespace-only line holds no data: before, it was a malformed row ("wrong field count: 1 != 40")
    # and one of them failed a small file on the malformed budget; a bad line after it is still named by its line
    folder, _, out, _ = odd_files_run
    rows, dead = helpers.read_split(out), helpers.read_dead_letters(out)
    path = folder / "blank.tsv"
    assert len(_of(rows, path)) == 59
    assert [(d["source"], d["reason"]) for d in _of(dead, path)] == [(f"{path}:41", "wrong field count: 2 != 40")]
    assert {11, 12, 63, 64}.isdisjoint(int(r["source"].rsplit(":", 1)[1]) for r in _of(rows, path))


def test_a_folder_of_odd_files_adds_up(odd_files_run, helpers):
    _, result, out, _ = odd_files_run
    rows, dead = helpers.read_split(out), helpers.read_dead_letters(out)
    assert result["rows"]["read"] == 300 + 50 + 60 + 40 == len(rows) + len(dead)
    assert result["rows"]["malformed"] == len(dead) == 2


def test_a_cr_inside_a_line_of_a_lf_file_stays_in_its_line():
    # a quoted MovieLens tag may hold a CR: it must not split the line (and shift every later line number)
    fn = ReadFileLinesFn(skip_header=False, max_lines=0)
    import tempfile

    with tempfile.NamedTemporaryFile("wb", suffix=".csv", delete=False) as f:
        f.write(b'15,339,"sand\rra bullock",1138537770\n16,340,tag,1138537771\n')
    try:
        lines = [e for e in fn.process((0, f.name)) if isinstance(e, tuple)]
    finally:
        os.unlink(f.name)
    assert [(ln[2], ln[4]) for ln in lines] == [
        (1, '15,339,"sand\rra bullock",1138537770'),
        (2, "16,340,tag,1138537771"),
    ]


def test_parse_error_reasons_are_counted_by_kind():
    e = layouts.ParseError("unparsable number in I3: 'abc'", "unparsable number")
    dead = dead_letter("f", 3, "raw", e, True)
    summary = MalformedSummaryFn()
    acc = summary.add_input(summary.create_accumulator(), dead)
    other = summary.add_input(summary.create_accumulator(), dead)
    out = summary.extract_output(summary.merge_accumulators([acc, other]))
    assert out["by_reason"] == {"unparsable number": 2} and out["by_file"] == {"f": 2} and out["examples"] == 2


def test_delimited_csv_with_header_and_timestamp_column_splits_by_time(tmp_path, helpers):
    rng = np.random.default_rng(0)
    stamps = rng.permutation(np.arange(1000, 1100))
    lines = ["label,t,x,a,b"] + [f"{i % 2},{t},{i},a{i % 7},b{i % 3}" for i, t in enumerate(stamps)]
    path = tmp_path / "events.csv"
    path.write_text("\n".join(lines) + "\n")
    cfg = load_config("criteo").with_overrides(
        {
            "layout.delimiter": ",",
            "layout.has_header": True,
            "layout.columns": ["label", "t", "x", "a", "b"],
            "layout.dense_columns": ["x"],
            "layout.timestamp_column": "t",
            "layout.dense_transform": "none",
            "slots": [{"name": "a", "source": "a"}, {"name": "ab", "cross": ["a", "b"]}],
        }
    )
    out = str(tmp_path / "out")
    result = helpers.run(cfg, str(path), out)
    assert result["split"] == {"by": "time", "cutoff": 1080, "eval_fraction": 0.2}
    evals = helpers.read_split(out, "eval")
    assert sorted(r["ts"] for r in evals) == list(range(1080, 1100))
    row = by_line(helpers.read_split(out))[2]  # the first data line (the header is line 1)
    assert row["ts"] == int(stamps[0]) and row["dense"] == [0.0]
    assert row["slot_ab"] == feature_ids("ab", ["a0\x1eb0"])


def test_dense_stats_combine_matches_numpy_across_batches_and_merges():
    rng = np.random.default_rng(1)
    x = rng.normal(3.0, 2.0, (10000, 3)).astype(np.float32)
    x[:, 2] = 0.1  # constant: std 1.0
    fn = DenseStatsFn(3)
    accs = []
    for part in np.array_split(x, 3):
        acc = fn.create_accumulator()
        for v in part:
            acc = fn.add_input(acc, v.tobytes())
        accs.append(acc)
    out = fn.extract_output(fn.merge_accumulators(accs))
    xd = x.astype(np.float64)
    np.testing.assert_allclose(out["mean"], xd.mean(axis=0), rtol=1e-10)
    np.testing.assert_allclose(out["std"][:2], xd.std(axis=0)[:2], rtol=1e-10)
    assert out["std"][2] == 1.0 and out["count"] == 10000


def test_distinct_ids_estimate_is_within_three_percent():
    def row(big: list[int], small: list[int]) -> tuple:
        return (0.0, b"", (np.array(big, np.uint64).tobytes(), np.array(small, np.uint64).tobytes()), 0, "", 0)

    fn = DistinctIdsFn(["big", "small"])
    acc = fn.create_accumulator()
    for i in range(30000):
        big = feature_ids("big", [str(i), str(i // 2)])
        acc = fn.add_input(acc, row(big, feature_ids("small", [str(i)]) if i < 100 else []))
    out = fn.extract_output(fn.merge_accumulators([acc, fn.create_accumulator()]))
    assert abs(out["big"] - 30000) <= 900
    assert out["small"] == 100


def test_an_empty_input_is_refused_naming_the_file_and_a_movielens_file_for_its_folder(
    movielens_dir, tmp_path, helpers
):
    empty = tmp_path / "day_9.tsv"
    empty.write_text("")
    with pytest.raises(ValueError, match=f"no data rows were read from {empty}"):
        helpers.run(helpers.config_with("criteo"), str(empty), str(tmp_path / "out"))
    ratings = os.path.join(movielens_dir, "ratings.csv")
    with pytest.raises(FileNotFoundError, match="is a file, but the MovieLens layout reads a folder holding ratings"):
        pipeline.resolve_inputs(load_config("movielens"), ratings)


@pytest.mark.parametrize(
    "flags, says",
    [
        (["--sett", "split.eval_fraction=0.5"], r"--sett: did you mean --set\?"),
        (["--max-rows", "100"], r"--max-rows: use --set split.max_rows=N"),
        (["--confg=criteo"], r"--confg: did you mean --config\?"),
        (["--direct_num_workers=1", "--no-such-beam-option", "x"], r"unknown flag\(s\).*: --no-such-beam-option$"),
    ],
)
def test_main_refuses_flags_that_are_neither_ours_nor_beam_options(tiny_movielens, tmp_path, capsys, flags, says):
    # before: Beam logged "Discarding unparseable args" and the run went on with the defaults (exit 0)
    with pytest.raises(SystemExit) as e:
        pipeline.main(["--data", tiny_movielens, "--output", str(tmp_path / "out"), *flags])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert re.search(says, err), err
    assert not (tmp_path / "out").exists()
    assert (
        pipeline.unknown_beam_flags(
            [
                "--runner",
                "DirectRunner",
                "--direct_num_workers=2",
                "--project=p",
                "--region",
                "us-central1",
                "--temp_location",
                "gs://b/t",
            ]
        )
        == []
    )


def test_movielens_files_whose_header_is_not_grouplens_are_refused_naming_the_file(tiny_movielens, tmp_path):
    # found by a fresh-user trial: the parsers read ratings.csv by position, so a file with userId and movieId
    # swapped was read as the other column (failing only at the malformed-row limit, for "unknown movieId")
    cfg = load_config("movielens")
    assert set(pipeline.resolve_inputs(cfg, tiny_movielens)) == {"ratings", "movies", "tags"}  # GroupLens headers
    for name, header in (
        ("ratings.csv", "movieId,userId,rating,timestamp"),
        ("ratings.csv", "user,movie,rating,ts"),
        ("tags.csv", "userId,movieId,timestamp,tag"),
        ("movies.csv", "movieId,genres,title"),
    ):
        d = tmp_path / f"{name}-{len(header)}"
        shutil.copytree(tiny_movielens, d)
        body = (d / name).read_text().splitlines()[1:]
        (d / name).write_text("\n".join([header, *body]) + "\n")
        with pytest.raises(ValueError, match="MovieLens layout reads") as e:
            pipeline.resolve_inputs(cfg, str(d))
        assert f"{d / name}:1: the header is '{header}'" in str(e.value)
