"""The columns of a delimited layout in their roles: the label and the timestamp never feed a feature, no column
is listed twice in one role list, and a column may feed several features (a slot and a cross, a slot and a dense
feature)."""

from __future__ import annotations

import pytest

from persia_core.config import RunConfig

COLUMNS = ["label", "ts", "x", "a", "b"]


def _config(dense=("x",), slots=None, timestamp="ts") -> RunConfig:
    return RunConfig.from_dict(
        {
            "layout": {
                "kind": "delimited",
                "columns": COLUMNS,
                "label_column": "label",
                "timestamp_column": timestamp,
                "dense_columns": list(dense),
            },
            "slots": slots or [{"name": "a", "source": "a"}, {"name": "b", "source": "b"}],
        }
    )


@pytest.mark.parametrize(
    "dense, field, named",
    [
        (["x", "label"], "layout.dense_columns", "label column"),
        (["ts", "x"], "layout.dense_columns", "timestamp column"),
    ],
)
def test_the_label_or_the_timestamp_as_a_dense_feature_is_refused_naming_it(dense, field, named):
    with pytest.raises(ValueError, match=rf"'{field}'.*{named}"):
        _config(dense=dense)


@pytest.mark.parametrize(
    "slot, named",
    [
        ({"name": "l", "source": "label"}, "label column"),
        ({"name": "t", "source": "ts"}, "timestamp column"),
        ({"name": "ax", "cross": ["a", "label"]}, "label column"),
        ({"name": "at", "cross": ["ts", "a"]}, "timestamp column"),
    ],
)
def test_the_label_or_the_timestamp_in_a_slot_or_a_cross_is_refused_naming_it(slot, named):
    with pytest.raises(ValueError, match=rf"'slots\[{slot['name']}\](\.cross)?'.*{named}"):
        _config(slots=[{"name": "a", "source": "a"}, slot])


def test_a_column_listed_twice_in_one_role_list_is_refused_naming_it():
    with pytest.raises(ValueError, match=r"'layout.dense_columns'.*'x' twice"):
        _config(dense=["x", "x"])
    with pytest.raises(ValueError, match=r"'slots\[aa\].cross'.*'a' twice"):
        _config(slots=[{"name": "aa", "cross": ["a", "b", "a"]}])


def test_a_column_may_feed_a_slot_and_a_cross_or_a_slot_and_a_dense_feature():
    cfg = _config(
        slots=[
            {"name": "a", "source": "a"},
            {"name": "ab", "cross": ["a", "b"]},
            {"name": "x_id", "source": "x"},  # the dense column x as an ID too (a bucketized count, say)
        ]
    )
    assert [s.fields() for s in cfg.slots] == [["a"], ["a", "b"], ["x"]]
    assert cfg.layout.dense_fields() == ["x"]
