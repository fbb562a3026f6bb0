"""User-history features of the MovieLens layout (``layout.history_length``): built only from the user's own
ratings strictly before each rating, through the Beam pipeline and as the pure ``layouts`` functions."""

from __future__ import annotations

import math
import os

import numpy as np
import pyarrow.parquet as pq
import pytest
from hypothesis import given
from hypothesis import strategies as st

from persia_core.config import LayoutConfig, RunConfig, load_config
from persia_core.data import schema
from persia_core.hashing import feature_ids
from persia_core.preprocess import layouts
from persia_core.preprocess.pipeline import run_preprocess

T = 1_000_000_000
HISTORY_LENGTH = 2
MOVIES = [
    "movieId,title,genres",
    "1,Toy Story (1995),Animation",
    "2,Jumanji (1995),Adventure",
    "3,Heat (1995),Action",
    "4,Casino (1995),Crime",
    "5,Sabrina (1995),Romance",
    "6,Babe (1995),Children",
]
# (line, userId, movieId, rating, timestamp); line 1 is the header.
RATINGS = [
    (2, "1", "1", 5.0, T + 100),  # user 1's first rating: empty history
    (3, "1", "2", 2.0, T + 200),  # same second as line 4: neither sees the other
    (4, "1", "3", 4.0, T + 200),
    (5, "2", "4", 5.0, T + 250),  # sees only user 2's line 9 (earlier in time, later in the file)
    (6, "1", "4", 4.5, T + 300),  # 3 earlier ratings, cut to the 2 most recent
    (7, "1", "5", 1.0, T + 400),  # the unknown movie of line 8 (T + 350) is a dead letter, not history
    (8, "1", "99", 5.0, T + 350),
    (9, "2", "6", 3.0, T + 50),
]
KNOWN_MOVIES = {line.split(",")[0] for line in MOVIES[1:]}
HISTORY_SLOTS = [{"name": "history", "source": "history"}, {"name": "liked_history", "source": "liked_history"}]


def _write(path, lines: list[str]) -> None:
    path.write_bytes(("\r\n".join(lines) + "\r\n").encode("utf-8"))


@pytest.fixture(scope="module")
def history_data(tmp_path_factory) -> str:
    d = tmp_path_factory.mktemp("history_movielens")
    _write(d / "movies.csv", MOVIES)
    _write(d / "ratings.csv", ["userId,movieId,rating,timestamp"] + [f"{u},{m},{r},{t}" for _, u, m, r, t in RATINGS])
    _write(d / "tags.csv", ["userId,movieId,tag,timestamp", f"1,1,pixar,{T}"])
    return str(d)


def _config(history_length: int, history_slots: bool) -> RunConfig:
    base = load_config("movielens")
    history_names = {s["name"] for s in HISTORY_SLOTS}
    slots = [s for s in base.to_dict()["slots"] if s["name"] not in history_names]
    slots += HISTORY_SLOTS if history_slots else []
    return base.with_overrides(
        {
            "layout.history_length": history_length,
            "split.max_malformed_fraction": 0.5,
            "slots": slots,
        }
    )


def _run(data: str, out: str, cfg: RunConfig) -> tuple[dict, dict[int, dict]]:
    """Preprocess ``data`` into ``out``: ``(schema dict, {ratings.csv line: row of either split})``."""
    result = run_preprocess(cfg, data, out)
    files = [os.path.join(out, f) for f in result["train_files"] + result["eval_files"]]
    rows = [r for f in files for r in pq.read_table(f).to_pylist()]
    return result, {int(r["source"].rsplit(":", 1)[1]): r for r in rows}


@pytest.fixture(scope="module")
def history_run(history_data, tmp_path_factory) -> tuple[dict, dict[int, dict]]:
    return _run(history_data, str(tmp_path_factory.mktemp("history_out")), _config(HISTORY_LENGTH, True))


def _brute_force(line: int, max_len: int) -> tuple[list[str], list[str], int, int]:
    """The history of one rating by a scan of every rating: earlier (strictly) ratings of the same user whose
    movie is known, newest first, ties at one second by file line (later line = more recent)."""
    _, user, _, _, ts = next(r for r in RATINGS if r[0] == line)
    before = sorted((t, ln, m, r >= 4.0) for ln, u, m, r, t in RATINGS if u == user and t < ts and m in KNOWN_MOVIES)
    movies = [m for _, _, m, _ in before]
    liked = [m for _, _, m, like in before if like]
    return movies[::-1][:max_len], liked[::-1][:max_len], len(before), sum(like for *_, like in before)


def test_history_holds_only_earlier_movies_of_the_same_user_and_not_same_second_ones(history_run):
    _, rows = history_run
    assert rows[2]["slot_history"] == []  # first rating of user 1
    assert rows[9]["slot_history"] == []  # first rating (in time) of user 2
    assert rows[3]["slot_history"] == feature_ids("history", ["1"])  # line 4 has the same second: excluded
    assert rows[4]["slot_history"] == feature_ids("history", ["1"])  # and vice versa
    assert rows[5]["slot_history"] == feature_ids("history", ["6"])  # user 2 only, never user 1's movies
    assert rows[7]["slot_history"] == feature_ids("history", ["4", "3"])  # not movie 99 (a dead letter)
    for line, row in rows.items():
        movies, _, _, _ = _brute_force(line, HISTORY_LENGTH)
        assert row["slot_history"] == feature_ids("history", movies), line


def test_history_is_cut_to_the_most_recent_history_length_movies(history_run):
    _, rows = history_run
    # Line 6 (T + 300) follows movies 1 (T + 100), 2 and 3 (both T + 200; line 4 is later in the file).
    assert rows[6]["slot_history"] == feature_ids("history", ["3", "2"])
    assert all(len(r["slot_history"]) <= HISTORY_LENGTH for r in rows.values())


def test_liked_history_holds_only_earlier_ratings_at_or_above_the_threshold(history_run):
    _, rows = history_run
    assert rows[3]["slot_liked_history"] == feature_ids("liked_history", ["1"])
    assert rows[5]["slot_liked_history"] == []  # movie 6 got 3.0 < 4.0
    assert rows[6]["slot_liked_history"] == feature_ids("liked_history", ["3", "1"])  # movie 2 got 2.0
    assert rows[7]["slot_liked_history"] == feature_ids("liked_history", ["4", "3"])  # 4.5 and 4.0 (cut from 3)
    for line, row in rows.items():
        _, liked, _, _ = _brute_force(line, HISTORY_LENGTH)
        assert row["slot_liked_history"] == feature_ids("liked_history", liked), line


def test_prior_ratings_and_smoothed_like_rate_equal_a_float64_recomputation(history_run):
    result, rows = history_run
    assert result["dense"] == ["hour", "weekday", "movie_age", "user_prior_ratings", "user_prior_like_rate"]
    for line, row in rows.items():
        _, _, n, k = _brute_force(line, HISTORY_LENGTH)
        expected = np.array([math.log1p(n), (k + 1) / (n + 2)], np.float64)
        assert row["dense"][3:] == expected.astype(np.float32).tolist(), line
    assert rows[7]["dense"][3:] == pytest.approx([math.log(5.0), 4 / 6], rel=1e-6)  # 4 earlier, 3 of them liked
    assert rows[2]["dense"][3:] == [0.0, 0.5]


def test_history_length_zero_gives_the_same_schema_and_rows_as_without_history(history_data, history_run, tmp_path):
    result, rows = _run(history_data, str(tmp_path), _config(0, False))
    assert result["dense"] == ["hour", "weekday", "movie_age"]
    assert result["slots"] == ["user", "movie", "genres", "tags", "year", "user_x_genre"]
    history_names = {s["name"] for s in HISTORY_SLOTS}
    assert result["slots"] == [n for n in load_config("movielens").slot_names if n not in history_names]
    for f in result["train_files"] + result["eval_files"]:
        assert pq.read_schema(os.path.join(str(tmp_path), f)).equals(schema.arrow_schema(result["slots"]))
    _, with_history = history_run
    assert rows.keys() == with_history.keys()
    for line, row in rows.items():
        other = dict(with_history[line])
        del other["slot_history"], other["slot_liked_history"]
        other["dense"] = other["dense"][:3]
        assert row == other, line


def test_history_fields_exist_only_when_history_length_is_positive():
    assert "history" not in LayoutConfig().id_fields() and len(LayoutConfig().dense_fields()) == 3
    layout = LayoutConfig(history_length=5)
    assert layout.id_fields() == ["userId", "movieId", "genres", "tags", "year", "history", "liked_history"]
    assert layout.dense_fields()[3:] == ["user_prior_ratings", "user_prior_like_rate"]
    with pytest.raises(ValueError, match="layout.history_length"):
        LayoutConfig(history_length=-1)
    shipped = load_config("movielens")
    assert shipped.layout.history_length > 0  # the shipped config has history: a history slot is valid there
    assert shipped.with_overrides({"slots": [{"name": "h", "source": "history"}]}).slot_names == ["h"]
    for source in ("history", "liked_history"):
        with pytest.raises(ValueError, match="not produced by the layout"):
            shipped.with_overrides({"layout.history_length": 0, "slots": [{"name": "h", "source": source}]})


@given(
    st.lists(st.tuples(st.integers(0, 6), st.sampled_from("abcdef"), st.booleans()), max_size=25),
    st.integers(1, 4),
)
def test_user_history_each_matches_a_scan_of_all_earlier_ratings(ratings, max_len):
    got = layouts.user_history_each(ratings, max_len)
    for (ts, _, _), (movies, liked, n, k) in zip(ratings, got, strict=True):
        before = sorted((t, i) for i, (t, _, _) in enumerate(ratings) if t < ts)  # ties: input order
        assert movies == [ratings[i][1] for _, i in before][::-1][:max_len]
        assert liked == [ratings[i][1] for _, i in before if ratings[i][2]][::-1][:max_len]
        assert (n, k) == (len(before), sum(ratings[i][2] for _, i in before))
