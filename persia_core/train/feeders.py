"""An NN worker's side of its embedding workers: it creates their ready ring, starts them (processes against the
parameter servers, or threads against an in-process table), takes ready batches in step order, hands gradients
back, and fails fast, naming the embedding worker, when one reports an error or dies.

Supervision: an embedding-worker process dies with its NN worker (``PR_SET_PDEATHSIG``, set by the child itself:
a ``preexec_fn`` would run Python in a fork of a process with gRPC threads, which gRPC's fork handlers abort); its
death closes its
control socket, which the NN worker sees at once (``EmbeddingWorkerFailed``, with its exit status); ``close``
stops, reaps and, where one was killed, removes its ``/dev/shm`` segments; the ring's file carries the NN worker's
pid, so the local launcher removes it when the NN worker itself is killed.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque

import numpy as np

from persia_core.data.reader import ParquetExamples
from persia_core.embedding.backend import EmbeddingBackend
from persia_core.embedding.layout import TableLayout
from persia_core.host import usable_cpus
from persia_core.ps import shm
from persia_core.ps.protocol import TOKEN_ENV
from persia_core.train import processes
from persia_core.train import ready_ring as rr
from persia_core.train.embedding_worker import BatchSource, EmbeddingWorker, StepRules, first_own_step
from persia_core.train.ready_stream import StreamBridge

log = logging.getLogger("persia.feeders")
STARTED_TIMEOUT_S = 300.0
HALT_CHECK_S = 0.5
"""Seconds between an NN worker's checks of its embedding-worker processes for a stop or a freeze."""


class EmbeddingWorkerFailed(RuntimeError):
    """An embedding worker reported an error, or died."""


def examples_prefix(pid: int) -> str:
    """The name prefix of the temporary folder where NN worker ``pid`` saves its examples for its embedding workers."""
    return f"persia_examples_{pid}_"


def remove_examples_of(pids) -> int:
    """Remove the example folders NN workers ``pids`` left in the temporary folder (killed before their close).
    Returns how many were removed."""
    removed = 0
    for pid in pids:
        for path in glob.glob(os.path.join(tempfile.gettempdir(), examples_prefix(pid) + "*")):
            shutil.rmtree(path, ignore_errors=True)
            removed += 1
    return removed


def auto_embedding_workers(nn_workers_on_host: int) -> int:
    """``trainer.embedding_workers: 0`` -> embedding workers per NN worker: the host's cores (this process's CPU
    affinity) less one per NN worker, shared among the NN workers of the host; at least 1, at most 8."""
    cores = usable_cpus()
    n = max(1, nn_workers_on_host)
    return max(1, min(8, (cores - n) // n))


class Feeders:
    """E embedding workers of one NN worker and their ready ring. Subclasses start them (``_start``)."""

    def __init__(self, layout: rr.RingLayout, start: int, rank: int, shared: bool):
        self.layout = layout
        self.E = layout.workers
        self.rank = rank
        self.segment = rr.Segment(layout, shared=shared)
        frontier = layout.frontier(self.segment.buf)
        for e in range(self.E):
            frontier[e] = first_own_step(start, e, self.E)
        self.frontier = frontier
        self.socks: list[socket.socket] = []
        self.peer_socks: list[socket.socket] = []
        for _ in range(self.E):
            a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            self.socks.append(a)
            self.peer_socks.append(b)
        self.stash: list[deque] = [deque() for _ in range(self.E)]
        self.closed = False

    # ---- what subclasses provide ------------------------------------------------------------------------
    def name(self, e: int) -> str:
        return f"embedding worker {self.rank}.{e}"

    def how(self, e: int) -> str:
        """Why embedding worker ``e`` is gone ("exited with code 1", "killed by SIGKILL"...), or ""."""
        return ""

    def check_halted(self) -> None:
        """Raise ``EmbeddingWorkerFailed`` naming an embedding worker stopped or frozen for
        ``processes.STOPPED_FAIL_S`` seconds (``processes.HaltWatch``): one that never runs again would otherwise
        be waited for for good. Called while the NN worker waits, at most every ``HALT_CHECK_S``."""

    # ---- the NN worker's calls --------------------------------------------------------------------------
    def views(self, e: int, slot: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(emb float32[B, S, D], dense float32[B, F], labels float32[B])`` of slot ``slot`` of worker ``e``."""
        return self.layout.slot(self.segment.buf, e, slot)

    def wide_view(self, e: int, slot: int) -> np.ndarray | None:
        """``float32[B, S, 1]``: the wide table's pooled weights of slot ``slot`` of worker ``e`` (then room for
        their gradient), or None without a wide table."""
        return self.layout.wide_view(self.segment.buf, e, slot)

    def ready(self, step: int) -> tuple[int, int, int]:
        """Block until step ``step`` is ready. Returns ``(slot, rows, staleness)``. Raises
        ``EmbeddingWorkerFailed`` naming the embedding worker when it reported an error or died."""
        e = step % self.E
        while True:
            msg = self.stash[e].popleft() if self.stash[e] else self._recv(e, HALT_CHECK_S)
            if msg is None:
                self.check_halted()  # any of them: one waiting on a halted one's pushes waits for good too
                continue
            kind, slot, got, a, b, _ = msg
            if kind != rr.READY or got != step:
                raise EmbeddingWorkerFailed(f"{self.name(e)}: sent message {kind} for step {got}, expected step {step}")
            return slot, a, b

    def views_half(self, e: int, slot: int) -> np.ndarray:
        """``float16[B, S, D]``: a half ring's embeddings of slot ``slot`` of worker ``e``, or room for an fp16
        gradient."""
        return self.layout.slot_half(self.segment.buf, e, slot)

    def give_grad(self, step: int, slot: int, half: bool = False) -> None:
        """Hand slot ``slot`` (now holding d loss / d emb of step ``step``; ``half``: as fp16, in
        ``views_half``) back to its embedding worker."""
        e = step % self.E
        try:
            rr.send(self.socks[e], rr.GRAD, slot, step, int(half))
        except OSError as err:
            raise self._failed(e, f"its control socket failed ({err})") from None

    def drain(self, upto: int, timeout_s: float) -> None:
        """Wait until every push of steps < ``upto`` is applied (the ring's ``frontier``). Raises
        ``EmbeddingWorkerFailed`` for a failed embedding worker, ``TimeoutError`` after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        next_check = time.monotonic() + HALT_CHECK_S
        while int(self.frontier.min()) < upto:
            for e in range(self.E):
                msg = self._recv(e, 0.0)
                if msg is not None:
                    self.stash[e].append(msg)
            if time.monotonic() > next_check:
                self.check_halted()
                next_check = time.monotonic() + HALT_CHECK_S
            if time.monotonic() > deadline:
                behind = [self.name(e) for e in range(self.E) if self.frontier[e] < upto]
                raise TimeoutError(
                    f"gradient pushes of steps < {upto} not applied within {timeout_s:.0f} s by {', '.join(behind)} "
                    f"(a parameter server that does not answer? see the servers' logs)"
                )
            time.sleep(0.0005)

    def _recv(self, e: int, timeout_s: float):
        """One message of worker ``e`` that is not an error; None after ``timeout_s``."""
        try:
            msg = rr.recv(self.socks[e], timeout_s)
        except (rr.PeerGone, OSError):
            raise self._failed(e, "") from None
        if msg is not None and msg[0] == rr.ERROR:
            raise EmbeddingWorkerFailed(f"{self.name(e)} failed: {msg[5]}")
        return msg

    def _failed(self, e: int, what: str) -> EmbeddingWorkerFailed:
        deadline = time.monotonic() + 5.0
        how = self.how(e)
        while not how and time.monotonic() < deadline:
            time.sleep(0.05)
            how = self.how(e)
        return EmbeddingWorkerFailed(f"{self.name(e)} died ({how or what or 'its control socket closed'})")

    def phase_seconds(self) -> list[dict[str, float]]:
        """Per embedding worker, seconds spent in each of ``ready_ring.PHASES`` so far."""
        table = self.layout.phase_seconds(self.segment.buf)
        return [{p: float(table[e, i]) for i, p in enumerate(rr.PHASES)} for e in range(self.E)]

    def close(self) -> None:
        """Stop the embedding workers, wait for them, free the ring (idempotent)."""
        if self.closed:
            return
        self.closed = True
        for s in self.socks:
            try:
                rr.send(s, rr.STOP)
            except OSError:
                pass
        self._join()
        for s in self.socks + self.peer_socks:
            s.close()
        self.segment.close()

    def _join(self) -> None:
        pass

    def wait_started(self, timeout_s: float = STARTED_TIMEOUT_S) -> None:
        """Block until every embedding worker is set up (its data read, its client connected). Raises
        ``EmbeddingWorkerFailed`` for one that failed or died, ``TimeoutError`` after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        for e in range(self.E):
            while True:
                msg = self._recv(e, HALT_CHECK_S)
                if msg is None:
                    self.check_halted()
                if msg is not None:
                    if msg[0] != rr.STARTED:
                        raise EmbeddingWorkerFailed(f"{self.name(e)}: sent message {msg[0]} before it started")
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{self.name(e)} not started within {timeout_s:.0f} s")


class ThreadFeeders(Feeders):
    """Embedding workers as threads of the NN worker, against an in-process ``backend`` (``LocalEmbedding``)."""

    def __init__(
        self,
        backend: EmbeddingBackend,
        layouts: list[TableLayout],
        source: BatchSource,
        layout: rr.RingLayout,
        start: int,
        rules: StepRules,
    ):
        super().__init__(layout, start, rules.rank, shared=False)
        self.errors: list[BaseException | None] = [None] * self.E
        self.threads = []
        for e in range(self.E):
            ew = EmbeddingWorker(
                backend, layouts, source, layout, self.segment.buf, self.peer_socks[e], e, start, rules
            )
            t = threading.Thread(target=self._run, args=(e, ew), name=f"embedding-worker-{rules.rank}.{e}", daemon=True)
            self.threads.append(t)
        for t in self.threads:
            t.start()

    def _run(self, e: int, ew: EmbeddingWorker) -> None:
        try:
            ew.run()
        except BaseException as err:  # sent to the NN worker as ERROR; kept for how()
            self.errors[e] = err

    def how(self, e: int) -> str:
        err = self.errors[e]
        return f"{type(err).__name__}: {err}" if err is not None else ""

    def _join(self) -> None:
        for t in self.threads:
            t.join(timeout=10)


class ProcessFeeders(Feeders):
    """Embedding workers as processes of their own (``python -m persia_core.train.embedding_worker``), each with its
    own client of the parameter servers at ``addresses`` (``token``: the job's, passed in their environment).
    ``spec``: what every one of them needs (config dict, world, row counts per rank, client id prefix);
    ``examples``: this NN worker's rows, saved once for all of them to map. The ring goes in ``/dev/shm``."""

    def __init__(
        self,
        layout: rr.RingLayout,
        start: int,
        rank: int,
        spec: dict,
        addresses: list[str],
        token: str | None,
        examples: ParquetExamples,
    ):
        super().__init__(layout, start, rank, shared=True)
        self.procs: list[subprocess.Popen] = []
        self.halts = processes.HaltWatch()
        # one copy of this NN worker's examples for all its embedding workers: saved once, memory-mapped by each
        # (the page cache holds it once); removed by close, or by the local launcher for a killed NN worker
        self.examples_dir = tempfile.mkdtemp(prefix=examples_prefix(os.getpid()))
        try:
            examples.save(self.examples_dir)
        except BaseException:
            self.close()
            raise
        env = dict(os.environ)
        env.pop(TOKEN_ENV, None)
        if token:
            env[TOKEN_ENV] = token  # in the environment, never on a command line
        try:
            for e in range(self.E):
                child = self.peer_socks[e]
                s = dict(spec, rank=rank, index=e, start=start, addresses=addresses, layout=layout.to_list())
                s["examples"] = self.examples_dir
                s.update(segment=self.segment.name, client_id=f"{spec['client_id']}-e{e}")
                cmd = [sys.executable, "-m", "persia_core.train.embedding_worker", "--spec", json.dumps(s)]
                cmd += ["--fd", str(child.fileno()), "--parent", str(os.getpid())]
                self.procs.append(subprocess.Popen(cmd, pass_fds=(child.fileno(),), close_fds=True, env=env))
            for s_ in self.peer_socks:
                s_.close()  # the children hold them: their end of file is now their death
        except BaseException:
            self.close()
            raise
        log.info("%d embedding worker process(es) started: pids %s", self.E, [p.pid for p in self.procs])

    def name(self, e: int) -> str:
        pid = self.procs[e].pid if e < len(self.procs) else "?"
        return f"embedding worker {self.rank}.{e} (pid {pid})"

    def how(self, e: int) -> str:
        code = self.procs[e].poll()
        if code is None:
            return ""
        if code < 0:
            return f"killed by {signal.Signals(-code).name}"
        return f"exited with code {code}"

    def check_halted(self) -> None:
        for e, p in enumerate(self.procs):
            halted = self.halts.check(p.pid) if p.poll() is None else None
            if halted is not None:
                raise EmbeddingWorkerFailed(f"{self.name(e)} {halted}, and this NN worker cannot go on without it")

    def _join(self) -> None:
        for e, p in enumerate(self.procs):
            if p.poll() is None and processes.halted(p.pid) is not None:  # it cannot act on STOP: not waited for
                p.kill()
                processes.reap_killed(p, f"embedding worker {self.rank}.{e}")
        deadline = time.monotonic() + 10.0
        for e, p in enumerate(self.procs):
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                processes.reap_killed(p, f"embedding worker {self.rank}.{e}")
        shm.remove_segments_of([p.pid for p in self.procs])  # a killed one's client segments
        shutil.rmtree(self.examples_dir, ignore_errors=True)


class NetworkFeeders(Feeders):
    """Embedding workers on other hosts (``python -m persia_core.train.embedding_worker --listen``), one gRPC
    stream each (``persia_core.train.ready_stream``): embedding worker e of this NN worker is the one at
    ``ew_addresses[e]``. ``spec``: as for ``ProcessFeeders``, plus ``data`` (the data folder, which they read
    themselves: it must be reachable from their hosts, e.g. ``gs://`` or ``/gcs/``). ``token``: the job's, sent
    on every stream. Raises ``EmbeddingWorkerFailed`` naming one not reachable within ``connect_timeout_s``."""

    def __init__(
        self,
        layout: rr.RingLayout,
        start: int,
        rank: int,
        spec: dict,
        addresses: list[str],
        token: str | None,
        ew_addresses: list[str],
        connect_timeout_s: float = 120.0,
    ):
        if len(ew_addresses) != layout.workers:
            raise ValueError(f"{len(ew_addresses)} embedding-worker addresses for {layout.workers} embedding workers")
        super().__init__(layout, start, rank, shared=False)
        self.ew_addresses = list(ew_addresses)
        self.bridges: list[StreamBridge] = []
        try:
            for e, address in enumerate(ew_addresses):
                s = dict(spec, rank=rank, index=e, start=start, addresses=addresses, layout=layout.to_list())
                s.update(frontier=[int(x) for x in self.frontier], client_id=f"{spec['client_id']}-e{e}")
                try:
                    bridge = StreamBridge(
                        address,
                        token,
                        layout,
                        self.segment.buf,
                        e,
                        self.peer_socks[e],
                        s,
                        self._relay,
                        connect_timeout_s,
                    )
                except ConnectionError as err:
                    raise EmbeddingWorkerFailed(f"{self.name(e)}: {err}") from None
                self.bridges.append(bridge)
        except BaseException:
            self.close()
            raise
        log.info("%d embedding worker(s) over the network: %s", self.E, ", ".join(ew_addresses))

    def _relay(self, e: int) -> None:
        """Embedding worker ``e``'s frontier advanced: tell the others (their staleness bound reads it)."""
        for j, b in enumerate(self.bridges):
            if j != e:
                b.relay_frontier()

    def name(self, e: int) -> str:
        return f"embedding worker {self.rank}.{e} at {self.ew_addresses[e]}"

    def how(self, e: int) -> str:
        return self.bridges[e].error if e < len(self.bridges) else ""

    def _join(self) -> None:
        deadline = time.monotonic() + 10.0  # one deadline for all: a stuck stream is cancelled, not waited on E times
        for b in self.bridges:
            b.close(deadline)
