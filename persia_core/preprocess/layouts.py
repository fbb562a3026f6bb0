"""Pure parsing of raw input lines into records, one function per layout kind (no Beam here).

A *record* is the layout-independent form of one example that the pipeline encodes into a Parquet row::

    {"label":  float,               0.0 or 1.0
     "dense":  list[float],         in LayoutConfig.dense_fields() order (transformed, not scaled)
     "fields": {name: list[str]},   every categorical field of the layout; [] = missing
     "ts":     int | None}          Unix seconds, or None for layouts that split by row order

A line that cannot be parsed raises ``ParseError`` whose ``reason`` is short and names the field and value
(``"wrong field count: 38 != 40"``, ``"unparsable number in I3: 'abc'"``); ``kind`` is the reason without the
specifics (``"unparsable number"``) so that reasons can be counted.

MovieLens (GroupLens ``ml-latest-small`` CSV files, quoted fields, one header row each) is three parsers
(``parse_rating``, ``parse_movie``, ``parse_tag``), a join (``movielens_record``, ``tags_before_each``) and
the optional user history (``user_history_each``, ``with_user_history``); the delimited layout (Criteo's
Display Advertising Challenge TSV) is ``parse_delimited`` (a line) and ``delimited_record`` (its fields by column).
"""

from __future__ import annotations

import bisect
import csv
import math
import re
import time
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import islice
from typing import Any

import numpy as np

from persia_core.config import LayoutConfig

NO_GENRES = "(no genres listed)"
_YEAR_RE = re.compile(r"\((\d{4})\)\s*$")

Record = dict[str, Any]


class ParseError(ValueError):
    """A raw line that is not a valid example.

    ``reason`` (and ``str()``): short and specific (``"unparsable number in I3: 'abc'"``); ``kind``: the reason
    without specifics, for counting (``"unparsable number"``; defaults to ``reason``); ``field``: the column or
    field it names, where it names one.
    """

    def __init__(self, reason: str, kind: str | None = None, field: str | None = None) -> None:
        self.reason = reason
        self.kind = kind or reason
        self.field = field
        self.row: int | None = None  # the example's index in a batch (delimited_columns)
        super().__init__(reason)


def strip_line_end(line: str) -> str:
    """``line`` without its trailing ``\\n`` / ``\\r\\n`` (the MovieLens files use CRLF)."""
    return line.rstrip("\r\n")


def split_csv_line(line: str) -> list[str]:
    """The fields of one CSV line (RFC 4180 quoting: ``"Babe Ruth Story, The (1948) "`` is one field)."""
    try:
        return next(csv.reader([line], strict=True))
    except csv.Error as e:
        raise ParseError(f"bad csv quoting: {e}", "bad csv quoting") from None
    except StopIteration:
        return []


def _expect_fields(fields: Sequence[str], n: int) -> None:
    if len(fields) != n:
        raise ParseError(f"wrong field count: {len(fields)} != {n}", "wrong field count")


FLOAT32_MAX = 3.4028234663852886e38
MAX_TIMESTAMP = 253402300799
"""The last second of year 9999 UTC: the latest timestamp (seconds since 1970) that every platform's ``gmtime``
converts; a later one is an error in the data, not a date."""


def _parse_int(text: str, name: str) -> int:
    """A decimal integer within int64 (``_`` digit separators, which Python's ``int`` accepts, are refused)."""
    s = text.strip()
    try:
        if "_" in s or not s.isascii():  # Python's int() also takes '1_000' and non-ASCII digits ('١٢٣')
            raise ValueError
        x = int(s)
    except ValueError:
        raise ParseError(f"unparsable integer in {name}: {text!r}", "unparsable integer", field=name) from None
    if not -(2**63) <= x < 2**63:
        raise ParseError(f"integer out of the 64-bit range in {name}: {text!r}", "out of range", field=name)
    return x


def _parse_timestamp(text: str, name: str) -> int:
    """Seconds since 1970 (UTC), within [-MAX_TIMESTAMP, MAX_TIMESTAMP]."""
    x = _parse_int(text, name)
    if not -MAX_TIMESTAMP <= x <= MAX_TIMESTAMP:
        raise ParseError(f"timestamp beyond year 9999 in {name}: {text!r}", "out of range", field=name)
    return x


def _parse_float(text: str, name: str) -> float:
    """A finite number (``_`` digit separators refused)."""
    try:
        x = math.nan if "_" in text or not text.isascii() else float(text)
    except ValueError:
        x = math.nan
    if not math.isfinite(x):
        raise ParseError(f"unparsable number in {name}: {text!r}", "unparsable number", field=name)
    return x


def _require(text: str, name: str) -> str:
    s = text.strip()
    if not s:
        raise ParseError(f"missing {name}", "missing value", field=name)
    return s


# --------------------------------------------------------------------------------------------- MovieLens


def parse_rating(line: str, layout: LayoutConfig) -> dict[str, Any]:
    """One line of ``ratings.csv`` (``userId,movieId,rating,timestamp``).

    Returns ``{"userId": str, "movieId": str, "label": 1.0 if rating >= layout.label_threshold else 0.0,
    "timestamp": int}``. Raises ``ParseError`` for a wrong field count, a missing ID, or an unparsable rating
    or timestamp.
    """
    fields = split_csv_line(strip_line_end(line))
    _expect_fields(fields, 4)
    user, movie, rating, ts = fields
    return {
        "userId": _require(user, "userId"),
        "movieId": _require(movie, "movieId"),
        "label": 1.0 if _parse_float(rating, "rating") >= layout.label_threshold else 0.0,
        "timestamp": _parse_timestamp(ts, "timestamp"),
    }


def parse_genres(text: str) -> list[str]:
    """``"Adventure|Comedy"`` -> ``["Adventure", "Comedy"]``; ``"(no genres listed)"`` or empty -> ``[]``."""
    text = text.strip()
    if not text or text == NO_GENRES:
        return []
    return [g.strip() for g in text.split("|") if g.strip()]


def parse_year(title: str) -> list[str]:
    """Release year from a trailing ``(YYYY)`` in a title (trailing spaces allowed): ``["1995"]``, else ``[]``.

    ``"Toy Story (1995)"`` -> ``["1995"]``; ``"Rocky VI (1986) "`` -> ``["1986"]``;
    ``"Fawlty Towers (1975-1979)"`` and ``"Li'l Quinquin"`` -> ``[]`` (missing, not malformed).
    """
    m = _YEAR_RE.search(title)
    return [m.group(1)] if m else []


def parse_movie(line: str) -> dict[str, Any]:
    """One line of ``movies.csv`` (``movieId,title,genres``; titles are quoted where they hold commas).

    Returns ``{"movieId": str, "genres": list[str], "year": list[str] (0 or 1 item)}``.
    Raises ``ParseError`` for a wrong field count or a missing movieId.
    """
    fields = split_csv_line(strip_line_end(line))
    _expect_fields(fields, 3)
    movie, title, genres = fields
    return {"movieId": _require(movie, "movieId"), "genres": parse_genres(genres), "year": parse_year(title)}


def normalize_tag(tag: str) -> str:
    """A tag as a feature value: stripped and lower-cased (``" Robert De Niro"`` -> ``"robert de niro"``)."""
    return tag.strip().lower()


def parse_tag(line: str) -> dict[str, Any]:
    """One line of ``tags.csv`` (``userId,movieId,tag,timestamp``).

    Returns ``{"movieId": str, "tag": str (normalized), "timestamp": int}``. Raises ``ParseError`` for a wrong
    field count, a missing movieId, an empty tag, or an unparsable timestamp.
    """
    fields = split_csv_line(strip_line_end(line))
    _expect_fields(fields, 4)
    _, movie, tag, ts = fields
    tag = normalize_tag(tag)
    if not tag:
        raise ParseError("missing tag", "missing value")
    return {"movieId": _require(movie, "movieId"), "tag": tag, "timestamp": _parse_timestamp(ts, "timestamp")}


def tags_before_each(events: Iterable[tuple[int, str]], timestamps: Sequence[int], max_tags: int) -> list[list[str]]:
    """For each timestamp, the distinct tags applied strictly before it, the most recently applied first.

    ``events``: one movie's tag applications ``(timestamp, tag)``, any order; ``timestamps``: its ratings'
    timestamps. Returns one list per timestamp with at most ``max_tags`` tags, ordered by their latest
    application before that timestamp (newest first; events at the same second are ordered by tag).

    Sort + bisect + one sweep: the events are sorted once, each timestamp is bisected to the number of events
    before it, and the positions are visited in increasing order while an ordered dict keeps the distinct tags
    by recency, so a movie costs O((E + R) log(E + R) + R * max_tags), not a scan of the events per rating.
    Ratings with the same bisect position share one (read-only) list.
    """
    evs = sorted(events)
    times = [t for t, _ in evs]
    pos = [bisect.bisect_left(times, ts) for ts in timestamps]
    out: list[list[str]] = [[] for _ in pos]
    if not evs or max_tags == 0:
        return out
    recent: OrderedDict[str, None] = OrderedDict()
    j = 0
    cached_at, cached = -1, []
    for r in sorted(range(len(pos)), key=pos.__getitem__):
        i = pos[r]
        if i != cached_at:
            while j < i:
                tag = evs[j][1]
                recent[tag] = None
                recent.move_to_end(tag)
                j += 1
            cached_at, cached = i, list(islice(reversed(recent), max_tags))
        out[r] = cached
    return out


def tags_before(events: Iterable[tuple[int, str]], timestamp: int, max_tags: int) -> list[str]:
    """``tags_before_each(events, [timestamp], max_tags)[0]``: the tags of one rating."""
    return tags_before_each(events, [timestamp], max_tags)[0]


def movielens_dense(timestamp: int, year: Sequence[str]) -> list[float]:
    """Dense features of a rating: ``[hour, weekday, movie_age]``.

    ``hour`` in 0..23 and ``weekday`` in 0..6 (Monday = 0) of the rating time in UTC; ``movie_age`` = the
    rating's UTC year - release year (``year`` = ``[]`` or ``["YYYY"]``; 0.0 when the release year is missing).
    """
    t = time.gmtime(timestamp)
    age = float(t.tm_year - int(year[0])) if year else 0.0
    return [float(t.tm_hour), float(t.tm_wday), age]


def movielens_record(rating: dict[str, Any], movie: dict[str, Any], tags: list[str]) -> Record:
    """Join a parsed rating with its movie (``parse_movie``) and its tags (``tags_before_each``) into a record.

    ``fields``: userId, movieId (one value each), genres, tags, year (lists, possibly empty); ``ts`` is the
    rating's timestamp.
    """
    return {
        "label": rating["label"],
        "dense": movielens_dense(rating["timestamp"], movie["year"]),
        "fields": {
            "userId": [rating["userId"]],
            "movieId": [rating["movieId"]],
            "genres": movie["genres"],
            "tags": tags,
            "year": movie["year"],
        },
        "ts": rating["timestamp"],
    }


UserHistory = tuple[list[str], list[str], int, int]
"""``(history, liked_history, ratings_before, likes_before)`` of one rating (see ``user_history_each``)."""


def user_history_each(ratings: Sequence[tuple[int, str, bool]], max_len: int) -> list[UserHistory]:
    """For each of one user's ratings, what the user did strictly before it.

    ``ratings``: ``(timestamp, movieId, liked)`` of every rating of one user, any order. Returns one
    ``(history, liked_history, ratings_before, likes_before)`` per rating, in input order: ``history`` holds the
    movieIds of the most recent ``max_len`` ratings with a timestamp strictly earlier (newest first; a movie
    rated twice appears twice), ``liked_history`` the same over the earlier ratings with ``liked``;
    ``ratings_before`` / ``likes_before`` count all earlier ratings / likes (not cut to ``max_len``). Ratings at
    the same second never see each other; among earlier ratings at one second, input order decides which
    are the most recent (later in the input = more recent).

    Sort + bisect: the ratings are sorted once by timestamp (stable), each rating's timestamp is bisected to
    the number of ratings before it, and a prefix count of likes maps that to the likes before it, so a user
    costs O(R log R + R * max_len), not a scan of the history per rating.
    """
    order = sorted(range(len(ratings)), key=lambda i: ratings[i][0])
    times = [ratings[i][0] for i in order]
    movies = [ratings[i][1] for i in order]
    liked_movies: list[str] = []
    likes_prefix = [0]
    for i in order:
        if ratings[i][2]:
            liked_movies.append(ratings[i][1])
        likes_prefix.append(len(liked_movies))
    out: list[UserHistory] = []
    for ts, _, _ in ratings:
        n = bisect.bisect_left(times, ts)
        k = likes_prefix[n]
        out.append((movies[max(0, n - max_len) : n][::-1], liked_movies[max(0, k - max_len) : k][::-1], n, k))
    return out


def user_history_dense(ratings_before: int, likes_before: int) -> list[float]:
    """Dense history features of a rating: ``[log1p(ratings_before), (likes_before + 1) / (ratings_before + 2)]``.

    The second is the Laplace-smoothed share of the user's earlier ratings that were likes (0.5 with none).
    """
    return [math.log1p(ratings_before), (likes_before + 1) / (ratings_before + 2)]


def with_user_history(record: Record, history: UserHistory) -> Record:
    """A MovieLens record (``movielens_record``) plus its user history (one item of ``user_history_each``).

    Adds the fields ``history`` and ``liked_history`` and appends ``user_prior_ratings`` and
    ``user_prior_like_rate`` (``user_history_dense``) to ``dense``; ``record`` itself is not changed.
    """
    movies, liked, n, k = history
    fields = {**record["fields"], "history": movies, "liked_history": liked}
    return {**record, "dense": [*record["dense"], *user_history_dense(n, k)], "fields": fields}


# --------------------------------------------------------------------------------------------- delimited


def _parse_label(text: str, name: str) -> float:
    try:
        x = float(text)
    except ValueError:
        x = math.nan
    if x not in (0.0, 1.0):
        raise ParseError(f"label not 0/1 in {name}: {text!r}", "label not 0/1", field=name)
    return x


def parse_delimited(line: str, layout: LayoutConfig) -> Record:
    """One line of a delimited file (Criteo: ``label \\t I1..I13 \\t C1..C26``) -> a record.

    The field count must equal ``len(layout.columns)``; the label must be 0 or 1; a dense column is an integer
    or float, empty = missing = 0.0, then ``log1p(max(x, 0))`` when ``layout.dense_transform == "log1p"``;
    a categorical column is ``[]`` when empty, else ``[raw string]``; ``ts`` is the timestamp column
    (required) or ``None`` without one. Raises ``ParseError`` otherwise.
    """
    values = strip_line_end(line).split(layout.delimiter)
    if len(values) == 1 and len(layout.columns) > 1:
        raise ParseError(
            f"wrong field count: 1 != {len(layout.columns)} (no {layout.delimiter!r} in the line: "
            "check layout.delimiter)",
            "wrong field count",
        )
    _expect_fields(values, len(layout.columns))
    return _record(delimited_columns({name: [v] for name, v in zip(layout.columns, values, strict=True)}, layout))


def delimited_record(row: Mapping[str, str], layout: LayoutConfig) -> Record:
    """The fields of one delimited example, ``{column: text}`` holding every one of ``layout.columns`` (an empty
    text is a missing field), -> a record, as ``parse_delimited`` makes of a line (which it calls): the one-row
    case of ``delimited_columns``. Raises ``ParseError`` naming the field and value."""
    return _record(delimited_columns({name: [text] for name, text in row.items()}, layout))


def _record(c: DelimitedColumns) -> Record:
    """The record of the one example of ``c``."""
    return {
        "label": float(c.label[0]),
        "dense": c.dense[0].tolist(),
        "fields": {name: ([texts[0]] if texts[0] else []) for name, texts in c.fields.items()},
        "ts": int(c.ts[0]) if c.ts is not None else None,
    }


@dataclass
class DelimitedColumns:
    """B delimited examples, column by column (``delimited_columns``)."""

    label: np.ndarray
    """``float64[B]``, 0.0 or 1.0."""
    dense: np.ndarray
    """``float64[B, F]``: ``layout.dense_columns``, missing = 0.0, transformed (``log1p(max(x, 0))`` for
    ``dense_transform: log1p``)."""
    ts: np.ndarray | None
    """``int64[B]``: the timestamp column, or None without one."""
    fields: dict[str, Sequence[str]]
    """Every categorical field (``layout.id_fields()``): its B texts as given, ``""`` = missing."""


def delimited_columns(columns: Mapping[str, Sequence[str]], layout: LayoutConfig) -> DelimitedColumns:
    """B delimited examples given column by column (``columns[name]``: the B texts of each of
    ``layout.columns``; ``""`` = missing) -> their parsed columns: the record-to-features parsing of the
    delimited layout, for one line (``parse_delimited``, ``delimited_record``: preprocess and ``persia
    predict``) or a batch (the prediction server). A column is parsed in one pass (no Python call per value)
    unless one of its texts is unusual, then value by value.

    Rules: the label is 0 or 1; a dense value is an integer or float, empty = missing = 0.0, stored as float32 (a
    value beyond its range is refused); ``ts`` is the timestamp column (required). Raises ``ParseError`` for the
    first bad example in order (``row``: its index; for that example, the first bad field in the order label,
    dense columns, timestamp)."""
    try:
        return _columns(columns, layout)
    except ParseError as e:
        n = len(columns[layout.label_column])
        if n == 1:
            e.row = 0
            raise
        for i in range(n):  # the first bad example, in order, and its first bad field
            try:
                _columns({name: [texts[i]] for name, texts in columns.items()}, layout)
            except ParseError as first:
                first.row = i
                raise first from None
        raise  # a batch fails only where one of its rows does: not reached


def _columns(columns: Mapping[str, Sequence[str]], layout: LayoutConfig) -> DelimitedColumns:
    name = layout.label_column
    texts = [t.strip() for t in columns[name]]
    if all(t == "0" or t == "1" for t in texts):
        label = [1.0 if t == "1" else 0.0 for t in texts]
    else:
        label = [_parse_label(t, name) for t in texts]
    n, names = len(label), layout.dense_columns
    # every dense text in one pass, column after column (a handful of calls per batch, not per value)
    texts = [t.strip() for name in names for t in columns[name]]
    joined = "".join(texts)
    values = None
    if "_" not in joined and joined.isascii():  # Python's float() also takes '1_000' and non-ASCII digits
        try:
            values = [float(t) if t else 0.0 for t in texts]
        except ValueError:
            values = None
    log1p = layout.dense_transform == "log1p"
    if values is not None and not all(map(math.isfinite, values)):
        values = None
    if values is not None:
        if log1p:  # log1p(max(x, 0)), with math's log1p (numpy's rounds otherwise); -0.0 stays -0.0, as there
            f = math.log1p
            values = [f(x) if x > 0.0 else (x if x == 0.0 else 0.0) for x in values]
        if max(values, default=0.0) > FLOAT32_MAX or min(values, default=0.0) < -FLOAT32_MAX:
            values = None
    if values is None:  # something is wrong: find the first bad value, example by example, field by field
        for i in range(n):
            for j, name in enumerate(names):
                t = texts[j * n + i]
                x = _parse_float(t, name) if t else 0.0
                x = math.log1p(max(x, 0.0)) if log1p else x
                if abs(x) > FLOAT32_MAX:  # stored as float32: it would become inf and poison the dense statistics
                    raise ParseError(f"number beyond float32 range in {name}: {t!r}", "out of range", field=name)
        raise AssertionError("a dense text failed the one-pass parse but not the careful one")  # pragma: no cover
    dense = np.array(values, dtype=np.float64).reshape(len(names), n).T
    ts = None
    if layout.timestamp_column:
        name = layout.timestamp_column
        ts = np.array([_parse_timestamp(_require(t, name), name) for t in columns[name]], dtype=np.int64)
    fields = {name: columns[name] for name in layout.id_fields()}
    return DelimitedColumns(np.array(label, dtype=np.float64), dense, ts, fields)
