"""A local training job listens on 127.0.0.1 only: the NN workers' rendezvous is a file (not torch's TCP store,
which binds every interface) and gloo's sockets are on the loopback interface."""

import ipaddress
import os
import threading
import time

import pytest
from support import tiny_config, write_dataset

from persia_core.train.launcher import train


def _listening(pid: int) -> list[ipaddress._BaseAddress]:
    """Addresses of the TCP sockets process ``pid`` listens on (read from /proc)."""
    inodes = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
    except OSError:  # the process has exited
        return []
    found = []
    for table, v6 in (("/proc/net/tcp", False), ("/proc/net/tcp6", True)):
        with open(table) as f:
            next(f)
            for line in f:
                cols = line.split()
                if cols[3] != "0A" or cols[9] not in inodes:  # 0A: LISTEN
                    continue
                raw = bytes.fromhex(cols[1].split(":")[0])
                # the kernel prints each 32-bit word of the address in host (little-endian) order
                raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
                addr = ipaddress.ip_address(raw)
                found.append(addr.ipv4_mapped or addr if v6 else addr)
    return found


def _children() -> list[tuple[int, str]]:
    me = str(os.getpid())
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = f.read().rsplit(")", 1)[1].split()[1]
            if ppid == me:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    out.append((int(pid), f.read().replace(b"\0", b" ").decode()))
        except OSError:
            continue
    return out


@pytest.mark.processes
def test_a_local_job_with_two_workers_listens_on_loopback_only(tmp_path):
    data = write_dataset(str(tmp_path / "data"), rows=4096)
    cfg = tiny_config(num_workers=2, embedding_staleness=1, epochs=2)
    done = threading.Event()
    errors = []

    def run():
        try:
            train(cfg, data, str(tmp_path / "model"), work_dir=str(tmp_path / "work"))
        except BaseException as e:  # reported by the main thread
            errors.append(e)
        finally:
            done.set()

    threading.Thread(target=run, daemon=True).start()
    seen: dict[str, set] = {"worker": set(), "server": set()}
    deadline = time.monotonic() + 300
    while not done.is_set() and time.monotonic() < deadline:
        for pid, cmd in _children():
            role = "worker" if "persia_core.train.worker" in cmd else "server" if "persia_core.ps" in cmd else None
            if role:
                seen[role].update(_listening(pid))
        time.sleep(0.02)
    assert done.wait(1), "training did not finish within 300 s"
    assert not errors, errors
    # the check saw what each role listens on (gRPC for servers; gloo's pairs for workers), and all is loopback
    assert seen["server"] and seen["worker"], seen
    assert all(a.is_loopback for a in seen["server"] | seen["worker"]), seen
