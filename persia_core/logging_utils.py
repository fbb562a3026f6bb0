"""One log format for every process, progress that suits a terminal and a log file, TensorBoard event files.

* ``setup_logging(role, rank)``: every line reads ``2026-01-02 03:04:05,678 INFO nn_worker[1] persia.worker: ...``
  (role and rank name the process, so the merged logs of N servers and M workers stay readable).
* ``progress(iterable, total, desc)``: a ``tqdm`` bar when stderr is a terminal; otherwise (KFP and Vertex AI
  logs, redirected output) one log line at most every ``interval_s`` seconds and one at the end, so logs hold
  no carriage-return noise.
* ``write_tensorboard(history, log_dir)``: the training history (``train_metrics.json``) as TensorBoard scalars,
  which Vertex AI TensorBoard and ``tensorboard --logdir`` read. Needs the ``tensorboard`` package.
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from typing import TypeVar

from persia_core import io

T = TypeVar("T")

#: ``%`` -style format of every line; ``{who}`` becomes ``role[rank]`` (or ``role`` without a rank).
LOG_FORMAT = "%(asctime)s %(levelname)s {who} %(name)s: %(message)s"

_handler: logging.Handler | None = None
log = logging.getLogger("persia.progress")


PROGRESS_FORMAT = "step %d/%d loss %.4f samples/s %.0f staleness %d"
"""An NN worker's progress line (step, steps, loss, samples/s, staleness), which the launcher repeats in its own
log (``train.local_cluster.ProgressRelay``) and ``pipelines.run_local`` on the terminal."""
PROGRESS_PATTERN = r"step (\d+)/(\d+) loss \S+ samples/s \S+ staleness \d+"
"""A regular expression matching a ``PROGRESS_FORMAT`` line (groups: the step and the number of steps)."""
MILESTONE_PATTERN = r"(?:epoch \d+: validation logloss|trainer\.refit:) .*"
"""A regular expression matching an NN worker's milestone lines (``epochs: auto``'s score of an epoch, the start
of a ``trainer.refit``), which the launcher and ``pipelines.run_local`` repeat as they come."""


def log_format(role: str, rank: int | None = None) -> str:
    """The format string for a process: ``"%(asctime)s %(levelname)s <role>[<rank>] %(name)s: %(message)s"``
    (``<role>`` alone when ``rank`` is None). Raises ``ValueError`` for an empty role."""
    if not role:
        raise ValueError("setup_logging: role must not be empty")
    who = role if rank is None else f"{role}[{int(rank)}]"
    return LOG_FORMAT.format(who=who.replace("%", "%%"))


def setup_logging(role: str, rank: int | None = None, level: int | str = logging.INFO, stream=None) -> logging.Handler:
    """Send this process's log records to ``stream`` (default stderr) in the one project format.

    Call once at the start of a process's ``main`` (a parameter server: ``setup_logging("ps", shard)``; an NN
    worker: ``setup_logging("nn_worker", rank)``; the CLI: ``setup_logging("preprocess")``). Installs one
    handler on the root logger and sets its level; calling again replaces the handler this function installed
    (other handlers, e.g. pytest's, are left alone). Returns the handler.
    """
    global _handler
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(logging.Formatter(log_format(role, rank)))
    root = logging.getLogger()
    if _handler is not None:
        root.removeHandler(_handler)
    root.addHandler(handler)
    root.setLevel(level)
    _handler = handler
    return handler


def _is_terminal(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def progress(
    iterable: Iterable[T],
    total: int | None = None,
    desc: str = "",
    unit: str = "it",
    interval_s: float = 30.0,
    logger: logging.Logger | None = None,
    stream=None,
) -> Iterator[T]:
    """Iterate ``iterable`` while showing progress.

    On a terminal (``stream``, default stderr, ``isatty()``): a ``tqdm`` bar. Elsewhere: an INFO line
    ``"<desc>: 40/100 it (40%), 2.1 it/s, 19 s"`` on ``logger`` (default ``persia.progress``) at most every
    ``interval_s`` seconds, and one when the iteration ends. ``total`` may be None (no percentage).
    """
    stream = stream if stream is not None else sys.stderr
    if _is_terminal(stream):
        from tqdm import tqdm

        yield from tqdm(iterable, total=total, desc=desc or None, unit=unit, file=stream)
        return
    logger = logger or log
    t0 = last = time.monotonic()
    n = 0

    def line() -> None:
        el = time.monotonic() - t0
        rate = n / el if el > 0 else 0.0
        pct = f" ({100.0 * n / total:.0f}%)" if total else ""
        of = f"/{total}" if total is not None else ""
        logger.info("%s: %d%s %s%s, %.1f %s/s, %.0f s", desc or "progress", n, of, unit, pct, rate, unit, el)

    for item in iterable:
        yield item
        n += 1
        now = time.monotonic()
        if now - last >= interval_s:
            last = now
            line()
    line()


def _scalar_series(history: dict) -> dict[str, tuple[list[int], list[float]]]:
    """TensorBoard tags -> (global steps, values) from a training history (see ``write_tensorboard``)."""
    samples = [int(s) for s in history.get("samples", [])]
    out: dict[str, tuple[list[int], list[float]]] = {}
    if history.get("loss"):
        out["train/loss"] = (samples, [float(v) for v in history["loss"]])
    if history.get("staleness"):
        out["train/staleness"] = (samples, [float(v) for v in history["staleness"]])
    elapsed = history.get("elapsed_s") or []
    if len(elapsed) == len(samples) and len(samples) > 1:
        steps, rates = [], []
        for i in range(1, len(samples)):
            dt = float(elapsed[i]) - float(elapsed[i - 1])
            if dt > 0:
                steps.append(samples[i])
                rates.append((samples[i] - samples[i - 1]) / dt)
        if steps:
            out["train/samples_per_s"] = (steps, rates)
    return out


def write_tensorboard(history: dict, log_dir: str) -> str | None:
    """Write a training history as TensorBoard event files under ``log_dir`` and return ``log_dir``.

    ``history``: the ``train_metrics.json`` dict of a Model artifact: ``samples`` (cumulative samples, the
    global step of every point), ``loss``, optionally ``staleness`` and ``elapsed_s``. Tags: ``train/loss``,
    ``train/staleness`` and ``train/samples_per_s`` (per logging interval, Δsamples / Δelapsed_s), plus the
    run summary (``samples_per_s``, ``max_staleness``, ...) as ``summary/<name>`` at the last step.
    ``log_dir``: local or ``/gcs/`` path, or ``gs://`` (written locally, then uploaded with ``persia_core.io``).

    Uses ``torch.utils.tensorboard.SummaryWriter``, which needs the ``tensorboard`` package; without it, logs
    a warning and returns None (nothing written).
    """
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:  # tensorboard is not installed
        logging.getLogger("persia.tensorboard").warning(
            "TensorBoard event files not written (%s); install the 'tensorboard' package", e
        )
        return None
    local = tempfile.mkdtemp(prefix="persia-tb-") if io.is_gcs(log_dir) else log_dir
    writer = SummaryWriter(log_dir=local)
    try:
        last_step = 0
        for tag, (steps, values) in _scalar_series(history).items():
            for step, value in zip(steps, values, strict=True):
                writer.add_scalar(tag, value, global_step=step)
            if steps:
                last_step = max(last_step, steps[-1])
        for k in ("samples_per_s", "max_staleness", "train_seconds", "wait_seconds_rank0"):
            v = history.get(k)
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                writer.add_scalar(f"summary/{k}", float(v), global_step=last_step)
        writer.flush()
    finally:
        writer.close()
    if io.is_gcs(log_dir):
        for name in sorted(os.listdir(local)):
            with open(os.path.join(local, name), "rb") as f:
                io.write_bytes(io.join(log_dir, name), f.read())
    return log_dir
