"""``exit_now``: a process ended without the interpreter's teardown still delivers what it wrote and its status."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

CHILD = """
import logging, logging.handlers, sys
from persia_core.process_exit import exit_now
# a handler that writes only when flushed or closed (as logging.shutdown does)
held = logging.handlers.MemoryHandler(1000, flushLevel=logging.CRITICAL, target=logging.FileHandler(sys.argv[1]))
logging.basicConfig(handlers=[held], level=logging.INFO, format="%(message)s")
logging.info("logged before the exit")
print("printed before the exit", end="")   # stdout is a file here: block-buffered, so lost without a flush
sys.stderr.write("to stderr")
exit_now(int(sys.argv[2]) if sys.argv[2] != "None" else None)
"""


@pytest.mark.processes
def test_exit_now_flushes_logs_stdout_and_stderr_and_exits_with_the_code(tmp_path):
    for code, status in ((3, 3), (None, 0)):
        log, out, err = tmp_path / f"log{code}", tmp_path / f"out{code}", tmp_path / f"err{code}"
        with open(out, "w") as o, open(err, "w") as e:
            env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
            rc = subprocess.run(
                [sys.executable, "-c", CHILD, str(log), str(code)], stdout=o, stderr=e, env=env
            ).returncode
        assert rc == status
        assert log.read_text() == "logged before the exit\n"
        assert out.read_text() == "printed before the exit"
        assert err.read_text() == "to stderr"
