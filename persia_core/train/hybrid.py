"""PERSIA's hybrid training step: embeddings asynchronous with bounded staleness, dense network synchronous.

Algorithm (Lian et al., "PERSIA: An Open, Hybrid System Scaling Deep Learning-based Recommenders up to 100
Trillion Parameters", KDD 2022, Sec. 4 and Alg. 1), per NN worker r of M with E embedding workers:

    embedding worker e (steps t % E == e, run ahead;      NN worker (this module), step t:
      ``persia_core.train.embedding_worker``):              take ready batch t from embedding worker t % E
      batch t: ID dropout, dedup IDs per table              dense forward/backward on emb[B, S, D] (DDP
      wait until pushes of steps <= t-K-1 applied             all-reduces dense gradients: synchronous)
      look rows up on the parameter servers                 write d loss / d emb into the ready slot,
      sum-pool each bag's rows into emb[B, S, D]              hand it back to embedding worker t % E
      take d loss / d emb back: one gradient row per        dense optimizer step
        unique ID (``kernels.bag_grads``), pushed

The NN worker does dense work only; the sparse work scales with E (``trainer.embedding_workers``), processes of
their own against the parameter servers (``feeders.ProcessFeeders``) or, for an in-process table, threads
(``feeders.ThreadFeeders``); the same code either way.

What overlaps with what: each embedding worker prepares up to ``trainer.prefetch_threads`` batches ahead of the
one in training, and pushes run in the background. The bound is exact: no lookup of batch t starts before every
push of this worker's batches <= t-K-1 is applied (K = ``embedding_staleness``; the embedding workers share one
``frontier`` of applied steps); the observed staleness of a lookup is the number of this worker's earlier steps
whose pushes are not yet applied, and is <= K. Running lookups no further ahead than overlap needs keeps the
observed staleness low, which is what keeps the AUC of K > 0 close to that of K = 0 (``docs/design-figures.md``).
With ``trainer.fresh_lookups`` (on by default) an embedding worker also waits, before looking batch t up, for
the pushes of steps <= t-2 (staleness 1: only the step in training's push missing), for as long as the NN
worker's pace leaves time for the lookup after them; a slower worker or server lets lookups run ahead within K.

K = 0 is fully synchronous training on the same code path: pushes carry ``sync_workers = M``, so each shard
combines the M workers' gradients of a step per ID and applies them once, and the next lookup waits for it.

Scaling: worker r's loss is ``sum of its BCE * M / B_global`` (B_global = rows of step t over all workers), so
DDP's mean over workers of dense gradients, and the server's sum of pushes divided by M, both equal the
gradient of the mean loss over the step's global batch; M workers therefore equal one worker on the M batches
concatenated, also when ranks hold uneven data (a rank out of data runs empty steps). With K > 0 each worker's
push is applied on its own and carries ``step_fraction = 1/M``: the scale-invariant optimizers (Adagrad, row-wise
Adagrad, Adam) normalize the 1/M gradient scale away, so they take 1/M of their step instead, and the M pushes of
a step move a row about as far as one synchronous update (without it, K > 0 loses AUC to K = 0: see
``docs/design-figures.md``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from persia_core.models import fused_step
from persia_core.models.dense import grad_into, wide_logit
from persia_core.train.feeders import Feeders

log = logging.getLogger("persia.hybrid")


def pin_host_memory(buf: np.ndarray) -> bool:
    """Page-lock ``buf`` (a page-aligned mapping) for the current CUDA device (``cudaHostRegister``), so that
    copies between it and the GPU are DMA transfers. Returns False, logging why, where CUDA refuses (e.g. a locked-
    memory limit): copies then go through CUDA's staging buffers, as from any pageable memory."""
    err = int(torch.cuda.cudart().cudaHostRegister(buf.ctypes.data, buf.nbytes, 0))
    if err != 0:
        torch.cuda.cudart().cudaGetLastError()  # clear it, so the next CUDA call does not report it
        log.warning(
            "could not pin the %d MiB ready ring for the GPU (cudaHostRegister error %d)", buf.nbytes >> 20, err
        )
        return False
    return True


@dataclass
class StepResult:
    """What one step did: step index, examples, summed BCE loss over them, lookup staleness (pushes of this
    worker not yet applied when the batch's rows were looked up), seconds spent waiting for the prefetcher."""

    step: int
    samples: int
    loss_sum: float
    staleness: int
    wait_s: float


class HybridTrainPipeline:
    """One NN worker's hybrid training loop; ``progress()`` advances one step (TorchRec's train-pipeline shape).

    Args:
        model: the dense model (wrapped in DDP when M > 1); called as ``model(emb[B,S,D], dense[B,F])``.
        optimizer: the dense optimizer.
        feeders: this NN worker's embedding workers (``feeders.ThreadFeeders`` or ``feeders.ProcessFeeders``),
            started at step ``start``; closed by ``close``.
        global_batch: rows of each step over all NN workers (``Schedule.global_batch``).
        start: the first step. num_workers: M.
        device: where the dense model runs. On CUDA the ready batch is copied to the GPU and the gradient with
            respect to the pooled embeddings comes back.

    A ``half`` ring (``trainer.fp16_transfer``; ``ready_ring``) hands the embeddings over as fp16, converted by the
    embedding workers, and takes the gradient back as fp16; a gradient that overflows fp16 goes back as fp32 for
    that step instead (counted in ``fp16_fallbacks``), never as inf. On CUDA the ring is pinned where CUDA allows.
    """

    def __init__(
        self,
        model,
        optimizer,
        feeders: Feeders,
        global_batch: list[int],
        start: int,
        num_workers: int,
        device: str | torch.device = "cpu",
    ):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.half = feeders.layout.half
        self.fp16_fallbacks = 0
        # the ring pinned (page-locked) for the GPU: batches and gradients then cross by DMA, without a staging copy
        self.pinned = self.cuda and pin_host_memory(feeders.segment.buf)
        self.model = model
        self.optimizer = optimizer
        # zeroed by setting each gradient to None: ``optimizer.zero_grad`` does that too, behind a per-call cost of
        # tens of microseconds (torch.compile's guard and the profiler's record_function)
        self.params = [p for group in optimizer.param_groups for p in group["params"]]
        self.feeders = feeders
        self.global_batch = global_batch
        self.next_step = start
        self.M = num_workers
        self.max_staleness = 0
        # seconds per phase of a step; the first batch's wait (the first lookups: start-up) is kept apart, so that
        # "wait" says how long steady-state steps wait on the embedding workers
        self.phase_s = {
            "first_batch_wait": 0.0,
            "wait": 0.0,
            "forward": 0.0,
            "backward": 0.0,
            "push": 0.0,
            "optimizer": 0.0,
        }
        self._waited_first = False

    def progress(self) -> StepResult:
        """Train one step. Raises ``StopIteration`` after the last step, ``EmbeddingWorkerFailed`` naming an
        embedding worker that failed (a lookup or push error, inf or NaN gradients) or died."""
        step = self.next_step
        if step >= len(self.global_batch):
            raise StopIteration
        t0 = time.perf_counter()
        slot, b, staleness = self.feeders.ready(step)
        t1 = time.perf_counter()
        e = step % self.feeders.E
        emb_buf, dense_buf, labels_buf = self.feeders.views(e, slot)
        emb_host = torch.from_numpy(self.feeders.views_half(e, slot)[:b] if self.half else emb_buf[:b])
        dense, labels = torch.from_numpy(dense_buf[:b]), torch.from_numpy(labels_buf[:b])
        if self.cuda:  # from the ring as it is: DMA where it is pinned, and fp16 where the ring is half
            emb = emb_host.to(self.device, non_blocking=self.pinned).float()
            dense = dense.to(self.device, non_blocking=self.pinned)
            labels = labels.to(self.device, non_blocking=self.pinned)
        else:
            emb = emb_host.float() if self.half else emb_host
        emb.requires_grad_(True)
        if emb.data_ptr() == emb_buf.ctypes.data:  # the ring's slot itself: the gradient may go straight there
            grad_into(emb, torch.from_numpy(emb_buf[:b]))  # (a tensor of its own: emb referring to itself is a cycle)
        logits = self.model(emb, dense)
        wide_buf = self.feeders.wide_view(e, slot)
        wide = None
        if wide_buf is not None:  # the first-order term: the sum of the sample's wide-table weights
            wide = torch.from_numpy(wide_buf[:b])
            wide = (wide.to(self.device, non_blocking=self.pinned) if self.cuda else wide).requires_grad_(True)
            logits = logits + wide_logit(wide)
        loss_sum = F.binary_cross_entropy_with_logits(logits, labels, reduction="sum")
        scaled = loss_sum * (self.M / max(self.global_batch[step], 1))
        for p in self.params:
            p.grad = None
        t2 = time.perf_counter()
        scaled.backward()
        t3 = time.perf_counter()
        g = emb.grad
        out = emb_buf[:b]
        half = False
        if g is None:  # the dense model ignores the embeddings: zero gradients, pushed all the same
            out[...] = 0.0
        else:
            if self.half:
                h = g.half()
                half = bool(torch.isfinite(h).all())  # else fp32: an overflow, or inf/NaN the embedding worker refuses
                self.fp16_fallbacks += not half
            # straight into the ring (from the GPU: DMA where it is pinned), unless the model wrote it there already
            # (grad_into); inf/NaN are refused by the embedding worker as it sums the gradient per ID
            if half or g.data_ptr() != out.ctypes.data:
                torch.from_numpy(self.feeders.views_half(e, slot)[:b] if half else out).copy_(h if half else g)
        emb.grad = None
        if wide is not None:
            assert wide_buf is not None
            assert wide.grad is not None  # the logit always depends on it
            torch.from_numpy(wide_buf[:b]).copy_(wide.grad)
        self.feeders.give_grad(step, slot, half)
        t4 = time.perf_counter()
        fused_step(self.optimizer)
        t5 = time.perf_counter()
        self.next_step = step + 1
        self.max_staleness = max(self.max_staleness, staleness)
        ph = self.phase_s
        ph["wait" if self._waited_first else "first_batch_wait"] += t1 - t0
        self._waited_first = True
        ph["forward"] += t2 - t1
        ph["backward"] += t3 - t2
        ph["push"] += t4 - t3
        ph["optimizer"] += t5 - t4
        return StepResult(step, b, float(loss_sum.detach()), staleness, t1 - t0)

    def drain(self, timeout_s: float = 120.0) -> None:
        """Wait until every push of the steps trained so far is applied. Raises ``EmbeddingWorkerFailed`` for a
        failed push, or ``TimeoutError``."""
        self.feeders.drain(self.next_step, timeout_s)

    def close(self) -> None:
        """Stop the embedding workers (after ``drain`` for a clean end)."""
        if self.pinned:
            torch.cuda.synchronize(self.device)
            torch.cuda.cudart().cudaHostUnregister(self.feeders.segment.buf.ctypes.data)
            self.pinned = False
        self.feeders.close()
