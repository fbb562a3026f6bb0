"""Config sections of the data schema: the raw layout, the evaluation split, the ID features (slots)."""

from __future__ import annotations

from dataclasses import dataclass, field

from persia_core.config.errors import config_error


@dataclass
class LayoutConfig:
    """How the raw input is laid out. The layout is data, not code.

    ``kind="movielens"``: the GroupLens files ``ratings.csv``, ``movies.csv`` and ``tags.csv`` in one folder,
    joined on movieId. Fields produced per rating: ``userId``, ``movieId``, ``genres`` (multi-hot),
    ``tags`` (multi-hot, tags applied to the movie by anyone strictly before the rating's timestamp),
    ``year`` (release year parsed from the title; missing for some titles), and the dense fields
    ``hour``, ``weekday``, ``movie_age`` (years between release and rating). Label: ``rating >= label_threshold``.
    With ``history_length > 0`` also the user's history (``history``, ``liked_history``, ``user_prior_ratings``,
    ``user_prior_like_rate``; see ``history_length``).

    ``kind="delimited"``: one or more text files, one example per line, fields separated by ``delimiter``
    (Criteo's Display Advertising layout: tab, ``label, I1..I13, C1..C26``, empty = missing).
    """

    kind: str = "movielens"
    """``movielens`` or ``delimited``."""
    ratings_file: str = "ratings.csv"
    """movielens: file name of the ratings inside the data folder."""
    movies_file: str = "movies.csv"
    """movielens: file name of the movie titles and genres."""
    tags_file: str = "tags.csv"
    """movielens: file name of the tag applications."""
    label_threshold: float = 4.0
    """movielens: label = 1 where rating >= this many stars."""
    max_tags: int = 32
    """movielens: at most this many distinct tags per rating (the most recently applied ones)."""
    history_length: int = 0
    """movielens: when > 0, each rating also gets the user's history fields below, computed only from that
    user's ratings with a timestamp strictly earlier than this rating's (ratings at the same second never see
    each other; only ratings that become rows count, not dead letters). ID fields ``history`` (the movieIds of
    the most recent ``history_length`` earlier ratings, newest first; empty for a user's first ratings) and
    ``liked_history`` (the same over earlier ratings >= ``label_threshold``); dense fields, after
    ``movie_age``: ``user_prior_ratings`` = log1p(earlier ratings) and ``user_prior_like_rate`` =
    (earlier likes + 1) / (earlier ratings + 2). 0: none of these fields."""
    delimiter: str = "\t"
    """delimited: field separator."""
    has_header: bool = False
    """delimited: whether the first line of each file is a header. Its names must be ``columns``, in order (a file
    whose header differs is refused, naming the first difference), unless ``map_header_by_name``."""
    map_header_by_name: bool = False
    """delimited, with ``has_header``: read each file's fields by their header names, in any order (a header may
    hold more columns; each of ``columns`` must be named once)."""
    columns: list[str] = field(default_factory=list)
    """delimited: the names of the fields, in file order; a line with another field count is malformed."""
    label_column: str = "label"
    """delimited: the field holding the 0/1 label."""
    dense_columns: list[str] = field(default_factory=list)
    """delimited: numeric fields used as dense features (empty = missing = 0)."""
    dense_transform: str = "log1p"
    """delimited: ``log1p`` (log(1 + max(x, 0)), Criteo's usual transform) or ``none``."""
    timestamp_column: str = ""
    """delimited: a Unix-seconds field to split by time; empty: split by row order (files in name order)."""
    file_pattern: str = "*"
    """delimited: glob of the files to read when the data path is a folder."""

    def __post_init__(self) -> None:
        if self.kind not in ("movielens", "delimited"):
            raise config_error("layout.kind", f"must be 'movielens' or 'delimited', got {self.kind!r}")
        if self.kind == "delimited":
            if not self.columns:
                raise config_error("layout.columns", "a delimited layout needs its column names")
            if len(set(self.columns)) != len(self.columns):
                raise config_error("layout.columns", "column names must be unique")
            for name, cols in (("label_column", [self.label_column]), ("dense_columns", self.dense_columns)):
                missing = [c for c in cols if c not in self.columns]
                if missing:
                    raise config_error(f"layout.{name}", f"{missing} not in layout.columns")
            if self.timestamp_column and self.timestamp_column not in self.columns:
                raise config_error("layout.timestamp_column", f"{self.timestamp_column!r} not in layout.columns")
            if self.timestamp_column == self.label_column:
                raise config_error("layout.timestamp_column", f"{self.timestamp_column!r} is the label column")
            check_feature_columns("layout.dense_columns", self.dense_columns, self)
            if self.map_header_by_name and not self.has_header:
                raise config_error("layout.map_header_by_name", "needs layout.has_header: true (names to map by)")
            if self.dense_transform not in ("log1p", "none"):
                raise config_error("layout.dense_transform", "must be 'log1p' or 'none'")
        if self.max_tags < 0:
            raise config_error("layout.max_tags", "must be >= 0")
        if self.history_length < 0:
            raise config_error("layout.history_length", "must be >= 0")
        if self.history_length and self.kind != "movielens":
            raise config_error("layout.history_length", "user history is only produced by the movielens layout")

    def dense_fields(self) -> list[str]:
        """Names of the dense features this layout produces, in order."""
        if self.kind == "movielens":
            history = ["user_prior_ratings", "user_prior_like_rate"] if self.history_length else []
            return ["hour", "weekday", "movie_age", *history]
        return list(self.dense_columns)

    def id_fields(self) -> list[str]:
        """Names of the categorical fields this layout produces (usable as slot sources)."""
        if self.kind == "movielens":
            history = ["history", "liked_history"] if self.history_length else []
            return ["userId", "movieId", "genres", "tags", "year", *history]
        skip = {self.label_column, *([self.timestamp_column] if self.timestamp_column else [])}
        return [c for c in self.columns if c not in skip]  # as role_of, without a call per column (once a row)

    def role_of(self, column: str) -> str | None:
        """``"label column"`` or ``"timestamp column"`` when ``column`` holds the label or the timestamp (a
        delimited layout's, or MovieLens' ``rating`` and ``timestamp``), else None: any other column may feed
        features, several at once (a slot and a cross, a slot and a dense feature)."""
        if self.kind == "movielens":
            return {"rating": "label column", "timestamp": "timestamp column"}.get(column)
        if column == self.label_column:
            return "label column"
        if self.timestamp_column and column == self.timestamp_column:
            return "timestamp column"
        return None


def check_feature_columns(where: str, columns: list[str], layout: LayoutConfig) -> None:
    """Raise ``config_error(where, ...)`` when ``columns`` (one role list: a layout's dense columns, a slot's
    fields) holds the label or the timestamp column (a feature computed from the label leaks it: evaluation would
    report a perfect model), or one column twice."""
    for c in columns:
        role = layout.role_of(c)
        if role is not None:
            raise config_error(where, f"{c!r} is the {role}: a feature made of it would leak it into the model")
    twice = sorted({c for c in columns if columns.count(c) > 1})
    if twice:
        raise config_error(where, f"lists {', '.join(repr(c) for c in twice)} twice")


@dataclass
class SplitConfig:
    """Evaluation split, malformed-row budget and output sharding of the preprocess step."""

    eval_fraction: float = 0.2
    """The last this share of rows (by timestamp, or by row order without one) is the evaluation split."""
    max_malformed_fraction: float = 0.01
    """Fail the preprocess step when more than this share of rows is malformed."""
    num_train_shards: int = 4
    """Parquet files written for the train split (NN worker r reads files r, r+M, ...)."""
    num_eval_shards: int = 1
    """Parquet files written for the evaluation split."""
    max_rows: int = 0
    """Read at most this many examples (0 = all): for smoke runs on a tiny subset."""

    def __post_init__(self) -> None:
        if not 0.0 < self.eval_fraction < 1.0:
            raise config_error("split.eval_fraction", "must be in (0, 1)")
        if not 0.0 <= self.max_malformed_fraction <= 1.0:
            raise config_error("split.max_malformed_fraction", "must be in [0, 1]")
        for name in ("num_train_shards", "num_eval_shards"):
            if getattr(self, name) < 1:
                raise config_error(f"split.{name}", "must be >= 1")
        if self.max_rows < 0:
            raise config_error("split.max_rows", "must be >= 0")


@dataclass
class SlotConfig:
    """One ID feature (slot). Its values become feature IDs ``xxh3_64(slot name, value)`` (see ``hashing``).

    Either ``source`` (one field of the layout) or ``cross`` (two or more fields: one ID per combination of
    their values, e.g. user x genre) must be given.
    """

    name: str
    """Slot name, unique; part of every feature ID's hash, so renaming a slot renames its IDs."""
    source: str = ""
    """Layout field whose values are this slot's IDs."""
    cross: list[str] = field(default_factory=list)
    """Layout fields crossed into this slot."""
    table: str = "default"
    """Embedding table (``embedding.tables[].name``) that holds this slot's rows."""
    id_dropout: float = 0.0
    """Training only: probability that a row's IDs of this slot are dropped to the default (zero) row,
    so the model learns to use it for IDs never seen in training."""

    def __post_init__(self) -> None:
        if not self.name:
            raise config_error("slots[].name", "must not be empty")
        if bool(self.source) == bool(self.cross):
            raise config_error(f"slots[{self.name}]", "give exactly one of 'source' or 'cross'")
        if self.cross and len(self.cross) < 2:
            raise config_error(f"slots[{self.name}].cross", "a cross needs at least two fields")
        if not 0.0 <= self.id_dropout < 1.0:
            raise config_error(f"slots[{self.name}].id_dropout", "must be in [0, 1)")

    def fields(self) -> list[str]:
        """The layout fields this slot reads."""
        return [self.source] if self.source else list(self.cross)
