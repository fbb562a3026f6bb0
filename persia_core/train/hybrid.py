"""PERSIA's hybrid training step: embeddings asynchronous with bounded staleness, dense network synchronous.

Algorithm (Lian et al., "PERSIA: An Open, Hybrid System Scaling Deep Learning-based Recommenders up to 100
Trillion Parameters", KDD 2022, Sec. 4 and Alg. 1), per NN worker r of M:

    preparation threads (run ahead):                 main thread, step t:
      batch t: ID dropout, dedup IDs per table          take prepared batch t (pooled emb[B, S, D])
      wait until pushes of steps <= t-K-1 applied       dense forward/backward (DDP all-reduces dense
      look rows up on the parameter servers               gradients: synchronous)
      sum-pool each bag's rows into emb[B, S, D]        hand d loss / d emb to the grads thread
      hand batch t to the main thread                   dense optimizer step
    grads thread (in step order): d loss / d emb -> one gradient row per unique ID (the pooling's backward,
      ``kernels.bag_grads``), pushed to the parameter servers (non-blocking)

The sparse work (dedup, lookups, pooling and its backward) is compiled code that releases the GIL, off the main
thread, which does the dense work only: what PERSIA's embedding workers do for its NN workers (Sec. 4.1).

What overlaps with what: batch preparation and lookups of the next batches (as many as there are preparation
threads, ``trainer.prefetch_threads``, never more than K) run during the dense compute of batch t, and gradient
pushes run in the background. Running lookups no further ahead than overlap needs keeps the observed staleness
low, which is what keeps the AUC of K > 0 close to that of K = 0 (figures: ``docs/notes-train.md``). The bound is
exact: no lookup of batch t starts before every push of this worker's batches <= t-K-1 is applied
(K = ``embedding_staleness``); the observed staleness of a lookup is the number of this worker's earlier pushes
not yet applied, and is <= K.

K = 0 is fully synchronous training on the same code path: pushes carry ``sync_workers = M``, so each shard
combines the M workers' gradients of a step per ID and applies them once, and the next lookup waits for it.

Scaling: worker r's loss is ``sum of its BCE * M / B_global`` (B_global = rows of step t over all workers), so
DDP's mean over workers of dense gradients, and the server's sum of pushes divided by M here, both equal the
gradient of the mean loss over the step's global batch; M workers therefore equal one worker on the M batches
concatenated, also when ranks hold uneven data (a rank out of data runs empty steps). With K > 0 each worker's
push is applied on its own and carries ``step_fraction = 1/M``: the scale-invariant optimizers (Adagrad, row-wise
Adagrad, Adam) normalize the 1/M gradient scale away, so they take 1/M of their step instead, and the M pushes of
a step move a row about as far as one synchronous update (without it, K > 0 loses AUC to K = 0: see
``docs/notes-train.md``).
"""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from persia_core.embedding.backend import EmbeddingBackend
from persia_core.embedding.kernels import bag_grads, pool_into
from persia_core.embedding.pooling import PreparedIds, TableLayout, prepare_ids
from persia_core.sparse import Batch, IdBatch


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


def grads_to_host(g: torch.Tensor, fp16: bool) -> tuple[np.ndarray, bool]:
    """Embedding gradients ``g: float32[U, D]`` (per unique ID, any device) -> host ``float32[U, D]``.

    With ``fp16``: sent across as fp16 (half the PCIe bytes) unless a value overflows fp16 (|g| > 65504), in
    which case the fp32 values are sent instead. Returns (gradients, whether fp16 overflowed). Raises
    ``FloatingPointError`` when ``g`` itself holds inf or NaN, so no inf ever reaches a parameter server."""
    if not bool(torch.isfinite(g).all()):
        raise FloatingPointError("an embedding gradient is inf or NaN (diverged training); nothing was pushed")
    if fp16:
        h = g.half()
        if bool(torch.isfinite(h).all()):
            return h.to("cpu").float().numpy(), False
    return g.detach().to("cpu").numpy().astype(np.float32, copy=False), fp16


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


@dataclass
class StepResult:
    """What one step did: step index, examples, summed BCE loss over them, lookup staleness (pushes of this
    worker not yet applied when the batch's rows were looked up), seconds spent waiting for the prefetcher."""

    step: int
    samples: int
    loss_sum: float
    staleness: int
    wait_s: float


@dataclass
class _Item:
    step: int
    batch: Batch
    global_batch: int
    prepared: dict[str, PreparedIds]
    pooled: np.ndarray  # float32[B, S, D]: every table's bags, pooled (slots in layout order)
    staleness: int
    emb: torch.Tensor | None = None
    dense: torch.Tensor | None = None
    labels: torch.Tensor | None = None
    event: object = None


class HybridTrainPipeline:
    """One NN worker's hybrid training loop; ``progress()`` advances one step (TorchRec's train-pipeline shape).

    Args:
        model: the dense model (wrapped in DDP when M > 1); called as ``model(emb[B,S,D], dense[B,F])``.
        optimizer: the dense optimizer.
        backend: ``LocalEmbedding`` or ``EmbeddingClient``.
        layouts: tables and their slots (``table_layouts``).
        batches: iterator of ``(step, Batch, global_batch_size)``; steps increase by 1 from any start.
        staleness: K. num_workers: M. dropout: slot -> ID dropout rate. seed: of the dropout RNG.
        device: where the dense model runs. On CUDA the preparation threads also copy each batch's pooled
            embeddings and dense features into pinned host memory and to the GPU on a side stream (non-blocking),
            so the copy overlaps the previous step; the gradient with respect to the pooled embeddings comes back.
        fp16_transfer: embeddings and gradients cross between host and device as fp16; a gradient that overflows
            fp16 is sent in fp32 for that step instead (counted in ``fp16_fallbacks``), never as inf.
        prefetch_threads: batches prepared concurrently (dedup, lookups, pooling, staging; the compiled kernels and
            gRPC release the GIL). A feeder thread decodes batches in order; results are consumed in order.
    """

    def __init__(
        self,
        model,
        optimizer,
        backend: EmbeddingBackend,
        layouts: list[TableLayout],
        batches,
        staleness: int,
        num_workers: int,
        rank: int = 0,
        dropout: dict[str, float] | None = None,
        seed: int = 0,
        device: str | torch.device = "cpu",
        fp16_transfer: bool = False,
        prefetch_threads: int = 2,
    ):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.fp16 = fp16_transfer
        self.fp16_fallbacks = 0
        self.h2d_stream = torch.cuda.Stream(device=self.device) if self.cuda else None
        self.model = model
        self.optimizer = optimizer
        self.backend = backend
        self.layouts = layouts
        self.K = staleness
        self.M = num_workers
        self.rank = rank
        self.dropout = {k: v for k, v in (dropout or {}).items() if v > 0}
        self.seed = seed
        self.cond = threading.Condition()
        self.applied_upto: int | None = None  # highest step s.t. all pushes <= it are applied
        self.done: set[int] = set()
        self.inflight: list = []
        self.error: BaseException | None = None
        self.max_staleness = 0
        # seconds of the main thread per phase of progress() (wait: for the prepared batch)
        # seconds per phase of a step; the first batch's wait (opening the data, the first lookups: start-up)
        # is kept apart, so that "wait" says how long steady-state steps wait on the prepared batch
        self.phase_s = {
            "first_batch_wait": 0.0,
            "wait": 0.0,
            "forward": 0.0,
            "backward": 0.0,
            "push": 0.0,
            "optimizer": 0.0,
        }
        self._waited_first = False
        self.queue: queue.Queue = queue.Queue()
        # batches handed to the preparation pool and not yet trained on: at most one per preparation thread
        # (and at most K, or 1 when K = 0), so lookups run no further ahead than overlap needs: the bound K is
        # what may be observed, not what every batch gets
        self.ahead = threading.Semaphore(max(1, min(max(self.K, 1), prefetch_threads)))
        self._stop = threading.Event()
        self._batches = batches
        self.pool = ThreadPoolExecutor(max_workers=max(1, prefetch_threads), thread_name_prefix=f"prepare-{rank}")
        # per-ID gradients of a step (the backward of the pooling) and its pushes, off the main thread, in step order
        self.grad_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"grads-{rank}")
        self.slot0 = [int(x) for x in np.cumsum([0] + [len(t.slots) for t in layouts])[:-1]]
        self.num_slots = sum(len(t.slots) for t in layouts)
        self.thread = threading.Thread(target=self._prefetch, name=f"prefetch-{rank}", daemon=True)
        self.thread.start()

    # ---- prefetch ------------------------------------------------------------------------------------
    def _prefetch(self) -> None:
        """Feeder thread: decode batches in order and hand each to the preparation pool."""
        try:
            for step, batch, gbs in self._batches:
                if self._stop.is_set():
                    return
                if self.applied_upto is None:
                    with self.cond:
                        self.applied_upto = step - 1
                while not self.ahead.acquire(timeout=0.5):
                    if self._stop.is_set():
                        return
                self._put(self.pool.submit(self._prepare, step, batch, gbs))
            self._put(None)
        except BaseException as e:  # surfaced in progress()
            with self.cond:
                self.error = e
                self.cond.notify_all()
            self._put(None)

    def _prepare(self, step: int, batch: Batch, gbs: int) -> _Item:
        """ID dropout and dedup, then (once the staleness bound allows) lookups and staging for one batch."""
        ids = batch.ids
        if self.dropout:
            ids = drop_ids(ids, self.dropout, np.random.default_rng([self.seed, self.rank, step]))
        prepared = prepare_ids(ids, self.layouts)
        with self.cond:
            assert self.applied_upto is not None  # set by the feeder before it hands the first batch over
            while self.applied_upto < step - self.K - 1 and self.error is None and not self._stop.is_set():
                self.cond.wait(0.5)
            if self.error is not None:
                raise self.error
            if self._stop.is_set():
                raise RuntimeError("training pipeline closed")
            staleness = step - 1 - self.applied_upto
        pooled = np.empty((batch.size, self.num_slots, self.layouts[0].dim if self.layouts else 0), np.float32)
        for t, slot0 in zip(self.layouts, self.slot0, strict=True):
            p = prepared[t.name]
            pool_into(
                self.backend.lookup(t.name, p.uniq), p.inverse, p.offsets, len(t.slots), batch.size, pooled, slot0
            )
        return self._stage(_Item(step, batch, gbs, prepared, pooled, staleness))

    def _stage(self, item: _Item) -> _Item:
        """Turn the item's pooled embeddings, dense features and labels into tensors on the training device (the
        embeddings as fp16 when asked)."""

        def host(a: np.ndarray, half: bool = False) -> torch.Tensor:
            t = torch.from_numpy(a)
            if half:
                t = t.half()
            return t.pin_memory() if self.cuda else t

        emb, dense, labels = host(item.pooled, self.fp16), host(item.batch.dense), host(item.batch.labels)
        if self.cuda:
            with torch.cuda.stream(self.h2d_stream):
                emb = emb.to(self.device, non_blocking=True)
                dense = dense.to(self.device, non_blocking=True)
                labels = labels.to(self.device, non_blocking=True)
                item.event = torch.cuda.Event()
                item.event.record(self.h2d_stream)
        item.emb, item.dense, item.labels = emb, dense, labels
        return item

    def _put(self, item) -> None:
        while not self._stop.is_set():
            try:
                self.queue.put(item, timeout=0.5)
                return
            except queue.Full:
                continue

    def _mark_applied(self, step: int, fut) -> None:
        with self.cond:
            exc = fut.exception()
            if exc is not None:
                self.error = exc
            else:
                self.done.add(step)
                while self.applied_upto is not None and self.applied_upto + 1 in self.done:
                    self.applied_upto += 1
                    self.done.discard(self.applied_upto)
            self.cond.notify_all()

    # ---- main thread ----------------------------------------------------------------------------------
    def progress(self) -> StepResult:
        """Train one step. Raises ``StopIteration`` at the end of the batches, or the error of a failed lookup
        or push (``ParameterServerError``)."""
        t0 = time.perf_counter()
        while True:
            try:
                item = self.queue.get(timeout=0.5)
                break
            except queue.Empty:
                pass
            # raised outside the except clause: an empty queue is no cause of either error
            if self.error is not None:
                raise self.error
            if not self.thread.is_alive() and self.queue.empty():
                raise RuntimeError("prefetch thread ended without a result")
        if item is None:
            if self.error is not None:
                raise self.error
            raise StopIteration
        item = item.result()
        self.ahead.release()
        t1 = time.perf_counter()
        wait_s = t1 - t0
        self.max_staleness = max(self.max_staleness, item.staleness)
        b = item.batch.size
        if item.event is not None:
            torch.cuda.current_stream(self.device).wait_event(item.event)
        assert item.emb is not None  # staged by _prepare
        emb = (item.emb.float() if item.emb.dtype != torch.float32 else item.emb).requires_grad_(True)
        logits = self.model(emb, item.dense)
        loss_sum = F.binary_cross_entropy_with_logits(logits, item.labels, reduction="sum")
        scaled = loss_sum * (self.M / max(item.global_batch, 1))
        self.optimizer.zero_grad(set_to_none=True)
        t2 = time.perf_counter()
        scaled.backward()
        t3 = time.perf_counter()
        g = emb.grad
        if g is None:  # the dense model ignores the embeddings: zero gradients, pushed all the same
            grad = np.zeros(item.pooled.shape, np.float32)
        elif self.cuda:
            grad, fell_back = grads_to_host(g, self.fp16)
            self.fp16_fallbacks += int(fell_back)
        else:
            grad = g.numpy()  # checked for inf/NaN as the per-ID gradients are summed
        pushed: Future = Future()
        self.grad_pool.submit(self._push, item, grad, pushed)
        self._track(item.step, pushed)
        t4 = time.perf_counter()
        self.optimizer.step()
        t5 = time.perf_counter()
        ph = self.phase_s
        ph["wait" if self._waited_first else "first_batch_wait"] += wait_s
        self._waited_first = True
        ph["forward"] += t2 - t1
        ph["backward"] += t3 - t2
        ph["push"] += t4 - t3
        ph["optimizer"] += t5 - t4
        return StepResult(item.step, b, float(loss_sum.detach()), item.staleness, wait_s)

    def _push(self, item: _Item, grad: np.ndarray, out: Future) -> None:
        """Grads thread: the per-ID gradients of one step (``bag_grads``: the pooling's backward, divided by M) and
        their pushes; ``out`` completes when every table's push is applied. Raises (into ``out``)
        ``FloatingPointError`` when a gradient holds inf or NaN: nothing of that step is then pushed."""
        try:
            per_table = []
            for t, slot0 in zip(self.layouts, self.slot0, strict=True):
                p = item.prepared[t.name]
                g, finite = bag_grads(
                    grad, p.inverse, p.offsets, len(t.slots), item.batch.size, slot0, len(p.uniq), 1.0 / self.M
                )
                if not finite:
                    raise FloatingPointError(
                        "an embedding gradient is inf or NaN (diverged training); nothing was pushed"
                    )
                per_table.append((t.name, p.uniq, g))
            futs = [
                self.backend.push(
                    name,
                    uniq,
                    g,
                    step=item.step,
                    sync_workers=self.M if self.K == 0 else 0,
                    step_fraction=1.0 if self.K == 0 else 1.0 / self.M,
                )
                for name, uniq, g in per_table
            ]
        except BaseException as e:
            out.set_exception(e)
            return
        complete_when_all(futs, out)

    def _track(self, step: int, pushed: Future) -> None:
        """Count step ``step`` as applied when ``pushed`` (all its pushes) completes; ``drain`` waits for it."""
        pushed.add_done_callback(lambda f: self._mark_applied(step, f))
        self.inflight = [f for f in self.inflight if not f.done()] + [pushed]

    def drain(self, timeout_s: float = 120.0) -> None:
        """Wait until every push issued so far is applied. Raises the first push error, or ``TimeoutError``."""
        deadline = time.monotonic() + timeout_s
        for f in list(self.inflight):
            try:
                f.result(timeout=max(0.0, deadline - time.monotonic()))
            except FutureTimeout:
                pending = sum(not g.done() for g in self.inflight)
                raise TimeoutError(
                    f"{pending} gradient push(es) of this worker not applied within {timeout_s:.0f} s "
                    f"(a parameter server that does not answer? see the servers' logs)"
                ) from None
        if self.error is not None:
            raise self.error

    def close(self) -> None:
        """Stop the feeder and preparation threads (after ``drain`` for a clean end)."""
        self._stop.set()
        with self.cond:
            self.cond.notify_all()
        self.thread.join(timeout=5)
        self.pool.shutdown(wait=True, cancel_futures=True)
        self.grad_pool.shutdown(wait=True, cancel_futures=True)


@dataclass
class Schedule:
    """Which rows every worker trains on at every step.

    ``rows[r][t]``: ``int64[b]`` row indices of worker r's batch at step t (b <= batch size; 0 when r is out of
    data); ``global_batch[t]``: rows over all workers at step t."""

    rows: list[list[np.ndarray]]
    global_batch: list[int] = field(default_factory=list)


def make_schedule(rows_per_worker: list[int], batch_size: int, epochs: int, seed: int, shuffle: bool) -> Schedule:
    """Every worker's batches for all epochs: each epoch permutes a worker's own rows (seeded by seed, epoch,
    rank) and cuts them into batches; all workers run ``max_r ceil(n_r / batch)`` steps per epoch."""
    steps = max((n + batch_size - 1) // batch_size for n in rows_per_worker) if rows_per_worker else 0
    out: list[list[np.ndarray]] = [[] for _ in rows_per_worker]
    gbs = []
    for epoch in range(epochs):
        perms = []
        for r, n in enumerate(rows_per_worker):
            perms.append(
                np.random.default_rng([seed, epoch, r]).permutation(n) if shuffle else np.arange(n, dtype=np.int64)
            )
        for t in range(steps):
            total = 0
            for r, p in enumerate(perms):
                rows = p[t * batch_size : (t + 1) * batch_size]
                out[r].append(rows)
                total += len(rows)
            gbs.append(total)
    return Schedule(out, gbs)
