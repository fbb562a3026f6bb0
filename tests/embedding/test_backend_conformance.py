"""The same cases against both ``EmbeddingBackend`` implementations: the in-process ``LocalEmbedding`` and the
``EmbeddingClient`` of two real parameter servers on 127.0.0.1.

The servers are shared by the module's tests, so each test draws its own feature IDs and counts rows as
differences. The reference for row values is one unsharded ``EmbeddingTable`` of the same config and seed; the
reference for an update is its float64 recomputation (row-wise Adagrad, the config's optimizer)."""

from __future__ import annotations

import contextlib

import grpc
import numpy as np
import pytest
from support import tiny_config

from persia_core.embedding.checksums import file_crc32c
from persia_core.embedding.reference import LocalEmbedding
from persia_core.embedding.routing import group_by_shard, positions_by_shard
from persia_core.embedding.shard_file import ShardFileError
from persia_core.embedding.table import EmbeddingTable
from persia_core.ps.client import EmbeddingClient, ParameterServerError
from persia_core.ps.server import ParameterServerShard, serve

TOKEN = "conformance"
CFG = tiny_config()
TABLE = CFG.embedding.tables[0]
N = CFG.embedding.num_shards


class _LostReply(grpc.RpcError):
    """What the client sees when a server applied a call but its answer never arrived."""

    def code(self):
        return grpc.StatusCode.UNAVAILABLE

    def details(self):
        return "reply lost (injected by the test)"


class Backend:
    """A backend under test, with what a case needs beyond the Protocol: losing the first reply of each
    shard's push (the client retries; in process there is no reply to lose)."""

    def __init__(self, impl, lose_replies=None):
        self.impl = impl
        self._lose = lose_replies

    def lose_first_push_replies(self):
        return self._lose() if self._lose is not None else contextlib.nullcontext({})


def _serve_shards():
    """N shards of ``tiny_config()`` served on 127.0.0.1: their addresses."""
    shards = [ParameterServerShard(CFG, s, N) for s in range(N)]
    started = [serve(sh, "127.0.0.1", 0, token=TOKEN) for sh in shards]
    yield [f"127.0.0.1:{port}" for _, port in started]
    for srv, _ in started:
        srv.stop(0)


@pytest.fixture(scope="module")
def servers():
    yield from _serve_shards()


@pytest.fixture(scope="module")
def servers_grpc():
    """Servers of their own for the gRPC-only client (the tests' IDs are per test, not per backend)."""
    yield from _serve_shards()


@pytest.fixture(params=["local", "client", "client-grpc"])
def backend(request):
    """The in-process backend; the client of the servers over their local channel and shared memory (as on one
    host); the client over gRPC messages only (as across hosts)."""
    if request.param == "local":
        yield Backend(LocalEmbedding(CFG.embedding, N, CFG.trainer.seed))
        return
    servers = request.getfixturevalue("servers" if request.param == "client" else "servers_grpc")
    client = EmbeddingClient(
        servers, CFG.embedding, token=TOKEN, shared_memory=None if request.param == "client" else False
    )

    @contextlib.contextmanager
    def lose_replies():
        real = client._send  # one attempt of a call, on either transport
        calls = {}

        def lossy(method, shard, request, timeout_s):
            answer = real(method, shard, request, timeout_s)
            if method == "Push":
                calls[shard] = calls.get(shard, 0) + 1
                if calls[shard] == 1:
                    raise _LostReply()
            return answer

        client._send = lossy
        try:
            yield calls
        finally:
            client._send = real

    yield Backend(client, lose_replies)
    client.close()


def _ids(seed: int, n: int = 64) -> np.ndarray:
    """``n`` distinct feature IDs of one test (random 63-bit, so tests sharing the servers do not collide)."""
    ids = np.unique(np.random.default_rng(seed).integers(1, 2**63, n, dtype=np.uint64))
    assert len(ids) == n
    return ids


def _reference_rows(ids: np.ndarray) -> np.ndarray:
    t = EmbeddingTable(TABLE.dim, TABLE.optimizer, 4096, TABLE.init_scale, CFG.trainer.seed)
    return t.lookup(ids)


def _rowwise_adagrad(w: np.ndarray, grads: list[np.ndarray]) -> np.ndarray:
    """float64 recomputation of successive row-wise Adagrad steps: s += mean(g^2); w -= lr g / (sqrt(s) + eps)."""
    o = TABLE.optimizer
    w = w.astype(np.float64)
    s = np.full(len(w), o.initial_accumulator, np.float64)
    for g in grads:
        g = g.astype(np.float64) + o.weight_decay * w
        s += (g * g).mean(axis=1)
        w = w - o.lr * g / (np.sqrt(s)[:, None] + o.eps)
    return w


def _rows(backend) -> list[int]:
    return [sum(t["rows"] for t in st["tables"].values()) for st in backend.stats()]


def test_lookup_creates_rows_with_the_seeded_initial_values_of_every_backend(backend):
    b = backend.impl
    ids = _ids(1)
    assert not b.contains(TABLE.name, ids).any()
    rows = b.lookup(TABLE.name, ids)
    assert rows.dtype == np.float32 and rows.shape == (len(ids), TABLE.dim) == (len(ids), b.dims[TABLE.name])
    np.testing.assert_array_equal(rows, _reference_rows(ids))
    assert b.contains(TABLE.name, ids).all()
    np.testing.assert_array_equal(b.lookup(TABLE.name, ids[::-1]), rows[::-1])  # created once, not again


def test_readonly_lookup_of_unseen_ids_reads_zeros_and_inserts_nothing(backend):
    b = backend.impl
    seen, unseen = _ids(2, 16), _ids(3, 16)
    b.lookup(TABLE.name, seen)
    before = _rows(b)
    ids = np.concatenate([unseen, seen])
    rows = b.lookup_readonly(TABLE.name, ids)
    assert rows.dtype == np.float32 and rows.shape == (len(ids), TABLE.dim)
    np.testing.assert_array_equal(rows[: len(unseen)], 0.0)
    np.testing.assert_array_equal(rows[len(unseen) :], _reference_rows(seen))
    assert _rows(b) == before
    np.testing.assert_array_equal(b.contains(TABLE.name, ids), [False] * len(unseen) + [True] * len(seen))


def test_pushes_apply_the_optimizer_step_as_a_float64_recomputation(backend):
    b = backend.impl
    ids = _ids(4)
    w0 = b.lookup(TABLE.name, ids)
    rng = np.random.default_rng(0)
    grads = [rng.normal(size=(len(ids), TABLE.dim)).astype(np.float32) for _ in range(2)]
    for g in grads:
        assert b.push(TABLE.name, ids, g).result(timeout=30) == 0  # no row was evicted: nothing dropped
    b.flush()
    np.testing.assert_allclose(b.lookup_readonly(TABLE.name, ids), _rowwise_adagrad(w0, grads), rtol=0, atol=1e-6)


def test_a_push_whose_reply_is_lost_and_retried_is_applied_once(backend):
    b = backend.impl
    ids = _ids(5)
    w0 = b.lookup(TABLE.name, ids)
    g = np.random.default_rng(1).normal(size=(len(ids), TABLE.dim)).astype(np.float32)
    with backend.lose_first_push_replies() as calls:
        b.push(TABLE.name, ids, g).result(timeout=30)
    if isinstance(b, EmbeddingClient):  # every shard's push was sent twice: the lost attempt and its retry
        assert calls == {s: 2 for s, pos in enumerate(positions_by_shard(ids, N)) if len(pos)}
    np.testing.assert_allclose(b.lookup_readonly(TABLE.name, ids), _rowwise_adagrad(w0, [g]), rtol=0, atol=1e-6)


def test_dump_and_load_round_trip_and_a_file_that_differs_from_its_checksum_is_refused(backend, tmp_path):
    b = backend.impl
    ids = _ids(6)
    b.lookup(TABLE.name, ids)
    b.push(TABLE.name, ids, np.ones((len(ids), TABLE.dim), np.float32)).result(timeout=30)
    saved = b.lookup_readonly(TABLE.name, ids)
    rows = _rows(b)
    paths = [str(tmp_path / f"shard-{s}.npz") for s in range(N)]
    dumped = b.dump(paths)
    assert dumped == [file_crc32c(p) for p in paths]
    b.push(TABLE.name, ids, np.ones((len(ids), TABLE.dim), np.float32)).result(timeout=30)
    later = _ids(7, 8)
    b.lookup(TABLE.name, later)
    assert not np.allclose(b.lookup_readonly(TABLE.name, ids), saved)
    wrong = [(n, crc ^ 1) for n, crc in dumped]
    with pytest.raises((ShardFileError, ParameterServerError), match="CRC-32C"):
        b.load(paths, wrong)
    b.load(paths, dumped)
    np.testing.assert_array_equal(b.lookup_readonly(TABLE.name, ids), saved)
    assert not b.contains(TABLE.name, later).any()
    assert _rows(b) == rows
    with pytest.raises(ValueError, match="shard files for"):
        b.load(paths[:1])


def test_stats_count_the_rows_of_every_shard(backend):
    b = backend.impl
    ids = _ids(8, 100)
    before = b.stats()
    assert [(st["shard"], st["num_shards"]) for st in before] == [(s, N) for s in range(N)]
    b.lookup(TABLE.name, ids)
    b.lookup_readonly(TABLE.name, _ids(9, 10))  # read-only misses add no row
    added = [
        a["tables"][TABLE.name]["rows"] - z["tables"][TABLE.name]["rows"]
        for a, z in zip(b.stats(), before, strict=True)
    ]
    assert added == [len(pos) for pos in positions_by_shard(ids, N)]
    assert b.num_shards == N


def test_the_clients_calls_go_over_the_transport_their_fixture_names(backend, request):
    b = backend.impl
    ids = _ids(41)
    b.lookup(TABLE.name, ids)
    if isinstance(b, EmbeddingClient):
        on_local = [ch is not None for ch in b.local]
        assert on_local == [request.node.callspec.params["backend"] == "client"] * N


def test_ids_grouped_by_shard_with_their_bounds_give_the_rows_and_updates_of_routed_ids(backend):
    b = backend.impl
    ids = _ids(43, 300)
    batch = np.concatenate([ids, ids[::3]])  # a batch's IDs, some repeated
    uniq, inverse = np.unique(batch, return_inverse=True)
    grouped, inv, bounds = group_by_shard(uniq, inverse.astype(np.int64), N)
    np.testing.assert_array_equal(grouped[inv], batch)  # the same IDs, regrouped
    for s, pos in enumerate(positions_by_shard(uniq, N)):  # each shard's IDs, in their order
        np.testing.assert_array_equal(grouped[bounds[s] : bounds[s + 1]], uniq[pos])
    rows = b.lookup(TABLE.name, grouped, bounds)
    np.testing.assert_array_equal(rows, _reference_rows(grouped))
    g = np.random.default_rng(5).normal(size=(len(grouped), TABLE.dim)).astype(np.float32)
    b.push(TABLE.name, grouped, g, bounds=bounds).result(timeout=30)
    np.testing.assert_allclose(b.lookup_readonly(TABLE.name, grouped), _rowwise_adagrad(rows, [g]), atol=1e-6)
    with pytest.raises(ValueError, match="shard bounds"):
        b.lookup(TABLE.name, grouped, bounds[:-1])
