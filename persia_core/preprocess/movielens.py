"""The MovieLens join of the preprocess pipeline: ratings x movies x tags by movieId, then (optionally) the
user history by userId::

    ratings --ParseRatings--> (movieId, rating) --.
    movies  --ParseMovies---> (movieId, movie)  --+-- GroupByMovie (CoGroupByKey) -- JoinMovies --> rows
    tags    --ParseTags-----> (movieId, tag)    --'                                      |
                                                        layout.history_length > 0:       v
                                                        (userId, record) -- GroupByUser -- AddUserHistory --> rows

The per-record logic (parsing, tags before a rating, the user history) is in ``layouts``; here is the wiring.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import apache_beam as beam
from apache_beam.pvalue import TaggedOutput

from persia_core.config import RunConfig
from persia_core.preprocess import layouts
from persia_core.preprocess.counters import counter
from persia_core.preprocess.rows import DEAD, dead_letter, encode_row, slot_specs


class KeyByMovieFn(beam.DoFn):
    """``(path, line_no, row_number, text)`` -> ``(movieId, (line_no, source, text, parsed, path))`` or a dead
    letter.

    ``parse``: one of ``layouts.parse_rating`` (bound to the layout), ``parse_movie``, ``parse_tag``. ``names``:
    per file path, its name in the row's ``source`` (``read.source_names``; default the path); dead letters name
    the path.
    """

    def __init__(self, parse: Callable[[str], dict], example: bool, names: dict[str, str] | None = None) -> None:
        self.parse = parse
        self.example = example
        self.names = dict(names or {})
        self.malformed = counter("malformed" if example else "malformed_side_lines")

    def process(self, element: tuple):
        path, line_no, _, text = element
        try:
            parsed = self.parse(text)
        except layouts.ParseError as e:
            self.malformed.inc()
            yield TaggedOutput(DEAD, dead_letter(path, line_no, text, e, self.example))
            return
        yield parsed["movieId"], (line_no, f"{self.names.get(path, path)}:{line_no}", text, parsed, path)


class JoinMovieFn(beam.DoFn):
    """One movie's ratings, movie lines and tag lines (``CoGroupByKey`` output) -> encoded rows.

    Ratings of a movie missing from movies.csv are dead letters ``"unknown movieId"``; a second line for the
    same movieId is a dead letter ``"duplicate movieId"`` (the first line in the file wins). With
    ``layout.history_length > 0`` the output is ``(userId, (line_no, source, record))`` instead, for
    ``UserHistoryFn`` to add the user history and encode.
    """

    def __init__(self, config: RunConfig) -> None:
        self.specs = slot_specs(config)
        self.max_tags = config.layout.max_tags
        self.by_user = config.layout.history_length > 0
        self.rows = counter("rows")
        self.malformed = counter("malformed")

    def process(self, element: tuple):
        movie_id, groups = element
        ratings = list(groups["ratings"])
        movies = sorted(groups["movies"], key=lambda m: m[0])
        for line_no, _, text, _, path in movies[1:]:
            err = layouts.ParseError(f"duplicate movieId: {movie_id}", "duplicate movieId")
            yield TaggedOutput(DEAD, dead_letter(path, line_no, text, err, False))
        if not ratings:
            return
        if not movies:
            err = layouts.ParseError(f"unknown movieId: {movie_id}", "unknown movieId")
            for line_no, _, text, _, path in ratings:
                self.malformed.inc()
                yield TaggedOutput(DEAD, dead_letter(path, line_no, text, err, True))
            return
        movie = movies[0][3]
        events = [(t[3]["timestamp"], t[3]["tag"]) for t in groups["tags"]]
        tag_lists = layouts.tags_before_each(events, [r[3]["timestamp"] for r in ratings], self.max_tags)
        for (line_no, source, _, rating, _), tags in zip(ratings, tag_lists, strict=True):
            record = layouts.movielens_record(rating, movie, tags)
            self.rows.inc()
            if self.by_user:
                yield rating["userId"], (line_no, source, record)
            else:
                yield encode_row(record, self.specs, source, record["ts"])


class UserHistoryFn(beam.DoFn):
    """One user's joined ratings ``(userId, [(line_no, source, record)])`` -> encoded rows with user history.

    Each record gets ``layouts.with_user_history`` of ``layouts.user_history_each`` over all of the user's
    records (``layout.history_length`` most recent earlier movies; liked = label 1.0). Records are first put in
    ratings-file order, so that ties at one second are cut the same way on every run. One user's ratings are
    held in memory.
    """

    def __init__(self, config: RunConfig) -> None:
        self.specs = slot_specs(config)
        self.history_length = config.layout.history_length

    def process(self, element: tuple):
        _, joined = element
        joined = sorted(joined, key=lambda j: (j[0], j[1]))
        events = [(r["ts"], r["fields"]["movieId"][0], r["label"] == 1.0) for _, _, r in joined]
        for (_, source, record), history in zip(
            joined, layouts.user_history_each(events, self.history_length), strict=True
        ):
            yield encode_row(layouts.with_user_history(record, history), self.specs, source, record["ts"])


class JoinMovieLens(beam.PTransform):
    """MovieLens numbered lines ``{"ratings", "movies", "tags"}`` -> ``{"rows", "dead"}``.

    Each file is parsed (``layouts``), keyed by movieId, and the three are joined with ``CoGroupByKey``.
    Malformed ratings are example dead letters; malformed movie or tag lines are side dead letters (they do
    not count as rows, but a rating of a movie whose line is malformed becomes ``"unknown movieId"``).
    With ``layout.history_length > 0`` the joined ratings are then grouped by userId (``GroupByKey``) and each
    gets its user history (``UserHistoryFn``); ratings that are dead letters are in no user's history.
    ``names``: as ``KeyByMovieFn``'s.
    """

    def __init__(self, config: RunConfig, names: dict[str, str] | None = None) -> None:
        super().__init__()
        self.config = config
        self.names = names

    def expand(self, inputs):
        parsers: dict[str, tuple[Callable[[str], dict], bool]] = {
            "ratings": (functools.partial(layouts.parse_rating, layout=self.config.layout), True),
            "movies": (layouts.parse_movie, False),
            "tags": (layouts.parse_tag, False),
        }
        keyed, dead = {}, []
        for name, (parse, example) in parsers.items():
            out = inputs[name] | f"Parse{name.title()}" >> beam.ParDo(
                KeyByMovieFn(parse, example, self.names)
            ).with_outputs(DEAD, main="keyed")
            keyed[name] = out.keyed
            dead.append(out[DEAD])
        joined = (
            keyed
            | "GroupByMovie" >> beam.CoGroupByKey()
            | "JoinMovies" >> beam.ParDo(JoinMovieFn(self.config)).with_outputs(DEAD, main="rows")
        )
        dead.append(joined[DEAD])
        rows = joined.rows
        if self.config.layout.history_length > 0:
            rows = (
                rows | "GroupByUser" >> beam.GroupByKey() | "AddUserHistory" >> beam.ParDo(UserHistoryFn(self.config))
            )
        return {"rows": rows, "dead": tuple(dead) | "FlattenDead" >> beam.Flatten()}
