"""Contestant (c) of ``make bench``: plain PyTorch, fully synchronous, one process; and the data it shares with (d).

The plain baseline is what a PyTorch user writes without a parameter server: the embedding tables are one
``nn.EmbeddingBag(sum, sparse=True)`` holding every slot's rows (slot s at rows ``base[s] .. base[s]+V_s-1``,
one ``embedding_bag`` call per batch), ``torch.optim.Adagrad`` on its sparse gradients, ``torch.optim.Adam`` on
the dense model (``persia_core.models``, the same network as the hybrid contestants), one step per batch.

Feature IDs become table rows through an exact vocabulary per slot (``np.unique`` of the slot's train IDs,
then ``searchsorted``), computed once before the timed loop, as a categorified Criteo dataset would hold them;
an evaluation ID never seen in training is left out of its bag, which equals the hybrid engine's zero row for
unseen IDs under sum pooling. This module imports only numpy, pyarrow and torch at the top (and
``persia_core`` data helpers), so the TorchRec contestant's own environment can import it too.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from persia_core.data.reader import ParquetExamples, read_schema, shard_files
from persia_core.sparse import jagged_take


@dataclass
class IndexedSplit:
    """One split with feature IDs replaced by per-slot row indices.

    ``labels: float32[R]``, ``dense: float32[R, F]``, per slot s ``values[s]: int64[n_s]`` (row of slot s's
    table) and ``offsets[s]: int64[R+1]``; ``fixed: int64[R, S]`` when every slot has exactly one ID per row
    (then batches are a plain gather), else None."""

    labels: np.ndarray
    dense: np.ndarray
    values: list[np.ndarray]
    offsets: list[np.ndarray]
    fixed: np.ndarray | None

    def __len__(self) -> int:
        return len(self.labels)

    def batch(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The bags of ``rows: int64[B]``, slot-major (bag ``s*B + b``, KeyedJaggedTensor order):
        ``values: int64[n]`` per-slot row indices and ``lengths: int64[S*B]``."""
        if self.fixed is not None:
            v = self.fixed[rows].T.reshape(-1)
            return v, np.ones(len(v), dtype=np.int64)
        vals, lens = [], []
        for v, o in zip(self.values, self.offsets, strict=True):
            bv, bo = jagged_take(v, o, rows)
            vals.append(bv)
            lens.append(np.diff(bo))
        return np.concatenate(vals), np.concatenate(lens)


@dataclass
class IndexedData:
    """Train and eval splits of a preprocessed dataset, indexed per slot; ``vocab[s]``: rows of slot s's
    table (its distinct train IDs); ``dense_mean``/``dense_std``: the train statistics of ``schema.json``."""

    slots: list[str]
    train: IndexedSplit
    eval: IndexedSplit
    vocab: list[int]
    dense_mean: list[float]
    dense_std: list[float]
    seconds: float


def _index_split(ex: ParquetExamples, slots: list[str], vocabs: list[np.ndarray]) -> IndexedSplit:
    values, offsets = [], []
    for s, vocab in zip(slots, vocabs, strict=True):
        v, o = ex.ids[s]
        pos = np.minimum(np.searchsorted(vocab, v), max(len(vocab) - 1, 0))
        found = vocab[pos] == v if len(vocab) else np.zeros(len(v), bool)
        if not found.all():  # drop unseen IDs from their bags (the zero row under sum pooling)
            row = np.repeat(np.arange(len(o) - 1), np.diff(o))
            o = np.zeros(len(o), np.int64)
            np.cumsum(np.bincount(row[found], minlength=len(o) - 1), out=o[1:])
            pos = pos[found]
        values.append(pos.astype(np.int64))
        offsets.append(o.astype(np.int64))
    fixed = None
    r = len(ex)
    if all(len(v) == r and np.array_equal(o, np.arange(r + 1)) for v, o in zip(values, offsets, strict=True)):
        fixed = np.stack(values, axis=1) if values else np.zeros((r, 0), np.int64)
        values, offsets = [], []  # the matrix holds them; halves the memory of a large split
    return IndexedSplit(ex.labels, ex.dense, values, offsets, fixed)


def load_indexed(data_dir: str, slots: list[str] | None = None) -> IndexedData:
    """Read a preprocessed dataset (Parquet shards + ``schema.json``) and index its IDs (see module docstring).
    ``slots``: default all of ``schema.json``'s. Raises ``FileNotFoundError`` for a missing dataset."""
    t0 = time.perf_counter()
    schema = read_schema(data_dir)
    slots = list(slots or schema["slots"])
    tr = ParquetExamples(shard_files(data_dir, "train"), slots)
    ev = ParquetExamples(shard_files(data_dir, "eval"), slots)
    vocabs = [np.unique(tr.ids[s][0]) for s in slots]
    f = tr.dense.shape[1]
    mean = schema.get("dense_mean") or [0.0] * f
    std = schema.get("dense_std") or [1.0] * f
    return IndexedData(
        slots,
        _index_split(tr, slots, vocabs),
        _index_split(ev, slots, vocabs),
        [len(v) for v in vocabs],
        list(mean),
        list(std),
        time.perf_counter() - t0,
    )


def drop_bags(
    values: np.ndarray, lengths: np.ndarray, rates: np.ndarray, batch: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """ID dropout as the hybrid trainer does it (``persia_core.train.hybrid.drop_ids``): each bag of slot s is
    emptied with probability ``rates[s]``. ``values: int64[n]``, ``lengths: int64[S*B]`` slot-major."""
    keep = rng.random(len(lengths)) >= np.repeat(rates, batch)
    return values[np.repeat(keep, lengths)], lengths * keep


def batches(num_rows: int, batch_size: int, samples: int, seed: int):
    """Row indices ``int64[b]`` of successive batches until ``samples`` rows were served: every pass over the
    data is a fresh permutation (seeded by seed and the pass); the last batch may be short."""
    served, epoch = 0, 0
    while served < samples:
        perm = np.random.default_rng([seed, epoch]).permutation(num_rows)
        for start in range(0, num_rows, batch_size):
            rows = perm[start : start + min(batch_size, samples - served)]
            if len(rows) == 0:
                return
            yield rows
            served += len(rows)
            if served >= samples:
                return
        epoch += 1


def eval_metrics(labels: np.ndarray, preds: np.ndarray) -> dict:
    """AUC, logloss and NE exactly as the evaluate step computes them (``binary_metrics``)."""
    from persia_core.evaluate.metrics import binary_metrics

    m = binary_metrics(labels, preds)
    return {"auc": m["auc"], "logloss": m["logloss"], "ne": m["ne"]}


class PlainTorchModel(torch.nn.Module):
    """One sparse ``EmbeddingBag`` over every slot's rows + a dense model ``dense(emb[B,S,D], x[B,F])``."""

    base: torch.Tensor  # a buffer (register_buffer), typed for mypy

    def __init__(self, vocab: list[int], dim: int, dense: torch.nn.Module, init_scale: float):
        super().__init__()
        self.num_slots = len(vocab)
        self.register_buffer(
            "base", torch.tensor(np.concatenate([[0], np.cumsum(vocab)[:-1]]), dtype=torch.int64), persistent=False
        )
        self.emb = torch.nn.EmbeddingBag(
            max(int(sum(vocab)), 1), dim, mode="sum", sparse=True, include_last_offset=True
        )
        torch.nn.init.uniform_(self.emb.weight, -init_scale, init_scale)
        self.dense = dense

    def forward(self, values: torch.Tensor, lengths: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        b = x.shape[0]
        per_slot = lengths.view(self.num_slots, b).sum(1)
        idx = values + torch.repeat_interleave(self.base, per_slot, output_size=values.shape[0])
        offsets = torch.zeros(lengths.shape[0] + 1, dtype=torch.int64)
        torch.cumsum(lengths, 0, out=offsets[1:])
        pooled = self.emb(idx, offsets)  # [S*B, D]
        return self.dense(pooled.view(self.num_slots, b, -1).transpose(0, 1), x)


def predict(forward, split: IndexedSplit, batch_size: int = 16384) -> np.ndarray:
    """Click probabilities ``float32[R]`` of every row of ``split``, in order; ``forward(values, lengths, x)``
    returns logits."""
    out = []
    with torch.no_grad():
        for start in range(0, len(split), batch_size):
            rows = np.arange(start, min(start + batch_size, len(split)))
            v, ln = split.batch(rows)
            out.append(
                torch.sigmoid(
                    forward(torch.from_numpy(v), torch.from_numpy(ln), torch.from_numpy(split.dense[rows]))
                ).numpy()
            )
    return np.concatenate(out) if out else np.zeros(0, np.float32)


def train_loop(
    step, data: IndexedData, batch_size: int, samples: int, seed: int, dropout: np.ndarray, progress=None
) -> dict:
    """Run ``step(values, lengths, x, labels) -> loss`` over ``samples`` training rows (see :func:`batches`);
    returns ``{"samples", "train_seconds", "train_cpu_seconds", "sps", "final_loss"}`` (``train_cpu_seconds``: CPU
    time of this process, all its threads, over the loop). ``dropout``: ID-dropout rate per slot."""
    rng = np.random.default_rng([seed, 99])
    tr = data.train
    n, loss, steps = 0, float("nan"), 0
    t0, cpu0 = time.perf_counter(), time.process_time()
    for rows in batches(len(tr), batch_size, samples, seed):
        v, ln = tr.batch(rows)
        if dropout.any():
            v, ln = drop_bags(v, ln, dropout, len(rows), rng)
        loss = step(
            torch.from_numpy(v),
            torch.from_numpy(ln),
            torch.from_numpy(tr.dense[rows]),
            torch.from_numpy(tr.labels[rows]),
        )
        n += len(rows)
        steps += 1
        if progress is not None and steps % 50 == 0:
            progress(f"{n}/{samples} samples, {n / (time.perf_counter() - t0):.0f} samples/s, loss {loss:.4f}")
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    return {
        "samples": n,
        "train_seconds": elapsed,
        "train_cpu_seconds": cpu,
        "sps": n / max(elapsed, 1e-9),
        "final_loss": loss,
    }


def run_plain_torch(
    data: IndexedData,
    config,
    samples: int,
    seed: int = 0,
    batch_size: int | None = None,
    threads: int = 0,
    progress=None,
) -> dict:
    """Contestant (c): train on ``samples`` rows of ``data`` with the run config's dense model, embedding dim,
    learning rates and ID dropout, then evaluate on the eval split.

    Returns ``{"sps", "auc", "logloss", "ne", "samples", "train_seconds", "eval_seconds", "final_loss"}``.
    ``batch_size``: default ``trainer.batch_size``; ``threads``: torch intra-op threads (0 = all cores)."""
    import os
    import warnings

    import torch.nn.functional as F

    from persia_core.models import build_model, dense_optimizer

    warnings.filterwarnings("ignore", message="Sparse invariant checks")  # from Adagrad's sparse path
    torch.set_flush_denormal(True)
    torch.set_num_threads(threads or os.cpu_count() or 1)
    table = config.embedding.tables[0]
    bs = batch_size or config.trainer.batch_size
    torch.manual_seed(seed)
    dense = build_model(config.model, len(data.slots), table.dim, len(data.dense_mean), data.dense_mean, data.dense_std)
    model = PlainTorchModel(data.vocab, table.dim, dense, table.init_scale)
    opt_e = torch.optim.Adagrad(model.emb.parameters(), lr=table.optimizer.lr, eps=table.optimizer.eps)
    opt_d = dense_optimizer(dense, config.trainer.dense_lr, config.trainer.dense_weight_decay)
    rates = {s.name: s.id_dropout for s in config.slots}
    dropout = np.array([rates.get(s, 0.0) for s in data.slots])

    def step(v, ln, x, y):
        logits = model(v, ln, x)
        loss = F.binary_cross_entropy_with_logits(logits, y)
        opt_e.zero_grad(set_to_none=True)
        opt_d.zero_grad(set_to_none=True)
        loss.backward()
        opt_e.step()
        opt_d.step()
        return float(loss.detach())

    out = train_loop(step, data, bs, samples, seed, dropout, progress)
    t0 = time.perf_counter()
    model.eval()
    preds = predict(model, data.eval)
    out.update(eval_metrics(data.eval.labels, preds))
    out["eval_seconds"] = time.perf_counter() - t0
    out["table_rows"] = int(sum(data.vocab))
    return out
