"""PERSIA's embedding-worker role (Lian et al., KDD 2022, Sec. 4.1): the sparse half of an NN worker's steps.

Embedding worker e of E (of NN worker r) owns steps t with ``t % E == e``. For each, in step order:

    read batch t (the same schedule as the NN worker: ``persia_core.train.schedule``)
    ID dropout (seeded by seed, rank, step), dedup the IDs per table
    wait for a free ready slot, and until every push of steps <= t-K-1 is applied (all E workers' ``frontier``)
    fresh lookups (K >= 2): also wait for the pushes of steps <= t-2, while the NN worker's pace leaves time
    look rows up on the parameter servers, sum-pool them into the slot's emb[B, S, D] (and a wide table's rows
        into wide[B, S, 1]); copy dense, labels
    READY -> NN worker (dense forward/backward; writes d loss / d emb into the slot) -> GRAD
    per-ID gradients (``kernels.bag_grads``, scaled by 1/M), pushed; when applied, ``frontier[e]`` advances

The worker is model-agnostic: the dense model and its autograd stay in the NN worker. Per batch it makes a fixed
number of Python calls (a few per table); every per-ID or per-row loop is compiled (``prepare_ids``,
``pool_into``, ``bag_grads``, the client's routing).

The same ``EmbeddingWorker`` runs as a process of its own (``python -m persia_core.train.embedding_worker``,
started by ``persia_core.train.feeders``) against the parameter servers, or as a thread of the NN worker against
an in-process table (``LocalEmbedding``, in tests and the in-process trainer).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np

from persia_core.allocator import keep_freed_memory
from persia_core.config import WIDE_TABLE, RunConfig
from persia_core.data.reader import ParquetExamples, read_schema, shard_files, validation_cutoff
from persia_core.embedding.backend import EmbeddingBackend
from persia_core.embedding.kernels import bag_grads, pool_into
from persia_core.embedding.layout import TableLayout, model_slot_order, prepare_ids, prepare_wide, table_layouts
from persia_core.logging_utils import setup_logging
from persia_core.process_exit import exit_now
from persia_core.ps.client import EmbeddingClient
from persia_core.ps.protocol import EXIT_PORT_IN_USE, TOKEN_ENV
from persia_core.ps.servicer import PortInUse
from persia_core.sparse import Batch, IdBatch
from persia_core.train import ready_ring as rr
from persia_core.train.processes import die_with_parent, die_with_spawner
from persia_core.train.ready_stream import FeedServer, is_loopback, parse_listen
from persia_core.train.schedule import make_schedule

log = logging.getLogger("persia.embedding_worker")


def drop_ids(ids: IdBatch, rates: dict[str, float], rng: np.random.Generator) -> IdBatch:
    """ID dropout: each (example, slot) bag of a slot with rate p > 0 is emptied with probability p, so its slot
    pools to the default (zero) row, as for an ID never seen in training. Vectorized over bags."""
    if not rates or ids.batch_size == 0:
        return ids
    b = ids.batch_size
    keep = np.ones(len(ids.keys) * b, dtype=bool)
    for s, key in enumerate(ids.keys):
        p = rates.get(key, 0.0)
        if p > 0:
            keep[s * b : (s + 1) * b] = rng.random(b) >= p
    lengths = ids.lengths
    values = ids.values[np.repeat(keep, lengths)]
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths * keep, out=offsets[1:])
    return IdBatch(ids.keys, values, offsets, b)


def complete_when_all(futs: list[Future], out: Future) -> None:
    """Complete ``out`` (result None) once every future of ``futs`` has, or with the first exception among them."""
    left = [len(futs)]
    lock = threading.Lock()

    def one(f: Future) -> None:
        with lock:
            if out.done():
                return
            if f.exception() is not None:
                out.set_exception(f.exception())
                return
            left[0] -= 1
            if left[0] == 0:
                out.set_result(None)

    if not futs:
        out.set_result(None)
    for f in futs:
        f.add_done_callback(one)


def first_own_step(start: int, index: int, workers: int) -> int:
    """The first step >= ``start`` of embedding worker ``index`` of ``workers`` (steps t with t % E == index)."""
    return start + (index - start) % workers


@dataclass(frozen=True)
class StepRules:
    """What an NN worker's steps follow, the same in all its embedding workers: ``staleness`` K, ``num_workers``
    M, this NN worker's ``rank``, ID ``dropout`` rates (slot -> rate; 0: none), the dropout RNG's ``seed``,
    ``fresh_lookups`` (``trainer.fresh_lookups``), and the embedding tables' learning-rate decay per epoch
    (``lr_decay``, ``trainer.embedding_lr_decay``) over epochs of ``steps_per_epoch`` steps (0: one epoch), the
    first of them numbered ``epoch0`` (0 but for the pass over the validation slice: the epochs kept before it)."""

    staleness: int
    num_workers: int
    rank: int
    dropout: dict[str, float] = field(default_factory=dict)
    seed: int = 0
    fresh_lookups: bool = False
    lr_decay: float = 1.0
    steps_per_epoch: int = 0
    epoch0: int = 0

    @classmethod
    def of(cls, config: RunConfig, rank: int, world: int, steps_per_epoch: int = 0, epoch0: int = 0) -> StepRules:
        """The rules of NN worker ``rank`` of ``world`` in a run of ``config`` whose epochs are ``steps_per_epoch``
        steps long, the first numbered ``epoch0``."""
        tc = config.trainer
        dropout = {s.name: s.id_dropout for s in config.slots}
        return cls(
            tc.embedding_staleness,
            world,
            rank,
            dropout,
            tc.seed,
            tc.fresh_lookups,
            tc.embedding_lr_decay,
            steps_per_epoch,
            epoch0,
        )

    def lr_scale(self, step: int) -> float:
        """The embedding tables' learning-rate multiplier at ``step``: ``lr_decay ** epoch`` (epochs from 0), never
        below the smallest normal float (a push's ``lr_scale`` must be > 0)."""
        if self.lr_decay == 1.0 or self.steps_per_epoch <= 0:
            return 1.0
        return max(float(self.lr_decay ** (self.epoch0 + step // self.steps_per_epoch)), sys.float_info.min)

    def epochs_trained(self, step: int) -> float:
        """The epochs trained once ``step`` is applied, fractional (``epoch0 + (step + 1) / steps_per_epoch``;
        ``epoch0 + 1`` with no epoch length): FTRL's ``l2`` grows with it (``optimizer.l2_per_epoch``)."""
        if self.steps_per_epoch <= 0:
            return float(self.epoch0 + 1)
        return self.epoch0 + (step + 1) / self.steps_per_epoch


class BatchSource:
    """One NN worker's batches: ``batch(step)`` gathers the rows ``rows[step]: int64[b]`` of ``examples`` (a
    ``ParquetExamples``, or anything with ``batch(rows) -> Batch``); ``global_batch[step]``: rows of the step over
    all NN workers."""

    def __init__(self, examples, rows: list[np.ndarray], global_batch: list[int]):
        if len(rows) != len(global_batch):
            raise ValueError(f"{len(rows)} batches of rows but {len(global_batch)} global batch sizes")
        self.examples = examples
        self.rows = rows
        self.global_batch = global_batch

    @property
    def total_steps(self) -> int:
        return len(self.global_batch)

    def batch(self, step: int) -> Batch:
        return self.examples.batch(self.rows[step])


class _Stopped(Exception):
    pass


class EmbeddingWorker:
    """Embedding worker ``index`` of ``workers`` for NN worker ``rank`` of M (``num_workers``).

    Args:
        backend: ``EmbeddingClient`` (a process of its own) or ``LocalEmbedding`` (a thread).
        layouts: tables and their slots (a ``wide`` ring adds the wide table over all of them). source: the NN
            worker's batches.
        layout, buf: the ready ring (``ready_ring.RingLayout``) and its ``uint8`` memory. sock: this worker's end
            of its control socket. start: the first step (a resume). rules: K, M, rank, ID dropout, seed, fresh
            lookups.
        notify: called after ``frontier[index]`` advanced (the network transport relays it).
    """

    def __init__(
        self,
        backend: EmbeddingBackend,
        layouts: list[TableLayout],
        source: BatchSource,
        layout: rr.RingLayout,
        buf: np.ndarray,
        sock: socket.socket,
        index: int,
        start: int,
        rules: StepRules,
        notify: Callable[[], None] | None = None,
    ):
        self.backend, self.layouts, self.source = backend, layouts, source
        self.notify = notify
        self.layout, self.buf, self.sock = layout, buf, sock
        self.index, self.E = index, layout.workers
        self.K, self.M, self.rank = rules.staleness, rules.num_workers, rules.rank
        self.dropout = {k: v for k, v in rules.dropout.items() if v > 0}
        self.seed = rules.seed
        self.rules = rules
        self.fresh = rules.fresh_lookups and self.K > 1
        # the NN worker's pace, for fresh lookups (exponential moving averages; None: not measured yet): when the
        # last gradient came and the seconds between two of this worker's gradients; the seconds of a lookup and
        # its pooling (not the first, which loads the kernels) and their mean deviation; the seconds from a push
        # to its being applied
        self.last_grad: float | None = None
        self.grad_interval: float | None = None
        self.lookup_s: float | None = None
        self.lookup_dev = 0.0
        self.lookups = 0
        self.push_latency: float | None = None
        self.pushed_at: dict[int, float] = {}
        self.frontier = layout.frontier(buf)
        self.phase = layout.phase_seconds(buf)[index]  # seconds per ``ready_ring.PHASES``, read by the NN worker
        self.push_s = 0.0  # seconds in ``_push`` so far (it also runs within the waits)
        self.slot0 = [int(x) for x in np.cumsum([0] + [len(t.slots) for t in layouts])[:-1]]
        self.wide = TableLayout(WIDE_TABLE, 1, [s for t in layouts for s in t.slots]) if layout.wide else None
        self.free = list(range(layout.slots_per_worker - 1, -1, -1))
        # a half ring: rows are pooled here, then converted into the slot's fp16 view; an fp16 gradient is
        # converted back here before its per-ID sums (one buffer: both happen in this worker's own thread)
        self.scratch = np.empty((layout.batch, layout.num_slots, layout.dim), np.float32) if layout.half else None
        self.pending: dict[int, tuple[int, dict, int]] = {}  # slot -> (step, prepared IDs, rows)
        self.lock = threading.Lock()
        self.done: set[int] = set()
        self.next_own = first_own_step(start, index, self.E)  # the first own step not yet applied
        self.error: BaseException | None = None

    def run(self) -> None:
        """Serve every own step, then gradients until ``STOP`` or the NN worker's end. An error is sent to the NN
        worker (``ERROR``) and raised."""
        try:
            rr.send(self.sock, rr.STARTED)
            self._loop()
        except (_Stopped, rr.PeerGone):
            return
        except BaseException as e:
            try:
                rr.send(self.sock, rr.ERROR, text=f"{type(e).__name__}: {e}")
            except OSError:
                pass
            raise

    def _loop(self) -> None:
        total = self.source.total_steps
        self._publish()
        read, dedup, wait_slot, wait_bound, lookup_pool = range(5)  # the first five of rr.PHASES
        wait_fresh = rr.PHASES.index("wait_fresh")
        ph = self.phase
        for step in range(self.next_own, total, self.E):
            t0 = time.perf_counter()
            batch = self.source.batch(step)
            t1 = time.perf_counter()
            ids = batch.ids
            if self.dropout:
                ids = drop_ids(ids, self.dropout, np.random.default_rng([self.seed, self.rank, step]))
            prepared = prepare_ids(ids, self.layouts, self.backend.num_shards)
            if self.wide is not None:
                prepared[WIDE_TABLE] = prepare_wide(ids, self.wide, prepared, self.backend.num_shards)
            t2, pushed = time.perf_counter(), self.push_s
            while not self.free:
                self._serve(None)
            t3, pushed = self._charge_wait(wait_slot, t2, pushed)
            self._wait_bound(step)
            t35, pushed = self._charge_wait(wait_bound, t3, pushed)
            staleness = self._wait_fresh(step)
            t4, _ = self._charge_wait(wait_fresh, t35, pushed)
            slot = self.free.pop()
            emb, dense, labels = self.layout.slot(self.buf, self.index, slot)
            b = batch.size
            pooled = emb if self.scratch is None else self.scratch
            for t, slot0 in zip(self.layouts, self.slot0, strict=True):
                p = prepared[t.name]
                rows = self.backend.lookup(t.name, p.uniq, p.bounds)
                pool_into(rows, p.inverse, p.offsets, len(t.slots), b, pooled, slot0)
            if self.wide is not None:
                p = prepared[WIDE_TABLE]
                wide = self.layout.wide_view(self.buf, self.index, slot)
                rows = self.backend.lookup(WIDE_TABLE, p.uniq, p.bounds)
                pool_into(rows, p.inverse, p.offsets, len(self.wide.slots), b, wide, 0)
            if self.scratch is not None:
                np.copyto(self.layout.slot_half(self.buf, self.index, slot)[:b], pooled[:b], casting="same_kind")
            dense[:b] = batch.dense
            labels[:b] = batch.labels
            self.pending[slot] = (step, prepared, b)
            rr.send(self.sock, rr.READY, slot, step, b, staleness)
            ph[read] += t1 - t0
            ph[dedup] += t2 - t1
            t5 = time.perf_counter()
            ph[lookup_pool] += t5 - t4
            self._lookup_took(t5 - t4)
        while True:  # every own step handed over: gradients of those the NN worker trains, until STOP
            self._raise_error()
            self._serve(0.5)

    def _charge_wait(self, phase: int, since: float, pushed: float) -> tuple[float, float]:
        """Add the seconds from ``since`` to now to ``phase``, less those spent in ``_push`` meanwhile (``push_s``
        was ``pushed`` then; the pushes count in their own phases). Returns now and ``push_s``, the next wait's
        start."""
        now = time.perf_counter()
        self.phase[phase] += now - since - (self.push_s - pushed)
        return now, self.push_s

    def _wait_bound(self, step: int) -> None:
        """Block until every push of steps <= step-K-1 (of all E workers) is applied, serving gradients meanwhile."""
        while int(self.frontier.min()) < step - self.K:
            self._raise_error()
            self._serve(0.0002)

    def _wait_fresh(self, step: int) -> int:
        """With fresh lookups, block until every push of steps <= step-2 (of all E workers) is applied, serving
        gradients meanwhile, while the lookup can still be handed over before the NN worker needs it
        (``_fresh_deadline``); not at all when the pushes take longer than that leaves. Returns the staleness of the
        lookup: earlier steps whose pushes are not all applied yet (<= K)."""
        low = int(self.frontier.min())
        if self.fresh and low < step - 1 and self.push_latency is not None:
            deadline = self._fresh_deadline()
            if time.perf_counter() + self.push_latency < deadline:
                while low < step - 1:
                    self._raise_error()
                    left = self._fresh_deadline() - time.perf_counter()
                    if left <= 0:
                        break
                    self._serve(min(0.001, left))
                    low = int(self.frontier.min())
        return max(0, step - low)

    def _fresh_deadline(self) -> float:
        """The latest ``perf_counter`` time at which a lookup may start and still be handed over before the NN
        worker needs it. The NN worker needs this worker's next step once it has trained the steps it holds of
        this worker (``pending``) and the E-1 steps of the others before that one, each an E-th of this worker's
        mean interval between gradients: (pending + 1 - 1/E) intervals after the last gradient. Less twice the
        mean lookup and pooling time, four times its mean deviation and 1 ms. ``-inf`` until those means are
        known."""
        if self.last_grad is None or self.grad_interval is None or self.lookup_s is None:
            return float("-inf")
        need = self.last_grad + (len(self.pending) + 1 - 1 / self.E) * self.grad_interval
        return need - 2.0 * self.lookup_s - 4.0 * self.lookup_dev - 0.001

    def _lookup_took(self, seconds: float) -> None:
        """Fold one lookup and pooling's ``seconds`` into their mean and mean deviation (the first is left out)."""
        self.lookups += 1
        if self.lookups == 1:
            return
        if self.lookup_s is None:
            self.lookup_s = seconds
            return
        self.lookup_dev = 0.8 * self.lookup_dev + 0.2 * abs(seconds - self.lookup_s)
        self.lookup_s = 0.8 * self.lookup_s + 0.2 * seconds

    def _serve(self, timeout_s: float | None) -> None:
        msg = rr.recv(self.sock, timeout_s)
        if msg is None:
            return
        kind, slot, step = msg[0], msg[1], msg[2]
        if kind == rr.STOP:
            raise _Stopped()
        if kind != rr.GRAD:
            raise ValueError(f"embedding worker {self.rank}.{self.index}: unexpected control message {kind}")
        now = time.perf_counter()
        if self.last_grad is not None:
            d = now - self.last_grad
            if self.grad_interval is None:
                self.grad_interval = d
            else:  # a pause (an epoch's validation, a checkpoint) counts as at most two intervals
                self.grad_interval = 0.8 * self.grad_interval + 0.2 * min(d, 2.0 * self.grad_interval)
        self.last_grad = now
        self._push(slot, step, bool(msg[3]))

    def _push(self, slot: int, step: int, half: bool = False) -> None:
        """The per-ID gradients of step ``step`` from slot ``slot`` (``bag_grads``, divided by M), then its pushes;
        ``half``: the gradient is fp16 (``slot_half``). Raises ``FloatingPointError`` when a gradient holds inf or
        NaN: nothing of that step is then pushed."""
        owned = self.pending.pop(slot, None)
        if owned is None or owned[0] != step:
            raise ValueError(f"embedding worker {self.rank}.{self.index}: gradient of step {step} in slot {slot}")
        _, prepared, b = owned
        t0 = time.perf_counter()
        grad = self.layout.slot(self.buf, self.index, slot)[0]
        if half:
            if self.scratch is None:
                raise ValueError(f"embedding worker {self.rank}.{self.index}: an fp16 gradient in a float32 ring")
            np.copyto(self.scratch[:b], self.layout.slot_half(self.buf, self.index, slot)[:b])
            grad = self.scratch
        per_table = []
        for t, slot0 in zip(self.layouts, self.slot0, strict=True):
            p = prepared[t.name]
            g, finite = bag_grads(grad, p.inverse, p.offsets, len(t.slots), b, slot0, len(p.uniq), 1.0 / self.M)
            if not finite:
                raise FloatingPointError("an embedding gradient is inf or NaN (diverged training); nothing was pushed")
            per_table.append((t.name, p, g))
        if self.wide is not None:
            p = prepared[WIDE_TABLE]
            wide = self.layout.wide_view(self.buf, self.index, slot)
            g, finite = bag_grads(wide, p.inverse, p.offsets, len(self.wide.slots), b, 0, len(p.uniq), 1.0 / self.M)
            if not finite:
                raise FloatingPointError("a wide-table gradient is inf or NaN (diverged training); nothing was pushed")
            per_table.append((WIDE_TABLE, p, g))
        self.free.append(slot)  # its gradient is read out
        t1 = time.perf_counter()
        scale = self.rules.lr_scale(step)  # the wide table is not decayed (trainer.embedding_lr_decay)
        epochs = self.rules.epochs_trained(step)
        futs = [
            self.backend.push(
                name,
                p.uniq,
                g,
                step=step,
                sync_workers=self.M if self.K == 0 else 0,
                step_fraction=1.0 if self.K == 0 else 1.0 / self.M,
                bounds=p.bounds,
                lr_scale=1.0 if name == WIDE_TABLE else scale,
                epochs_trained=epochs,
            )
            for name, p, g in per_table
        ]
        t2 = time.perf_counter()
        self.phase[rr.PHASES.index("grads")] += t1 - t0
        self.phase[rr.PHASES.index("push")] += t2 - t1
        self.push_s += t2 - t0
        if self.fresh:
            self.pushed_at[step] = t2
        out: Future = Future()
        out.add_done_callback(lambda f: self._applied(step, f))
        complete_when_all(futs, out)

    def _applied(self, step: int, fut: Future) -> None:
        with self.lock:
            exc = fut.exception()
            if exc is not None:
                self.error = self.error or exc
                return
            self.done.add(step)
            t = self.pushed_at.pop(step, None)
            if t is not None:
                d = time.perf_counter() - t
                self.push_latency = d if self.push_latency is None else 0.8 * self.push_latency + 0.2 * d
            while self.next_own in self.done:
                self.done.discard(self.next_own)
                self.next_own += self.E
            self._publish()

    def _publish(self) -> None:
        self.frontier[self.index] = self.next_own if self.next_own < self.source.total_steps else rr.NEVER
        if self.notify is not None:
            self.notify()

    def _raise_error(self) -> None:
        if self.error is not None:
            raise self.error


def rank_split(config: RunConfig, data_dir: str, rank: int, world: int):
    """NN worker ``rank``'s share of the train split of ``data_dir`` (its files ``rank, rank + world, ...``) as
    ``(training examples, validation examples or None)``: with ``epochs: auto`` the rows past the validation
    cutoff (``reader.validation_cutoff``) are held back from training, in file order."""
    files = shard_files(data_dir, "train")[rank::world]
    examples = ParquetExamples(files, model_slot_order(config), num_dense=len(read_schema(data_dir)["dense"]))
    if not config.trainer.auto_epochs:
        return examples, None
    late = examples.ts > validation_cutoff(data_dir, config.trainer.validation_fraction)
    return examples.subset(np.flatnonzero(~late)), examples.subset(np.flatnonzero(late))


def rank_examples(config: RunConfig, data_dir: str, rank: int, world: int) -> ParquetExamples:
    """NN worker ``rank``'s training examples (``rank_split``)."""
    return rank_split(config, data_dir, rank, world)[0]


def build_worker(
    spec: dict, examples: ParquetExamples, buf: np.ndarray, sock: socket.socket, notify=None
) -> tuple[EmbeddingWorker, EmbeddingClient]:
    """The embedding worker ``spec`` describes (config, world, counts, rank, index, start, parameter-server
    addresses, ring layout, client id; ``epochs`` where not the config's, ``epoch0`` where not 0), with its own
    client of the parameter servers (token: ``$PERSIA_PS_TOKEN``), on ring memory ``buf`` and control socket
    ``sock``.
    Raises ``ValueError`` when ``examples`` are not its NN worker's (row count, slots)."""
    rank, index = int(spec["rank"]), int(spec["index"])
    config = RunConfig.from_dict(spec["config"])
    tc = config.trainer
    counts = [int(c) for c in spec["counts"]]
    if len(examples) != counts[rank] or examples.slots != model_slot_order(config):
        raise ValueError(
            f"not the examples of NN worker {rank}: {len(examples)} rows, slots {examples.slots}; its NN worker has "
            f"{counts[rank]} rows, slots {model_slot_order(config)} (another data folder?)"
        )
    epochs = int(spec.get("epochs", tc.scheduled_epochs))  # 1 for the pass over the validation slice
    schedule = make_schedule(counts, tc.batch_size, epochs, tc.seed, tc.shuffle, rank)
    client = EmbeddingClient(
        spec["addresses"],
        config.embedding,
        timeout_s=tc.rpc_timeout_s,
        client_id=spec["client_id"],
        delay_s=tc.network_delay_s,
        bandwidth_bytes_per_s=tc.network_bandwidth_bytes_per_s,
        shared_memory=None if tc.shared_memory else False,
    )
    worker = EmbeddingWorker(
        client,
        table_layouts(config),
        BatchSource(examples, schedule.rows[rank], schedule.global_batch),
        rr.RingLayout.from_list(spec["layout"]),
        buf,
        sock,
        index,
        int(spec["start"]),
        StepRules.of(config, rank, int(spec["world"]), schedule.steps_per_epoch, int(spec.get("epoch0", 0))),
        notify,
    )
    return worker, client


def _serve_network(args) -> int:
    """``--listen``: serve one NN worker's stream (``persia_core.train.ready_stream``); it sends the spec, and this
    process reads that NN worker's share of the data itself. Exit code 0 after its ``stop``, 1 otherwise."""
    try:
        host, port = parse_listen(args.listen)
    except ValueError as e:
        log.error("%s", e)
        return 2
    token = os.environ.get(TOKEN_ENV) or None
    if token is None and not is_loopback(host):
        log.error("refusing to listen on %s without a token: set %s", host, TOKEN_ENV)
        return 2
    clients: list[EmbeddingClient] = []

    def build(spec, buf, sock, notify):
        config = RunConfig.from_dict(spec["config"])
        examples = rank_examples(config, spec["data"], int(spec["rank"]), int(spec["world"]))
        worker, client = build_worker(spec, examples, buf, sock, notify)
        clients.append(client)
        return worker

    try:
        server = FeedServer(build, f"[{host}]" if ":" in host else host, port, token)
    except PortInUse as e:
        log.error("%s", e)
        return EXIT_PORT_IN_USE
    if args.port_file:
        tmp = args.port_file + ".tmp"
        with open(tmp, "w") as f:
            f.write(str(server.port))
        os.replace(tmp, args.port_file)
    log.info("embedding worker listening on %s:%d (token %s)", host, server.port, "required" if token else "off")
    try:
        server.wait()
    finally:
        for c in clients:
            c.close()
        server.stop()
    log.info("served its NN worker: %s", "stopped cleanly" if server.clean else "the stream ended in error")
    return 0 if server.clean else 1


def main(argv: list[str] | None = None) -> int:
    """A process of its own, either beside its NN worker (``--spec``, JSON written by ``feeders.ProcessFeeders``;
    ``--fd``, its end of the control socket, inherited) or on a host of its own (``--listen HOST:PORT``: the
    network transport, ``persia_core.train.ready_stream``). A set-up error is sent to the NN worker (``ERROR``)
    before it is raised."""
    p = argparse.ArgumentParser(prog="persia_core.train.embedding_worker", description="One embedding worker.")
    p.add_argument("--spec", default="", help="JSON: config, data, rank, world, counts, start, index, ring")
    p.add_argument("--fd", type=int, default=-1, help="inherited control socket")
    p.add_argument("--parent", type=int, default=0, help="the NN worker's pid: this process dies with it")
    p.add_argument("--listen", default="", help="HOST:PORT: serve an NN worker on another host over gRPC")
    p.add_argument("--port-file", default="", help="with --listen: write the bound port here once listening")
    args = p.parse_args(argv)
    keep_freed_memory()  # every batch allocates the same multi-MiB arrays: reuse them, no page faults
    if not die_with_spawner():  # a listening one's replica process died before this process could follow it
        return 1
    if args.parent:
        die_with_parent()
        if os.getppid() != args.parent:  # it died before the line above
            return 1
    if args.listen:
        setup_logging("embedding_worker")
        return _serve_network(args)
    if not args.spec or args.fd < 0:
        p.error("give --spec and --fd (beside the NN worker) or --listen HOST:PORT")
    spec = json.loads(args.spec)
    setup_logging(f"embedding_worker[{int(spec['rank'])}.{int(spec['index'])}]")
    sock = socket.socket(fileno=args.fd)
    try:
        layout = rr.RingLayout.from_list(spec["layout"])
        seg = rr.Segment.attach(spec["segment"], layout)
        worker, client = build_worker(spec, ParquetExamples.mapped(spec["examples"]), seg.buf, sock)
    except BaseException as e:
        try:
            rr.send(sock, rr.ERROR, text=f"set-up failed: {type(e).__name__}: {e}")
        except OSError:
            pass
        raise
    try:
        worker.run()
    finally:
        worker.buf = np.empty(0, np.uint8)
        worker.frontier = np.empty(0, np.int64)
        client.close()
        seg.close()
        sock.close()
    return 0


if __name__ == "__main__":
    exit_now(main())
