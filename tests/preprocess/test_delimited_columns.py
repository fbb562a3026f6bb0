"""A batch of delimited examples parses and hashes as its lines do one by one (preprocess and ``persia predict``):
the same values, the same feature IDs, and the same first error."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from persia_core.config import RunConfig
from persia_core.preprocess import layouts
from persia_core.preprocess.rows import encode_row, slot_ids, slot_specs

CONFIG = RunConfig.from_dict(
    {
        "layout": {
            "kind": "delimited",
            "columns": ["label", "x", "y", "a", "b"],
            "label_column": "label",
            "dense_columns": ["x", "y"],
            "dense_transform": "log1p",
        },
        "slots": [{"name": "a", "source": "a"}, {"name": "b", "source": "b"}, {"name": "ab", "cross": ["a", "b"]}],
        "embedding": {"tables": [{"name": "default", "dim": 4}], "num_shards": 1, "shard_memory_bytes": 1 << 22},
        "model": {"kind": "dnn", "hidden": [4], "bottom": []},
        "trainer": {"batch_size": 4, "epochs": 1, "num_workers": 1},
    }
)
LAYOUT = CONFIG.layout
NUMBERS = ["0", "1", "3", "-2", "0.5", "-0.0", "1e3", " 7 ", "", "2.5e-3", "1e39", "1e308"]
ODD = ["abc", "1_0", "nan", "inf", "1e999", "\u0661", " "]
LABELS = ["0", "1", " 1 ", "1.0", "0.0", "2", "", "x"]
IDS = ["", "3", "x y", "\u00e9", "17"]


def _row(draw) -> dict[str, str]:
    odd = draw(st.booleans()) and draw(st.integers(0, 9)) == 0
    dense = st.sampled_from(NUMBERS + (ODD if odd else []))
    label = st.sampled_from(LABELS if odd else ["0", "1"])
    return {
        "label": draw(label),
        "x": draw(dense),
        "y": draw(dense),
        "a": draw(st.sampled_from(IDS)),
        "b": draw(st.sampled_from(IDS)),
    }


rows_strategy = st.lists(st.composite(lambda draw: _row(draw))(), min_size=1, max_size=12)


@settings(max_examples=300, deadline=None)
@given(rows_strategy)
def test_a_batch_parses_and_hashes_as_its_lines_one_by_one(rows):
    lines = ["\t".join(r[c] for c in LAYOUT.columns) for r in rows]
    records, first_error = [], None
    for i, line in enumerate(lines):
        try:
            records.append(layouts.parse_delimited(line, LAYOUT))
        except layouts.ParseError as e:
            first_error = (i, e.field, e.reason)
            break
    columns = {c: [r[c] for r in rows] for c in LAYOUT.columns}
    try:
        batch = layouts.delimited_columns(columns, LAYOUT)
    except layouts.ParseError as e:
        assert (e.row, e.field, e.reason) == first_error
        return
    assert first_error is None
    assert batch.label.tolist() == [r["label"] for r in records]
    dense = np.array([r["dense"] for r in records], dtype=np.float64)
    assert np.array_equal(batch.dense, dense) and np.array_equal(np.signbit(batch.dense), np.signbit(dense))
    specs = slot_specs(CONFIG)
    encoded = [encode_row(r, specs, "s", 0) for r in records]
    ids = slot_ids(batch.fields, specs, len(rows), single=True)
    for s, (values, lengths) in enumerate(ids):
        per_row = [np.frombuffer(e[2][s], np.uint64).tolist() for e in encoded]
        assert lengths.dtype == np.int64 and lengths.tolist() == [len(v) for v in per_row]
        assert values.dtype == np.uint64 and values.tolist() == [v for row in per_row for v in row]
