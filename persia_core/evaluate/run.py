"""Evaluate a trained Model artifact on the evaluation split.

Lookups are read-only: an ID never seen in training gets the zero (default) row and no row is inserted. The
shards are loaded in this process (``LocalEmbedding``) with the same routing as training.
"""

from __future__ import annotations

import io as _io
import json

import numpy as np
import torch

from persia_core import io
from persia_core.config import RunConfig
from persia_core.data.reader import ParquetExamples, read_schema, shard_files
from persia_core.embedding.sharded import LocalEmbedding
from persia_core.evaluate.metrics import StreamingMetrics, roc_points
from persia_core.models import build_model
from persia_core.train.hybrid import model_slot_order, pool, prepare_ids, table_layouts


class LoadedModel:
    """A Model artifact in memory: dense network and embedding shards. ``predict(batch) -> float32[B]``.

    Raises ``FileNotFoundError`` for a missing artifact file, ``ValueError`` for an unknown format."""

    def __init__(self, model_dir: str):
        path = io.join(model_dir, "manifest.json")
        if not io.exists(path):
            raise FileNotFoundError(f"{path}: not a trained model (no manifest.json)")
        self.manifest = json.loads(io.read_text(path))
        if self.manifest.get("format") != "persia-model/1":
            raise ValueError(f"{path}: unknown model format {self.manifest.get('format')!r}")
        self.config = RunConfig.from_dict(self.manifest["config"])
        self.layouts = table_layouts(self.config)
        self.slots = model_slot_order(self.config)
        self.embedding = LocalEmbedding(self.config.embedding, self.manifest["num_shards"], self.config.trainer.seed)
        self.embedding.load([io.join(model_dir, f) for f in self.manifest["shard_files"]])
        self.dense = build_model(self.config.model, len(self.slots), self.layouts[0].dim, len(self.manifest["dense"]),
                                 self.manifest["dense_mean"], self.manifest["dense_std"])
        state = torch.load(_io.BytesIO(io.read_bytes(io.join(model_dir, self.manifest["dense_file"]))),
                           weights_only=True)
        self.dense.load_state_dict(state)
        self.dense.eval()

    @torch.no_grad()
    def predict(self, batch) -> np.ndarray:
        """Click probabilities ``float32[B]`` of a ``Batch`` whose slots are in ``self.slots`` order."""
        prepared = prepare_ids(batch.ids, self.layouts)
        pooled = []
        for t in self.layouts:
            rows = torch.from_numpy(self.embedding.lookup_readonly(t.name, prepared[t.name].uniq))
            pooled.append(pool(rows, prepared[t.name], len(t.slots), batch.size))
        emb = torch.cat(pooled, dim=1) if len(pooled) > 1 else pooled[0]
        return torch.sigmoid(self.dense(emb, torch.from_numpy(batch.dense))).numpy()


def evaluate(model_dir: str, data_dir: str, batch_size: int = 4096) -> dict:
    """Score the evaluation split of ``data_dir`` with the model in ``model_dir``.

    Returns ``{"metrics": {...auc, logloss, ne, calibration, ...}, "roc": {...}, "labels": float32[N],
    "preds": float32[N], "config": dict, "train_history": dict|None}``."""
    model = LoadedModel(model_dir)
    read_schema(data_dir)
    examples = ParquetExamples(shard_files(data_dir, "eval"), model.slots)
    stream = StreamingMetrics()
    preds = []
    for start in range(0, len(examples), batch_size):
        batch = examples.batch(np.arange(start, min(start + batch_size, len(examples))))
        p = model.predict(batch)
        stream.update(batch.labels, p)
        preds.append(p)
    preds_all = np.concatenate(preds) if preds else np.zeros(0, np.float32)
    metrics = stream.compute()
    history = None
    hp = io.join(model_dir, "train_metrics.json")
    if io.exists(hp):
        history = json.loads(io.read_text(hp))
    return {"metrics": metrics, "roc": roc_points(examples.labels, preds_all) if metrics["auc"] is not None else None,
            "labels": examples.labels, "preds": preds_all, "config": model.manifest["config"],
            "train_history": history}
