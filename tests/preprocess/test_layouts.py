"""Pure parsing of raw lines (persia_core.preprocess.layouts): MovieLens and delimited (Criteo) layouts."""

from __future__ import annotations

import calendar
import dataclasses
import math
import random

import pytest

from persia_core.config import load_config
from persia_core.preprocess import layouts
from persia_core.preprocess.layouts import ParseError

ML = load_config("movielens").layout
CRITEO = load_config("criteo").layout


def criteo_line(label="1", dense=None, cats=None) -> str:
    dense = dense if dense is not None else [str(i) for i in range(13)]
    cats = cats if cats is not None else [f"{i:08x}" for i in range(26)]
    return "\t".join([label, *dense, *cats])


# ----------------------------------------------------------------------------------------------- MovieLens


def test_rating_label_is_one_at_or_above_threshold_and_ids_stay_strings():
    assert layouts.parse_rating("1,16,4.0,1217897793\r\n", ML) == {
        "userId": "1",
        "movieId": "16",
        "label": 1.0,
        "timestamp": 1217897793,
    }
    assert layouts.parse_rating("1,24,3.5,1217895807", ML)["label"] == 0.0
    assert layouts.parse_rating("1,24,5,1217895807", ML)["label"] == 1.0


@pytest.mark.parametrize(
    "line, reason",
    [
        ("1,16,4.0", "wrong field count: 3 != 4"),
        ("1,16,good,1217897793", "unparsable number in rating: 'good'"),
        ("1,16,nan,1217897793", "unparsable number in rating: 'nan'"),
        ("1,16,4.0,yesterday", "unparsable integer in timestamp: 'yesterday'"),
        (",16,4.0,1217897793", "missing userId"),
        # before: an OverflowError in gmtime crashed the whole Beam job, naming no file or row
        ("1,16,4.0,99999999999999999999", "integer out of the 64-bit range in timestamp: '99999999999999999999'"),
        ("1,16,4.0,253402300800", "timestamp beyond year 9999 in timestamp: '253402300800'"),
        ("1,16,4.0,1_217_897_793", "unparsable integer in timestamp: '1_217_897_793'"),
        ("1,16,4_0,1217897793", "unparsable number in rating: '4_0'"),
        ("1,16,4.0,١٢٣", "unparsable integer in timestamp: '١٢٣'"),  # Arabic-Indic digits: int() takes them
        ("1,16,٤.0,1217897793", "unparsable number in rating: '٤.0'"),
    ],
)
def test_malformed_rating_raises_parse_error_with_short_reason(line, reason):
    with pytest.raises(ParseError) as e:
        layouts.parse_rating(line, ML)
    assert e.value.reason == reason
    assert str(e.value) == reason


def test_quoted_title_with_comma_and_trailing_space_gives_year_and_genres():
    movie = layouts.parse_movie('25936,"Babe Ruth Story, The (1948) ",Drama|Comedy\r\n')
    assert movie == {"movieId": "25936", "genres": ["Drama", "Comedy"], "year": ["1948"]}


@pytest.mark.parametrize(
    "title, year",
    [
        ("Toy Story (1995)", ["1995"]),
        ("Pressure Point  (1962) ", ["1962"]),
        ("Woman's Face, A (En kvinnas ansikte) (1938) ", ["1938"]),
        ("Fawlty Towers (1975-1979)", []),
        ("Big Bang Theory, The (2007-)", []),
        ("Li'l Quinquin", []),
        ("1984 (1984)", ["1984"]),
    ],
)
def test_year_is_parsed_from_a_trailing_parenthesized_four_digit_year_only(title, year):
    assert layouts.parse_year(title) == year


def test_missing_year_and_no_genres_listed_are_empty_lists_not_malformed():
    movie = layouts.parse_movie("126929,Li'l Quinquin,(no genres listed)")
    assert movie == {"movieId": "126929", "genres": [], "year": []}
    record = layouts.movielens_record(layouts.parse_rating("7,126929,4.5,1451606400", ML), movie, [])
    assert record["fields"]["year"] == [] and record["fields"]["genres"] == []
    assert record["dense"][2] == 0.0


def test_tag_is_lower_cased_and_stripped_and_csv_quotes_are_undone():
    assert layouts.parse_tag('128,4270,"Dwayne ""The Rock"" Johnson",1269624103')["tag"] == 'dwayne "the rock" johnson'
    assert layouts.parse_tag("12,16, Robert De Niro ,1144396554") == {
        "movieId": "16",
        "tag": "robert de niro",
        "timestamp": 1144396554,
    }
    with pytest.raises(ParseError, match="missing tag"):
        layouts.parse_tag("12,16,  ,1144396554")


def test_tags_before_includes_only_tags_strictly_before_the_rating_newest_first_distinct():
    events = [(100, "b"), (50, "a"), (200, "c"), (150, "a"), (300, "d")]
    assert layouts.tags_before(events, 50, 10) == []
    assert layouts.tags_before(events, 51, 10) == ["a"]
    assert layouts.tags_before(events, 150, 10) == ["b", "a"]  # the tag at exactly 150 is not before it
    assert layouts.tags_before(events, 151, 10) == ["a", "b"]  # "a" re-applied at 150 is now the newest
    assert layouts.tags_before(events, 1000, 10) == ["d", "c", "a", "b"]


def test_tags_before_keeps_at_most_max_tags_most_recently_applied():
    events = [(t, f"tag{t}") for t in range(10)]
    assert layouts.tags_before(events, 100, 3) == ["tag9", "tag8", "tag7"]
    assert layouts.tags_before(events, 100, 0) == []


def test_tags_before_each_matches_a_brute_force_scan_per_rating():
    rng = random.Random(0)
    events = [(rng.randrange(1000), rng.choice("abcdefgh")) for _ in range(200)]
    stamps = [rng.randrange(-10, 1010) for _ in range(300)]
    got = layouts.tags_before_each(events, stamps, 4)
    for ts, tags in zip(stamps, got, strict=True):
        latest: dict[str, tuple[int, str]] = {}
        for t, tag in events:
            if t < ts:
                latest[tag] = max(latest.get(tag, (t, tag)), (t, tag))
        expected = [tag for (_, tag) in sorted(latest.values(), reverse=True)][:4]
        assert tags == expected


def test_movielens_dense_is_utc_hour_weekday_monday_zero_and_movie_age():
    ts = calendar.timegm((2016, 1, 4, 23, 30, 0))  # Monday 23:30 UTC
    assert layouts.movielens_dense(ts, ["1995"]) == [23.0, 0.0, 21.0]
    ts = calendar.timegm((2015, 12, 27, 0, 0, 1))  # Sunday
    assert layouts.movielens_dense(ts, []) == [0.0, 6.0, 0.0]


def test_movielens_record_has_every_layout_id_field():
    rating = layouts.parse_rating("1,1,4.0,1000000000", ML)
    movie = layouts.parse_movie("1,Toy Story (1995),Adventure|Comedy")
    record = layouts.movielens_record(rating, movie, ["pixar"])
    # The bare record has every id field of a layout without history ...
    assert set(record["fields"]) == set(dataclasses.replace(ML, history_length=0).id_fields())
    assert record["fields"]["userId"] == ["1"] and record["fields"]["tags"] == ["pixar"]
    assert record["label"] == 1.0 and record["ts"] == 1000000000
    # ... and with its user history, every id field of the shipped layout (history_length > 0).
    assert ML.history_length > 0
    with_history = layouts.with_user_history(record, ([], [], 0, 0))
    assert set(with_history["fields"]) == set(ML.id_fields())
    assert with_history["fields"]["userId"] == ["1"] and with_history["fields"]["tags"] == ["pixar"]
    assert with_history["label"] == 1.0 and with_history["ts"] == 1000000000


# ----------------------------------------------------------------------------------------------- delimited


def test_criteo_line_gives_log1p_dense_raw_categoricals_and_no_timestamp():
    dense = ["3", "", "-1", "0", "1.5", *["7"] * 8]
    cats = ["68fd1e64", "", *[f"{i:08x}" for i in range(24)]]
    record = layouts.parse_delimited(criteo_line("0", dense, cats) + "\n", CRITEO)
    assert record["label"] == 0.0 and record["ts"] is None
    assert record["dense"][:5] == [math.log1p(3), 0.0, 0.0, 0.0, math.log1p(1.5)]
    assert record["fields"]["C1"] == ["68fd1e64"]
    assert record["fields"]["C2"] == []
    assert record["fields"]["C26"] == ["00000017"]
    # every column but the label (and a timestamp) can be a slot's source: a dense one keeps its raw text too
    assert set(record["fields"]) == {f"C{i}" for i in range(1, 27)} | {f"I{i}" for i in range(1, 14)}
    assert record["fields"]["I1"] == ["3"] and record["fields"]["I2"] == []


def test_dense_transform_none_keeps_raw_values():
    layout = load_config("criteo", {"layout.dense_transform": "none"}).layout
    record = layouts.parse_delimited(criteo_line(dense=["-2", "", *["5"] * 11]), layout)
    assert record["dense"][:3] == [-2.0, 0.0, 5.0]


@pytest.mark.parametrize(
    "line, reason, kind",
    [
        ("\t".join(["1"] * 38), "wrong field count: 38 != 40", "wrong field count"),
        (criteo_line(dense=["1", "2", "abc", *["0"] * 10]), "unparsable number in I3: 'abc'", "unparsable number"),
        (criteo_line(label="2"), "label not 0/1 in label: '2'", "label not 0/1"),
        (criteo_line(label=""), "label not 0/1 in label: ''", "label not 0/1"),
        ("", "wrong field count: 1 != 40 (no '\\t' in the line: check layout.delimiter)", "wrong field count"),
        (
            ",".join(["1"] * 40),
            "wrong field count: 1 != 40 (no '\\t' in the line: check layout.delimiter)",
            "wrong field count",
        ),
    ],
)
def test_malformed_delimited_line_raises_reason_and_countable_kind(line, reason, kind):
    with pytest.raises(ParseError) as e:
        layouts.parse_delimited(line, CRITEO)
    assert (e.value.reason, e.value.kind) == (reason, kind)


def test_a_dense_value_beyond_float32_is_malformed_unless_its_transform_brings_it_in_range():
    # before: 1e308 was stored as float32 inf and made the train split's dense mean and std NaN
    raw = load_config("criteo", {"layout.dense_transform": "none"}).layout
    with pytest.raises(ParseError) as e:
        layouts.parse_delimited(criteo_line(dense=["1e308", *["0"] * 12]), raw)
    assert (e.value.reason, e.value.kind) == ("number beyond float32 range in I1: '1e308'", "out of range")
    assert layouts.parse_delimited(criteo_line(dense=["3e38", *["0"] * 12]), raw)["dense"][0] == 3e38
    record = layouts.parse_delimited(criteo_line(dense=["1e308", *["0"] * 12]), CRITEO)  # log1p(1e308) = 709.2
    assert record["dense"][0] == pytest.approx(math.log1p(1e308))


def test_delimited_timestamp_column_becomes_ts_and_is_required():
    layout = load_config(
        "criteo",
        {
            "layout.columns": ["label", "t", "I1", "C1"],
            "layout.dense_columns": ["I1"],
            "layout.timestamp_column": "t",
            "slots": [{"name": "C1", "source": "C1"}],
        },
    ).layout
    assert layouts.parse_delimited("1\t1700000000\t3\tab", layout)["ts"] == 1700000000
    assert layouts.parse_delimited("1\t1700000000\t3\tab", layout)["fields"] == {"I1": ["3"], "C1": ["ab"]}
    with pytest.raises(ParseError, match="missing t"):
        layouts.parse_delimited("1\t\t3\tab", layout)
    with pytest.raises(ParseError, match="integer out of the 64-bit range in t"):  # before: OverflowError
        layouts.parse_delimited(f"1\t{2**63}\t3\tab", layout)
