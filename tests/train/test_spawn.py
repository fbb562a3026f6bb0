"""Starting a job's child processes: never Python in a fork (a ``preexec_fn``), and every child dies with the
process that started it.

The launcher and the Vertex AI replica hold gRPC threads when they start children. With a ``preexec_fn``,
``subprocess`` forks and runs Python in the child before ``exec``, and gRPC's fork handlers restart its poller
there, which can abort the child with SIGABRT (``epoll_wait error: Bad file descriptor``): a parameter server
of a test run died so, and a loop of 60 such starts beside a busy gRPC channel lost 2."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from concurrent import futures

import grpc
import pytest

from persia_core.train.processes import spawn

CHILD = "from persia_core.train.processes import die_with_spawner\nimport sys, time\n" + (
    "import os\nif not die_with_spawner(): sys.exit(7)\n"
    "print('up', os.environ.get('PERSIA_DIE_WITH'), flush=True)\ntime.sleep(float(sys.argv[1]))\n"
)


@pytest.fixture
def busy_grpc():
    """A gRPC server and a channel calling it in a loop, in this process, while the test starts children."""
    server = grpc.server(futures.ThreadPoolExecutor(2))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    stop = threading.Event()

    def call():
        fn = channel.unary_unary("/none/Call")
        while not stop.is_set():
            try:
                fn(b"", timeout=0.05)
            except grpc.RpcError:
                pass

    t = threading.Thread(target=call, daemon=True)
    t.start()
    yield
    stop.set()
    t.join()
    channel.close()
    server.stop(0)


@pytest.mark.processes
def test_children_started_beside_busy_grpc_threads_are_never_aborted(busy_grpc):
    codes = []
    for _ in range(60):
        p = spawn([sys.executable, "-c", CHILD, "0"], dict(os.environ), stdout=subprocess.DEVNULL)
        codes.append(p.wait(timeout=60))
    assert codes == [0] * 60


@pytest.mark.processes
def test_a_spawned_child_dies_with_the_process_that_started_it_and_not_its_own_children():
    starter = (
        "import os, sys, subprocess\nfrom persia_core.train.processes import spawn\n"
        f"p = spawn([sys.executable, '-c', {CHILD!r}, '120'], dict(os.environ), stdout=subprocess.PIPE, text=True)\n"
        "print(p.pid, p.stdout.readline().strip(), flush=True)\nimport time; time.sleep(120)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", starter], stdout=subprocess.PIPE, text=True)
    pid, said = parent.stdout.readline().split(" ", 1)
    child = int(pid)
    assert said.strip() == "up None"  # taken out of its environment: its own children do not inherit it
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and os.path.exists(f"/proc/{child}"):
        with open(f"/proc/{child}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                break
        time.sleep(0.05)
    else:
        assert not os.path.exists(f"/proc/{child}"), "the child outlived the process that started it"
