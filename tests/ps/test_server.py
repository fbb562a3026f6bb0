"""The gRPC parameter server and its client, on 127.0.0.1, against the in-process table."""

import numpy as np
import pytest
from support import tiny_config

from persia_core.embedding.reference import LocalEmbedding
from persia_core.ps.client import EmbeddingClient, ParameterServerError
from persia_core.ps.shard import ParameterServerShard


def test_lookup_and_push_through_grpc_equal_the_in_process_reference(cluster):
    cfg, _, addrs = cluster
    client = EmbeddingClient(addrs, cfg.embedding, token="s3cret")
    local = LocalEmbedding(cfg.embedding, num_shards=1)
    ids = np.array([0, 5, 2**64 - 1, 17, 123456789], dtype=np.uint64)
    np.testing.assert_array_equal(client.lookup("default", ids), local.lookup("default", ids))
    g = np.random.default_rng(0).normal(size=(len(ids), 4)).astype(np.float32)
    client.push("default", ids, g).result(timeout=10)
    local.push("default", ids, g)
    np.testing.assert_allclose(client.lookup_readonly("default", ids), local.lookup_readonly("default", ids), atol=1e-7)
    client.close()


def test_call_without_the_token_is_refused(cluster):
    cfg, _, addrs = cluster
    bad = EmbeddingClient(addrs, cfg.embedding, token="wrong", retries=0)
    with pytest.raises(ParameterServerError, match="UNAUTHENTICATED"):
        bad.lookup("default", np.array([1], dtype=np.uint64))
    none = EmbeddingClient(addrs, cfg.embedding, token="", retries=0)
    with pytest.raises(ParameterServerError, match="UNAUTHENTICATED"):
        none.health()
    bad.close()
    none.close()


def test_retried_gradient_push_is_applied_once(cluster):
    cfg, shards, addrs = cluster
    client = EmbeddingClient(addrs, cfg.embedding, token="s3cret")
    ids = np.array([42], dtype=np.uint64)
    client.lookup("default", ids)
    owner = int(np.argmax([sh.tables["default"].size for sh in shards]))
    before = client.lookup_readonly("default", ids)
    meta = {"table": "default", "client": "c1", "seq": 7, "step": 0, "sync_workers": 0}
    arrays = {"ids": ids, "grads": np.ones((1, 4), np.float32)}
    first = client.call("Push", owner, meta, arrays)[0]
    again = client.call("Push", owner, meta, arrays)[0]  # the same sequence number: a retry
    assert first["applied"] and not again["applied"] and again["duplicate"]
    after_one = client.lookup_readonly("default", ids)
    ref = LocalEmbedding(cfg.embedding, 1)
    ref.lookup("default", ids)
    ref.push("default", ids, np.ones((1, 4), np.float32))
    np.testing.assert_allclose(after_one, ref.lookup_readonly("default", ids), atol=1e-7)
    assert not np.allclose(after_one, before)
    client.close()


def test_sync_pushes_of_all_workers_are_combined_and_applied_once(cluster):
    cfg, _, addrs = cluster
    ids = np.array([1, 2, 3], dtype=np.uint64)
    clients = [EmbeddingClient(addrs, cfg.embedding, token="s3cret", client_id=f"w{r}") for r in range(2)]
    clients[0].lookup("default", ids)
    g = [np.full((3, 4), 0.25, np.float32), np.full((3, 4), 0.75, np.float32)]
    futs = [clients[r].push("default", ids, g[r], step=0, sync_workers=2) for r in range(2)]
    for f in futs:
        f.result(timeout=10)
    ref = LocalEmbedding(cfg.embedding, 1)
    ref.lookup("default", ids)
    ref.push("default", ids, g[0] + g[1])  # one row-wise Adagrad update with the combined gradient
    np.testing.assert_allclose(
        clients[0].lookup_readonly("default", ids), ref.lookup_readonly("default", ids), atol=1e-7
    )
    for c in clients:
        c.close()


def test_sync_push_missing_a_worker_times_out_instead_of_hanging(cluster):
    cfg, _, addrs = cluster
    client = EmbeddingClient(addrs, cfg.embedding, token="s3cret", timeout_s=1.0, retries=0)
    fut = client.push("default", np.array([1], np.uint64), np.ones((1, 4), np.float32), step=3, sync_workers=2)
    with pytest.raises(ParameterServerError, match="DEADLINE_EXCEEDED"):
        fut.result(timeout=10)
    client.close()


def test_a_call_to_a_server_that_does_not_answer_fails_within_twice_its_deadline_retries_included(cluster):
    # the second worker's push of a sync step never comes, so the server never answers: all attempts together
    # get 2 x timeout_s (before, each of the 3 retries had a deadline of its own: 4 x timeout_s, 2 minutes at the
    # default 30 s for a hung server)
    import time

    cfg, _, addrs = cluster
    client = EmbeddingClient(addrs, cfg.embedding, token="s3cret", timeout_s=1.0, retries=3)
    t0 = time.monotonic()
    fut = client.push("default", np.array([1], np.uint64), np.ones((1, 4), np.float32), step=3, sync_workers=2)
    with pytest.raises(ParameterServerError, match=r"shard \d.*DEADLINE_EXCEEDED"):
        fut.result(timeout=10)
    assert 2.0 <= time.monotonic() - t0 < 6.0  # before: 4 attempts of 1 s and the back-off
    client.close()


def test_server_answers_an_error_for_an_unknown_table(cluster):
    cfg, _, addrs = cluster
    client = EmbeddingClient(addrs, cfg.embedding, token="s3cret", retries=0)
    client.dims["nope"] = 4
    with pytest.raises(ParameterServerError, match="INVALID_ARGUMENT.*no table"):
        client.lookup("nope", np.array([1], np.uint64))
    client.close()


def test_compiled_routing_agrees_with_shard_of():
    from persia_core.embedding.kernels import route
    from persia_core.hashing import shard_of

    ids = np.random.default_rng(3).integers(0, 2**64 - 1, 5000, dtype=np.uint64, endpoint=True)
    ids[:3] = [0, 2**63, 2**64 - 1]
    for n in (1, 2, 3, 7):
        order, bounds = route(ids, n)
        owner = shard_of(ids, n)
        assert sorted(order.tolist()) == list(range(len(ids)))
        for s in range(n):
            part = order[bounds[s] : bounds[s + 1]]
            assert (owner[part] == s).all() and (np.diff(part) > 0).all()


def test_exactly_once_bookkeeping_stays_bounded_when_pushes_arrive_out_of_order():
    cfg = tiny_config()
    shard = ParameterServerShard(cfg, 0, 1)
    shard.table("default").lookup(np.array([1], np.uint64))
    order = np.random.default_rng(0).permutation(200)
    for seq in order:
        meta = {"table": "default", "client": "w0", "seq": int(seq), "step": 0, "sync_workers": 0}
        shard.push(meta, np.array([1], np.uint64), np.zeros((1, 4), np.float32), timeout=5)
    rec = shard.applied["w0"]
    assert rec.low == 199 and not rec.above
