"""A parameter server's port is its own: a second server, or any socket, on it is refused in one line naming it.

gRPC sets SO_REUSEPORT by default on Linux, so a second server on a port in use also reported "serving" and the
kernel split the connections between the two: readers of one row got another row's value by connection."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest
from support import tiny_config

from persia_core.ps.servicer import PortInUse, serve
from persia_core.ps.shard import ParameterServerShard


def _shard():
    return ParameterServerShard(tiny_config(), 0, 1)


def test_a_second_server_on_the_port_of_a_running_one_is_refused_naming_the_port():
    first, port = serve(_shard())
    try:
        with pytest.raises(PortInUse, match=rf"127.0.0.1:{port}.*in use"):
            serve(_shard(), port=port)
    finally:
        first.stop(0)


def test_a_port_held_by_another_socket_is_refused_naming_it():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(PortInUse, match=rf"127.0.0.1:{port}.*in use"):
            serve(_shard(), port=port)


@pytest.mark.processes
def test_the_server_process_on_a_port_in_use_exits_with_one_line_naming_it_and_no_traceback(tmp_path):
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(tiny_config().to_yaml())
    root = os.path.join(os.path.dirname(__file__), "..", "..")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        cmd = [sys.executable, "-m", "persia_core.ps.server", "--config", str(cfg), "--shard", "0", "--num-shards", "1"]
        r = subprocess.run([*cmd, "--port", str(port)], cwd=root, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    errors = [line for line in (r.stderr + r.stdout).splitlines() if "ERROR" in line or "Error" in line]
    assert len(errors) == 1 and f"127.0.0.1:{port}" in errors[0] and "in use" in errors[0], r.stderr
    assert "Traceback" not in r.stderr


def test_an_embedding_worker_listening_on_a_port_in_use_is_refused_naming_it():
    from persia_core.train.ready_stream import FeedServer

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(PortInUse, match=rf"embedding worker could not bind 127.0.0.1:{port}.*in use"):
            FeedServer(lambda *a: None, "127.0.0.1", port, None)


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback (::1) on this machine")
def test_a_host_name_is_refused_when_any_address_it_resolves_to_is_taken_and_bare_ipv6_is_served():
    # found by a helper session: the check bound only the first address of "localhost", and gRPC then served on
    # the other, so two servers shared localhost:P; and "::1" without brackets could not be bound at all
    # the port is taken on ::1 only; on a busy machine another process (a parallel test's client connection) may
    # hold the same number on 127.0.0.1, which the check rightly names first: then try another port
    for _ in range(20):
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
            s.listen()
            port = s.getsockname()[1]
            with pytest.raises(PortInUse, match=rf"localhost:{port}.*in use on") as refused:
                serve(_shard(), host="localhost", port=port)
        if "in use on 127.0.0.1" not in str(refused.value):
            break
    assert "in use on ::1" in str(refused.value)
    server, bound = serve(_shard(), host="::1", port=0)
    server.stop(0)
    assert bound > 0


def test_a_port_outside_0_to_65535_is_refused_not_wrapped():
    with pytest.raises(PortInUse, match="0 .* to 65535"):
        serve(_shard(), port=70000)
