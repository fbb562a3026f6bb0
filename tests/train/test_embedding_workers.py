"""Embedding workers: Python calls per batch independent of the batch, the ready ring's checks, and a SIGKILLed
embedding-worker process failing the job fast with nothing left behind."""

import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np
import pytest
from slow_server import SlowPushes
from support import tiny_config, write_dataset

from persia_core.data.reader import ParquetExamples, read_schema, shard_files
from persia_core.embedding.layout import model_slot_order, table_layouts
from persia_core.embedding.reference import LocalEmbedding
from persia_core.ps import shm
from persia_core.train import ready_ring as rr
from persia_core.train.embedding_worker import BatchSource, EmbeddingWorker, StepRules
from persia_core.train.feeders import examples_prefix
from persia_core.train.launcher import train
from persia_core.train.local_cluster import STOPPED_FAIL_S, TrainingFailed
from persia_core.train.processes import descendants
from persia_core.train.schedule import make_schedule


def _stop_once_applied(ring, buf, nn: list[socket.socket], threads: list[threading.Thread]) -> None:
    """Wait (30 s at most) until every push of the embedding workers on ``ring`` is applied, then stop them
    (``STOP`` over each of ``nn``) and check that their ``threads`` ended."""
    deadline = time.monotonic() + 30
    while (ring.frontier(buf) != rr.NEVER).any() and time.monotonic() < deadline:
        time.sleep(0.001)
    for sock in nn:
        rr.send(sock, rr.STOP)
    for t in threads:
        t.join(30)
        assert not t.is_alive()
    assert (ring.frontier(buf) == rr.NEVER).all()  # every push applied


def _calls_of_a_run(tmp_path, batch: int, steps: int) -> int:
    """Python and C calls an embedding worker makes (its backend's aside) for ``steps`` batches of ``batch`` rows,
    driven by this test as its NN worker."""
    cfg = tiny_config(num_workers=1, embedding_staleness=steps, epochs=1, batch_size=batch)
    data = write_dataset(str(tmp_path / f"data{batch}"), rows=batch * steps, shards=1)
    layouts = table_layouts(cfg)
    examples = ParquetExamples(shard_files(data, "train"), model_slot_order(cfg))
    sched = make_schedule([len(examples)], batch, 1, 0, True)
    assert len(sched.global_batch) == steps
    ring = rr.RingLayout(
        1, 1, batch, sum(len(t.slots) for t in layouts), layouts[0].dim, len(read_schema(data)["dense"])
    )
    seg = rr.Segment(ring, shared=False)
    nn, ew_end = socket.socketpair()
    backend = LocalEmbedding(cfg.embedding, 1)
    rules = StepRules(staleness=steps, num_workers=1, rank=0, dropout={"a": 0.5}, seed=0)
    source = BatchSource(examples, sched.rows[0], sched.global_batch)
    ew = EmbeddingWorker(backend, layouts, source, ring, seg.buf, ew_end, 0, 0, rules)
    skipped = {backend.lookup.__code__, backend.push.__code__}
    count = [0]
    inside: list = []

    def prof(frame, event, arg):
        if inside:
            if event == "return" and frame is inside[-1]:
                inside.pop()
            return
        if event == "call" and frame.f_code in skipped:
            inside.append(frame)
            return
        if event in ("call", "c_call"):
            count[0] += 1

    def run():
        sys.setprofile(prof)
        try:
            ew.run()
        finally:
            sys.setprofile(None)

    t = threading.Thread(target=run)
    t.start()
    assert rr.recv(nn, 30)[0] == rr.STARTED
    for step in range(steps):
        kind, slot, got, rows, _, text = rr.recv(nn, 30)
        assert (kind, got, rows) == (rr.READY, step, batch), text
        emb = ring.slot(seg.buf, 0, slot)[0]
        emb[:rows] = 0.5  # d loss / d emb
        rr.send(nn, rr.GRAD, slot, step)
    _stop_once_applied(ring, seg.buf, [nn], [t])
    nn.close()
    ew_end.close()
    seg.close()
    return count[0]


def test_an_embedding_worker_makes_as_many_python_calls_per_batch_at_8192_rows_as_at_1024(tmp_path):
    _calls_of_a_run(tmp_path / "warm", 1024, 4)  # the first run loads the compiled kernels (numba)
    small = _calls_of_a_run(tmp_path, 1024, 4)
    large = _calls_of_a_run(tmp_path, 8192, 4)
    assert small == large, (small, large)
    assert small < 4 * 400  # a few hundred calls per batch, whatever its size


def test_the_ready_ring_refuses_a_dev_shm_too_small_naming_the_setting(monkeypatch):
    layout = rr.RingLayout(2, 2, 4096, 26, 16, 13)
    st = os.statvfs(shm.SHM_DIR)

    class Small:
        f_bavail, f_frsize, f_blocks = 1000, st.f_frsize, 16384

    monkeypatch.setattr(rr.os, "statvfs", lambda path: Small)
    with pytest.raises(OSError, match=r"--shm-size.*emptyDir.*medium: Memory"):
        rr.Segment(layout, shared=True)
    assert not [n for n in os.listdir(shm.SHM_DIR) if n.startswith(shm.segment_name(os.getpid())[:15])]


def test_the_ready_ring_holds_every_slot_apart_and_a_second_process_sees_the_same_bytes():
    layout = rr.RingLayout(2, 2, 8, 3, 4, 2)
    seg = rr.Segment(layout, shared=True)
    try:
        views = [layout.slot(seg.buf, e, k) for e in range(2) for k in range(2)]
        for i, (emb, dense, labels) in enumerate(views):
            emb[...], dense[...], labels[...] = i, 10 + i, 20 + i
        for i, (emb, dense, labels) in enumerate(views):
            assert (emb == i).all() and (dense == 10 + i).all() and (labels == 20 + i).all()
        layout.frontier(seg.buf)[:] = [7, rr.NEVER]
        other = rr.Segment.attach(seg.name, layout)
        assert layout.frontier(other.buf).tolist() == [7, rr.NEVER]
        assert (layout.slot(other.buf, 1, 1)[0] == 3).all()
        other.close()
        assert os.path.exists(seg.path)  # only its creator removes it
    finally:
        seg.close()
    assert not os.path.exists(seg.path)


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _signal_an_embedding_worker_once_training(tmp_path, box: dict, sig: int, which: int) -> None:
    """Send ``sig`` to embedding worker ``which`` (by pid order) of this test's job once it trains; ``box`` gets the
    job's pids and the time."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        ews = [p for p in descendants(os.getpid()) if "persia_core.train.embedding_worker" in _cmdline(p)]
        metrics = list((tmp_path / "work" / "logs").glob("nn_worker-0.log"))
        if len(ews) == 2 and metrics and "step " in metrics[0].read_text():
            box["pids"] = descendants(os.getpid())
            box["signalled_at"] = time.monotonic()
            os.kill(sorted(ews)[which], sig)
            return
        time.sleep(0.01)


@pytest.mark.processes
def test_a_sigkilled_embedding_worker_fails_train_within_60s_naming_it_and_leaves_nothing(tmp_path):
    data = write_dataset(str(tmp_path / "data"), rows=192)
    cfg = tiny_config(num_workers=1, embedding_staleness=1, epochs=400, embedding_workers=2)
    box: dict = {}
    killer = threading.Thread(target=_signal_an_embedding_worker_once_training, args=(tmp_path, box, signal.SIGKILL, 0))
    killer.start()
    with pytest.raises(TrainingFailed) as err:
        train(cfg, data, str(tmp_path / "model"), work_dir=str(tmp_path / "work"))
    raised_at = time.monotonic()
    killer.join()
    assert "signalled_at" in box, "training ended before an embedding worker was killed"
    msg = str(err.value)
    assert "embedding worker 0." in msg and "killed by SIGKILL" in msg, msg
    assert raised_at - box["signalled_at"] < 60
    assert len(box["pids"]) == 5  # 2 servers, 1 NN worker and its 2 embedding workers
    assert descendants(os.getpid()) == []
    prefixes = tuple(shm.segment_name(p)[:15] for p in box["pids"])
    assert not [n for n in os.listdir(shm.SHM_DIR) if n.startswith(prefixes)]
    # nor the examples the NN worker saved for its embedding workers
    assert not [
        n for n in os.listdir(tempfile.gettempdir()) if n.startswith(tuple(examples_prefix(p) for p in box["pids"]))
    ]


@pytest.mark.processes
def test_a_sigstopped_embedding_worker_fails_train_after_the_stopped_limit_naming_it_and_leaves_nothing(tmp_path):
    # before: the NN worker waited for its ready batch for good, and the launcher watched only its own children
    data = write_dataset(str(tmp_path / "data"), rows=192)
    cfg = tiny_config(num_workers=1, embedding_staleness=1, epochs=400, embedding_workers=2)
    box: dict = {}
    stop = (tmp_path, box, signal.SIGSTOP, 1)
    stopper = threading.Thread(target=_signal_an_embedding_worker_once_training, args=stop)
    stopper.start()
    with pytest.raises(TrainingFailed) as err:
        train(cfg, data, str(tmp_path / "model"), work_dir=str(tmp_path / "work"))
    raised_at = time.monotonic()
    stopper.join()
    assert "signalled_at" in box, "training ended before an embedding worker was stopped"
    msg = str(err.value)
    assert re.search(r"embedding worker 0\.1 \(pid \d+\) has been stopped \(SIGSTOP\) for \d+ s", msg), msg
    assert STOPPED_FAIL_S <= raised_at - box["signalled_at"] < 60
    assert descendants(os.getpid()) == []
    prefixes = tuple(shm.segment_name(p)[:15] for p in box["pids"])
    assert not [n for n in os.listdir(shm.SHM_DIR) if n.startswith(prefixes)]


@pytest.mark.processes
def test_an_embedding_worker_process_imports_no_torch():
    # the role is model-agnostic: torch (about 1.7 s and 300 MB a process) stays in the NN worker
    code = "import sys, persia_core.train.embedding_worker; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("shuffle", [False, True])
def test_a_schedule_of_one_rank_holds_that_ranks_batches_and_every_steps_global_batch(shuffle):
    counts, batch = [37, 0, 50, 12], 8  # uneven ranks, one without data
    full = make_schedule(counts, batch, 2, 3, shuffle)
    steps = len(full.global_batch)
    assert steps == 2 * 7  # ceil(50 / 8) per epoch
    assert full.global_batch == [sum(len(full.rows[r][t]) for r in range(4)) for t in range(steps)]
    for r in range(4):
        one = make_schedule(counts, batch, 2, 3, shuffle, rank=r)
        assert one.global_batch == full.global_batch
        assert all(one.rows[q] == [] for q in range(4) if q != r)
        assert [a.tolist() for a in one.rows[r]] == [a.tolist() for a in full.rows[r]]
    # each epoch covers each rank's rows once
    assert sorted(np.concatenate(full.rows[2][:7]).tolist()) == list(range(50))


def _staleness_of_a_run(
    tmp_path, fresh: bool, step_s: float, push_s: float, workers: int = 1, steps: int = 12
) -> tuple[list[int], float]:
    """The staleness of each lookup of ``workers`` embedding workers (K = 4, one ready slot each beyond the one in
    training) whose pushes are applied ``push_s`` after they are made, driven by this test as an NN worker whose
    steps take ``step_s``, and the seconds that NN worker waited for a ready batch after the first 4 steps."""
    batch = 32
    cfg = tiny_config(num_workers=1, embedding_staleness=4, epochs=1, batch_size=batch)
    data = write_dataset(str(tmp_path / f"data-{fresh}-{step_s}-{workers}"), rows=batch * steps, shards=1)
    layouts = table_layouts(cfg)
    examples = ParquetExamples(shard_files(data, "train"), model_slot_order(cfg))
    sched = make_schedule([len(examples)], batch, 1, 0, True)
    ring = rr.RingLayout(
        workers, 2, batch, sum(len(t.slots) for t in layouts), layouts[0].dim, len(read_schema(data)["dense"])
    )
    seg = rr.Segment(ring, shared=False)
    pairs = [socket.socketpair() for _ in range(workers)]
    nn = [p[0] for p in pairs]

    backend = SlowPushes(cfg.embedding, 1, push_s)
    rules = StepRules(staleness=4, num_workers=1, rank=0, fresh_lookups=fresh)
    source = BatchSource(examples, sched.rows[0], sched.global_batch)
    threads = [
        threading.Thread(target=EmbeddingWorker(backend, layouts, source, ring, seg.buf, pairs[e][1], e, 0, rules).run)
        for e in range(workers)
    ]
    for t in threads:
        t.start()
    staleness, waited = [], 0.0
    try:
        for sock in nn:
            assert rr.recv(sock, 30)[0] == rr.STARTED
        for step in range(steps):
            e = step % workers
            t0 = time.monotonic()
            kind, slot, got, rows, stal, text = rr.recv(nn[e], 30)
            waited += (time.monotonic() - t0) * (step >= 4)
            assert (kind, got) == (rr.READY, step), text
            staleness.append(stal)
            time.sleep(step_s)  # the dense step
            ring.slot(seg.buf, e, slot)[0][:rows] = 0.01
            rr.send(nn[e], rr.GRAD, slot, step)
        _stop_once_applied(ring, seg.buf, nn, threads)
    finally:
        for a, b in pairs:
            a.close()
            b.close()
        seg.close()
    return staleness, waited


def test_fresh_lookups_wait_for_the_last_push_only_while_the_nn_worker_leaves_time_for_it(tmp_path):
    # NN steps of 150 ms, pushes applied in 30 ms: a lookup can wait for the push of the step before the one in
    # training and still be ready in time; without fresh lookups it goes as soon as a ready slot is free
    fresh, waited = _staleness_of_a_run(tmp_path, True, 0.15, 0.03)
    eager, _ = _staleness_of_a_run(tmp_path, False, 0.15, 0.03)
    assert fresh[4:] == [1] * 8, fresh
    assert eager[4:] == [2] * 8, eager
    assert waited < 0.1, waited  # the NN worker found its batch ready (8 steps of 150 ms)
    # two embedding workers, each a step in two: the same
    fresh2, waited2 = _staleness_of_a_run(tmp_path, True, 0.15, 0.03, workers=2, steps=16)
    assert fresh2[6:] == [1] * 10, fresh2
    assert waited2 < 0.1, waited2
    # NN steps of 5 ms against pushes of 60 ms: waiting would starve the NN worker, so lookups go within K
    fast, _ = _staleness_of_a_run(tmp_path, True, 0.005, 0.06)
    assert max(fast) <= 4 and sum(s >= 2 for s in fast[4:]) >= 6, fast
