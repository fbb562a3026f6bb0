"""Start the roles of a training job as local processes, watch them, and collect the Model artifact.

Roles: N embedding parameter servers (``persia_core.ps.server``, one per shard, gRPC on 127.0.0.1 with a fresh
shared token) and M NN workers (``persia_core.train.worker``, torch DDP over gloo). When every worker exits 0,
each server dumps its shard into the model folder and ``manifest.json`` is written last.

Failures fail fast: the launcher polls its children every 0.2 s; on the first one that dies (a crash, SIGKILL,
OOM) it kills all the others at once (a worker blocked in a gloo collective on a dead peer included) and raises
``TrainingFailed`` naming the process, how it ended, and its last log lines. A child alive but stopped (SIGSTOP:
state ``T`` in ``/proc``) for ``STOPPED_FAIL_S`` seconds fails the job the same way: its peers would otherwise
wait on it for the gloo timeout (30 min) or the RPC retries. Children run in their own sessions
and also die with the launcher (``PR_SET_PDEATHSIG``), so no process is left behind.

Checkpoints and resume (``persia_core.train.checkpoint``): with checkpoint settings, the workers write
checkpoints under ``<model_dir>/checkpoints`` (or the given folder). ``train`` started again on the same output
(a KFP retry) finds the newest complete checkpoint there and continues from it in new processes; a checkpoint
whose files are partial or corrupt is refused, with the reason logged, and the previous one is used. A checkpoint
of another shard count is re-sharded first.

Model folder::

    manifest.json          format, config, tables, shard files, dense file, slots, dense feature stats, summary,
                           lineage, the checkpoint the run resumed from
    dense.pt               dense model state_dict (load with torch.load(..., weights_only=True))
    shards/shard-SSSSS.npz one per parameter-server shard (``persia_core.embedding.sharded``; no pickles)
    train_metrics.json     loss curve, samples/s, observed staleness
    checkpoints/           the newest checkpoints (when enabled)
    deltas/                incremental exports (when enabled; ``persia_core.embedding.delta``)
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass

from persia_core import io
from persia_core.config import RunConfig
from persia_core.logging_utils import PROGRESS_PATTERN
from persia_core.memory import capacity_for_budget
from persia_core.model_store import shard_file_name
from persia_core.ps.protocol import EXIT_BAD_INIT
from persia_core.ps.storage_roots import resolve_storage_roots
from persia_core.train.model_output import finish_model

_PR_SET_PDEATHSIG = 1
log = logging.getLogger("persia.launcher")


class TrainingFailed(RuntimeError):
    """A training process failed; the message names it and ends with its last log lines."""


class InitRefused(TrainingFailed):
    """A parameter server refused the state it was to start from (partial or corrupt shard file)."""


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def max_local_processes() -> int:
    """The most parameter servers + NN workers one local job starts: 16 per CPU this process may run on, at least
    64 (a guard against a typo such as ``num_shards=100000`` starting one process per shard on a laptop)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(64, 16 * cpus)


def check_local_process_count(num_shards: int, num_workers: int) -> None:
    """Raise ``ValueError`` naming both settings when a local job would start more than ``max_local_processes``."""
    limit = max_local_processes()
    if num_shards + num_workers > limit:
        raise ValueError(
            f"embedding.num_shards={num_shards} and trainer.num_workers={num_workers} make "
            f"{num_shards + num_workers} local processes, more than the {limit} this machine allows; "
            f"a job that large runs on a cluster (python -m pipelines.submit)"
        )


class ProgressRelay:
    """Repeats NN worker 0's progress lines (``step N/M loss ... samples/s ... staleness ...``) from its log file
    in the launcher's own log, at most one every ``interval_s`` seconds (and the last step's always), so that
    ``persia train`` and a pipeline's train task show progress instead of silence until the end."""

    PATTERN = re.compile(r"\b" + PROGRESS_PATTERN)

    def __init__(self, log_path: str, name: str = "nn_worker-0", interval_s: float = 10.0):
        self.log_path, self.name, self.interval_s = log_path, name, interval_s
        self.offset = 0
        self.last = -float("inf")
        self.partial = b""

    def poll(self) -> None:
        """Read what the log gained since the last call; log its newest progress line when one is due."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self.offset)
                chunk = f.read()
        except OSError:
            return
        self.offset += len(chunk)
        lines = (self.partial + chunk).split(b"\n")
        self.partial = lines.pop()  # an incomplete last line waits for its end
        newest = None
        for raw in lines:
            m = self.PATTERN.search(raw.decode("utf-8", "replace"))
            if m:
                newest = m
        if newest is None:
            return
        final = newest.group(1) == newest.group(2)
        now = time.monotonic()
        if final or now - self.last >= self.interval_s:
            self.last = now
            log.info("%s: %s", self.name, newest.group(0))


STOPPED_FAIL_S = 20.0
"""Seconds a child may stay stopped (``/proc/<pid>/stat`` state ``T``; not ``t``, a debugger's stop) before the
job fails."""


def proc_stat(pid: int) -> tuple[str, int] | None:
    """``(state, parent pid)`` of process ``pid`` from ``/proc/<pid>/stat`` (state: ``R``, ``S``, ``D``, ``T``,
    ``t``, ``Z``...), or None where it cannot be read (no ``/proc``, the process gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        fields = stat[stat.rindex(b")") + 2 :].split()  # the command name, in parentheses, may hold ' ' or ')'
        return fields[0].decode("ascii", "replace"), int(fields[1])
    except (OSError, ValueError, IndexError):
        return None


def process_state(pid: int) -> str:
    """The one-letter state of process ``pid`` (``proc_stat``), or ``""`` where it cannot be read."""
    st = proc_stat(pid)
    return st[0] if st else ""


def descendants(pid: int) -> list[int]:
    """The pids of every live process below ``pid`` (children, their children...), from ``/proc``; [] without it."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        st = proc_stat(int(entry)) if entry.isdigit() else None
        if st is not None and st[0] != "Z":
            children.setdefault(st[1], []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


@dataclass
class _Proc:
    name: str
    popen: subprocess.Popen
    log_path: str
    stopped_since: float | None = None

    def tail(self, n: int = 20) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(deque(f, maxlen=n))
        except OSError:
            return "(no log)"

    def how(self) -> str:
        rc = self.popen.returncode
        if rc is not None and rc < 0:
            try:
                return f"was killed by {signal.Signals(-rc).name}"
            except ValueError:
                return f"was killed by signal {-rc}"
        return f"exited with code {rc}"


def _failed(p: _Proc, what: str) -> TrainingFailed:
    """``TrainingFailed`` naming ``p``, what happened to it, and its last log lines."""
    return TrainingFailed(
        f"{p.name} (pid {p.popen.pid}) {what}; last log lines of {p.name} (all logs kept in "
        f"{os.path.dirname(p.log_path)}):\n{p.tail()}"
    )


class LocalCluster:
    """Parameter servers and NN workers as child processes of this one. Use as a context manager: leaving it
    stops every child (at once with SIGKILL when an exception is leaving it).

    Args:
        config_path: run config YAML every process loads. num_shards, num_workers: N and M.
        work_dir: logs and port files. plan_path / init_dir: shard plan and initial shard files (optional).
        delta_dir, delta_every_s: incremental export of every server (off when empty / 0).
        storage_roots: the folders (or URL prefixes) under which the servers' ``Dump`` and ``Load`` calls may
            write and read (``persia_core.ps.storage_roots.check_storage_path``); None: any path.
    """

    def __init__(
        self,
        config_path: str,
        num_shards: int,
        num_workers: int,
        work_dir: str,
        plan_path: str = "",
        init_dir: str = "",
        delta_dir: str = "",
        delta_every_s: float = 0.0,
        storage_roots: list[str] | None = None,
    ):
        check_local_process_count(num_shards, num_workers)
        self.config_path = config_path
        self.num_shards = num_shards
        self.num_workers = num_workers
        self.work_dir = work_dir
        self.plan_path = plan_path
        self.init_dir = init_dir
        self.delta_dir = delta_dir
        self.delta_every_s = delta_every_s
        self.storage_roots = resolve_storage_roots(storage_roots)  # TypeError/ValueError for a bad root
        self.token = secrets.token_hex(16)
        self.servers: list[_Proc] = []
        self.workers: list[_Proc] = []
        from persia_core.ps.shm import remove_orphans

        remove_orphans()  # shared-memory files of an earlier job that was killed outright
        self.addresses: list[str] = []
        os.makedirs(os.path.join(work_dir, "logs"), exist_ok=True)

    def _env(self, **extra) -> dict:
        env = dict(os.environ)
        env["PERSIA_PS_TOKEN"] = self.token
        env.setdefault("OMP_NUM_THREADS", "1")
        # idle OpenMP threads sleep instead of spinning, so an NN worker's intra-op threads do not starve the
        # parameter servers and preparation threads sharing the cores
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        env["PYTHONUNBUFFERED"] = "1"
        env.update({k: str(v) for k, v in extra.items()})
        return env

    def _spawn(self, name: str, args: list[str], env: dict) -> _Proc:
        log_path = os.path.join(self.work_dir, "logs", f"{name}.log")
        f = open(log_path, "w")
        popen = subprocess.Popen(
            [sys.executable, *args],
            stdout=f,
            stderr=subprocess.STDOUT,
            env=env,
            preexec_fn=_die_with_parent,
            start_new_session=True,
        )
        f.close()
        return _Proc(name, popen, log_path)

    def start_servers(self, timeout_s: float = 120.0, inits: list[dict | None] | None = None) -> list[str]:
        """Start the N servers and wait until each reports its port. Returns their addresses.

        ``inits[s]``: the state shard s starts from, ``{"path", "bytes"?, "crc32c"?}`` (checked by the server);
        default: ``<init_dir>/shards/shard-SSSSS.npz`` where it exists. Raises ``InitRefused`` when a server
        refuses its state, ``TrainingFailed`` when one dies or does not start in time."""
        port_files = []
        for s in range(self.num_shards):
            pf = os.path.join(self.work_dir, f"ps-{s}.port")
            if os.path.exists(pf):
                os.remove(pf)
            port_files.append(pf)
            args = [
                "-m",
                "persia_core.ps.server",
                "--config",
                self.config_path,
                "--shard",
                str(s),
                "--num-shards",
                str(self.num_shards),
                "--port-file",
                pf,
            ]
            if self.plan_path:
                args += ["--plan", self.plan_path]
            init = inits[s] if inits is not None else None
            if init is None and inits is None and self.init_dir:
                path = io.join(self.init_dir, shard_file_name(s))
                init = {"path": path} if io.exists(path) else None
            if init is not None:
                args += ["--init", init["path"]]
                if init.get("bytes") is not None:
                    args += ["--init-size", str(init["bytes"])]
                if init.get("crc32c") is not None:
                    args += ["--init-crc32c", str(init["crc32c"])]
            if self.delta_dir and self.delta_every_s > 0:
                args += ["--delta-dir", self.delta_dir, "--delta-every-s", str(self.delta_every_s)]
            for root in self.storage_roots:
                args += ["--storage-root", root]
            self.servers.append(self._spawn(f"ps-{s}", args, self._env()))
        deadline = time.monotonic() + timeout_s
        for proc, pf in zip(self.servers, port_files, strict=True):
            while not os.path.exists(pf):
                for p in self.servers:
                    if p.popen.poll() == EXIT_BAD_INIT:
                        raise InitRefused(
                            f"{p.name} refused the state it was to start from; last log lines:\n{p.tail()}"
                        )
                self._check_alive(self.servers)
                if time.monotonic() > deadline:
                    raise TrainingFailed(
                        f"{proc.name} did not start serving within {timeout_s:.0f} s; last log lines:\n{proc.tail()}"
                    )
                time.sleep(0.05)
            with open(pf) as f:
                self.addresses.append(f"127.0.0.1:{int(f.read())}")
        return self.addresses

    def start_workers(self, data_dir: str, out_dir: str, extra_args: list[str] | None = None) -> None:
        """Start the NN workers (DDP ranks 0..M-1). On one machine their rendezvous is a file in the work dir
        (``PERSIA_DIST_FILE_STORE``) rather than torch's TCP store, which listens on every interface; gloo's and
        NCCL's own sockets are bound to the loopback interface (``GLOO_SOCKET_IFNAME``, ``NCCL_SOCKET_IFNAME``
        = ``lo``) unless the caller set them.
        So a local job listens on 127.0.0.1 only."""
        store = os.path.join(self.work_dir, f"dist-store-{secrets.token_hex(8)}")
        extra = {"MASTER_ADDR": "127.0.0.1", "PERSIA_DIST_FILE_STORE": store}
        if os.path.exists("/sys/class/net/lo"):
            for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):  # gloo's pairs, NCCL's bootstrap sockets
                if var not in os.environ:
                    extra[var] = "lo"
        for r in range(self.num_workers):
            env = self._env(
                RANK=r, WORLD_SIZE=self.num_workers, LOCAL_RANK=r, PERSIA_PS_ADDRESSES=",".join(self.addresses), **extra
            )
            args = [
                "-m",
                "persia_core.train.worker",
                "--config",
                self.config_path,
                "--data",
                data_dir,
                "--out",
                out_dir,
                *(extra_args or []),
            ]
            self.workers.append(self._spawn(f"nn_worker-{r}", args, env))

    def _check_alive(self, procs: list[_Proc], allow_clean_exit: bool = False) -> None:
        dead = [p for p in procs if p.popen.poll() is not None and (p.popen.returncode != 0 or not allow_clean_exit)]
        if dead:
            others = "".join(f"; {p.name} (pid {p.popen.pid}) {p.how()}" for p in dead[1:])
            raise _failed(dead[0], dead[0].how() + others)
        now = time.monotonic()
        for p in procs:
            if p.popen.returncode is not None or process_state(p.popen.pid) != "T":  # not "t": a debugger's stop
                p.stopped_since = None
                continue
            if p.stopped_since is None:
                p.stopped_since = now
            elif now - p.stopped_since >= STOPPED_FAIL_S:
                raise _failed(
                    p,
                    f"has been stopped (SIGSTOP) for {now - p.stopped_since:.0f} s, and the job "
                    f"cannot go on without it",
                )

    def check(self) -> None:
        """Raise ``TrainingFailed`` if a server died, or a worker exited with an error."""
        self._check_alive(self.servers)
        self._check_alive(self.workers, allow_clean_exit=True)

    def wait_workers(self, timeout_s: float | None = None) -> None:
        """Block until all workers exit 0. Any failure (a worker or a server dying) raises ``TrainingFailed``
        within about a second."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        relay = ProgressRelay(self.workers[0].log_path) if self.workers else None
        while True:
            self.check()
            if relay is not None:
                relay.poll()
            if all(p.popen.poll() == 0 for p in self.workers):
                if relay is not None:
                    relay.poll()
                return
            if deadline is not None and time.monotonic() > deadline:
                raise TrainingFailed(f"training did not finish within {timeout_s:.0f} s")
            time.sleep(0.2)

    def run_watched(self, fn, *args):
        """Run ``fn(*args)`` on a thread while watching the servers; a server dying fails it within a second."""
        box: dict = {}

        def target():
            try:
                box["out"] = fn(*args)
            except BaseException as e:  # handed to the caller
                box["err"] = e

        th = threading.Thread(target=target, daemon=True)
        th.start()
        while th.is_alive():
            self._check_alive(self.servers)
            th.join(0.2)
        if "err" in box:
            raise box["err"]
        return box.get("out")

    def stop(self, force: bool = False) -> None:
        """Stop every child and reap it: SIGKILL at once with ``force``, else SIGTERM and SIGKILL after 5 s.
        Each child's whole process group is signalled (it runs in its own session), so nothing it started
        survives either; a group is only signalled before its leader is reaped (its id cannot be reused yet)."""
        procs = self.workers + self.servers
        sig = signal.SIGKILL if force else signal.SIGTERM
        for p in procs:
            if p.popen.returncode is None:
                _signal_group(p.popen, sig)
        deadline = time.monotonic() + (0 if force else 5)
        for p in procs:
            try:
                p.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(p.popen, signal.SIGKILL)
                p.popen.wait()
        from persia_core.ps.shm import remove_segments_of

        remove_segments_of([p.popen.pid for p in self.workers])  # left by a worker killed before its close

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self.stop(force=exc_type is not None)


def _signal_group(popen: subprocess.Popen, sig: int) -> None:
    """Signal the process group a child leads (not yet reaped, so the id is still its own)."""
    try:
        os.killpg(popen.pid, sig)
    except (ProcessLookupError, PermissionError):
        try:
            popen.send_signal(sig)
        except ProcessLookupError:
            pass


def _capacities(config: RunConfig, plan_path: str) -> dict[str, int]:
    if plan_path and io.exists(plan_path):
        plan = json.loads(io.read_text(plan_path))
        return {n: int(t["capacity_rows_per_shard"]) for n, t in plan["tables"].items()}
    emb = config.embedding
    return {
        t.name: capacity_for_budget(emb.shard_memory_bytes // len(emb.tables), t.optimizer.name, t.dim)
        for t in emb.tables
    }


def _checkpoint_inits(
    ckpt_path: str, manifest: dict, n: int, config: RunConfig, plan_path: str, work_dir: str
) -> list[dict]:
    """The state each of the ``n`` servers starts from: the checkpoint's shard files (checked by the servers as
    they load them), or, for a checkpoint of another shard count, its rows re-sharded into ``work_dir``."""
    from persia_core.embedding.reshard import reshard
    from persia_core.embedding.shard_file import read_shard_file, write_shard_arrays
    from persia_core.train.checkpoint import CheckpointError

    shards = sorted((e for e in manifest["files"] if e.get("role") == "shard"), key=lambda e: e["shard"])
    if len(shards) == n:
        return [{"path": io.join(ckpt_path, e["path"]), "bytes": e["bytes"], "crc32c": e["crc32c"]} for e in shards]
    log.info("re-sharding %s from %d to %d shards", ckpt_path, len(shards), n)
    try:
        sources = [
            read_shard_file(io.join(ckpt_path, e["path"]), e["bytes"], e["crc32c"], build_index=False).tables
            for e in shards
        ]
    except ValueError as e:
        raise CheckpointError(str(e)) from e
    out, report = reshard(sources, n, _capacities(config, plan_path))
    inits = []
    for s, tables in enumerate(out):
        path = os.path.join(work_dir, "resharded", shard_file_name(s))
        nbytes, crc = write_shard_arrays(path, tables, fsync=False)
        inits.append({"path": path, "bytes": nbytes, "crc32c": crc})
    log.info("re-sharded rows per table: %s (dropped beyond capacity: %s)", report["rows"], report["dropped"])
    return inits


def checkpoint_settings(config: RunConfig, model_dir: str, settings=None):
    """The checkpoint settings of a run: ``settings`` if given, else the ``trainer.checkpoint_*`` config
    fields; an empty folder means ``<model_dir>/checkpoints``."""
    from persia_core.train.checkpoint import CheckpointSettings

    if settings is None:
        tc = config.trainer
        settings = CheckpointSettings(
            dir=tc.checkpoint_dir,
            every_steps=tc.checkpoint_every_steps,
            every_s=tc.checkpoint_every_s,
            keep=tc.checkpoint_keep,
            at_end=tc.checkpoint_at_end,
        )
    if not settings.dir:
        settings = type(settings)(**{**settings.__dict__, "dir": io.join(model_dir, "checkpoints")})
    return settings


def check_config_matches_data(config: RunConfig, schema: dict, data_dir: str) -> None:
    """Raise ``ValueError`` naming the slots of ``config`` that the preprocessed data in ``data_dir`` (its
    ``schema``) does not hold, or when its train split has no row, before any process starts."""
    rows = schema.get("rows", {})
    if rows.get("train") == 0:
        raise ValueError(
            f"{io.join(data_dir, 'schema.json')}: the train split holds no row ({rows.get('read', '?')} "
            f"read, {rows.get('malformed', '?')} malformed, {rows.get('eval', '?')} in the eval split); "
            f"nothing to train on"
        )
    missing = [s.name for s in config.slots if s.name not in schema.get("slots", [])]
    if missing:
        raise ValueError(
            f"{io.join(data_dir, 'schema.json')}: the data has no slot(s) {missing} of the run "
            f"config; it holds {schema.get('slots', [])} (was it preprocessed with another config?)"
        )


def check_plan_matches_config(plan: dict, config: RunConfig, init_dir: str) -> None:
    """Raise ``ValueError`` when the shard plan of ``init_dir`` was made for another shard count or other
    embedding tables than ``config`` has: its shard files route feature IDs by ``hash % num_shards`` and hold
    rows of the planned dims, so serving them under another layout would misplace or lose rows."""
    where = io.join(init_dir, "shard_plan.json")
    n = config.embedding.num_shards
    if int(plan.get("num_shards", n)) != n:
        raise ValueError(
            f"{where}: the initial shards were planned for {plan['num_shards']} shards, but "
            f"embedding.num_shards is {n}; run init-shards again with embedding.num_shards={n} "
            f"(it re-shards a warm start), or train with embedding.num_shards={plan['num_shards']}"
        )
    planned = plan.get("tables", {})
    for t in config.embedding.tables:
        p = planned.get(t.name)
        if p is None:
            raise ValueError(
                f"{where}: no embedding table {t.name!r} in the plan (it has {sorted(planned)}); "
                f"run init-shards again with this config"
            )
        for field, have in (("dim", t.dim), ("optimizer", t.optimizer.name)):
            if p.get(field, have) != have:
                raise ValueError(
                    f"{where}: table {t.name!r} was planned with {field} {p[field]!r}, but the config "
                    f"has {have!r}; run init-shards again with this config"
                )


class Terminated(KeyboardInterrupt):
    """SIGTERM, the way Kubernetes, KFP and Vertex AI cancel a task, raised where Ctrl-C's KeyboardInterrupt is,
    so that the same cleanup runs (children stopped and reaped, shared-memory segments removed)."""


@contextlib.contextmanager
def sigterm_as_interrupt():
    """Within the block, SIGTERM raises ``Terminated`` in the main thread instead of ending the process at once
    (Python's default), leaving no children and no ``/dev/shm`` segments behind. No effect off the main thread."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def raise_terminated(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut the cleanup short
        raise Terminated()

    previous = signal.signal(signal.SIGTERM, raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def train(
    config: RunConfig,
    data_dir: str,
    model_dir: str,
    init_dir: str = "",
    work_dir: str = "",
    checkpoint=None,
    resume_from: str = "auto",
    delta_every_s: float = 0.0,
    delta_dir: str = "",
) -> dict:
    """Run hybrid training with ``embedding.num_shards`` parameter servers and ``trainer.num_workers`` NN
    workers on this machine; write the Model artifact to ``model_dir`` (see module docstring).

    Args:
        init_dir: the ``init_shards`` output (shard plan, initial shard states, warm-start dense weights).
        checkpoint: ``CheckpointSettings`` (default: from the config, see ``checkpoint_settings``).
        resume_from: ``"auto"``: continue from the newest complete checkpoint in the checkpoint folder, if any;
            a checkpoint folder: continue from exactly that one; ``""``: start afresh.
        delta_every_s, delta_dir: incremental export every T seconds (0: ``trainer.delta_every_s`` where the
            config has it, else off) to ``delta_dir`` (default ``<model_dir>/deltas``).

    Returns the manifest. Raises ``TrainingFailed`` when a process fails, ``CheckpointError`` when the checkpoint
    named by ``resume_from`` is refused or belongs to another run, ``FileNotFoundError`` for missing inputs
    (``data_dir``'s schema, ``init_dir``, ``resume_from``), ``ValueError`` when the config does not match the data
    or the shard plan of ``init_dir`` (checked before anything is written or started), ``Terminated`` (a
    ``KeyboardInterrupt``) on SIGTERM, after stopping every process it started."""
    with sigterm_as_interrupt():
        return _train(
            config, data_dir, model_dir, init_dir, work_dir, checkpoint, resume_from, delta_every_s, delta_dir
        )


def _train(
    config: RunConfig,
    data_dir: str,
    model_dir: str,
    init_dir: str,
    work_dir: str,
    checkpoint,
    resume_from: str,
    delta_every_s: float,
    delta_dir: str,
) -> dict:
    from persia_core.data.reader import read_schema
    from persia_core.ps.client import EmbeddingClient
    from persia_core.train import checkpoint as ckpt

    check_local_process_count(config.embedding.num_shards, config.trainer.num_workers)
    schema = read_schema(data_dir)
    check_config_matches_data(config, schema, data_dir)
    settings = checkpoint_settings(config, model_dir, checkpoint)
    if resume_from not in ("", "auto") and not io.exists(resume_from):
        raise FileNotFoundError(f"resume_from {resume_from}: no such checkpoint folder")
    if resume_from == "" and (settings.periodic or settings.at_end):
        earlier = [p for _, p in ckpt.list_checkpoints(settings.dir) if io.exists(io.join(p, ckpt.MANIFEST))]
        if earlier:  # they would prune this run's checkpoints (higher steps), and a retry would resume them
            raise ValueError(
                f"resume_from '': {settings.dir} holds checkpoints of an earlier run "
                f"({', '.join(os.path.basename(p) for p in earlier[:3])}"
                f"{' ...' if len(earlier) > 3 else ''}); to start afresh, remove them or write to a new "
                f"output (or checkpoint) folder"
            )
    plan_path = io.join(init_dir, "shard_plan.json") if init_dir else ""
    plan = {}
    if init_dir:
        if not io.exists(plan_path):
            raise FileNotFoundError(
                f"init_dir {init_dir}: "
                + ("not an init_shards output (no shard_plan.json)" if io.exists(init_dir) else "no such folder")
            )
        plan = json.loads(io.read_text(plan_path))
        # a checkpoint to resume from brings its own shards (re-sharded to any count); the init shards do not
        resuming = resume_from not in ("", "auto") or (resume_from == "auto" and ckpt.list_checkpoints(settings.dir))
        if not resuming:
            check_plan_matches_config(plan, config, init_dir)
    io.makedirs(model_dir)
    own_work_dir = not work_dir
    work_dir = work_dir or tempfile.mkdtemp(prefix="persia-train-")
    os.makedirs(work_dir, exist_ok=True)
    cfg_path = os.path.join(work_dir, "run_config.yaml")
    with open(cfg_path, "w") as f:
        f.write(config.to_yaml())
    n, m = config.embedding.num_shards, config.trainer.num_workers
    info = ckpt.lineage(config, data_dir)
    lineage_path = os.path.join(work_dir, "lineage.json")
    with open(lineage_path, "w") as f:
        json.dump(info, f)
    delta_every_s = delta_every_s or config.trainer.delta_every_s
    delta_dir = delta_dir or (io.join(model_dir, "deltas") if delta_every_s > 0 else "")
    t0 = time.time()
    refused: set[str] = set()
    reasons: list[str] = []
    while True:
        chosen = None
        if resume_from == "auto":
            chosen = ckpt.find_latest(settings.dir, skip=refused, refusals=reasons)
        elif resume_from:
            chosen = (resume_from, ckpt.verify(resume_from, deep=True, deep_roles=("dense", "worker")))
        inits = None
        worker_args = ["--lineage", lineage_path]
        if settings.periodic or settings.at_end:
            worker_args += [
                "--checkpoint-dir",
                settings.dir,
                "--checkpoint-every-steps",
                str(settings.every_steps),
                "--checkpoint-every-s",
                str(settings.every_s),
                "--checkpoint-keep",
                str(settings.keep),
            ]
            if not settings.at_end:
                worker_args.append("--no-checkpoint-at-end")
        if chosen is not None:
            ckpt.check_lineage(chosen[1], info, chosen[0])
            try:
                inits = _checkpoint_inits(chosen[0], chosen[1], n, config, plan_path, work_dir)
            except ckpt.CheckpointError as e:  # a shard file refused while re-sharding it
                if resume_from != "auto":
                    raise
                log.warning("checkpoint %s refused while re-sharding it, trying the previous one: %s", chosen[0], e)
                reasons.append(str(e))
                refused.add(chosen[0])
                continue
            worker_args += ["--resume", chosen[0]]
            log.info("resuming from %s (step %d)", chosen[0], chosen[1]["step"])
        elif plan.get("warm_start", {}).get("dense_file"):
            worker_args += ["--init-dense", io.join(init_dir, plan["warm_start"]["dense_file"])]
        try:
            # the servers write their shards only into this run's model and checkpoint folders
            with LocalCluster(
                cfg_path,
                n,
                m,
                work_dir,
                plan_path,
                init_dir,
                delta_dir,
                delta_every_s,
                storage_roots=[r for r in (model_dir, settings.dir) if r],
            ) as cluster:
                addresses = cluster.start_servers(inits=inits)
                cluster.start_workers(data_dir, model_dir, worker_args)
                cluster.wait_workers()
                client = EmbeddingClient(addresses, config.embedding, token=cluster.token)
                try:
                    dumped = cluster.run_watched(
                        client.dump, [io.join(model_dir, shard_file_name(s)) for s in range(n)]
                    )
                    stats = cluster.run_watched(client.stats)
                finally:
                    client.close()
            break
        except InitRefused as e:
            if chosen is None or resume_from != "auto":
                raise ckpt.CheckpointError(f"{chosen[0] if chosen else init_dir}: {e}") from e
            log.warning("checkpoint %s refused by a parameter server, trying the previous one: %s", chosen[0], e)
            reasons.append(str(e))
            refused.add(chosen[0])
    logs = os.path.join(work_dir, "logs")
    for name in sorted(os.listdir(logs)) if os.path.isdir(logs) else []:
        with open(os.path.join(logs, name), "rb") as f:
            io.write_bytes(io.join(model_dir, "logs", name), f.read())
    last = ckpt.list_checkpoints(settings.dir)
    manifest = finish_model(
        model_dir,
        config,
        schema,
        dumped,
        stats,
        wall_seconds=time.time() - t0,
        lineage=info,
        resumed_from=chosen[0] if chosen is not None else None,
        checkpoints_refused=reasons,
        last_checkpoint=last[0][1] if last else None,
        warm_start=plan.get("warm_start"),
    )
    if own_work_dir:  # kept when training fails, for its logs
        shutil.rmtree(work_dir, ignore_errors=True)
    return manifest
