"""Rows' sources keyed by one rule (relative to the input root), and per-file row counts in the statistics."""

from __future__ import annotations

import json
import logging
import os
import shutil

import pytest

from persia_core.data.synthetic import write_criteo_tsv
from persia_core.preprocess.write import STATS_FILE

FILES = {"day_0.tsv": 25, "day_1.tsv": 15, "nested/day_2.tsv": 10}


def _shards(out: str) -> dict[str, list[dict]]:
    """Each Parquet shard's rows, in file order, by shard name."""
    import pyarrow.parquet as pq

    return {
        f"{split}/{name}": pq.read_table(os.path.join(out, split, name)).to_pylist()
        for split in ("train", "eval")
        for name in sorted(os.listdir(os.path.join(out, split)))
    }


@pytest.fixture(scope="module")
def typed_two_ways(tmp_path_factory):
    """The same folder of TSV files (and one 0-byte file) preprocessed twice: as a relative glob typed with
    ``./`` from its parent, and as a folder after the folder was moved elsewhere. Returns both output folders
    and the second run's log records."""
    base = tmp_path_factory.mktemp("sources")
    folder = base / "in" / "days"
    for i, (name, rows) in enumerate(FILES.items()):
        write_criteo_tsv(str(folder / name), rows, seed=i)
    (folder / "empty.tsv").write_bytes(b"")
    from persia_core.config import load_config
    from persia_core.preprocess.pipeline import run_preprocess

    cfg = load_config("criteo", {"split.num_train_shards": 3, "split.num_eval_shards": 2, "layout.file_pattern": "**"})
    first = str(base / "out_glob")
    cwd = os.getcwd()
    os.chdir(base / "in")
    try:
        run_preprocess(cfg, "./days/**", first)
    finally:
        os.chdir(cwd)
    moved = base / "elsewhere" / "renamed"
    moved.parent.mkdir()
    shutil.move(str(folder), str(moved))
    second = str(base / "out_moved")
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logging.getLogger().addHandler(handler)
    try:
        run_preprocess(cfg, str(moved), second)
    finally:
        logging.getLogger().removeHandler(handler)
    return first, second, moved, records


def test_a_glob_typed_with_dot_slash_and_a_moved_folder_give_the_same_shards(typed_two_ways):
    first, second, moved, _ = typed_two_ways
    a, b = _shards(first), _shards(second)
    assert sum(len(r) for r in a.values()) == sum(FILES.values())
    assert a == b  # every shard holds the same rows in the same order, sources included
    sources = {r["source"].rsplit(":", 1)[0] for rows in a.values() for r in rows}
    assert sources == set(FILES)  # relative to the input root, normalized (no "./", no folder above it)


def test_dead_letters_still_name_the_file_as_found(tmp_path):
    from persia_core.config import load_config
    from persia_core.preprocess.pipeline import run_preprocess

    folder = tmp_path / "in"
    write_criteo_tsv(str(folder / "a.tsv"), 20, seed=3)
    with open(folder / "a.tsv", "a", encoding="utf-8") as f:
        f.write("not\ta\tcriteo\tline\n")
    out = str(tmp_path / "out")
    run_preprocess(load_config("criteo", {"split.max_malformed_fraction": 0.5}), str(folder), out)
    with open(os.path.join(out, "dead_letter", os.listdir(os.path.join(out, "dead_letter"))[0])) as f:
        dead = [json.loads(line) for line in f if line.strip()]
    assert [d["source"] for d in dead] == [f"{folder / 'a.tsv'}:21"]  # where a user finds the line


def test_preprocess_stats_count_the_rows_of_each_file_and_warn_of_an_empty_one(typed_two_ways):
    first, second, moved, records = typed_two_ways
    for out in (first, second):
        with open(os.path.join(out, STATS_FILE)) as f:
            stats = json.load(f)
        assert stats["files"] == {**FILES, "empty.tsv": 0}
    warned = [r.getMessage() for r in records if r.levelno == logging.WARNING and "empty.tsv" in r.getMessage()]
    assert warned and str(moved / "empty.tsv") in warned[0] and "no data rows" in warned[0]


def test_preprocess_stats_count_the_rows_each_file_keeps_under_max_rows(tmp_path, caplog):
    # found by a tester: with split.max_rows, files gave the lines read from each file up to the limit (20, 30, 10
    # here: 60 for 35 rows kept), not the rows kept
    from persia_core.config import load_config
    from persia_core.preprocess.pipeline import run_preprocess

    folder = tmp_path / "in"
    for i, rows in enumerate((20, 30, 10)):
        write_criteo_tsv(str(folder / f"day_{i}.tsv"), rows, seed=i)
    out = str(tmp_path / "out")
    with caplog.at_level(logging.INFO):
        result = run_preprocess(load_config("criteo", {"split.max_rows": 35}), str(folder), out)
    with open(os.path.join(out, STATS_FILE)) as f:
        stats = json.load(f)
    assert stats["files"] == {"day_0.tsv": 20, "day_1.tsv": 15, "day_2.tsv": 0}  # the limit cuts inside day_1
    in_shards: dict[str, int] = {}
    for rows in _shards(out).values():
        for r in rows:
            name = r["source"].rsplit(":", 1)[0]
            in_shards[name] = in_shards.get(name, 0) + 1
    assert in_shards == {"day_0.tsv": 20, "day_1.tsv": 15}
    assert sum(stats["files"].values()) == sum(in_shards.values()) == stats["read"] == result["rows"]["read"] == 35
    # a file past the limit is not empty: it is not warned of as one
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert not [m for m in warned if "day_2.tsv" in m], warned
