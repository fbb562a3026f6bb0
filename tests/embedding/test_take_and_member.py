"""The GIL-free helpers of delta application equal the numpy operations they replace: ``member`` is ``np.isin``,
``take`` is fancy indexing, ``stacked`` is the concatenation of two takes, ``copy_into`` is slice assignment, for
every dtype a table holds; ``newest_first`` is a stable argsort; a table loads a state through them."""

from __future__ import annotations

import numpy as np
import pytest

from persia_core.config import OptimizerConfig
from persia_core.embedding import kernels as K
from persia_core.embedding.delta import member, stacked
from persia_core.embedding.table import EmbeddingTable, copy_into, take


def test_member_equals_isin_with_duplicates_extremes_and_empty_sides():
    rng = np.random.default_rng(0)
    keys = rng.integers(0, 2**64 - 1, 50_000, dtype=np.uint64, endpoint=True)
    keys[:3] = np.array([0, 2**64 - 1, 7], dtype=np.uint64)
    extremes = np.array([0, 2**64 - 1], dtype=np.uint64)
    of = np.concatenate([keys[::5], keys[::5], rng.integers(0, 2**64 - 1, 2_000, dtype=np.uint64), extremes])
    assert of.dtype == np.uint64
    np.testing.assert_array_equal(member(keys, of), np.isin(keys, of))
    assert member(keys, np.zeros(0, np.uint64)).tolist() == [False] * len(keys)
    assert member(np.zeros(0, np.uint64), of).shape == (0,)


@pytest.mark.parametrize(
    ("dtype", "shape"),
    [(np.uint64, ()), (np.float32, (16,)), (np.uint16, (8,)), (np.int32, ()), (np.float32, (2, 3))],
)
def test_take_and_stacked_equal_numpy_indexing_and_concatenation(dtype, shape):
    rng = np.random.default_rng(1)
    a = rng.integers(0, 1000, (40, *shape)).astype(dtype)
    b = rng.integers(0, 1000, (25, *shape)).astype(dtype)
    a_rows, b_rows = rng.integers(0, 40, 60), np.flatnonzero(rng.random(25) < 0.5)
    reversed_rows = np.arange(40, dtype=np.int32)[::-1]  # a strided int32 order, as a recency queue gives
    np.testing.assert_array_equal(take(a, reversed_rows), a[reversed_rows])
    np.testing.assert_array_equal(take(a, a_rows), a[a_rows])
    got = stacked([(a, a_rows), (b, b_rows)])
    want = np.concatenate([a[a_rows], b[b_rows]])
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(got, want)
    empty = np.zeros(0, np.int64)
    np.testing.assert_array_equal(stacked([(a, empty), (b[:0], empty)]), np.concatenate([a[:0], b[:0]]))
    np.testing.assert_array_equal(
        stacked([(a, a_rows), (b, b_rows), (a, a_rows[:3])]), np.concatenate([want, a[a_rows[:3]]])
    )


def test_stacked_of_two_dtypes_promotes_as_concatenate_does():
    a, b = np.arange(6, dtype=np.int32).reshape(3, 2), np.arange(4, dtype=np.float32).reshape(2, 2)
    got = stacked([(a, np.array([2, 0])), (b, np.array([1]))])
    want = np.concatenate([a[[2, 0]], b[[1]]])
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(got, want)


def test_deltas_applied_in_one_pass_equal_the_deltas_applied_one_after_the_other():
    from persia_core.embedding.delta import _newest_first

    rng = np.random.default_rng(2)

    def state(keys: np.ndarray) -> dict:
        n = len(keys)
        return {
            "keys": keys.astype(np.uint64),
            "weights": rng.normal(size=(n, 4)).astype(np.float32),
            "last_used": rng.integers(0, 50, n).astype(np.int32),  # ties: the stable order must hold
            "acc": rng.random(n).astype(np.float32),
        }

    cur = state(rng.permutation(np.arange(1, 400)))
    deltas = []
    for _ in range(5):  # rows changed or added, keys evicted (some of them changed again later, some re-added)
        keys = rng.choice(np.arange(1, 600), 80, replace=False)
        evicted = rng.choice(np.arange(1, 600), 30, replace=False).astype(np.uint64)
        deltas.append((state(keys), evicted))
    one_pass = _newest_first(deltas, cur)
    one_by_one = cur
    for d, evicted in deltas:
        one_by_one = _newest_first([(d, evicted)], one_by_one)
    assert one_pass.keys() == one_by_one.keys()
    for k in one_pass:
        np.testing.assert_array_equal(one_pass[k], one_by_one[k])
    assert len(np.unique(one_pass["keys"])) == len(one_pass["keys"])


@pytest.mark.parametrize(
    ("dtype", "shape"),
    [(np.uint64, ()), (np.float32, (16,)), (np.uint16, (8,)), (np.int32, ()), (np.float32, (2, 3))],
)
def test_copy_into_equals_slice_assignment_and_refuses_rows_of_another_shape(dtype, shape):
    rng = np.random.default_rng(2)
    src = rng.integers(0, 1000, (777, *shape)).astype(dtype)
    dst = np.full((1000, *shape), 5, dtype=dtype)
    want = dst.copy()
    want[:777] = src
    copy_into(dst, src, 777)
    np.testing.assert_array_equal(dst, want)
    with pytest.raises(ValueError, match="where"):
        copy_into(dst, src, 700)
    with pytest.raises(ValueError, match="where"):
        copy_into(dst[:10], src[:20], 20)


def test_newest_first_is_a_stable_descending_argsort():
    steps = np.random.default_rng(3).integers(0, 50, 20_000).astype(np.int32)  # many ties
    np.testing.assert_array_equal(K.newest_first(steps), np.argsort(-steps.astype(np.int64), kind="stable"))
    assert K.newest_first(np.zeros(0, np.int32)).shape == (0,)


def test_a_state_that_does_not_fit_is_refused_before_the_table_changes():
    t = EmbeddingTable(4, OptimizerConfig(name="adagrad"), capacity=100)
    ids = np.arange(1, 51, dtype=np.uint64)
    before = t.lookup(ids).copy()
    sd = t.state_dict()
    bad = dict(sd, acc=sd["acc"][:-1])
    with pytest.raises(ValueError, match="state acc has shape"):
        t.load_state_dict(bad)
    np.testing.assert_array_equal(t.lookup_readonly(ids), before)
    t.load_state_dict(sd)  # the good one loads through the compiled copies
    np.testing.assert_array_equal(t.lookup_readonly(ids), before)
    assert {k: v.tolist() for k, v in t.state_dict().items()} == {k: v.tolist() for k, v in sd.items()}
