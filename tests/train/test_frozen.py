"""A child frozen by the cgroup freezer is detected as a SIGSTOPped one is: the job fails naming it, and no process
is left; long legitimate work (a sleeping or busy child) never trips the limit.

The freezer tests need a writable freezer (cgroup v1 ``freezer`` or a cgroup v2 ``cgroup.freeze``); where there
is none (no root, a read-only ``/sys/fs/cgroup``) they skip, naming why."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import uuid

import pytest
from support import tiny_config, write_dataset

from persia_core.train import processes

V1 = "/sys/fs/cgroup/freezer"


def _cgroup2_mount() -> str | None:
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            if right.split()[:1] == ["cgroup2"]:
                return left.split()[4]
    return None


class Freezer:
    """A cgroup of its own that processes are moved into, then frozen and thawed (v1 or v2)."""

    def __init__(self) -> None:
        name = f"persia-test-{uuid.uuid4().hex[:8]}"
        if os.path.isdir(V1) and os.access(V1, os.W_OK):
            self.path, self.v1 = os.path.join(V1, name), True
        else:
            mount = _cgroup2_mount()
            if mount is None or not os.access(mount, os.W_OK):
                pytest.skip("no writable cgroup freezer here (no cgroup v1 freezer, no writable cgroup v2 mount)")
            self.path, self.v1 = os.path.join(mount, name), False
        try:
            os.mkdir(self.path)
        except OSError as e:
            pytest.skip(f"cannot create a cgroup under {os.path.dirname(self.path)}: {e}")
        if not self.v1 and not os.path.exists(os.path.join(self.path, "cgroup.freeze")):
            os.rmdir(self.path)
            pytest.skip("this cgroup v2 hierarchy has no cgroup.freeze (kernel before 5.2)")

    def add(self, pid: int) -> None:
        with open(os.path.join(self.path, "cgroup.procs"), "w") as f:
            f.write(str(pid))

    def _write(self, frozen: bool) -> None:
        name, value = (
            ("freezer.state", "FROZEN" if frozen else "THAWED") if self.v1 else ("cgroup.freeze", "01"[frozen])
        )
        with open(os.path.join(self.path, name), "w") as f:
            f.write(value)

    def freeze(self) -> None:
        self._write(True)

    def thaw(self) -> None:
        self._write(False)

    def remove(self) -> None:
        self.thaw()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                os.rmdir(self.path)
                return
            except OSError:  # its processes are still leaving
                time.sleep(0.1)


@pytest.fixture
def freezer():
    f = Freezer()
    yield f
    f.remove()


@pytest.mark.processes
def test_a_cgroup_frozen_process_reads_as_frozen_and_a_sleeping_or_busy_one_does_not(freezer):
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    frozen = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        freezer.add(frozen.pid)
        freezer.freeze()
        deadline = time.monotonic() + 5
        while processes.frozen_cgroup(frozen.pid) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert processes.frozen_cgroup(frozen.pid) == freezer.path
        assert processes.frozen_cgroup(sleeper.pid) is None and processes.frozen_cgroup(busy.pid) is None
        assert processes.frozen_cgroup(2**22 + 12345) is None  # no such process: not frozen, no error
        freezer.thaw()
        deadline = time.monotonic() + 5
        while processes.frozen_cgroup(frozen.pid) is not None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert processes.frozen_cgroup(frozen.pid) is None
    finally:
        freezer.thaw()
        for p in (sleeper, busy, frozen):
            p.kill()
            p.wait()


def _job_children(work: str) -> list[int]:
    out = []
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if work.encode() in f.read() and processes.process_state(int(pid)) not in ("Z", ""):
                    out.append(int(pid))
        except (OSError, ValueError):
            continue
    return out


@pytest.mark.processes
def test_a_frozen_parameter_server_fails_the_job_after_the_stopped_limit_naming_it_and_leaves_no_process(
    tmp_path, freezer, monkeypatch
):
    # before: a frozen child is in state D, not T, so the job waited on it for minutes of RPC retries; and a
    # SIGKILL does not end a process frozen by the v1 freezer, so stopping the job would have waited for good
    from persia_core.train import local_cluster
    from persia_core.train.launcher import train
    from persia_core.train.local_cluster import TrainingFailed

    monkeypatch.setattr(local_cluster, "STOPPED_FAIL_S", 3.0)
    data = write_dataset(str(tmp_path / "data"), rows=192)
    work, model = str(tmp_path / "work"), str(tmp_path / "model")
    cfg = tiny_config(num_workers=1, embedding_staleness=0, epochs=200, shuffle=True, network_delay_s=0.004)
    box: dict = {}

    def freeze_a_server_once_training():
        deadline = time.monotonic() + 120
        marker = os.path.join(work, "ps-1.port")
        while time.monotonic() < deadline:
            workers = [p for p in _job_children(work) if b"train.worker" in open(f"/proc/{p}/cmdline", "rb").read()]
            servers = _job_children(marker)
            if workers and servers:
                time.sleep(2.0)  # into training
                freezer.add(servers[0])
                freezer.freeze()
                box["frozen_at"] = time.monotonic()
                return
            time.sleep(0.05)

    th = threading.Thread(target=freeze_a_server_once_training)
    th.start()
    with pytest.raises(TrainingFailed, match=r"ps-1 \(pid \d+\) has been frozen .*cgroup") as err:
        train(cfg, data, model, work_dir=work)
    raised_at = time.monotonic()
    th.join()
    assert "frozen_at" in box, "training finished before the server was frozen"
    assert freezer.path in str(err.value)  # which cgroup, so that an operator can find what froze it
    assert 3.0 <= raised_at - box["frozen_at"] < 30
    deadline = time.monotonic() + 10
    while _job_children(work) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _job_children(work) == []


@pytest.mark.processes
def test_a_child_asleep_or_busy_for_longer_than_the_stopped_limit_is_not_failed(tmp_path, monkeypatch):
    # long legitimate work (a multi-GB dump: the process sleeps in I/O or computes) must never trip the limit
    from persia_core.train import local_cluster

    monkeypatch.setattr(local_cluster, "STOPPED_FAIL_S", 0.3)
    cluster = local_cluster.LocalCluster(str(tmp_path / "cfg.yaml"), 1, 0, str(tmp_path))
    kids = [
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"]),
        subprocess.Popen([sys.executable, "-c", "while True: pass"]),
    ]
    try:
        procs = [local_cluster._Proc(f"child-{i}", p, str(tmp_path / "log")) for i, p in enumerate(kids)]
        end = time.monotonic() + 1.5
        while time.monotonic() < end:
            cluster._check_alive(procs)  # raises TrainingFailed if it took either for stopped or frozen
            time.sleep(0.1)
        assert all(p.popen.poll() is None for p in procs)
    finally:
        for p in kids:
            p.kill()
            p.wait()


@pytest.mark.processes
def test_a_frozen_embedding_worker_fails_the_job_naming_it_and_its_cgroup_and_leaves_no_process(tmp_path, freezer):
    # an embedding worker is the NN worker's child, not the launcher's: before, the NN worker waited for its
    # ready batch for good, and stopping the job then waited on the frozen process (v1 holds a killed one)
    from persia_core.train.launcher import train
    from persia_core.train.local_cluster import STOPPED_FAIL_S, TrainingFailed

    data = write_dataset(str(tmp_path / "data"), rows=192)
    work, model = str(tmp_path / "work"), str(tmp_path / "model")
    cfg = tiny_config(num_workers=1, embedding_staleness=1, epochs=400, embedding_workers=2)
    box: dict = {}

    def freeze_an_embedding_worker_once_training():
        deadline = time.monotonic() + 120
        log = os.path.join(work, "logs", "nn_worker-0.log")
        while time.monotonic() < deadline:
            ews = [
                p
                for p in processes.descendants(os.getpid())
                if b"train.embedding_worker" in open(f"/proc/{p}/cmdline", "rb").read()
            ]
            if len(ews) == 2 and os.path.exists(log) and "step " in open(log).read():
                freezer.add(min(ews))
                freezer.freeze()
                box["frozen_at"] = time.monotonic()
                return
            time.sleep(0.02)

    th = threading.Thread(target=freeze_an_embedding_worker_once_training)
    th.start()
    with pytest.raises(TrainingFailed, match=r"embedding worker 0\.0 \(pid \d+\) has been frozen .*cgroup") as err:
        train(cfg, data, model, work_dir=work)
    raised_at = time.monotonic()
    th.join()
    assert "frozen_at" in box, "training finished before the embedding worker was frozen"
    assert freezer.path in str(err.value)
    assert STOPPED_FAIL_S <= raised_at - box["frozen_at"] < 60
    assert processes.descendants(os.getpid()) == []


@pytest.mark.processes
def test_a_process_frozen_through_a_parent_cgroup_names_that_parent_and_is_thawed_only_when_the_subtree_is_ours(
    freezer,
):
    # before: the inner cgroup was named (its state reads FROZEN too) and thawing it did nothing, so a killed
    # process stayed frozen; a process of someone else's elsewhere under the frozen parent must keep it frozen
    inner = os.path.join(freezer.path, "inner")
    other = os.path.join(freezer.path, "other")
    os.mkdir(inner)
    os.mkdir(other)
    ours = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    theirs = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        for folder, p in ((inner, ours), (other, theirs)):
            with open(os.path.join(folder, "cgroup.procs"), "w") as f:
                f.write(str(p.pid))
        freezer.freeze()
        deadline = time.monotonic() + 5
        while processes.frozen_cgroup(ours.pid) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert processes.frozen_cgroup(ours.pid) == freezer.path  # the cgroup that froze it, not its own
        assert processes.halted(ours.pid) == f"frozen (by the freezer of cgroup {freezer.path})"
        assert not processes.thaw_if_only(processes.frozen_cgroup(ours.pid), {ours.pid})  # theirs is in it too
        assert processes.frozen_cgroup(ours.pid) == freezer.path
        assert processes.thaw_if_only(processes.frozen_cgroup(ours.pid), {ours.pid, theirs.pid})
        deadline = time.monotonic() + 5
        while processes.frozen_cgroup(ours.pid) is not None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert processes.frozen_cgroup(ours.pid) is None and processes.halted(ours.pid) is None
    finally:
        freezer.thaw()
        for p in (ours, theirs):
            p.kill()
            p.wait()
        for folder in (inner, other):
            deadline = time.monotonic() + 10
            while os.path.isdir(folder) and time.monotonic() < deadline:
                try:
                    os.rmdir(folder)
                except OSError:
                    time.sleep(0.1)
