"""The same-host shared-memory path of the parameter-server client (``persia_core.ps.shm``), on 127.0.0.1."""

import os

import numpy as np
import pytest

from persia_core.ps import shm as shm_mod
from persia_core.ps.client import EmbeddingClient, ParameterServerError
from persia_core.ps.shard import ParameterServerShard

pytestmark = pytest.mark.skipif(not shm_mod.available(), reason="no writable /dev/shm")


def _ids(n, seed=0):
    return np.unique(np.random.default_rng(seed).integers(0, 2**64 - 1, n, dtype=np.uint64, endpoint=True))


def test_shared_memory_calls_equal_message_calls_and_leave_no_files(cluster):
    cfg, _, addrs = cluster
    ids = _ids(6000)  # 48 KB of IDs per call: above the size that goes through shared memory
    via_shm = EmbeddingClient(addrs, cfg.embedding, token="s3cret", shared_memory=True)
    via_msg = EmbeddingClient(addrs, cfg.embedding, token="s3cret", shared_memory=False)
    rows = via_shm.lookup("default", ids)
    np.testing.assert_array_equal(rows, via_msg.lookup_readonly("default", ids))
    g = np.random.default_rng(1).normal(size=(len(ids), 4)).astype(np.float32)
    assert via_shm.push("default", ids, g).result(timeout=10) == 0
    np.testing.assert_array_equal(via_shm.lookup_readonly("default", ids), via_msg.lookup_readonly("default", ids))
    assert via_shm.lookup_readonly("default", ids).shape == (len(ids), 4)
    assert not np.array_equal(via_msg.lookup_readonly("default", ids), rows)  # the push was applied
    np.testing.assert_array_equal(via_shm.contains("default", ids), np.ones(len(ids), bool))
    assert all(st["table_cpu_s"] > 0 for st in via_shm.stats())
    segs = [seg for pool in via_shm.segments for seg in pool.all]
    assert segs and via_shm.use_shm == [True, True]
    assert all(os.path.exists(seg.path) for seg in segs)
    assert not any(pool.all for pool in via_msg.segments)
    via_shm.close()
    via_msg.close()
    assert not any(os.path.exists(seg.path) for seg in segs)


def test_auto_mode_uses_shared_memory_for_loopback_only_and_not_with_injected_delay(cluster):
    cfg, _, addrs = cluster
    auto = EmbeddingClient(addrs, cfg.embedding, token="s3cret")
    assert auto.use_shm == [True, True]
    remote = EmbeddingClient(["10.1.2.3:5000"], cfg.embedding, token="s3cret")
    assert remote.use_shm == [False]
    delayed = EmbeddingClient(addrs, cfg.embedding, token="s3cret", delay_s=0.001)
    assert delayed.use_shm == [False, False]
    for c in (auto, remote, delayed):
        c.close()


def test_client_falls_back_to_messages_when_a_server_cannot_map_the_segment(cluster, monkeypatch):
    cfg, _, addrs = cluster

    def elsewhere(self, name, size):
        raise shm_mod.ShmUnavailable(f"cannot open shared-memory segment {name}: No such file or directory")

    monkeypatch.setattr(shm_mod.SegmentCache, "get", elsewhere)  # as a server on another host would answer
    ids = _ids(6000, seed=2)
    client = EmbeddingClient(addrs, cfg.embedding, token="s3cret", shared_memory=True)
    ref = EmbeddingClient(addrs, cfg.embedding, token="s3cret", shared_memory=False)
    np.testing.assert_array_equal(client.lookup("default", ids), ref.lookup_readonly("default", ids))
    assert client.use_shm == [False, False]
    client.close()
    ref.close()


@pytest.mark.parametrize("name", ["../../etc/passwd", "persia_../x", "other_0123456789abcdef", ""])
def test_server_refuses_segment_names_outside_its_own_form(cluster, name):
    cfg, _, addrs = cluster
    client = EmbeddingClient(addrs, cfg.embedding, token="s3cret", retries=0, shared_memory=False)
    meta = {"table": "default", "shm": {"name": name, "size": 1 << 20, "arrays": [], "out": [0, 0]}}
    with pytest.raises(ParameterServerError, match="FAILED_PRECONDITION"):
        client.call("Lookup", 0, meta)
    client.close()


def test_array_headers_outside_the_segment_are_refused():
    buf = np.zeros(4096, np.uint8)
    assert shm_mod.views(buf, [["ids", "uint64", [8], 64, 64]])["ids"].shape == (8,)
    for bad in (
        ["ids", "uint64", [8], 4096, 64],  # past the end
        ["ids", "uint64", [8], -64, 64],  # negative offset
        ["ids", "uint64", [9], 0, 64],  # size does not match the shape
        ["ids", "uint64", [8], 3, 64],  # misaligned
        ["ids", "object", [8], 0, 64],
    ):  # dtype not allowed
        with pytest.raises(ValueError):
            shm_mod.views(buf, [bad])
    with pytest.raises(ValueError):
        shm_mod.write_reply(buf, [4032, 4096], {"rows": np.zeros(4, np.float32)})
    assert shm_mod.write_reply(buf, [0, 64], {"rows": np.zeros(32, np.float32)}) is None  # too big: message


@pytest.mark.processes
def test_segments_of_a_killed_worker_are_removed_by_pid():
    import subprocess
    import sys

    code = (
        "from persia_core.ps.shm import Segment; import sys, time; s = Segment(4096); "
        "print(s.path, flush=True); time.sleep(60)"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    path = child.stdout.readline().strip()
    child.kill()
    child.wait()
    assert os.path.exists(path)  # killed before it could close its segment
    mine = shm_mod.Segment(4096)
    assert shm_mod.remove_segments_of([child.pid]) == 1
    assert not os.path.exists(path) and os.path.exists(mine.path)  # only that process's segments
    again = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    orphan = again.stdout.readline().strip()
    again.kill()
    again.wait()
    assert shm_mod.remove_orphans() >= 1  # a later job finds the files of a dead process by their pid
    assert not os.path.exists(orphan) and os.path.exists(mine.path)
    mine.close()


def test_a_timed_out_call_never_reuses_its_segment(cluster, monkeypatch):
    """The server may still answer a timed-out attempt into its segment: the retry gets a fresh one and the old
    one is removed, so no later call can read a stale reply."""
    import time as _time

    cfg, shards, addrs = cluster
    real = ParameterServerShard.lookup
    calls = []

    def slow_first(self, name, ids, out=None):
        calls.append(1)
        if len(calls) == 1:
            _time.sleep(0.6)
        return real(self, name, ids, out)

    monkeypatch.setattr(ParameterServerShard, "lookup", slow_first)
    client = EmbeddingClient(addrs[:1], cfg.embedding, token="s3cret", shared_memory=True, timeout_s=0.3, retries=2)
    ids = _ids(6000, seed=4)
    rows = client.call("Lookup", 0, {"table": "default"}, {"ids": ids}, None, len(ids) * 16)[1]["rows"]
    assert len(calls) >= 2 and rows.shape == (len(ids), 4)
    pool = client.segments[0]
    assert len(pool.all) == 1 and len(pool.free) == 1  # only the retry's segment is kept for reuse
    leftovers = [n for n in os.listdir(shm_mod.SHM_DIR) if n.startswith(shm_mod.segment_name(os.getpid())[:15])]
    assert leftovers == [pool.all[0].name]
    client.close()
    np.testing.assert_array_equal(rows, shards[0].table("default").lookup_readonly(ids))


def test_a_full_dev_shm_makes_the_client_send_messages_instead(cluster, monkeypatch):
    """Docker gives containers 64 MiB of /dev/shm by default: a segment that does not fit fails when it is
    made (its pages are reserved then, never a SIGBUS later), and the client sends that shard's arrays in
    messages."""
    import errno

    cfg, _, addrs = cluster

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    before = set(os.listdir(shm_mod.SHM_DIR))
    client = EmbeddingClient(addrs, cfg.embedding, token="s3cret", shared_memory=True)
    ref = EmbeddingClient(addrs, cfg.embedding, token="s3cret", shared_memory=False)
    ids = _ids(6000, seed=6)
    np.testing.assert_array_equal(client.lookup("default", ids), ref.lookup_readonly("default", ids))
    assert client.use_shm == [False, False]
    assert set(os.listdir(shm_mod.SHM_DIR)) <= before  # the half-made segments were removed
    client.close()
    ref.close()


def test_a_reply_written_in_place_is_not_copied_and_reads_back_whole():
    buf = np.zeros(1 << 16, np.uint8)
    area = [4096, 8192]
    rows = shm_mod.reply_array(buf, area, (100, 16), np.float32)
    assert rows is not None and rows.ctypes.data == buf.ctypes.data + 4096
    rows[:] = np.arange(1600, dtype=np.float32).reshape(100, 16)
    entries = shm_mod.write_reply(buf, area, {"rows": rows})
    np.testing.assert_array_equal(shm_mod.views(buf, entries)["rows"], rows)
    assert shm_mod.reply_array(buf, area, (1000, 16), np.float32) is None  # larger than the area
    assert shm_mod.reply_array(buf, [60000, 8192], (10, 16), np.float32) is None  # out of the segment
    assert shm_mod.reply_array(buf, [100, 8192], (10, 16), np.float32) is None  # not aligned
