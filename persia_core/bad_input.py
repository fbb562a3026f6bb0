"""Failures on bad input, recorded so that a retried task fails at once instead of repeating them.

KFP's task retry (``set_retry``, which the pipeline sets on the train task for transient failures: a lost
machine, a preempted VM) has no policy of its own: every failure is retried. A retry of the same task gets the
same inputs and output URIs, so a failure on bad input (a config that does not fit the data, a missing file)
would only repeat. ``refusing_bad_input`` writes the failure into the task's output folder and exits with
``EXIT_BAD_INPUT``; the next attempt finds the record and exits at once with the same message.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from collections.abc import Iterator

from persia_core import io

RECORD = "bad_input.json"
"""The record's file name in the task's output folder."""
EXIT_BAD_INPUT = 2
"""Exit code of a task that failed on bad input (as the ``persia`` command exits for bad input)."""
BAD_INPUT = (ValueError, FileNotFoundError)
"""What counts as bad input: the checks of inputs, configs and their fit raise these."""


def _exit(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
    raise SystemExit(EXIT_BAD_INPUT)


@contextlib.contextmanager
def refusing_bad_input(output_dir: str, task: str) -> Iterator[None]:
    """Run the block of task ``task`` writing to ``output_dir`` (local, ``/gcs/`` or gs://). Before it: when an
    earlier attempt recorded a failure on bad input there, print it and exit ``EXIT_BAD_INPUT`` at once. A
    ``BAD_INPUT`` exception leaving the block is recorded there (type, message, time), printed, and ends the
    process with ``EXIT_BAD_INPUT`` (``SystemExit``); any other exception leaves as it is (a retry may help)."""
    record = io.join(output_dir, RECORD)
    if io.exists(record):
        earlier = json.loads(io.read_text(record))
        _exit(
            f"{task}: an earlier attempt of this task failed on bad input, which a retry cannot change: "
            f"{earlier['type']}: {earlier['message']} (recorded in {record})"
        )
    try:
        yield
    except BAD_INPUT as e:
        io.makedirs(output_dir)
        io.write_text(record, json.dumps({"type": type(e).__name__, "message": str(e), "time": time.time()}))
        _exit(f"{task}: failed on bad input (not retried): {type(e).__name__}: {e}")
