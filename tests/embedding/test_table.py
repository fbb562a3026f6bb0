"""The in-process embedding table against dense PyTorch references."""

import dataclasses

import numpy as np
import pytest
import torch

from persia_core.config import OptimizerConfig
from persia_core.embedding.table import EmbeddingTable
from persia_core.memory import bytes_per_row, capacity_for_budget

D = 8


def _ids(*v):
    return np.array(v, dtype=np.uint64)


def _torch_reference(opt_cfg: OptimizerConfig, w0: np.ndarray, grads: list[np.ndarray]) -> np.ndarray:
    p = torch.nn.Parameter(torch.tensor(w0.copy()))
    if opt_cfg.name == "sgd":
        opt = torch.optim.SGD([p], lr=opt_cfg.lr, weight_decay=opt_cfg.weight_decay)
    elif opt_cfg.name == "adagrad":
        opt = torch.optim.Adagrad(
            [p],
            lr=opt_cfg.lr,
            eps=opt_cfg.eps,
            weight_decay=opt_cfg.weight_decay,
            initial_accumulator_value=opt_cfg.initial_accumulator,
        )
    else:
        opt = torch.optim.Adam(
            [p], lr=opt_cfg.lr, betas=(opt_cfg.beta1, opt_cfg.beta2), eps=opt_cfg.eps, weight_decay=opt_cfg.weight_decay
        )
    for g in grads:
        p.grad = torch.tensor(g)
        opt.step()
    return p.detach().numpy()


@pytest.mark.parametrize("name", ["sgd", "adagrad", "adam"])
def test_optimizer_matches_torch_optim_on_dense_reference(name):
    cfg = OptimizerConfig(name=name, lr=0.05, weight_decay=0.01)
    t = EmbeddingTable(D, cfg, capacity=4096, init_scale=0.5)
    ids = _ids(3, 0, 2**64 - 1, 2**63)
    w0 = t.lookup(ids)
    rng = np.random.default_rng(0)
    grads = [rng.normal(size=(len(ids), D)).astype(np.float32) for _ in range(5)]
    for g in grads:
        t.apply_gradients(ids, g)
    np.testing.assert_allclose(t.lookup_readonly(ids), _torch_reference(cfg, w0, grads), atol=1e-6, rtol=0)


def test_rowwise_adagrad_matches_float64_recomputation():
    cfg = OptimizerConfig(name="rowwise_adagrad", lr=0.1, eps=1e-8, initial_accumulator=0.1)
    t = EmbeddingTable(D, cfg, capacity=4096, init_scale=0.5)
    ids = _ids(1, 2, 3)
    w = t.lookup(ids).astype(np.float64)
    s = np.full(len(ids), 0.1)
    rng = np.random.default_rng(1)
    for _ in range(6):
        g = rng.normal(size=(len(ids), D)).astype(np.float32)
        t.apply_gradients(ids, g)
        s = s + (g.astype(np.float64) ** 2).mean(axis=1)  # FBGEMM: one accumulator per row
        w = w - 0.1 * g / (np.sqrt(s) + 1e-8)[:, None]
    np.testing.assert_allclose(t.lookup_readonly(ids), w, atol=1e-6, rtol=0)


def _ftrl_float64(o: OptimizerConfig, w, z, n, g, fraction=1.0):
    """McMahan et al. (KDD 2013), Algorithm 1, per coordinate, in float64; ``fraction`` as in ``apply_ftrl``."""
    g = g.astype(np.float64) + o.weight_decay * w
    n_new = n + g * g / fraction
    z = z + g - (np.sqrt(n_new) - np.sqrt(n)) / o.lr * w
    w = np.where(np.abs(z) <= o.l1, 0.0, -(z - np.sign(z) * o.l1) / ((o.eps + np.sqrt(n_new)) / o.lr + o.l2))
    return w, z, n_new


def test_ftrl_matches_float64_recomputation_with_exact_zeros_from_l1():
    cfg = OptimizerConfig(name="ftrl", lr=0.1, eps=1.0, initial_accumulator=0.2, l1=0.6, l2=0.3, weight_decay=0.01)
    t = EmbeddingTable(D, cfg, capacity=4096, init_scale=0.5)
    ids = _ids(1, 2, 2**64 - 1)
    w = t.lookup(ids).astype(np.float64)
    z, n = np.zeros_like(w), np.full_like(w, 0.2)
    rng = np.random.default_rng(2)
    for step in range(8):
        g = rng.normal(size=w.shape).astype(np.float32)
        fraction = 0.5 if step % 2 else 1.0
        t.apply_gradients(ids, g, step_fraction=fraction)
        w, z, n = _ftrl_float64(cfg, w, z, n, g, fraction)
    got = t.lookup_readonly(ids)
    np.testing.assert_allclose(got, w, atol=1e-6, rtol=0)
    assert 0 < (w == 0).sum() < w.size  # L1 zeroes some coordinates, not all
    np.testing.assert_array_equal(got == 0, w == 0)


def test_ftrl_with_l2_per_epoch_converges_to_the_l2_regularized_logistic_regression():
    # a wide table (one weight per ID) trained on one-hot rows by full-batch steps of the mean logloss's gradient,
    # each step one epoch: with l2_per_epoch its weights approach scikit-learn's L2 fit at C = 1 / (l2 * rows)
    # (the objective mean logloss + l2 / 2 * |w|^2) at about 1 / steps; with that l2 fixed they drift away from it
    from sklearn.linear_model import LogisticRegression

    rng = np.random.default_rng(0)
    rows, slots, vocab, l2 = 400, 3, 12, 0.05
    cols = rng.integers(0, vocab, size=(rows, slots)) + np.arange(slots) * vocab
    x = np.zeros((rows, slots * vocab))
    np.add.at(x, (np.repeat(np.arange(rows), slots), cols.ravel()), 1.0)
    y = (rng.random(rows) < 1 / (1 + np.exp(-x @ rng.normal(size=slots * vocab)))).astype(np.float64)
    ref = LogisticRegression(C=1 / (l2 * rows), fit_intercept=False, tol=1e-10, max_iter=10_000).fit(x, y).coef_[0]
    ids = np.arange(1, slots * vocab + 1, dtype=np.uint64)
    error = {}
    for per_epoch in (True, False):
        cfg = OptimizerConfig(name="ftrl", lr=0.5, eps=1.0, l2=0.0 if per_epoch else l2, l2_per_epoch=l2 * per_epoch)
        t = EmbeddingTable(1, cfg, capacity=1024, init_scale=0.0)
        for epoch in range(1, 801):
            w = t.lookup(ids)[:, 0].astype(np.float64)
            g = x.T @ (1 / (1 + np.exp(-x @ w)) - y) / rows
            t.apply_gradients(ids, g[:, None].astype(np.float32), epochs_trained=epoch)
        error[per_epoch] = np.abs(t.lookup_readonly(ids)[:, 0] - ref).max()
    assert np.abs(ref).max() > 0.5
    assert error[True] < 0.02, error
    assert error[False] > 1.0, error


def test_optimizer_fields_of_another_optimizer_are_refused():
    with pytest.raises(ValueError, match="l1/l2.*FTRL"):
        OptimizerConfig(name="adagrad", l1=0.1)
    with pytest.raises(ValueError, match="l1/l2.*>= 0"):
        OptimizerConfig(name="ftrl", l2=-1.0)
    with pytest.raises(ValueError, match="optimizer.l2_per_epoch.*FTRL's"):
        OptimizerConfig(name="rowwise_adagrad", l2_per_epoch=0.1)
    with pytest.raises(ValueError, match="optimizer.l2_per_epoch.*>= 0"):
        OptimizerConfig(name="ftrl", l2_per_epoch=-0.1)


def test_duplicate_ids_in_batch_accumulate_before_one_adagrad_update():
    cfg = OptimizerConfig(name="adagrad", lr=0.1)
    t = EmbeddingTable(D, cfg, capacity=4096, init_scale=0.5)
    w0 = t.lookup(_ids(7))
    g1 = np.full((1, D), 0.5, np.float32)
    g2 = np.full((1, D), 1.5, np.float32)
    t.apply_gradients(_ids(7, 7), np.concatenate([g1, g2]))
    # one update with the summed gradient, not two updates
    np.testing.assert_allclose(t.lookup_readonly(_ids(7)), _torch_reference(cfg, w0, [g1 + g2]), atol=1e-6)
    assert not np.allclose(t.lookup_readonly(_ids(7)), _torch_reference(cfg, w0, [g1, g2]), atol=1e-6)


def test_extreme_ids_are_stored_and_read_back():
    t = EmbeddingTable(D, OptimizerConfig(name="sgd", lr=1.0), capacity=4096)
    ids = _ids(0, 2**63, 2**64 - 1)
    rows = t.lookup(ids)
    assert t.size == 3
    assert len({r.tobytes() for r in rows}) == 3
    t.apply_gradients(ids, np.ones((3, D), np.float32))
    np.testing.assert_allclose(t.lookup_readonly(ids), rows - 1.0, atol=1e-7)


def test_initialization_is_deterministic_per_id_across_tables():
    a = EmbeddingTable(D, OptimizerConfig(), capacity=4096, init_scale=0.1)
    b = EmbeddingTable(D, OptimizerConfig(), capacity=8192, init_scale=0.1)
    b.lookup(np.arange(100, dtype=np.uint64))  # different insertion history
    ids = _ids(5, 99, 12345678901234567)
    np.testing.assert_array_equal(a.lookup(ids), b.lookup(ids))
    assert np.all(np.abs(a.lookup(ids)) <= 0.1)


def test_lookup_readonly_of_unseen_ids_leaves_table_size_unchanged():
    t = EmbeddingTable(D, OptimizerConfig(), capacity=4096)
    t.lookup(_ids(1, 2))
    out = t.lookup_readonly(_ids(1, 3, 4))
    assert t.size == 2
    assert np.all(out[1:] == 0.0) and np.any(out[0] != 0.0)


def test_eviction_keeps_rows_at_capacity_and_evicts_least_recently_used():
    cap = 1024
    t = EmbeddingTable(D, OptimizerConfig(), capacity=cap)
    t.lookup(np.arange(cap, dtype=np.uint64))
    t.lookup(_ids(0, 1))  # touch: now 2 is the least recently used
    t.lookup(np.arange(5000, 5003, dtype=np.uint64))
    assert t.size == cap
    st = t.stats()
    assert st["evictions"] == 3
    present = t.contains(np.arange(0, 6, dtype=np.uint64))
    assert present.tolist() == [True, True, False, False, False, True]
    # a gradient for an evicted row is dropped and counted
    assert t.apply_gradients(_ids(2, 0), np.ones((2, D), np.float32)) == 1
    assert t.stats()["dropped_gradients"] == 1


def test_state_dict_round_trip_keeps_rows_state_and_recency():
    t = EmbeddingTable(D, OptimizerConfig(name="adam"), capacity=1024)
    t.lookup(np.arange(1024, dtype=np.uint64))
    t.apply_gradients(np.arange(10, dtype=np.uint64), np.ones((10, D), np.float32))
    t.lookup(_ids(3))
    u = EmbeddingTable(D, OptimizerConfig(name="adam"), capacity=1024)
    u.load_state_dict(t.state_dict())
    for k, v in t.state_dict().items():
        np.testing.assert_array_equal(u.state_dict()[k], v)
    u.lookup(_ids(99999))  # evicts the least recently used, the same as t would
    t.lookup(_ids(99999))
    np.testing.assert_array_equal(
        u.contains(np.arange(1024, dtype=np.uint64)), t.contains(np.arange(1024, dtype=np.uint64))
    )


def test_memory_budget_fixes_capacity_and_bytes_per_row():
    cap = capacity_for_budget(64 << 20, "rowwise_adagrad", 16)
    t = EmbeddingTable(16, OptimizerConfig(), capacity=cap)
    t.lookup(np.arange(cap, dtype=np.uint64))
    assert t.stats()["bytes_allocated"] <= 64 << 20
    raw = 16 * 4 + 4
    assert bytes_per_row("rowwise_adagrad", 16, cap) <= 1.5 * raw


@pytest.mark.parametrize("ids", [(1, 2, 3), (1, 2, 1)], ids=["distinct", "repeated"])
@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_non_finite_gradient_is_refused_and_nothing_is_applied(ids, bad):
    # distinct IDs take the no-copy path of the gradient sum, repeated ones the summing path: both check
    t = EmbeddingTable(D, OptimizerConfig(), capacity=1024)
    before = t.lookup(_ids(1, 2, 3)).copy()
    g = np.ones((3, D), np.float32)
    g[2, D - 1] = bad
    with pytest.raises(ValueError, match="inf or NaN"):
        t.apply_gradients(_ids(*ids), g)
    np.testing.assert_array_equal(t.lookup_readonly(_ids(1, 2, 3)), before)


def test_eviction_never_takes_a_row_looked_up_in_the_same_batch():
    cap = 1024
    t = EmbeddingTable(D, OptimizerConfig(), capacity=cap, init_scale=0.5)
    t.lookup(np.arange(cap, dtype=np.uint64))
    # ID 0 is now the least recently used; a batch that reads it and creates new IDs must evict others
    batch = np.concatenate([np.arange(5000, 5010, dtype=np.uint64), _ids(0, 1), np.arange(6000, 6003, dtype=np.uint64)])
    out = t.lookup(batch)
    fresh = EmbeddingTable(D, OptimizerConfig(), capacity=4 * cap, init_scale=0.5)
    np.testing.assert_array_equal(out, fresh.lookup(batch))
    assert t.contains(_ids(0, 1)).all() and t.size == cap


def test_batch_with_more_distinct_ids_than_capacity_is_refused():
    t = EmbeddingTable(D, OptimizerConfig(), capacity=1024)
    t.lookup(np.arange(1024, dtype=np.uint64))
    with pytest.raises(ValueError, match="more distinct IDs"):
        t.lookup(np.arange(2000, 4100, dtype=np.uint64))


def test_admission_after_n_sightings_gives_a_row_only_from_the_nth():
    t = EmbeddingTable(D, OptimizerConfig(), capacity=4096, init_scale=0.5, admit_after_sightings=3)
    ids = _ids(10, 11)
    assert np.all(t.lookup(ids) == 0.0) and t.size == 0  # 1st sighting: refused, zero row
    assert np.all(t.lookup(ids[:1]) == 0.0) and t.size == 0  # 2nd
    row = t.lookup(ids[:1])  # 3rd sighting of ID 10: admitted
    assert t.size == 1 and np.any(row != 0.0)
    assert t.contains(ids).tolist() == [True, False]
    assert t.stats()["not_admitted"] == 3
    # a gradient for a refused ID has no row: dropped and counted, never applied
    assert t.apply_gradients(_ids(11), np.ones((1, D), np.float32)) == 1


def test_admission_probability_admits_about_that_share_reproducibly():
    def run():
        t = EmbeddingTable(D, OptimizerConfig(), capacity=1 << 16, admit_probability=0.25)
        t.lookup(np.arange(20000, dtype=np.uint64))
        return t.contains(np.arange(20000, dtype=np.uint64))

    a, b = run(), run()
    assert np.array_equal(a, b)
    assert 0.23 < a.mean() < 0.27


def test_expiry_removes_rows_untouched_for_t_steps_and_keeps_the_rest_intact():
    t = EmbeddingTable(D, OptimizerConfig(name="adam"), capacity=4096, init_scale=0.5, expire_after_steps=3)
    old = np.arange(0, 100, dtype=np.uint64)
    hot = np.arange(1000, 1050, dtype=np.uint64)
    t.lookup(old)
    t.apply_gradients(hot[:0], np.zeros((0, D), np.float32))
    t.lookup(hot)
    t.apply_gradients(hot, np.ones((50, D), np.float32))
    before = {k: v.copy() for k, v in zip(["w"], [t.lookup_readonly(hot)], strict=True)}
    m_before = t.state["m"][np.flatnonzero(np.isin(t.keys[: t.size], hot))]
    for _ in range(4):
        t.lookup(hot)  # old rows untouched for 4 lookup batches
    assert t.size == 50 and t.stats()["expired"] == 100
    assert not t.contains(old).any() and t.contains(hot).all()
    np.testing.assert_array_equal(t.lookup_readonly(hot), before["w"])
    m_after = t.state["m"][np.flatnonzero(np.isin(t.keys[: t.size], hot))]
    assert sorted(map(bytes, m_after)) == sorted(map(bytes, m_before))
    # the index still finds every row after the compaction moved rows around
    sd = t.state_dict()
    u = EmbeddingTable(D, OptimizerConfig(name="adam"), capacity=4096)
    u.load_state_dict(sd)
    np.testing.assert_array_equal(u.lookup_readonly(hot), before["w"])


@pytest.mark.parametrize("storage", ["fp16", "bf16"])
def test_16_bit_storage_rounds_each_fp32_update_and_halves_the_weight_bytes(storage):
    from persia_core.embedding.precision import decode, encode
    from persia_core.memory import row_bytes_without_index

    cfg = OptimizerConfig(name="rowwise_adagrad", lr=0.1)
    t = EmbeddingTable(D, cfg, capacity=4096, init_scale=0.5, storage=storage)
    ref = EmbeddingTable(D, cfg, capacity=4096, init_scale=0.5)
    ids = _ids(0, 7, 2**64 - 1)
    w0 = t.lookup(ids)
    np.testing.assert_array_equal(w0, decode(encode(ref.lookup(ids), storage), storage))  # rounded init
    g = np.random.default_rng(0).normal(size=(3, D)).astype(np.float32)
    t.apply_gradients(ids, g)
    # reference: the fp32 step applied to the stored (rounded) weights, then rounded again
    r2 = EmbeddingTable(D, cfg, capacity=4096)
    sd = ref.state_dict()
    sd["weights"] = decode(encode(sd["weights"], storage), storage)
    r2.load_state_dict(sd)
    r2.apply_gradients(ids, g)
    expect = decode(encode(r2.lookup_readonly(ids), storage), storage)
    np.testing.assert_array_equal(t.lookup_readonly(ids), expect)
    assert t.weights.dtype == np.uint16 and t.state["acc"].dtype == np.float32
    assert (
        row_bytes_without_index("rowwise_adagrad", 16, storage) == row_bytes_without_index("rowwise_adagrad", 16) - 32
    )
    u = EmbeddingTable(D, cfg, capacity=4096, storage=storage)
    u.load_state_dict(t.state_dict())
    np.testing.assert_array_equal(u.lookup_readonly(ids), t.lookup_readonly(ids))


def test_bf16_encoding_rounds_to_nearest_even():
    from persia_core.embedding.precision import decode, encode

    x = np.array([[1.0, 1.0 + 2**-8, 1.0 + 3 * 2**-8, -2.5, 65504.0, 1e-40]], np.float32)
    got = decode(encode(x, "bf16"), "bf16")
    assert got[0, :4].tolist() == [1.0, 1.0, 1.0 + 4 * 2**-8, -2.5]  # ties to even
    assert abs(got[0, 4] - 65504.0) / 65504.0 < 2**-8


def test_a_partial_async_push_scales_the_step_of_scale_invariant_optimizers_but_not_sgd():
    ids = _ids(1, 2)
    g = np.random.default_rng(4).normal(size=(2, D)).astype(np.float32)
    for name in ("rowwise_adagrad", "adam", "sgd"):
        half = EmbeddingTable(D, OptimizerConfig(name=name, lr=0.1), capacity=1024, init_scale=0.5)
        ref = EmbeddingTable(
            D, OptimizerConfig(name=name, lr=0.1 if name == "sgd" else 0.05), capacity=1024, init_scale=0.5
        )
        half.lookup(ids)
        ref.lookup(ids)
        half.apply_gradients(ids, g, step_fraction=0.5)
        ref.apply_gradients(ids, g)
        np.testing.assert_array_equal(half.lookup_readonly(ids), ref.lookup_readonly(ids))


def test_eviction_and_expiry_follow_a_reference_lru_over_many_batches():
    """Random batches against an ordered-dict LRU model (recency at batch granularity, ties in first-touch order):
    the same rows live after every batch, the same evicted, weights and optimizer state follow their IDs through
    expiry's row moves, and the recency queue compacts many times over. The eviction log (a delta's tombstones)
    holds the keys removed, expired and evicted, in order, across takes far apart (it grows past its first size)."""
    from collections import OrderedDict

    cap, expire_after = 300, 6
    t = EmbeddingTable(2, OptimizerConfig(name="adagrad", lr=0.1), cap, 0.1, 0, expire_after_steps=expire_after)
    t.log_evictions()
    model: OrderedDict[int, int] = OrderedDict()  # id -> last step, least recent first
    removed: list[int] = []  # keys the model removed since the last take
    rng = np.random.default_rng(3)
    for step in range(1, 400):
        hot = rng.integers(0, 40, 30)
        cold = rng.integers(0, 100_000, int(rng.integers(0, 120)))
        ids = np.concatenate([hot, cold]).astype(np.uint64)
        # the model: expire, then touch found IDs (first-touch order), then create unseen ones, evicting the LRU
        for k in [k for k, s in model.items() if s < step - expire_after]:
            del model[k]
            removed.append(k)
        seen = set()
        for k in (int(v) for v in ids):
            if k in model and k not in seen:
                model.move_to_end(k)
                model[k] = step
            seen.add(k)
        for k in dict.fromkeys(int(v) for v in ids):
            if k not in model:
                if len(model) >= cap:
                    removed.append(model.popitem(last=False)[0])
                model[k] = step
        rows = t.lookup(ids)
        if step % 100 == 0 or step == 399:
            assert t.take_evicted().tolist() == removed
            removed = []
        t.apply_gradients(np.unique(ids), np.ones((len(np.unique(ids)), 2), np.float32))
        assert t.size == len(model)
        sd = t.state_dict()  # most recent first: the model's order reversed, exactly
        assert sd["keys"].tolist() == list(reversed(model))
        assert sd["last_used"].tolist() == [model[int(k)] for k in sd["keys"]]
        assert rows.shape == (len(ids), 2)
    st = t.stats()
    assert st["evictions"] > 0 and st["expired"] > 0
    assert t.qht[1] - t.qht[0] <= len(t.qrow)
    # the rows of every ID are its own: a fresh table fed the same history gives the same state per ID
    sd = t.state_dict()
    assert len(set(sd["keys"].tolist())) == len(sd["keys"])
    assert (sd["acc"] > 0).all()


def test_find_rows_at_full_index_load_matches_a_dict_for_present_absent_and_repeated_ids():
    # at the index's highest load (0.75) long probe runs are common: every ID that is not in its home slot goes
    # through the kernel's round-by-round walk
    from persia_core.embedding import kernels as K
    from persia_core.embedding.buffers import aligned_array

    rng = np.random.default_rng(3)
    keys = np.unique(rng.integers(0, 2**64 - 1, 12_288, dtype=np.uint64, endpoint=True))
    keys = np.concatenate([keys, _ids(0, 2**63, 2**64 - 1)])
    index = aligned_array(16_384, np.int32, -1)
    K.rebuild_index(index, keys, K.shift_of(index), len(keys))
    absent = rng.integers(0, 2**64 - 1, 5_000, dtype=np.uint64, endpoint=True)
    query = np.concatenate([keys, absent, keys[::7], keys[::-3]])
    query = query[rng.permutation(len(query))]
    row = {int(k): r for r, k in enumerate(keys)}
    expected = np.array([row.get(int(q), -1) for q in query], np.int32)
    np.testing.assert_array_equal(K.find_rows(query, index, keys), expected)
    assert (expected >= 0).sum() > len(keys)  # repeats present


@pytest.mark.parametrize("dim", [16, 48, 64])
def test_lookups_copy_each_ids_own_row_on_the_streaming_store_path(dim):
    # dims that are multiples of 16 are written with 64-byte non-temporal stores into a cache-line-aligned output;
    # the reference is the table's own rows, fetched by row number in numpy
    from persia_core.embedding import kernels as K
    from persia_core.embedding.buffers import aligned_array

    t = EmbeddingTable(dim, OptimizerConfig(name="rowwise_adagrad", lr=0.1), 5_000, 0.5, 0)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 2**64 - 1, 3_000, dtype=np.uint64, endpoint=True)
    ids = np.concatenate([ids, ids[::3], _ids(0, 2**63, 2**64 - 1)])
    first = t.lookup(ids)
    t.apply_gradients(ids[:500], np.ones((500, dim), np.float32))
    rows = K.find_rows(ids, t.index, t.keys)
    assert (rows >= 0).all()
    np.testing.assert_array_equal(t.lookup(ids), t.weights[rows])
    np.testing.assert_array_equal(first[-3:], t.weights[rows[-3:]])  # IDs 0, 2^63, 2^64-1: untouched since made
    absent = rng.integers(0, 2**64 - 1, 100, dtype=np.uint64, endpoint=True)
    ro = t.lookup_readonly(np.concatenate([ids[:50], absent]))
    np.testing.assert_array_equal(ro[:50], t.weights[rows[:50]])
    assert not ro[50:].any()
    # the kernel itself: streamed and plain stores write the same bytes, zeros for rows < 0
    probe = np.concatenate([rows[:200], np.full(7, -1, np.int32)])
    streamed, plain = aligned_array((len(probe), dim), np.float32), np.full((len(probe), dim), np.nan, np.float32)
    K.gather_rows(t.weights, probe, streamed, True)
    K.gather_rows(t.weights, probe, plain, False)
    np.testing.assert_array_equal(streamed, plain)
    np.testing.assert_array_equal(plain[:200], t.weights[rows[:200]])
    assert not plain[200:].any()
    # rows held column-major (as a crafted shard file could give them) are never streamed as 64-byte vectors
    expected = t.weights[rows].copy()
    t.weights = np.asfortranarray(t.weights)
    np.testing.assert_array_equal(t.lookup_readonly(ids), expected)
    np.testing.assert_array_equal(t.lookup(ids), expected)


def test_output_pool_reuses_memory_only_once_no_array_or_tensor_refers_to_it():
    from persia_core.embedding.buffers import OutputPool

    pool = OutputPool(min_bytes=1 << 16)
    shape = (4096, 16)  # 256 KiB
    a = pool.take(shape, np.float32)
    assert a.ctypes.data % 64 == 0 and a.flags.writeable and a.flags.c_contiguous and a.shape == shape
    addr = a.ctypes.data
    view = a[10:20].T  # numpy collapses view chains; the view must still pin the memory
    tensor = torch.from_numpy(a[100:200])
    del a
    view[:] = 1.0
    tensor[:] = 2.0
    b = pool.take(shape, np.float32)
    assert b.ctypes.data != addr  # still referred to: not reused
    b[:] = 7.0
    assert (view == 1.0).all() and (tensor == 2.0).all()
    del view
    c = pool.take(shape, np.float32)
    assert c.ctypes.data != addr  # the tensor still holds it
    del tensor
    assert pool.held_bytes > 0
    d = pool.take(shape, np.float32)
    assert d.ctypes.data == addr  # now free: reused
    # a free buffer over twice the size asked for is not handed out (the pool holds it meanwhile)
    del b, c, d
    assert pool.held_bytes == 2 * (4096 * 16 * 4 + 64)  # keep=2: the third freed buffer was let go
    small = pool.take((1024, 16), np.float32)
    assert small.shape == (1024, 16) and pool.held_bytes == 2 * (4096 * 16 * 4 + 64)


def test_output_pool_takes_back_an_output_freed_while_its_own_lock_is_held():
    # an output in a reference cycle is freed by the garbage collector, which may start on any allocation, also
    # one made inside the pool's own locked section (take, held_bytes): returning the buffer there must not wait
    # on that lock. Freed here deterministically while the lock is held, in a thread, so a deadlock fails the test
    import threading

    from persia_core.embedding.buffers import OutputPool

    pool = OutputPool(min_bytes=1 << 16)
    done = []

    def work():
        a = pool.take((4096, 16), np.float32)
        addr = a.ctypes.data
        with pool._lock:
            del a  # the finalizer runs here, in this thread, under the lock
        b = pool.take((4096, 16), np.float32)
        done.append(b.ctypes.data == addr)

    worker = threading.Thread(target=work, daemon=True)
    worker.start()
    worker.join(30)
    assert not worker.is_alive(), "the pool deadlocked on a buffer freed under its own lock"
    assert done == [True]  # and the buffer was reused


def test_lookup_outputs_in_reused_memory_hold_their_own_rows_and_kept_outputs_stay_intact():
    # outputs of 1 MiB and more come from the table's output pool: an output the caller keeps must never be
    # overwritten by a later lookup, and one written into reused (dirty) memory must hold exactly its own rows,
    # zero rows for unseen IDs included
    from persia_core.embedding import kernels as K

    t = EmbeddingTable(16, OptimizerConfig(name="rowwise_adagrad", lr=0.1), 200_000, 0.5, 0)
    rng = np.random.default_rng(3)
    a_ids = rng.integers(0, 2**64 - 1, 20_000, dtype=np.uint64, endpoint=True)  # 20,000 x 64 B = 1.28 MB
    b_ids = rng.integers(0, 2**64 - 1, 20_000, dtype=np.uint64, endpoint=True)
    kept = t.lookup(a_ids)
    kept_copy = kept.copy()
    first_b = t.lookup(b_ids)
    first_b_copy, first_addr = first_b.copy(), first_b.ctypes.data
    del first_b
    for _ in range(3):  # each output dropped before the next lookup, which reuses its memory
        again = t.lookup(b_ids)
        assert again.ctypes.data == first_addr
        np.testing.assert_array_equal(again, first_b_copy)
        del again
    np.testing.assert_array_equal(kept, kept_copy)
    unseen = rng.integers(0, 2**64 - 1, 5_000, dtype=np.uint64, endpoint=True)
    query = np.concatenate([b_ids[:15_000], unseen])  # the size of the freed output: it gets that memory
    ro = t.lookup_readonly(query)
    assert ro.ctypes.data == first_addr
    np.testing.assert_array_equal(ro[:15_000], first_b_copy[:15_000])
    np.testing.assert_array_equal(ro[:15_000], t.weights[K.find_rows(b_ids[:15_000], t.index, t.keys)])
    assert not ro[15_000:].any()


@pytest.mark.parametrize("n", [0, 1, 17, 5_000, 300_000])
def test_dedup_matches_numpy_unique_in_first_seen_order(n):
    # reference: numpy's sort-based unique, reordered by first occurrence; Zipf-like repeats, colliding home
    # slots and the extreme IDs 0, 2^63 and 2^64-1 included
    from persia_core.embedding.kernels import dedup

    rng = np.random.default_rng(n)
    pool = np.concatenate(
        [rng.integers(0, 2**64 - 1, max(n // 4, 1), dtype=np.uint64, endpoint=True), _ids(0, 2**63, 2**64 - 1)]
    )
    ids = pool[np.minimum(rng.zipf(1.3, n) - 1, len(pool) - 1)].astype(np.uint64)
    uniq, inverse = dedup(ids)
    ref, first = np.unique(ids, return_index=True)
    np.testing.assert_array_equal(uniq, ids[np.sort(first)])
    assert inverse.dtype == np.int64 and inverse.shape == (n,)
    np.testing.assert_array_equal(uniq[inverse], ids)
    assert len(uniq) == len(ref)


@pytest.mark.parametrize(
    "dim,storage",
    [(16, "fp32"), (8, "fp32"), (16, "fp16")],
    ids=["streamed-copy", "element-copy", "16-bit-caller-copy"],
)
def test_lookup_rows_equal_a_readonly_lookup_through_eviction_admission_and_repeats(dim, storage):
    # each way a lookup copies rows out (64-byte streamed stores, an element loop, the 16-bit caller's copy)
    # against the read-only path (a separate probe and gather): found rows, repeats, rows created in the batch
    # (and their repeats), IDs refused by admission (zero rows) and evictions at capacity; every row looked up
    # is marked used in that step
    from persia_core.embedding import kernels as K
    from persia_core.embedding.table import _streamable

    t = EmbeddingTable(
        dim, OptimizerConfig(name="rowwise_adagrad", lr=0.1), 20_000, 0.5, 0, storage=storage, admit_probability=0.7
    )  # decided per ID and step: all of a batch's sightings alike
    rng = np.random.default_rng(11)
    pool = np.concatenate(
        [rng.integers(0, 2**64 - 1, 60_000, dtype=np.uint64, endpoint=True), _ids(0, 2**63, 2**64 - 1)]
    )
    for _ in range(6):
        hot = pool[np.minimum(rng.zipf(1.2, 20_000) - 1, len(pool) - 1)]
        ids = rng.permutation(np.concatenate([hot, rng.choice(pool, 10_000)]))  # >= 1 MiB out at dim 16: pooled
        out = t.lookup(ids)
        if dim == 16 and storage == "fp32":
            assert _streamable(out, t.weights)
        held = t.contains(ids)
        np.testing.assert_array_equal(out[held], t.lookup_readonly(ids[held]))
        assert not out[~held].any()
        assert (t.last_used[K.find_rows(ids[held], t.index, t.keys)] == t.step).all()
    st = t.stats()
    assert st["evictions"] > 0 and st["not_admitted"] > 0


@pytest.mark.parametrize("storage", ["fp32", "bf16"])
def test_lookup_into_a_given_output_writes_there_the_rows_it_would_return(storage):
    opt = OptimizerConfig(name="rowwise_adagrad")
    a = EmbeddingTable(16, opt, 1000, storage=storage)
    b = EmbeddingTable(16, opt, 1000, storage=storage)
    ids = np.arange(1, 301, dtype=np.uint64)
    out = np.full((300, 16), np.nan, np.float32)
    assert b.lookup(ids, out) is out
    np.testing.assert_array_equal(out, a.lookup(ids))
    again = np.full((300, 16), np.nan, np.float32)
    assert b.lookup_readonly(ids, again) is again
    np.testing.assert_array_equal(again, out)
    with pytest.raises(ValueError, match="expected C-contiguous float32"):
        b.lookup(ids, np.empty((300, 8), np.float32))
    with pytest.raises(ValueError, match="expected C-contiguous float32"):
        b.lookup_readonly(ids, np.empty((16, 300), np.float32).T)


@pytest.mark.parametrize(
    "opt",
    [
        OptimizerConfig(name="sgd", lr=0.1, weight_decay=0.01),
        OptimizerConfig(name="adagrad", lr=0.1),
        OptimizerConfig(name="rowwise_adagrad", lr=0.1, initial_accumulator=1e-3),
        OptimizerConfig(name="adam", lr=0.01),
        OptimizerConfig(name="ftrl", lr=0.2, l1=0.01, l2=0.1),
    ],
    ids=lambda o: o.name,
)
def test_lr_scale_steps_as_the_optimizer_with_its_rate_scaled(opt):
    # trainer.embedding_lr_decay's pushes: lr_scale s on a table of rate lr is a table of rate s * lr, every
    # optimizer alike, with or without a step fraction
    scaled = dataclasses.replace(opt, lr=opt.lr * 0.25)
    a = EmbeddingTable(D, opt, capacity=256, init_scale=0.1, seed=3)
    b = EmbeddingTable(D, scaled, capacity=256, init_scale=0.1, seed=3)
    c = EmbeddingTable(D, opt, capacity=256, init_scale=0.1, seed=3)
    ids = _ids(5, 9, 2**63 + 1)
    np.testing.assert_array_equal(a.lookup(ids), b.lookup(ids))
    c.lookup(ids)
    rng = np.random.default_rng(0)
    for step in range(6):
        g = rng.normal(size=(len(ids), D)).astype(np.float32)
        fraction = 0.5 if step % 2 else 1.0
        a.apply_gradients(ids, g, step_fraction=fraction, lr_scale=0.25)
        b.apply_gradients(ids, g, step_fraction=fraction)
        c.apply_gradients(ids, g, step_fraction=fraction)
    np.testing.assert_allclose(a.lookup_readonly(ids), b.lookup_readonly(ids), rtol=0, atol=1e-7)
    assert not np.allclose(a.lookup_readonly(ids), c.lookup_readonly(ids), rtol=0, atol=1e-4)
