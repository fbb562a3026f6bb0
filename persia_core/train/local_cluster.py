"""Parameter servers and NN workers of one training job as local child processes, and their supervision.

Roles: N embedding parameter servers (``persia_core.ps.server``, one per shard, gRPC on 127.0.0.1 with a fresh
shared token) and M NN workers (``persia_core.train.worker``, torch DDP over gloo).

Failures fail fast: the launcher polls its children every 0.2 s; on the first one that dies (a crash, SIGKILL,
OOM) it kills all the others at once (a worker blocked in a gloo collective on a dead peer included) and raises
``TrainingFailed`` naming the process, how it ended, and its last log lines. A child alive but stopped (SIGSTOP:
state ``T`` in ``/proc``) or frozen by the cgroup freezer (``processes.halted``) for ``STOPPED_FAIL_S`` seconds
fails the job the same way: its peers would otherwise wait on it for the gloo timeout (30 min) or the RPC retries.
An NN worker applies the same rule to its embedding workers (``feeders``). A child asleep or busy, however long (a
multi-GB dump), is neither. A frozen child's cgroup is thawed when it holds only this job's processes, so that the
kill ends it (the v1 freezer holds even a killed process); one frozen by someone else is named and not waited for.
Children run in their own sessions and also die with the launcher (``PR_SET_PDEATHSIG``), so no process is left
behind.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from persia_core import io
from persia_core.host import usable_cpus
from persia_core.logging_utils import MILESTONE_PATTERN, PROGRESS_PATTERN
from persia_core.model_store import shard_file_name
from persia_core.ps.protocol import EXIT_BAD_INIT, TOKEN_ENV
from persia_core.ps.shm import remove_orphans, remove_segments_of
from persia_core.ps.storage_roots import resolve_storage_roots
from persia_core.train import processes
from persia_core.train.feeders import remove_examples_of
from persia_core.train.processes import HaltWatch, descendants, reap_killed, signal_group, spawn

log = logging.getLogger("persia.launcher")


class TrainingFailed(RuntimeError):
    """A training process failed; the message names it and ends with its last log lines."""


class InitRefused(TrainingFailed):
    """A parameter server refused the state it was to start from (partial or corrupt shard file)."""


def max_local_processes() -> int:
    """The most parameter servers + NN workers one local job starts: 16 per CPU this process may run on, at least
    64 (a guard against a typo such as ``num_shards=100000`` starting one process per shard on a laptop)."""
    return max(64, 16 * usable_cpus())


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
    ``persia train`` and a pipeline's train task show progress instead of silence until the end; and its
    milestone lines (``MILESTONE_PATTERN``: an epoch's validation logloss, a refit's start) each as it comes."""

    PATTERN = re.compile(r"\b" + PROGRESS_PATTERN)
    MILESTONE = re.compile(r"\b" + MILESTONE_PATTERN)

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
            text = raw.decode("utf-8", "replace")
            m = self.PATTERN.search(text)
            if m:
                newest = m
                continue
            milestone = self.MILESTONE.search(text)
            if milestone:
                log.info("%s: %s", self.name, milestone.group(0))
        if newest is None:
            return
        final = newest.group(1) == newest.group(2)
        now = time.monotonic()
        if final or now - self.last >= self.interval_s:
            self.last = now
            log.info("%s: %s", self.name, newest.group(0))


STOPPED_FAIL_S = processes.STOPPED_FAIL_S
"""Seconds a child may stay stopped (SIGSTOP) or frozen (its cgroup's freezer) before the job fails
(``processes.halted``); the NN workers apply the same limit to their embedding workers."""


@dataclass
class _Proc:
    name: str
    popen: subprocess.Popen
    log_path: str

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


_ERROR_LINE = re.compile(r"^(?:[\w.]+(?:Error|Exception|Failed|Refused|Exit)\b.*| ?\S.* ERROR .*)$")
"""A Python exception's last line of a traceback (``OSError: [Errno 28] ...``) or a log line at ERROR."""


def _failed(p: _Proc, what: str) -> TrainingFailed:
    """``TrainingFailed`` naming ``p``, what happened to it and its last error line (the exception that ended
    it, naming the path where the failure was writing one) on the first line, then its last log lines."""
    tail = p.tail()
    errors = [line.strip() for line in tail.splitlines() if _ERROR_LINE.match(line)]
    because = f": {errors[-1]}" if errors else ""
    return TrainingFailed(
        f"{p.name} (pid {p.popen.pid}) {what}{because}; last log lines of {p.name} (all logs kept in "
        f"{os.path.dirname(p.log_path)}):\n{tail}"
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
        # the job's token: ``$PERSIA_PS_TOKEN`` where set (so processes started beside the job, such as embedding
        # workers listening for its NN workers, share it), else a fresh random one
        self.token = os.environ.get(TOKEN_ENV) or secrets.token_hex(16)
        self.servers: list[_Proc] = []
        self._halts = HaltWatch()
        self.workers: list[_Proc] = []
        remove_orphans()  # shared-memory files of an earlier job that was killed outright
        self.addresses: list[str] = []
        os.makedirs(os.path.join(work_dir, "logs"), exist_ok=True)

    def _env(self, **extra) -> dict:
        env = dict(os.environ)
        env[TOKEN_ENV] = self.token
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
        popen = spawn([sys.executable, *args], env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        f.close()
        return _Proc(name, popen, log_path)

    def start_servers(self, timeout_s: float = 120.0, inits: Sequence[dict | None] | None = None) -> list[str]:
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
                RANK=r,
                WORLD_SIZE=self.num_workers,
                LOCAL_RANK=r,
                LOCAL_WORLD_SIZE=self.num_workers,
                PERSIA_PS_ADDRESSES=",".join(self.addresses),
                **extra,
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
        for p in procs:
            halted = self._halts.check(p.popen.pid, STOPPED_FAIL_S) if p.popen.returncode is None else None
            if halted is not None:
                raise _failed(p, f"{halted}, and the job cannot go on without it")

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
        # every process of the job, the NN workers' embedding workers included, before any is killed: those killed
        # before their close leave shared-memory files named after their pids (``shm.segment_name``)
        everyone = {q for p in procs if p.popen.returncode is None for q in (p.popen.pid, *descendants(p.popen.pid))}
        sig = signal.SIGKILL if force else signal.SIGTERM
        for p in procs:
            if p.popen.returncode is None:
                signal_group(p.popen, sig)
        deadline = time.monotonic() + (0 if force else 5)
        for p in procs:
            try:
                p.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                signal_group(p.popen, signal.SIGKILL)
                reap_killed(p.popen, p.name)
        remove_segments_of(everyone | {p.popen.pid for p in self.workers})  # left by processes killed before close
        remove_examples_of([p.popen.pid for p in self.workers])

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self.stop(force=exc_type is not None)
