"""The compiled sum pooling into [B, S, D] and its backward, against torch's embedding_bag and autograd."""

import numpy as np
import pytest
import torch

from persia_core.embedding.kernels import bag_grads, dedup, pool_into
from persia_core.embedding.pooling import pool_bags


def _bags(rng, num_slots, batch, max_len, vocab):
    lengths = rng.integers(0, max_len + 1, num_slots * batch)
    offsets = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    ids = rng.integers(0, vocab, offsets[-1]).astype(np.uint64)
    uniq, inverse = dedup(ids)
    return uniq, inverse, offsets


@pytest.mark.parametrize("max_len", [1, 4])
def test_pooling_and_its_backward_equal_embedding_bag_and_autograd(max_len):
    rng = np.random.default_rng(3)
    batch, dim = 37, 8
    tables = [(3, _bags(rng, 3, batch, max_len, 50)), (2, _bags(rng, 2, batch, max_len, 9))]  # 5 slots in all
    rows = [rng.normal(size=(len(t[1][0]), dim)).astype(np.float32) for t in tables]
    out = np.full((batch + 3, 5, dim), 7.0, np.float32)  # a buffer for larger batches; rows past the batch stay
    slot0 = 0
    for (num_slots, (_, inverse, offsets)), r in zip(tables, rows, strict=True):
        pool_into(r, inverse, offsets, num_slots, batch, out, slot0)
        slot0 += num_slots
    assert (out[batch:] == 7.0).all()
    leaves = [torch.from_numpy(r).requires_grad_(True) for r in rows]
    ref = torch.cat(
        [
            pool_bags(leaf, torch.from_numpy(inv), torch.from_numpy(off), n, batch)
            for leaf, (n, (_, inv, off)) in zip(leaves, tables, strict=True)
        ],
        dim=1,
    )
    np.testing.assert_allclose(out[:batch], ref.detach().numpy(), rtol=1e-6, atol=1e-6)
    upstream = rng.normal(size=(batch, 5, dim)).astype(np.float32)
    (ref * torch.from_numpy(upstream)).sum().backward()
    grad_buf = np.concatenate([upstream, np.full((3, 5, dim), np.nan, np.float32)])  # past the batch: never read
    slot0 = 0
    for (num_slots, (uniq, inverse, offsets)), leaf in zip(tables, leaves, strict=True):
        got, finite = bag_grads(grad_buf, inverse, offsets, num_slots, batch, slot0, len(uniq), 0.5)
        assert finite
        assert leaf.grad is not None
        np.testing.assert_allclose(got, leaf.grad.numpy() * 0.5, rtol=1e-5, atol=1e-6)
        slot0 += num_slots


def test_pooling_matches_a_float64_recomputation_and_empty_bags_are_zero():
    rng = np.random.default_rng(5)
    uniq, inverse, offsets = _bags(rng, 2, 64, 6, 30)
    rows = rng.normal(size=(len(uniq), 4)).astype(np.float32)
    out = np.empty((64, 2, 4), np.float32)
    pool_into(rows, inverse, offsets, 2, 64, out, 0)
    for s in range(2):
        for i in range(64):
            lo, hi = offsets[s * 64 + i], offsets[s * 64 + i + 1]
            want = rows[inverse[lo:hi]].astype(np.float64).sum(axis=0) if hi > lo else np.zeros(4)
            np.testing.assert_allclose(out[i, s], want, rtol=1e-5, atol=1e-6)
            if hi == lo:
                assert (out[i, s] == 0).all() and not np.signbit(out[i, s]).any()


def test_a_non_finite_gradient_is_reported_and_bad_shapes_are_refused():
    rng = np.random.default_rng(7)
    uniq, inverse, offsets = _bags(rng, 1, 8, 1, 5)
    grad = np.zeros((8, 1, 4), np.float32)
    grad[2, 0, 1] = np.inf
    _, finite = bag_grads(grad, inverse, offsets, 1, 8, 0, len(uniq), 1.0)
    assert not finite
    rows = np.zeros((len(uniq), 4), np.float32)
    with pytest.raises(ValueError, match="offsets must hold"):
        pool_into(rows, inverse, offsets, 2, 8, np.zeros((8, 2, 4), np.float32), 0)
    with pytest.raises(ValueError, match="too small"):
        pool_into(rows, inverse, offsets, 1, 8, np.zeros((8, 1, 4), np.float32), 1)
    bad = inverse.copy()
    bad[0] = len(uniq)
    with pytest.raises(ValueError, match="out of range"):
        pool_into(rows, bad, offsets, 1, 8, np.zeros((8, 1, 4), np.float32), 0)
