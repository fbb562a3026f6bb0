"""Ending a job's process without the interpreter's teardown."""

from __future__ import annotations

import logging
import os
import sys
from typing import NoReturn


def exit_now(code: int | None) -> NoReturn:
    """End this process with exit status ``code`` (None: 0) at once: flush the logging handlers, stdout and
    stderr, then ``os._exit``.

    For the ``__main__`` of the ``persia`` command and of a job's processes (parameter server, NN worker,
    embedding worker, Vertex AI replica) once ``main`` has returned, having closed what it opened. The
    interpreter's own teardown frees every module of torch and numba one by one: it costs CPU seconds on a
    machine whose cores train, and the launcher waits for it, since a job ends when its processes have exited.
    Skipped with it: ``atexit`` handlers and the finalizers of objects still alive, so nothing that must
    outlive ``main`` may rely on them. An exception from ``main`` is not routed here: it ends the process the
    usual way, traceback and all."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):  # closed or replaced by None
            pass
    os._exit(0 if code is None else int(code))
