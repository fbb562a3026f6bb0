"""The parameter server's local channel (``persia_core.ps.local_channel``): same-host calls over a Unix socket
instead of gRPC, on real servers on 127.0.0.1."""

import socket
import struct
import threading
import time

import grpc
import numpy as np
import pytest
from support import tiny_config

from persia_core.ps import local_channel
from persia_core.ps.client import EmbeddingClient, ParameterServerError
from persia_core.ps.servicer import serve
from persia_core.ps.shard import ParameterServerShard

pytestmark = pytest.mark.skipif(not local_channel.supported(), reason="no abstract Unix sockets (not Linux)")


def _ids(n, seed=0):
    return np.unique(np.random.default_rng(seed).integers(0, 2**64 - 1, n, dtype=np.uint64, endpoint=True))


def _dropped(s: socket.socket) -> bool:
    """Whether the server closed the connection (an end of file, or a reset when it left bytes unread)."""
    s.settimeout(5)
    try:
        return s.recv(16) == b""
    except ConnectionResetError:
        return True


def test_calls_over_the_local_channel_equal_grpc_calls(cluster):
    cfg, _, addrs = cluster
    local = EmbeddingClient(addrs, cfg.embedding, token="s3cret")
    remote = EmbeddingClient(addrs, cfg.embedding, token="s3cret", shared_memory=False)  # gRPC messages only
    ids = _ids(6000)  # arrays through shared memory
    few = _ids(20, seed=3)  # small arrays: in the message, over the local channel too
    for batch in (ids, few):
        rows = local.lookup("default", batch)
        np.testing.assert_array_equal(rows, remote.lookup_readonly("default", batch))
        g = np.random.default_rng(1).normal(size=(len(batch), 4)).astype(np.float32)
        assert local.push("default", batch, g, step=0).result(timeout=10) == 0
        np.testing.assert_array_equal(local.lookup_readonly("default", batch), remote.lookup_readonly("default", batch))
        assert not np.array_equal(remote.lookup_readonly("default", batch), rows)  # the push was applied
    assert local.contains("default", ids).all()
    assert [s["pushes"] for s in local.stats()] == [s["pushes"] for s in remote.stats()]
    assert all(ch is not None for ch in local.local)  # the calls went over it
    assert remote.local == [None, None] and remote.use_local == [False, False]
    for c in (local, remote):
        c.close()


def test_a_retried_push_over_the_local_channel_is_applied_once(cluster):
    cfg, shards, addrs = cluster
    client = EmbeddingClient(addrs, cfg.embedding, token="s3cret", client_id="w0")
    ids = _ids(3000)
    client.lookup("default", ids)
    g = np.ones((len(ids), 4), np.float32)
    part = client._route(ids)[0]
    meta = {"table": "default", "client": "w0", "seq": 0, "step": 0, "sync_workers": 0, "step_fraction": 1.0}
    arrays = {"ids": ids[part], "grads": g[part]}
    first = client.call("Push", 0, meta, arrays)[0]
    again = client.call("Push", 0, meta, arrays)[0]  # the same sequence number: a retry
    assert first["applied"] and not first["duplicate"]
    assert again["duplicate"] and not again["applied"]
    assert shards[0].duplicates == 1 and client.local[0] is not None
    client.close()


def test_the_listener_refuses_a_wrong_token_and_survives_garbage(cluster):
    cfg, _, addrs = cluster
    client = EmbeddingClient(addrs, cfg.embedding, token="s3cret")
    name = client.health()[0]["local"]
    with pytest.raises(local_channel.LocalRpcError) as e:
        local_channel.LocalChannel(name, "wrong")
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:  # a hello of a method that is not Hello
        s.connect("\0" + name)
        s.sendall(struct.pack("<QHd", 4, 3, 1.0) + b"junk")
        assert _dropped(s)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:  # a good hello, then a frame of 2^40 bytes
        s.connect("\0" + name)
        s.sendall(struct.pack("<QHd", 6, 0, 0.0) + b"s3cret")
        s.settimeout(5)
        assert struct.unpack("<QB", s.recv(9)) == (0, 0)
        s.sendall(struct.pack("<QHd", 1 << 40, 1, 1.0))
        assert _dropped(s)
    ids = _ids(100)
    np.testing.assert_array_equal(client.lookup("default", ids), client.lookup_readonly("default", ids))
    client.close()


def test_a_stopped_server_fails_the_call_within_its_deadline_naming_the_shard():
    cfg = tiny_config()
    server, port = serve(ParameterServerShard(cfg, 0, 1), "127.0.0.1", 0, token="s3cret")
    client = EmbeddingClient([f"127.0.0.1:{port}"], cfg.embedding, token="s3cret", timeout_s=2.0)
    ids = _ids(100)
    client.lookup("default", ids)
    assert client.local[0] is not None
    server.stop(0).wait()
    t0 = time.monotonic()
    with pytest.raises(ParameterServerError, match=f"Lookup to shard 0 at 127.0.0.1:{port} failed: UNAVAILABLE"):
        client.lookup("default", ids)
    assert time.monotonic() - t0 < 5.0
    client.close()


def _lonely_sync_push(cluster, timeout_s: float):
    """A client (no retries) and its push of a sync step of 2 workers whose other worker never pushes."""
    cfg, _, addrs = cluster
    client = EmbeddingClient(addrs, cfg.embedding, token="s3cret", timeout_s=timeout_s, retries=0)
    ids = _ids(3000)
    client.lookup("default", ids)
    return client, client.push("default", ids, np.zeros((len(ids), 4), np.float32), step=0, sync_workers=2)


def test_a_sync_push_that_waits_past_its_deadline_fails_with_deadline_exceeded(cluster):
    t0 = time.monotonic()
    client, fut = _lonely_sync_push(cluster, 0.5)
    with pytest.raises(ParameterServerError, match="DEADLINE_EXCEEDED"):
        fut.result(timeout=10)
    assert time.monotonic() - t0 < 3.0 and client.local[0] is not None
    client.close()


def test_close_with_cancel_ends_a_call_in_flight_on_the_local_channel(cluster):
    client, fut = _lonely_sync_push(cluster, 30.0)
    time.sleep(0.5)
    closer = threading.Thread(target=client.close, kwargs={"cancel": True})
    t0 = time.monotonic()
    closer.start()
    with pytest.raises(ParameterServerError, match="CANCELLED"):
        fut.result(timeout=10)
    closer.join(timeout=10)
    assert not closer.is_alive() and time.monotonic() - t0 < 5.0


def test_a_connection_that_sends_no_hello_is_dropped(cluster, monkeypatch):
    monkeypatch.setattr(local_channel, "HELLO_TIMEOUT_S", 0.5)
    cfg, _, addrs = cluster
    client = EmbeddingClient(addrs, cfg.embedding, token="s3cret")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect("\0" + client.health()[0]["local"])
        t0 = time.monotonic()
        assert _dropped(s) and time.monotonic() - t0 < 4.0
    client.close()
