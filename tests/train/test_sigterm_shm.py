"""SIGTERM to a training job (how Kubernetes, KFP and Vertex AI cancel a task) leaves no shared-memory file of any
of its processes in ``/dev/shm``: not the NN workers' ready rings, not their embedding workers' segments."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from persia_core.ps import shm
from persia_core.train.processes import descendants


def _segments_of(pids: set[int]) -> list[str]:
    prefixes = tuple(f"{shm.PREFIX}{p & 0xFFFFFFFF:08x}" for p in pids)
    return sorted(n for n in os.listdir(shm.SHM_DIR) if n.startswith(prefixes))


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


@pytest.mark.processes
@pytest.mark.skipif(not shm.available(), reason="no writable /dev/shm here")
def test_sigterm_mid_training_leaves_no_shared_memory_file_of_the_job(tmp_path):
    # before: the NN workers' segments were removed, but an embedding worker killed with its NN worker left the
    # segments of its parameter-server client until the next job's start removed them
    # Criteo-shaped batches of 1,024: their lookups and pushes are large enough to go through shared memory
    from persia_core.bench.criteo_synth import criteo_config_dict, write_criteo_synth
    from persia_core.config import RunConfig

    data = str(tmp_path / "data")
    write_criteo_synth(data, train_rows=40_000, eval_rows=64, vocab=20_000)
    d = criteo_config_dict(batch_size=1024, staleness=2)
    d["model"] = {"kind": "dnn", "hidden": [], "bottom": []}
    d["trainer"].update(embedding_workers=2, epochs=50, threads_per_worker=1)
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(RunConfig.from_dict(d).to_yaml())
    script = textwrap.dedent(
        f"""
        from persia_core.config import load_config
        from persia_core.train.launcher import train
        train(load_config({str(cfg)!r}), {data!r}, {str(tmp_path / "model")!r})
        """
    )
    launcher = subprocess.Popen([sys.executable, "-c", script], stderr=subprocess.DEVNULL)
    seen: set[int] = set()
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and launcher.poll() is None:
            kids = descendants(launcher.pid)
            seen.update(kids)
            ews = [p for p in kids if b"embedding_worker" in _cmdline(p)]
            if len(ews) == 2 and _segments_of(set(ews)):  # both serving, with their client segments
                break
            time.sleep(0.05)
        else:
            pytest.fail("the embedding workers never started")
        time.sleep(1.0)
        seen.update(descendants(launcher.pid))
        assert _segments_of(seen), "no shared-memory file to check"
        launcher.send_signal(signal.SIGTERM)
        launcher.wait(timeout=60)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    assert launcher.returncode != 0
    assert _segments_of(seen | {launcher.pid}) == []
