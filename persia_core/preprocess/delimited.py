"""Step 2 of the preprocess pipeline for delimited layouts (Criteo's TSV): numbered lines -> encoded rows.

Each line is parsed by ``layouts.parse_delimited`` and encoded (``rows.encode_row``); a line that does not parse
is a dead letter with the parser's reason. The MovieLens layout's counterpart is ``movielens.JoinMovieLens``.
"""

from __future__ import annotations

import apache_beam as beam
from apache_beam.pvalue import TaggedOutput

from persia_core.config import RunConfig
from persia_core.preprocess import layouts, lines
from persia_core.preprocess.counters import counter
from persia_core.preprocess.rows import DEAD, dead_letter, encode_row, slot_specs


class ParseDelimitedFn(beam.DoFn):
    """``(path, line_no, row_number, text)`` -> an encoded row, or a dead letter on the ``dead`` output.

    ``ts`` is the layout's timestamp column, else the global row number. ``orders``: per file path, where its
    fields sit (``lines.header_order``; files not named are in ``layout.columns`` order). ``names``: per file path,
    its name in the row's ``source`` (``read.source_names``; default the path); dead letters name the path.
    """

    def __init__(
        self,
        config: RunConfig,
        orders: dict[str, lines.ColumnOrder] | None = None,
        names: dict[str, str] | None = None,
    ) -> None:
        self.layout = config.layout
        self.orders = dict(orders or {})
        self.names = dict(names or {})
        self.specs = slot_specs(config)
        self.rows = counter("rows")
        self.malformed = counter("malformed")

    def process(self, element: tuple):
        path, line_no, row_number, text = element
        order = self.orders.get(path)
        try:
            record = layouts.parse_delimited(lines.reorder(text, order, self.layout) if order else text, self.layout)
        except layouts.ParseError as e:
            self.malformed.inc()
            yield TaggedOutput(DEAD, dead_letter(path, line_no, text, e, True))
            return
        self.rows.inc()
        ts = record["ts"] if record["ts"] is not None else row_number
        yield encode_row(record, self.specs, f"{self.names.get(path, path)}:{line_no}", ts)


class ParseDelimited(beam.PTransform):
    """Numbered lines of a delimited layout -> ``{"rows": encoded rows, "dead": dead letters}``."""

    def __init__(
        self,
        config: RunConfig,
        orders: dict[str, lines.ColumnOrder] | None = None,
        names: dict[str, str] | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.orders = orders
        self.names = names

    def expand(self, numbered):
        fn = ParseDelimitedFn(self.config, self.orders, self.names)
        out = numbered | "ParseLines" >> beam.ParDo(fn).with_outputs(DEAD, main="rows")
        return {"rows": out.rows, "dead": out[DEAD]}
