"""Run the compiled-equivalent pipeline locally with ``kfp.local.SubprocessRunner`` (no cloud account needed).

Each task runs in this interpreter's environment, where the project is installed. kfp.local's own output (every
task's executor input and output, streamed logs) goes to ``<pipeline root>/logs/run-<time>.log``; the terminal
gets one line per task as it starts and ends (and the train task's progress, at most every 10 s); when a task
fails, its exception line, then the log's tail without kfp's type-hint notes, then the exception line again
(``--verbose``: everything, as kfp.local prints it); on success, where the outputs are and, as its last line,
``eval: AUC=... logloss=... NE=...``.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import logging
import os
import re
import shutil
import signal
import sys
import threading
import time

from kfp import local

from components.data_path import resolve_data_path
from persia_core.config import load_config
from persia_core.config.trainer import AUTO_EPOCHS, check_delta_period
from persia_core.embedding.warm_start import check_warm_start_location
from persia_core.evaluate.decision import DEFAULT_LR_MARGIN, DEFAULT_MAX_NE, DEFAULT_MIN_AUC, check_thresholds
from persia_core.logging_utils import MILESTONE_PATTERN, PROGRESS_PATTERN
from persia_core.model_store import latest_blessed_model
from persia_core.preprocess.pipeline import malformed_summary, resolve_inputs
from persia_core.train.local_cluster import check_local_process_count
from persia_core.train.processes import PARENT_ENV, descendants, end_with
from pipelines.persia_pipeline import persia_pipeline

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_STARTED = re.compile(r"Executing task '([^']+)'")
_FINISHED = re.compile(r"Task '([^']+)' finished with status (\w+)")
_PROGRESS = re.compile(r"persia\.launcher: nn_worker-0: (" + PROGRESS_PATTERN + "|" + MILESTONE_PATTERN + ")")
_NOISE = re.compile(r"Converting string literal type hint to Any")  # kfp's, once per component per task
_EXCEPTION = re.compile(r"\s*(?:[\w.]+\.)?[A-Z]\w*(?:Error|Exception): \S")  # an exception's last line


def epochs_arg(text: str) -> int:
    """``--epochs``: a count (0 = the config's) or ``auto`` (``AUTO_EPOCHS``); anything else is argparse's usage
    error naming the value."""
    if text == "auto":
        return AUTO_EPOCHS
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of epochs or 'auto', got {text!r}") from None


@contextlib.contextmanager
def captured_output(log_path: str, verbose: bool = False):
    """Send everything written to this process's stdout/stderr (and its task subprocesses', which inherit them)
    to ``log_path``; echo one line per task start and end to the terminal meanwhile. Yields a function that
    returns the log's last ``n`` lines (for a failure message). ``verbose``: no capture."""
    if verbose:
        yield lambda n=0: ""
        return
    os.makedirs(os.path.dirname(log_path), exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    start = os.path.getsize(log_path) if os.path.exists(log_path) else 0
    log = open(log_path, "ab", buffering=0)
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    # Python-level streams too: sys.stdout/err and logging handlers that hold them (kfp.local's) may not write
    # to fds 1 and 2 (e.g. under a test runner's capture)
    text = open(log_path, "a", buffering=1, errors="replace")
    old_streams = sys.stdout, sys.stderr
    handlers = []
    for logger in [logging.getLogger()] + [
        v for v in logging.Logger.manager.loggerDict.values() if isinstance(v, logging.Logger)
    ]:
        for h in logger.handlers:
            if isinstance(h, logging.StreamHandler) and h.stream in old_streams:
                handlers.append((h, h.setStream(text)))
    sys.stdout = sys.stderr = text
    stop = threading.Event()
    began: dict[str, float] = {}

    def echo(line: str) -> None:
        line = _ANSI.sub("", line)
        m = _STARTED.search(line)
        if m:
            began[m.group(1)] = time.time()
            os.write(saved[0], f"{time.strftime('%H:%M:%S')} {m.group(1)}: running\n".encode())
            return
        m = _PROGRESS.search(line)
        if m:  # the train task's progress (NN worker 0, relayed by the launcher at most every 10 s) and milestones
            os.write(saved[0], f"{time.strftime('%H:%M:%S')} train: {m.group(1)}\n".encode())
            return
        m = _FINISHED.search(line)
        if m:
            took = time.time() - began.get(m.group(1), time.time())
            os.write(
                saved[0], f"{time.strftime('%H:%M:%S')} {m.group(1)}: {m.group(2).lower()} ({took:.1f} s)\n".encode()
            )

    def follow() -> None:
        with open(log_path, errors="replace") as f:
            f.seek(start)
            pending = ""
            while True:
                chunk = f.read()
                if chunk:
                    pending += chunk
                    *lines, pending = pending.split("\n")
                    for line in lines:
                        echo(line)
                elif stop.is_set():
                    return
                else:
                    time.sleep(0.1)

    tail = threading.Thread(target=follow, daemon=True)
    tail.start()

    def last_lines(n: int = 60) -> str:
        with open(log_path, errors="replace") as f:
            f.seek(start)
            lines = [_ANSI.sub("", line) for line in f.readlines()]
        return "".join([line for line in lines if not _NOISE.search(line)][-n:])

    try:
        yield last_lines
    finally:
        text.flush()
        sys.stdout, sys.stderr = old_streams
        for h, stream in handlers:
            h.setStream(stream)
        text.close()
        stop.set()
        tail.join(timeout=5)
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        os.close(saved[0])
        os.close(saved[1])
        log.close()


def run_dirs(root: str) -> list[str]:
    """The run folders kfp.local made under ``root`` (one per pipeline run)."""
    try:
        return [
            os.path.join(root, d)
            for d in os.listdir(root)
            if os.path.isdir(os.path.join(root, d, "evaluate")) or os.path.isdir(os.path.join(root, d, "preprocess"))
        ]
    except FileNotFoundError:
        return []


def this_run(root: str, before: set[str], output: str) -> str:
    """This run's folder: the new one whose evaluate step returned ``output`` (another run may share the pipeline
    root and finish meanwhile). "" when none matches."""
    for d in sorted(set(run_dirs(root)) - before):
        try:
            with open(os.path.join(d, "evaluate", "executor_output.json")) as f:
                if json.load(f).get("parameterValues", {}).get("Output") == output:
                    return d
        except (OSError, ValueError):
            continue
    return ""


def terminate_descendants(sig: int = signal.SIGTERM) -> list[int]:
    """Send ``sig`` to every process below this one: the running task's shell, its Python executor and, where
    they are still there, the processes it started. Returns the pids signalled."""
    found = descendants(os.getpid())
    for pid in found:
        try:
            os.kill(pid, sig)
        except OSError:
            pass
    return found


@contextlib.contextmanager
def tasks_die_with_this_process():
    """Within the block, the processes kfp.local starts for the pipeline's tasks (they inherit this environment)
    find this process's pid in ``PERSIA_DIE_WITH`` and get SIGTERM once it has ended, even by SIGKILL
    (``processes.die_with_local_runner``), so that no task trains on orphaned. The variable is restored after."""
    saved = os.environ.get(PARENT_ENV)
    os.environ[PARENT_ENV] = str(os.getpid())
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(PARENT_ENV, None)
        else:
            os.environ[PARENT_ENV] = saved


def main(argv: list[str] | None = None) -> int:
    # started by ``make run`` (the Makefile names make's pid): end with make, even a SIGKILLed one, through the
    # SIGTERM handler below, which stops the running task; a make run behind a shell that goes away stays as is
    parent = os.environ.pop(PARENT_ENV, "")
    if parent.isdigit() and not end_with(int(parent)):
        print("run_local: make, which started it, has already ended", file=sys.stderr)
        return 143
    p = argparse.ArgumentParser(description="Run the persia-kfp pipeline with kfp.local on this machine.")
    p.add_argument("--data", default="data/movielens", help="raw data: folder, file or glob")
    p.add_argument("--config", default="movielens", help="run config: shipped name or YAML path")
    p.add_argument("--pipeline-root", default="local_outputs", help="where kfp.local writes artifacts")
    p.add_argument("--parameter-servers", type=int, default=0, help="embedding parameter servers (0 = config's)")
    p.add_argument("--nn-workers", type=int, default=0, help="NN workers / DDP ranks (0 = config's)")
    p.add_argument("--staleness", type=int, default=-1, help="embedding staleness K (-1 = config's)")
    p.add_argument(
        "--epochs",
        type=epochs_arg,
        default=0,
        help="epochs (0 = config's; auto: validation-driven, up to trainer.max_epochs)",
    )
    p.add_argument("--max-rows", type=int, default=0, help="read only this many examples (0 = all)")
    p.add_argument(
        "--blessed-dir",
        default="",
        help="the latest blessed model's location, written by the gate (default: "
        "<pipeline root>/blessed/<config name>, so models of different configs never compete)",
    )
    p.add_argument(
        "--warm-start-from",
        default="",
        help="start from a previous model, checkpoint or blessed-model location (empty = cold start)",
    )
    p.add_argument(
        "--min-auc", type=float, default=DEFAULT_MIN_AUC, help="the gate blesses only a model with this eval AUC"
    )
    p.add_argument(
        "--max-ne",
        type=float,
        default=DEFAULT_MAX_NE,
        help="... and never one whose normalized entropy is at or above this (1: the base rate)",
    )
    p.add_argument(
        "--lr-margin",
        type=float,
        default=DEFAULT_LR_MARGIN,
        help="... nor one whose AUC is more than this below the LR reference's (0: not below; 1: not enforced)",
    )
    p.add_argument(
        "--delta-every-s",
        type=float,
        default=0.0,
        help="seconds between the parameter servers' incremental exports (deltas) during training (0 = none)",
    )
    p.add_argument(
        "--delta-dir",
        default="",
        help="where deltas go, the same folder from run to run (default: <model>/deltas of each run's Model)",
    )
    p.add_argument("--verbose", action="store_true", help="print kfp.local's whole output (default: to a log file)")
    args = p.parse_args(argv)
    try:
        check_delta_period(args.delta_every_s)
    except ValueError as e:
        p.error(str(e))
    for name in ("parameter_servers", "nn_workers", "epochs", "max_rows"):
        if getattr(args, name) < (AUTO_EPOCHS if name == "epochs" else 0):
            zero = "all" if name == "max_rows" else "the config's value" + (", or auto" if name == "epochs" else "")
            p.error(f"--{name.replace('_', '-')} must be >= 0 (0 = {zero})")
    if args.staleness < -1:
        p.error("--staleness must be >= 0, or -1 for the config's value")
    try:  # the gate's own checks, made before preprocess and train rather than after
        check_thresholds(min_auc=args.min_auc, max_ne=args.max_ne, lr_margin=args.lr_margin, as_flags=True)
    except ValueError as e:
        p.error(str(e))
    try:  # bad configs and missing local data fail here, naming the key or path, before any pipeline task starts
        if "{date" in args.data:  # as on Vertex AI, from the current UTC time (a cron job's own run time)
            args.data = resolve_data_path(args.data, "")
            print(f"data: {args.data}")
        cfg = load_config(args.config)
        check_local_process_count(
            args.parameter_servers or cfg.embedding.num_shards, args.nn_workers or cfg.trainer.num_workers
        )
        if "://" not in args.data:
            resolve_inputs(cfg, os.path.abspath(args.data))
    except (ValueError, FileNotFoundError) as e:
        print(f"run_local: {e}", file=sys.stderr)
        return 2

    def absolute(path: str) -> str:
        return path if not path or "://" in path else os.path.abspath(path)

    data = absolute(args.data)
    root = os.path.abspath(args.pipeline_root)
    config_name = os.path.splitext(os.path.basename(args.config))[0]
    blessed_dir = absolute(args.blessed_dir) or os.path.join(root, "blessed", config_name)
    try:
        check_warm_start_location(absolute(args.warm_start_from), blessed_dir)
    except FileNotFoundError as e:
        print(f"run_local: {e}", file=sys.stderr)
        return 2
    config = args.config
    if config.endswith((".yaml", ".yml")) and "://" not in config:
        config = os.path.abspath(config)
    local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=root, raise_on_error=True)
    t0 = time.time()
    log_path = os.path.join(root, "logs", time.strftime("run-%Y%m%d-%H%M%S") + f"-{os.getpid()}.log")
    before = set(run_dirs(root))
    if not args.verbose:
        print(f"kfp.local output: {log_path}")
    failure: tuple[RuntimeError | None, str] | None = None
    terminated = []

    def on_sigterm(signum, frame):  # a cancel: the running task's processes go too (Ctrl-C reaches them itself)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        terminated.append(True)
        terminate_descendants()
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    with captured_output(log_path, args.verbose) as last_lines, tasks_die_with_this_process():
        try:
            result = persia_pipeline(
                data=data,
                config=config,
                num_parameter_servers=args.parameter_servers,
                num_nn_workers=args.nn_workers,
                embedding_staleness=args.staleness,
                epochs=args.epochs,
                max_rows=args.max_rows,
                blessed_dir=blessed_dir,
                warm_start_from=absolute(args.warm_start_from),
                min_auc=args.min_auc,
                max_ne=args.max_ne,
                lr_margin=args.lr_margin,
                delta_every_s=args.delta_every_s,
                delta_dir=absolute(args.delta_dir),
            )
        except RuntimeError as e:
            failure = (e, last_lines(80))
        except KeyboardInterrupt:
            failure = (None, "")
        finally:
            signal.signal(signal.SIGTERM, previous)
    if failure is not None and failure[0] is None:
        how = "terminated (SIGTERM)" if terminated else "interrupted"
        print(
            f"\nrun_local: {how} after {time.time() - t0:.0f} s; nothing was blessed by this run "
            f"(outputs so far under {root}, kfp.local's output in {log_path})",
            file=sys.stderr,
        )
        return 143 if terminated else 130
    if failure is not None:
        error, tail = failure
        where = "above" if args.verbose else f"in {log_path}; its last lines:"
        errors = [line.strip() for line in tail.splitlines() if _EXCEPTION.match(line)]
        first = f"run_local: the failing task's error: {errors[-1]}\n" if errors else ""
        print(
            f"\nrun_local: the pipeline failed after {time.time() - t0:.0f} s: {_ANSI.sub('', str(error))}\n{first}"
            f"run_local: the failing task's own output is {where}\n{tail}{first}",
            file=sys.stderr,
        )
        return 1
    metrics = json.loads(result.output)
    print(f"pipeline finished in {time.time() - t0:.1f} s; outputs under {root}")
    run_dir = this_run(root, before, result.output)
    plans = glob.glob(os.path.join(run_dir, "init-shards", "*", "shard_plan.json")) if run_dir else []
    if plans:
        with open(plans[0]) as f:
            warm = json.load(f).get("warm_start")
        if warm and not warm.get("cold_start"):
            print(f"warm start: from {warm['from']} ({sum(warm.get('rows', {}).values())} rows)")
        elif warm:
            print(f"cold start: {warm['cold_start']} ({warm['from']})")
        else:
            print("cold start")
    bad = malformed_summary(os.path.join(run_dir, "preprocess", "dataset")) if run_dir else None
    if bad and bad["rows"]:
        reasons = ", ".join(f"{k}: {v}" for k, v in bad["by_reason"].items())
        print(f"malformed rows set aside: {bad['rows']} ({reasons}); see {bad['dead_letter']}")
    report = os.path.join(run_dir, "evaluate", "report") if run_dir else ""
    if report and os.path.isfile(report):
        html = os.path.join(run_dir, "report.html")
        shutil.copyfile(report, html)
        print(f"report: {html}")
        decision = os.path.join(run_dir, "gate", "decision")
        if os.path.exists(decision):
            with open(decision) as f:
                print("gate:", "; ".join(line.replace("**", "").strip("#- \n") for line in f if line.strip()))
    marker = os.path.join(blessed_dir, "BLESSED.json")
    try:
        with open(marker) as f:
            source = json.load(f).get("source", "")
    except (OSError, ValueError):
        source = ""
    if run_dir and source.startswith(run_dir + os.sep):
        print(f"blessed model: {latest_blessed_model(blessed_dir)}")
    elif source:
        print(f"not blessed: the latest blessed model under {blessed_dir} stays")
    else:
        print(f"not blessed: nothing is blessed under {blessed_dir} yet")

    def fmt(v):
        return "undefined" if v is None else f"{v:.4f}"

    print(f"eval: AUC={fmt(metrics['auc'])} logloss={fmt(metrics['logloss'])} NE={fmt(metrics['ne'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
