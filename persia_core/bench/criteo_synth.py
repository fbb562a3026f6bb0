"""A synthetic Criteo-shaped click dataset with a planted model, written as the preprocess step's Parquet shards.

Shape (Criteo Display Advertising: ``label, I1..I13, C1..C26``)::

    C1..C26   one ID per row and slot, value ranks 0..V-1 (V = 100,000) drawn with a Zipf skew
              P(rank k) ~ (k + 1)^-a (a = 1.05), each value an 8-hex-digit string hashed to a feature ID
              (``persia_core.hashing``: every slot's vocabulary is hashed once, then indexed)
    I1..I13   counts floor(exp(N(mu_j, 1.2))), stored as log1p(count) (the delimited layout's transform)
    label     Bernoulli(sigmoid(logit)), the planted model:
                logit = b0 + sum_s w_s[v_s]                 per-ID weights, std 0.6 (8 slots), 0.25 (10), 0 (8)
                        + sum_(a,b) <u_a[v_a], u_b[v_b]>    two low-rank pairwise terms (C1 x C2, C3 x C4)
                        + beta . z                           z = standardized dense features
              with b0 set so the base rate is about 0.25.

The ``eval`` split (default 1,000,000 rows: AUC standard error ~0.0005) and the ``train`` split (N rows in 4
shards) are drawn from the same distribution; ``schema.json`` records ``planted_auc``, the AUC of the planted
logits on the eval split (the Bayes ceiling no contestant can beat). Generation is vectorized (``pa.ListArray``
from offsets and values, no Python loop per row) and deterministic in ``seed``.
"""

from __future__ import annotations

import json
import os
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from persia_core.data import schema as S
from persia_core.hashing import feature_ids

NUM_SLOTS = 26
NUM_DENSE = 13
VOCAB = 100_000
ZIPF_EXPONENT = 1.05
SLOTS = [f"C{i}" for i in range(1, NUM_SLOTS + 1)]
DENSE = [f"I{i}" for i in range(1, NUM_DENSE + 1)]
CHUNK_ROWS = 250_000


def criteo_config_dict(batch_size: int = 4096, num_workers: int = 1, staleness: int = 4, seed: int = 0) -> dict:
    """The run config (``RunConfig.from_dict`` input) of the synthetic set: Criteo's delimited layout, slots
    C1..C26 in one table (dim 16, row-wise Adagrad), DLRM of the Criteo Kaggle shape (bottom 13-512-256-64-16,
    top 512-256-1, the logit's bias starting at 0 as the plain-PyTorch and TorchRec contestants' does), 2
    parameter-server shards, one epoch. ``batch_size`` is per NN worker."""
    return {
        "layout": {
            "kind": "delimited",
            "delimiter": "\t",
            "columns": ["label", *DENSE, *SLOTS],
            "label_column": "label",
            "dense_columns": list(DENSE),
            "dense_transform": "log1p",
        },
        "split": {"eval_fraction": 0.2, "num_train_shards": 4, "num_eval_shards": 1},
        "slots": [{"name": s, "source": s} for s in SLOTS],
        "embedding": {
            "tables": [
                {
                    "name": "default",
                    "dim": 16,
                    "init_scale": 0.01,
                    "optimizer": {"name": "rowwise_adagrad", "lr": 0.05, "eps": 1e-8},
                }
            ],
            "num_shards": 2,
            "shard_memory_bytes": 268435456,
        },
        "model": {"kind": "dlrm", "hidden": [512, 256], "bottom": [512, 256, 64], "bias_init": "zero"},
        "trainer": {
            "batch_size": batch_size,
            "epochs": 1,
            "embedding_staleness": staleness,
            "num_workers": num_workers,
            "dense_lr": 0.001,
            "seed": seed,
        },
    }


class PlantedModel:
    """The generator: Zipf sampler, hashed vocabularies and planted weights, all from ``seed``."""

    STRONG, WEAK = 8, 10
    PAIRS = ((0, 1), (2, 3))
    RANK = 4

    def __init__(self, seed: int = 0, vocab: int = VOCAB, zipf: float = ZIPF_EXPONENT):
        rng = np.random.default_rng([seed, 1])
        self.vocab = vocab
        cdf = np.cumsum(np.arange(1, vocab + 1, dtype=np.float64) ** -zipf)
        self.cdf = cdf / cdf[-1]
        sig = np.zeros(NUM_SLOTS)
        sig[: self.STRONG] = 0.6
        sig[self.STRONG : self.STRONG + self.WEAK] = 0.25
        self.w = (rng.normal(size=(NUM_SLOTS, vocab)) * sig[:, None]).astype(np.float32)
        self.u = rng.normal(size=(NUM_SLOTS, vocab, self.RANK)).astype(np.float32) * np.float32(0.5)
        self.mu = rng.uniform(0.5, 4.0, NUM_DENSE)
        self.beta = rng.normal(scale=0.3, size=NUM_DENSE)
        # moments of log1p(floor(exp(N(mu, 1.2)))), estimated once on a fixed sample
        probe = self._dense_raw(np.random.default_rng([seed, 2]), 200_000)
        self.z_mean, self.z_std = probe.mean(0), probe.std(0) + 1e-6
        self.ids = np.stack(
            [np.asarray(feature_ids(s, [f"{v:08x}" for v in range(vocab)]), dtype=np.uint64) for s in SLOTS]
        )
        self.b0 = 0.0
        ranks, dense = self.sample_features(np.random.default_rng([seed, 3]), 200_000)
        base = self.logits(ranks, dense)
        lo, hi = -10.0, 10.0
        for _ in range(50):  # bisection: mean click probability 0.25
            mid = (lo + hi) / 2
            if np.mean(1 / (1 + np.exp(-(base + mid)))) > 0.25:
                hi = mid
            else:
                lo = mid
        self.b0 = (lo + hi) / 2

    def _dense_raw(self, rng: np.random.Generator, n: int) -> np.ndarray:
        counts = np.floor(np.exp(rng.normal(self.mu, 1.2, size=(n, NUM_DENSE))))
        return np.log1p(counts).astype(np.float32)

    def sample_features(self, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
        """``ranks: int32[n, 26]`` value ranks per slot and ``dense: float32[n, 13]`` (after log1p)."""
        ranks = np.minimum(np.searchsorted(self.cdf, rng.random((n, NUM_SLOTS))), self.vocab - 1).astype(np.int32)
        return ranks, self._dense_raw(rng, n)

    def logits(self, ranks: np.ndarray, dense: np.ndarray) -> np.ndarray:
        """The planted logit ``float64[n]`` of each row."""
        cols = np.arange(NUM_SLOTS)[None, :]
        out = self.w[cols, ranks].sum(1, dtype=np.float64) + self.b0
        for a, b in self.PAIRS:
            out += np.einsum("nk,nk->n", self.u[a, ranks[:, a]], self.u[b, ranks[:, b]])
        out += ((dense - self.z_mean) / self.z_std) @ self.beta
        return out

    def table(
        self, rng: np.random.Generator, n: int, start: int, ids_of=None, source: str = "criteo_synth"
    ) -> tuple[pa.Table, np.ndarray]:
        """``n`` rows as a shard table (``schema.arrow_schema(SLOTS)``) and their planted logits. ``ids_of(s,
        ranks)``: the feature IDs ``uint64[n]`` of slot ``s`` for its value ranks (default: the hashed vocabulary's);
        ``source``: every row's source."""
        ranks, dense = self.sample_features(rng, n)
        logit = self.logits(ranks, dense)
        label = (rng.random(n) < 1 / (1 + np.exp(-logit))).astype(np.float32)
        one = pa.array(np.arange(n + 1, dtype=np.int32))
        cols = [
            pa.array(label, pa.float32()),
            pa.ListArray.from_arrays(
                pa.array(np.arange(0, NUM_DENSE * n + 1, NUM_DENSE, dtype=np.int32)),
                pa.array(dense.reshape(-1), pa.float32()),
            ),
        ]
        for s in range(NUM_SLOTS):
            ids = self.ids[s][ranks[:, s]] if ids_of is None else ids_of(s, ranks[:, s])
            cols.append(pa.ListArray.from_arrays(one, pa.array(ids, pa.uint64())))
        cols.append(pa.array(np.arange(start, start + n, dtype=np.int64)))
        cols.append(pa.repeat(source, n))
        return pa.Table.from_arrays(cols, schema=S.arrow_schema(SLOTS)), logit


def _write_split(
    model: PlantedModel, out_dir: str, split: str, sizes: list[int], seed: int, start: int
) -> tuple[list[str], list[np.ndarray], list[np.ndarray]]:
    files, logits, labels = [], [], []
    os.makedirs(os.path.join(out_dir, split), exist_ok=True)
    for i, n in enumerate(sizes):
        rel = f"{split}/{split}-{i:05d}-of-{len(sizes):05d}.parquet"
        rng = np.random.default_rng([seed, 10 if split == "train" else 11, i])
        with pq.ParquetWriter(os.path.join(out_dir, rel), S.arrow_schema(SLOTS)) as w:
            done = 0
            while done < n:
                k = min(CHUNK_ROWS, n - done)
                t, lg = model.table(rng, k, start)
                w.write_table(t)
                logits.append(lg)
                labels.append(t.column(S.LABEL).to_numpy())
                done += k
                start += k
        files.append(rel)
    return files, logits, labels


def write_criteo_synth(
    out_dir: str, train_rows: int, eval_rows: int = 1_000_000, seed: int = 0, train_shards: int = 4, vocab: int = VOCAB
) -> dict:
    """Write ``train/`` (``train_rows`` in ``train_shards`` files), ``eval/`` (``eval_rows``, one file) and
    ``schema.json`` under ``out_dir``; returns the schema dict (with ``planted_auc`` on the eval split and
    ``config``: :func:`criteo_config_dict`). Raises ``ValueError`` for non-positive sizes."""
    from sklearn.metrics import roc_auc_score

    if train_rows < train_shards or eval_rows < 1:
        raise ValueError(f"train_rows ({train_rows}) must be >= train_shards ({train_shards}), eval_rows >= 1")
    t0 = time.time()
    model = PlantedModel(seed, vocab)
    sizes = [train_rows // train_shards + (1 if i < train_rows % train_shards else 0) for i in range(train_shards)]
    train_files, _, train_labels = _write_split(model, out_dir, "train", sizes, seed, 0)
    eval_files, eval_logits, eval_labels = _write_split(model, out_dir, "eval", [eval_rows], seed, train_rows)
    y = np.concatenate(eval_labels)
    planted_auc = float(roc_auc_score(y, np.concatenate(eval_logits))) if 0 < y.mean() < 1 else None
    schema = {
        "slots": list(SLOTS),
        "dense": list(DENSE),
        "dense_mean": [float(v) for v in model.z_mean],
        "dense_std": [float(v) for v in model.z_std],
        "rows": {"train": train_rows, "eval": eval_rows, "malformed": 0, "read": train_rows + eval_rows},
        "distinct_ids": {s: vocab for s in SLOTS},
        "split": {"by": "row_order", "cutoff": train_rows},
        "train_files": train_files,
        "eval_files": eval_files,
        "config": criteo_config_dict(),
        "synthetic": {
            "generator": "persia_core.bench.criteo_synth",
            "seed": seed,
            "vocab": vocab,
            "zipf_exponent": ZIPF_EXPONENT,
            "planted_auc": planted_auc,
            "train_base_rate": float(np.concatenate(train_labels).mean()),
            "eval_base_rate": float(y.mean()),
            "seconds": time.time() - t0,
        },
    }
    with open(os.path.join(out_dir, S.SCHEMA_FILE), "w") as f:
        json.dump(schema, f, indent=1)
    return schema
