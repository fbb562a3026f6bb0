"""A SIGKILLed ``run_local`` (or ``make run``) leaves no job behind: its tasks' processes end with it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _ours(marker: str) -> list[int]:
    """Live processes whose command line names ``marker``."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker.encode() in cmd and state != "Z":
            out.append(int(pid))
    return out


@pytest.mark.processes
@pytest.mark.timeout(180)
@pytest.mark.parametrize("via_make", [False, True])
def test_a_sigkilled_run_local_or_make_run_leaves_no_process_of_its_job(tmp_path, via_make):
    # before: kill -9 of run_local left the train task's launcher, servers and workers training on to the end,
    # orphaned; kill -9 of make left run_local itself running the whole pipeline
    root = str(tmp_path / "out")
    if via_make:
        cmd = ["make", "-s", "-o", ".venv/.installed", "run", f"PIPELINE_ROOT={root}", "EPOCHS=30", "MAX_ROWS=20000"]
    else:
        cmd = [sys.executable, "-m", "pipelines.run_local", "--pipeline-root", root, "--epochs", "30"]
        cmd += ["--max-rows", "20000"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        deadline = time.monotonic() + 120
        line = ""
        while time.monotonic() < deadline and " train: step " not in line:
            line = proc.stdout.readline()
            assert line or proc.poll() is None, "the run ended before training"
        assert " train: step " in line, "training never started"
        assert len(_ours(root)) >= 3  # the train task, its servers and its NN worker
        proc.kill()
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    deadline = time.monotonic() + 30
    while _ours(root) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = _ours(root)
    for pid in left:  # not left to run on after a failed test
        os.kill(pid, signal.SIGKILL)
    assert left == [], "processes of the killed run still running"
