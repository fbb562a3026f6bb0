"""Embedding workers on other hosts: the gRPC stream transport (``persia_core.train.ready_stream``) against real
parameter servers, real embedding-worker processes listening on an address, and an NN worker in this process."""

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch
from support import tiny_config, write_dataset

from persia_core.embedding.reference import LocalEmbedding
from persia_core.ps.client import EmbeddingClient
from persia_core.ps.protocol import TOKEN_ENV
from persia_core.train.feeders import EmbeddingWorkerFailed
from persia_core.train.ready_stream import wire_bytes_per_sample
from persia_core.train.worker import run_worker

TOKEN = "test-token-0123456789"


def _env() -> dict:
    return dict(os.environ, **{TOKEN_ENV: TOKEN, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"})


def _wait_port(proc: subprocess.Popen, port_file: str, what: str, timeout_s: float = 120.0) -> int:
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(port_file):
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with code {proc.returncode}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not start within {timeout_s:.0f} s")
        time.sleep(0.05)
    with open(port_file) as f:
        return int(f.read())


@contextlib.contextmanager
def _servers(tmp, cfg, host: str = "127.0.0.1"):
    """``embedding.num_shards`` parameter servers bound on ``host``, with the token. Yields their addresses."""
    path = str(tmp / "config.yaml")
    with open(path, "w") as f:
        f.write(cfg.to_yaml())
    procs, addresses = [], []
    n = cfg.embedding.num_shards
    try:
        for s in range(n):
            pf = str(tmp / f"ps-{s}-{host}.port")
            cmd = [sys.executable, "-m", "persia_core.ps.server", "--config", path, "--shard", str(s)]
            cmd += ["--num-shards", str(n), "--host", host, "--port-file", pf]
            procs.append((subprocess.Popen(cmd, env=_env()), pf))
        for s, (p, pf) in enumerate(procs):
            addresses.append(f"{host}:{_wait_port(p, pf, f'parameter server {s}')}")
        yield addresses
    finally:
        for p, _ in procs:
            p.terminate()
        for p, _ in procs:
            p.wait(timeout=30)


@contextlib.contextmanager
def _embedding_workers(tmp, count: int, host: str = "127.0.0.1", netns: str = "", token: str = TOKEN):
    """``count`` embedding-worker processes listening on ``host`` (in network namespace ``netns`` if given).
    Yields ``(processes, addresses)``."""
    procs, addresses = [], []
    env = dict(_env(), **{TOKEN_ENV: token})
    try:
        for e in range(count):
            pf = str(tmp / f"ew-{e}-{host}.port")
            cmd = [sys.executable, "-m", "persia_core.train.embedding_worker", "--listen", f"{host}:0"]
            cmd += ["--port-file", pf]
            if netns:
                cmd = ["ip", "netns", "exec", netns, *cmd]
            procs.append(subprocess.Popen(cmd, env=env))
            addresses.append(f"{host}:{_wait_port(procs[-1], pf, f'embedding worker {e}')}")
        yield procs, addresses
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=30)


def _train(cfg, data, out, addresses, ew_addresses=None, on_step=None):
    os.makedirs(out, exist_ok=True)
    client = EmbeddingClient(addresses, cfg.embedding, token=TOKEN, client_id="w0")
    try:
        return run_worker(
            cfg, data, out, client, rank=0, world=1, embedding_worker_addresses=ew_addresses, on_step=on_step
        )
    finally:
        client.close()


def _dense(path):
    return torch.load(path, weights_only=True)


def test_the_wire_carries_the_pooled_embeddings_dense_and_label_one_way_and_the_gradient_back():
    # Criteo's shape: 26 slots of dim 16, 13 dense features
    assert wire_bytes_per_sample(26, 16, 13) == {"to_nn_worker": 4 * (416 + 13 + 1), "to_embedding_worker": 1664}


@pytest.mark.processes
def test_two_embedding_workers_over_the_network_at_k0_give_the_in_process_reference(tmp_path):
    data = write_dataset(str(tmp_path / "data"), rows=192)
    cfg = tiny_config(num_workers=1, embedding_staleness=0, epochs=2, shuffle=True, embedding_workers=2)
    with _servers(tmp_path, cfg) as addresses, _embedding_workers(tmp_path, 2) as (procs, ews):
        hist = _train(cfg, data, str(tmp_path / "net"), addresses, ews)
        for p in procs:  # each served its one stream and stopped cleanly
            assert p.wait(timeout=30) == 0
    ref_backend = LocalEmbedding(cfg.embedding, num_shards=1, seed=cfg.trainer.seed)
    os.makedirs(tmp_path / "ref")
    ref = run_worker(cfg, data, str(tmp_path / "ref"), ref_backend, rank=0, world=1)
    assert hist["embedding_workers"] == 2 and len(hist["loss"]) == len(ref["loss"]) == 24
    np.testing.assert_allclose(hist["loss"], ref["loss"], atol=1e-5, rtol=0)
    a, b = _dense(tmp_path / "net" / "dense.pt"), _dense(tmp_path / "ref" / "dense.pt")
    for k in a:
        np.testing.assert_allclose(a[k].numpy(), b[k].numpy(), atol=1e-5)
    assert hist["max_staleness"] == 0
    # the phase seconds came back over the stream
    phases = hist["embedding_worker_phase_seconds"]
    assert phases["lookup_pool"] > 0 and phases["read"] > 0 and phases["grads"] > 0


@pytest.mark.processes
def test_epochs_auto_over_the_network_ends_with_the_pass_over_the_validation_slice_of_the_in_process_run(tmp_path):
    # the remote embedding workers stop with their stream after training; the pass over the validation slice
    # then runs in a thread of the NN worker against its own client: the same model as the in-process run
    data = write_dataset(str(tmp_path / "data"), rows=192)
    cfg = tiny_config(num_workers=1, embedding_staleness=0, shuffle=True, embedding_workers=2)
    cfg = cfg.with_overrides({"trainer.epochs": "auto", "trainer.max_epochs": 3, "trainer.validation_fraction": 0.25})
    with _servers(tmp_path, cfg) as addresses, _embedding_workers(tmp_path, 2) as (procs, ews):
        hist = _train(cfg, data, str(tmp_path / "net"), addresses, ews)
        for p in procs:
            assert p.wait(timeout=30) == 0
    ref_backend = LocalEmbedding(cfg.embedding, num_shards=cfg.embedding.num_shards, seed=cfg.trainer.seed)
    os.makedirs(tmp_path / "ref")
    ref = run_worker(cfg, data, str(tmp_path / "ref"), ref_backend, rank=0, world=1)
    assert hist["validation_pass"]["rows"] == ref["validation_pass"]["rows"] > 0
    assert hist["validation_pass"]["steps"] == ref["validation_pass"]["steps"] > 0
    assert hist["validation_pass"]["loss"] == pytest.approx(ref["validation_pass"]["loss"], abs=1e-5)
    a, b = _dense(tmp_path / "net" / "dense.pt"), _dense(tmp_path / "ref" / "dense.pt")
    for k in a:
        np.testing.assert_allclose(a[k].numpy(), b[k].numpy(), atol=1e-5)


@pytest.mark.processes
def test_staleness_over_the_network_stays_within_k_per_nn_worker(tmp_path):
    data = write_dataset(str(tmp_path / "data"), rows=512)
    cfg = tiny_config(num_workers=1, embedding_staleness=2, epochs=1, embedding_workers=3)
    with _servers(tmp_path, cfg) as addresses, _embedding_workers(tmp_path, 3) as (_, ews):
        hist = _train(cfg, data, str(tmp_path / "net"), addresses, ews)
    assert len(hist["staleness"]) == 32
    assert max(hist["staleness"]) <= 2


@pytest.mark.processes
def test_a_wrong_token_is_refused_naming_the_embedding_worker(tmp_path):
    data = write_dataset(str(tmp_path / "data"), rows=64)
    cfg = tiny_config(num_workers=1, embedding_staleness=0)
    with _servers(tmp_path, cfg) as addresses, _embedding_workers(tmp_path, 1, token="another") as (_, ews):
        with pytest.raises(EmbeddingWorkerFailed, match=rf"embedding worker 0\.0 at {ews[0]}.*UNAUTHENTICATED"):
            _train(cfg, data, str(tmp_path / "net"), addresses, ews)


@pytest.mark.processes
def test_a_sigkilled_remote_embedding_worker_fails_training_within_60s_naming_its_address(tmp_path):
    data = write_dataset(str(tmp_path / "data"), rows=4096)
    cfg = tiny_config(num_workers=1, embedding_staleness=1, epochs=200, embedding_workers=2)
    with _servers(tmp_path, cfg) as addresses, _embedding_workers(tmp_path, 2) as (procs, ews):
        started = threading.Event()
        killed_at = []

        def on_step(result, loss, model):
            if not started.is_set():
                started.set()
                os.kill(procs[1].pid, signal.SIGKILL)
                killed_at.append(time.monotonic())

        with pytest.raises(EmbeddingWorkerFailed, match=rf"embedding worker 0\.1 at {ews[1]}"):
            _train(cfg, data, str(tmp_path / "net"), addresses, ews, on_step=on_step)
        assert time.monotonic() - killed_at[0] < 60
        assert procs[0].wait(timeout=30) is not None  # the survivor was stopped, not left running


def _sh(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), capture_output=True, text=True)


@contextlib.contextmanager
def _namespace():
    """A network namespace joined to this one by a veth pair: yields ``(name, host address, its address)``."""
    tag = f"{os.getpid() % 100000}"
    ns, here, there = f"persia-ew-{tag}", f"pvh{tag}", f"pve{tag}"
    octet = os.getpid() % 250 + 1
    host_ip, ns_ip = f"10.231.{octet}.1", f"10.231.{octet}.2"
    if shutil.which("ip") is None:
        pytest.skip("network namespaces: no `ip` command (iproute2) on this machine")
    made = _sh("ip", "netns", "add", ns)
    if made.returncode != 0:
        pytest.skip(f"network namespaces not allowed here: {made.stderr.strip()}")
    try:
        steps = [
            ("ip", "link", "add", here, "type", "veth", "peer", "name", there),
            ("ip", "link", "set", there, "netns", ns),
            ("ip", "addr", "add", f"{host_ip}/30", "dev", here),
            ("ip", "link", "set", here, "up"),
            ("ip", "netns", "exec", ns, "ip", "addr", "add", f"{ns_ip}/30", "dev", there),
            ("ip", "netns", "exec", ns, "ip", "link", "set", there, "up"),
            ("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up"),
        ]
        for cmd in steps:
            r = _sh(*cmd)
            if r.returncode != 0:
                pytest.skip(f"could not set up a veth pair ({' '.join(cmd)}): {r.stderr.strip()}")
        yield ns, host_ip, ns_ip
    finally:
        _sh("ip", "link", "del", here)
        _sh("ip", "netns", "del", ns)


@pytest.mark.processes
def test_an_embedding_worker_in_its_own_network_namespace_trains_as_the_same_host_one_at_k0(tmp_path):
    data = write_dataset(str(tmp_path / "data"), rows=192)
    cfg = tiny_config(num_workers=1, embedding_staleness=0, epochs=2, shuffle=True, embedding_workers=1)
    with _servers(tmp_path, cfg) as addresses:
        same_host = _train(cfg, data, str(tmp_path / "same"), addresses)  # shared memory, a process beside us
    with _namespace() as (ns, host_ip, ns_ip):
        with _servers(tmp_path, cfg, host=host_ip) as addresses:
            with _embedding_workers(tmp_path, 1, host=ns_ip, netns=ns) as (procs, ews):
                assert ews[0].startswith(ns_ip + ":")
                remote = _train(cfg, data, str(tmp_path / "remote"), addresses, ews)
                assert procs[0].wait(timeout=30) == 0
    assert len(remote["loss"]) == len(same_host["loss"]) == 24
    assert remote["loss"] == same_host["loss"]
    a, b = _dense(tmp_path / "remote" / "dense.pt"), _dense(tmp_path / "same" / "dense.pt")
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.processes
def test_a_half_ring_over_the_network_carries_fp16_embeddings_and_gradients(tmp_path):
    from persia_core.data.reader import read_schema
    from persia_core.embedding.layout import table_layouts
    from persia_core.train.feeders import NetworkFeeders
    from persia_core.train.hybrid import HybridTrainPipeline
    from persia_core.train.ready_ring import RingLayout
    from persia_core.train.schedule import make_schedule
    from persia_core.train.worker import build_dense

    data = write_dataset(str(tmp_path / "data"), rows=128)
    cfg = tiny_config(num_workers=1, embedding_staleness=0, epochs=2)
    assert wire_bytes_per_sample(3, 4, 1, half=True) == {"to_nn_worker": 2 * 12 + 8, "to_embedding_worker": 24}
    from persia_core.train.embedding_worker import rank_examples

    rows = len(rank_examples(cfg, data, 0, 1))  # one NN worker: all the train rows
    sched = make_schedule([rows], cfg.trainer.batch_size, cfg.trainer.epochs, 0, False)
    ring = RingLayout(1, 2, cfg.trainer.batch_size, 3, table_layouts(cfg)[0].dim, 1, half=True)
    seen = []
    model = build_dense(cfg, read_schema(data))

    class Recording(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = model

        def forward(self, emb, dense):
            seen.append(emb.detach().clone())
            return self.inner(emb, dense)

    spec = {"config": cfg.to_dict(), "world": 1, "counts": [rows], "client_id": "w0-ew", "data": data}
    with _servers(tmp_path, cfg) as addresses, _embedding_workers(tmp_path, 1) as (procs, ews):
        feeders = NetworkFeeders(ring, 0, 0, spec, addresses, TOKEN, ews)
        feeders.wait_started()
        opt = torch.optim.Adam(model.parameters(), lr=cfg.trainer.dense_lr)
        pipe = HybridTrainPipeline(Recording(), opt, feeders, sched.global_batch, 0, num_workers=1)
        try:
            while True:
                try:
                    pipe.progress()
                except StopIteration:
                    break
            pipe.drain()
        finally:
            pipe.close()
        assert procs[0].wait(timeout=30) == 0
        client = EmbeddingClient(addresses, cfg.embedding, token=TOKEN)
        try:
            ids = np.unique(rank_examples(cfg, data, 0, 1).batch(np.arange(rows)).ids.values)
            rows_now = client.lookup_readonly("default", ids)
        finally:
            client.close()
    assert len(seen) == 16 and pipe.fp16_fallbacks == 0
    assert all(torch.equal(e, e.half().float()) for e in seen)  # every value the NN worker got was an fp16 one
    initial = LocalEmbedding(cfg.embedding, num_shards=1, seed=cfg.trainer.seed).lookup("default", ids)
    assert np.isfinite(rows_now).all() and np.abs(rows_now - initial).max() > 1e-3  # fp16 gradients were pushed


def _raw_stream(port: int, keepalive_s: float = 10.0, token: str = TOKEN):
    """A Feed stream to 127.0.0.1:``port`` whose requests are put on the returned queue (None ends them)."""
    import queue

    import grpc

    from persia_core.ps.protocol import TOKEN_HEADER
    from persia_core.train import ready_stream as rs

    ch = grpc.insecure_channel(f"127.0.0.1:{port}", options=rs.keepalive_options(keepalive_s, server=False))
    q: queue.Queue = queue.Queue()
    call = ch.stream_stream(rs.FEED, request_serializer=bytes, response_deserializer=bytes)(
        iter(q.get, None), metadata=((TOKEN_HEADER, token),)
    )
    return ch, q, call


def _refused_build(*args):
    raise AssertionError("no stream here gets as far as its set-up")


def test_an_idle_stream_survives_keepalive_pings_and_a_silent_one_times_out():
    import grpc

    from persia_core.ps import wire
    from persia_core.train.ready_stream import FeedServer

    # pings every 0.2 s for 1.5 s: a server that took them for abuse would end the stream (GOAWAY too_many_pings)
    server = FeedServer(_refused_build, token=TOKEN, keepalive_s=0.2, spec_timeout_s=1.5)
    try:
        ch, q, call = _raw_stream(server.port, keepalive_s=0.2)
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            next(call)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, err.value.details()
        assert 1.2 < time.monotonic() - t0 < 10  # the spec deadline ended it, nothing earlier
        ch.close()
        for spec, says in (
            ({"layout": [1, 2, 4, 3, 4, 1, 0], "index": 5, "frontier": [0]}, "index=5"),
            ({"layout": [1, 2, 1 << 40, 26, 16, 13, 0], "index": 0, "frontier": [0]}, "bytes"),
            ({"layout": [1, 2, 4, 3, 4, 1, 0], "index": 0, "frontier": "0"}, "frontier"),
        ):
            ch, q, call = _raw_stream(server.port)
            q.put(wire.encode({"kind": "spec", **spec}))
            with pytest.raises(grpc.RpcError) as err:
                next(call)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and says in err.value.details()
            ch.close()
        # streams refused before their session began neither used it up nor marked it failed
        assert not server.wait(0) and server.clean
        # the server lets clients ping at the interval (gRPC's name for it; a misspelt one is silently ignored)
        from persia_core.train.ready_stream import keepalive_options

        opts = dict(keepalive_options(10.0, server=True))
        assert opts["grpc.http2.min_ping_interval_without_data_ms"] == 5_000
        assert opts["grpc.http2.ping_timeout_ms"] == opts["grpc.keepalive_time_ms"] == 10_000
    finally:
        server.stop()


@pytest.mark.processes
def test_a_stopped_embedding_worker_is_found_by_the_keepalive_pings(tmp_path):
    import grpc

    code = (
        "import sys, time\n"
        "from persia_core.train.ready_stream import FeedServer\n"
        "s = FeedServer(lambda *a: None, keepalive_s=0.5, spec_timeout_s=600)\n"
        "print(s.port, flush=True)\n"
        "time.sleep(600)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=_env())
    try:
        port = int(proc.stdout.readline())
        ch, q, call = _raw_stream(port, keepalive_s=0.5)
        time.sleep(1.5)  # the stream is up and pinged
        os.kill(proc.pid, signal.SIGSTOP)  # alive, silent: no end of file, only unanswered pings
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            next(call)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert time.monotonic() - t0 < 5  # about two keepalive intervals, not gRPC's default minute
        ch.close()
    finally:
        proc.kill()
        proc.wait(timeout=30)


@pytest.mark.processes
def test_a_bad_gradient_message_stops_the_embedding_worker_which_exits_1(tmp_path):
    import grpc

    from persia_core.embedding.layout import table_layouts
    from persia_core.ps import wire
    from persia_core.train.embedding_worker import rank_examples

    data = write_dataset(str(tmp_path / "data"), rows=64)
    cfg = tiny_config(num_workers=1, embedding_staleness=0)
    rows = len(rank_examples(cfg, data, 0, 1))
    with _servers(tmp_path, cfg) as addresses, _embedding_workers(tmp_path, 1) as (procs, ews):
        layout = [1, 2, cfg.trainer.batch_size, 3, table_layouts(cfg)[0].dim, 1, 0]
        spec = {"kind": "spec", "config": cfg.to_dict(), "world": 1, "counts": [rows], "client_id": "x", "data": data}
        spec.update(rank=0, index=0, start=0, addresses=addresses, layout=layout, frontier=[0])
        ch, q, call = _raw_stream(int(ews[0].rsplit(":", 1)[1]))
        q.put(wire.encode(spec))
        kinds = []
        while "ready" not in kinds and len(kinds) < 10:
            kinds.append(wire.decode(next(call))[0]["kind"])
        assert "started" in kinds and kinds[-1] == "ready", kinds
        q.put(wire.encode({"kind": "grad", "slot": 99, "step": 0}, {"grad": np.zeros((4, 3, 4), np.float32)}))
        assert procs[0].wait(timeout=30) == 1  # it stopped, reported the stream's error, and exited
        with contextlib.suppress(grpc.RpcError):
            for _ in call:  # the stream ended: nothing left hanging
                pass
        ch.close()


def test_listen_addresses_parse_ipv4_ipv6_and_refuse_a_missing_port():
    from persia_core.train.ready_stream import is_loopback, parse_listen

    assert parse_listen("127.0.0.1:0") == ("127.0.0.1", 0) and parse_listen("[::1]:2222") == ("::1", 2222)
    assert is_loopback("::1") and is_loopback("127.0.0.2") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.0.0.1") and not is_loopback("example.com")
    for bad in ("127.0.0.1", "127.0.0.1:", ":80", "h:99999"):
        with pytest.raises(ValueError, match="HOST:PORT"):
            parse_listen(bad)
