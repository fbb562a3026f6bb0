"""Evaluate a trained Model artifact on the evaluation split.

Lookups are read-only: an ID never seen in training gets the zero (default) row and no row is inserted. The
shards are loaded in this process (``LocalEmbedding``) with the same routing as training.

Besides the overall metrics (``metrics.binary_metrics`` over every (prediction, label) pair, streamed batch by
batch), ``evaluate`` reports, from the same predictions:

* per-slot coverage: the share of evaluation IDs that have no row in the trained shards, i.e. were never seen in
  training (``LocalEmbedding.contains``; by occurrence and by distinct ID);
* with a user slot (``user_slot``, default ``"user"``): GAUC over users, and every metric for rows whose user
  was seen in training vs not (a row's user is seen when the shards hold a row for its user ID).
"""

from __future__ import annotations

import json
import logging
from typing import Any

import numpy as np
import torch

from persia_core import io
from persia_core.config import RunConfig
from persia_core.data.reader import ParquetExamples, read_schema, shard_files
from persia_core.embedding.layout import model_slot_order, table_layouts, wide_layout
from persia_core.embedding.pooling import readonly_logits
from persia_core.embedding.reference import LocalEmbedding
from persia_core.evaluate.lr_reference import lr_reference as fit_reference
from persia_core.evaluate.metrics import StreamingMetrics, group_auc, id_coverage, roc_points, subset_metrics
from persia_core.logging_utils import progress
from persia_core.model_store import METRICS_FILE, read_manifest
from persia_core.models import build_model, load_dense_weights

log = logging.getLogger("persia.evaluate")


DEFAULT_USER_SLOT = "user"
"""The user slot of the shipped MovieLens config; a model without it (Criteo) is evaluated without GAUC and
the seen/unseen-user split."""


def check_user_slot(user_slot: str, slots: list[str], model_dir: str = "") -> bool:
    """Whether the GAUC / seen-unseen-user split runs on ``user_slot`` for a model with ``slots``.

    ``""`` (no user slot) and the default ``DEFAULT_USER_SLOT`` absent from ``slots``: ``False`` (skipped).
    Any other name that is not one of ``slots``: ``ValueError`` naming it and listing the model's slots."""
    if user_slot in slots:
        return True
    if user_slot in ("", DEFAULT_USER_SLOT):
        return False
    where = f" of the model {model_dir}" if model_dir else ""
    raise ValueError(
        f"user slot {user_slot!r} is not a slot{where}; its slots are {slots} (or give '' for no user slot)"
    )


class LoadedModel:
    """A Model artifact in memory: dense network and embedding shards. ``predict(batch) -> float32[B]``.

    Raises ``FileNotFoundError`` for a missing artifact file, ``ValueError`` for an unknown format."""

    def __init__(self, model_dir: str):
        self.model_dir, self.manifest = read_manifest(model_dir)
        model_dir = self.model_dir
        self.config = RunConfig.from_dict(self.manifest.config)
        self.layouts = table_layouts(self.config)
        self.slots = model_slot_order(self.config)
        self.wide = wide_layout(self.config)
        crcs = self.manifest.shard_crc32c
        if len(self.manifest.shard_files) != self.manifest.num_shards:
            raise ValueError(
                f"{model_dir}: the manifest lists {len(self.manifest.shard_files)} shard files for "
                f"{self.manifest.num_shards} shards"
            )
        self.embedding = LocalEmbedding.from_shard_files(  # read-only: every table sized to the rows it holds
            self.config.embedding,
            [io.join(model_dir, f) for f in self.manifest.shard_files],  # each checked against its CRC-32C
            [(None, int(c)) for c in crcs] if crcs else None,
            self.config.trainer.seed,
        )
        self.dense = build_model(
            self.config.model,
            len(self.slots),
            self.layouts[0].dim,
            len(self.manifest.dense),
            self.manifest.dense_mean,
            self.manifest.dense_std,
        )
        dense_path = io.join(model_dir, self.manifest.dense_file)
        load_dense_weights(self.dense, io.read_state_dict(dense_path), dense_path)
        self.dense.eval()

    @torch.no_grad()
    def predict(self, batch) -> np.ndarray:
        """Click probabilities ``float32[B]`` of a ``Batch`` whose slots are in ``self.slots`` order."""
        logits = readonly_logits(self.dense, self.embedding, self.layouts, self.wide, batch)
        return torch.sigmoid(logits).numpy()


def score(
    model: LoadedModel,
    examples: ParquetExamples,
    batch_size: int = 4096,
    desc: str = "score",
    stream: StreamingMetrics | None = None,
) -> np.ndarray:
    """Click probabilities ``float32[N]`` of every row of ``examples``, in order, ``batch_size`` rows at a time
    (progress: a bar on a terminal, periodic log lines elsewhere). Each batch is also fed to ``stream``."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    preds = []
    starts = range(0, len(examples), batch_size)
    for start in progress(starts, total=len(starts), desc=desc, unit="batch"):
        batch = examples.batch(np.arange(start, min(start + batch_size, len(examples))))
        p = model.predict(batch)
        if stream is not None:
            stream.update(batch.labels, p)
        preds.append(p)
    return np.concatenate(preds) if preds else np.zeros(0, np.float32)


def _seen_flags(model: LoadedModel, slot: str, values: np.ndarray) -> np.ndarray:
    """``bool[n]``: whether the model's shards hold a row for each ID of ``slot`` (its table's rows)."""
    table = next(s.table for s in model.config.slots if s.name == slot)
    if values.shape[0] == 0:
        return np.zeros(0, dtype=bool)
    return model.embedding.contains(table, values)


def slot_coverage(model: LoadedModel, examples: ParquetExamples) -> dict:
    """Per slot (model order), :func:`persia_core.evaluate.metrics.id_coverage` of the rows of ``examples``:
    how many ID occurrences and distinct IDs have no row in the trained shards (never seen in training)."""
    out = {}
    for slot in model.slots:
        values, _ = examples.ids[slot]
        out[slot] = id_coverage(values, _seen_flags(model, slot, values))
    return out


def user_seen_rows(model: LoadedModel, examples: ParquetExamples, user_slot: str) -> tuple[np.ndarray, np.ndarray]:
    """Which rows' user was seen in training, and each row's user key.

    Returns ``(seen: bool[R], user: uint64[R])``: a row's user is seen when the row has at least one ID in
    ``user_slot`` and the trained shards hold a row for every one of them; ``user`` is the row's first ID of
    the slot (0 for a row without one; such rows are left out of GAUC)."""
    values, offsets = examples.ids[user_slot]
    lengths = np.diff(offsets)
    rows = len(examples)
    flags = _seen_flags(model, user_slot, values)
    row_of = np.repeat(np.arange(rows), lengths)
    seen_count = np.bincount(row_of, weights=flags.astype(np.float64), minlength=rows)
    has = lengths > 0
    seen = has & (seen_count == lengths)
    user = np.zeros(rows, dtype=np.uint64)
    user[has] = values[offsets[:-1][has]]
    return seen, user


def _gauc(labels: np.ndarray, preds: np.ndarray, user: np.ndarray, rows: np.ndarray) -> float | None:
    return group_auc(labels[rows], preds[rows], user[rows]) if rows.any() else None


def evaluate(
    model_dir: str,
    data_dir: str,
    batch_size: int = 4096,
    user_slot: str = "user",
    model: LoadedModel | None = None,
    lr_reference: bool = True,
    coverage: bool = True,
) -> dict:
    """Score the evaluation split of ``data_dir`` with the model in ``model_dir`` (``model``: that model already
    loaded, which is then not loaded again). ``lr_reference``: also fit and score the LR reference on the train
    split of ``data_dir``, where it has one (``persia_core.evaluate.lr_reference``). ``coverage``: also count, per
    slot, the eval IDs without a trained row (False: ``coverage`` is None; a benchmark that reads the metrics only).

    ``user_slot``: the slot that names the user (for GAUC and the seen/unseen-user split). When it is ``""``,
    or the default ``"user"`` and the model has no such slot, both are skipped (``metrics`` has no ``gauc`` and
    ``user_split`` is None); any other name that is not a slot of the model is refused (``ValueError`` naming
    it and the model's slots) before anything is loaded or scored.

    Returns::

        {"metrics": {auc, logloss, ne, calibration, base_rate, mean_prediction, count[, gauc][, lr_auc, lr_logloss,
                     lr_auc_lift (AUC minus the LR reference's), lr_relative_logloss (logloss over its)]},
         "roc": {"fpr", "tpr", "thresholds"} | None (one class),
         "labels": float32[N], "preds": float32[N], "config": dict, "train_history": dict | None,
         "coverage": {slot: id_coverage dict} | None,   share of eval IDs without a trained row, per slot
         "user_split": {"slot": user_slot, "seen": {...metrics, gauc}, "unseen": {...metrics, gauc}} | None,
         "lr_reference": persia_core.evaluate.lr_reference output | None (no train split, one class, or off),
         "model_dir": the Model folder scored (a blessed-model location resolved to its latest blessed model)}

    Undefined values (AUC or GAUC of one class, a share of nothing) are None. Raises ``FileNotFoundError``
    for a missing model or dataset file, ``ValueError`` for invalid ones."""
    model_dir, manifest = read_manifest(model_dir)  # a blessed-model location resolves to its latest blessed model
    use_user_slot = check_user_slot(user_slot, model_slot_order(RunConfig.from_dict(manifest.config)), model_dir)
    read_schema(data_dir)
    model = model if model is not None else LoadedModel(model_dir)
    examples = ParquetExamples(shard_files(data_dir, "eval"), model.slots, num_dense=len(model.manifest.dense))
    stream = StreamingMetrics()
    preds_all = score(model, examples, batch_size, desc="evaluate", stream=stream)
    metrics = stream.compute()
    labels = examples.labels
    user_split: dict[str, Any] | None = None
    if use_user_slot:
        seen, user = user_seen_rows(model, examples, user_slot)
        has_user = np.diff(examples.ids[user_slot][1]) > 0
        metrics["gauc"] = _gauc(labels, preds_all, user, has_user)
        user_split = {"slot": user_slot}
        for name, rows in (("seen", seen), ("unseen", ~seen)):
            m = subset_metrics(labels, preds_all, rows)
            m["gauc"] = _gauc(labels, preds_all, user, rows & has_user)
            user_split[name] = m
    elif user_slot:
        log.info("no slot named %r: GAUC and the seen/unseen-user split are skipped", user_slot)
    per_slot = slot_coverage(model, examples) if coverage else None
    reference = None
    train_files = shard_files(data_dir, "train") if lr_reference and "train_files" in read_schema(data_dir) else []
    if train_files and all(io.exists(f) for f in train_files):  # the train split the model learned from
        train = ParquetExamples(train_files, model.slots, num_dense=len(model.manifest.dense))
        mean = model.manifest.dense_mean or [0.0] * len(model.manifest.dense)
        std = model.manifest.dense_std or [1.0] * len(model.manifest.dense)
        reference = fit_reference(train, examples, mean, std)
        if reference is not None:  # beside the model's own metrics: the report, the KFP Metrics and the gate
            metrics["lr_auc"], metrics["lr_logloss"] = reference["auc"], reference["logloss"]
            if reference["auc"] is not None and metrics["auc"] is not None:
                metrics["lr_auc_lift"] = metrics["auc"] - reference["auc"]
            metrics["lr_relative_logloss"] = metrics["logloss"] / reference["logloss"] if reference["logloss"] else None
            log.info(
                "evaluate: LR reference AUC=%s logloss=%.4f (C=%g)",
                reference["auc"],
                reference["logloss"],
                reference["C"],
            )
    history = None
    hp = io.join(model_dir, METRICS_FILE)
    if io.exists(hp):
        history = json.loads(io.read_text(hp))
    log.info("evaluate: %d rows, AUC=%s logloss=%.4f", metrics["count"], metrics["auc"], metrics["logloss"])
    return {
        "metrics": metrics,
        "roc": roc_points(labels, preds_all) if metrics["auc"] is not None else None,
        "labels": labels,
        "preds": preds_all,
        "config": model.manifest.config,
        "train_history": history,
        "coverage": per_slot,
        "user_split": user_split,
        "lr_reference": reference,
        "model_dir": model_dir,
    }


def flat_metrics(result: dict) -> dict[str, float]:
    """The scalars of an :func:`evaluate` result for KFP ``Metrics.log_metric``: every defined overall metric
    (``auc``, ``gauc``, ...), ``seen_user_<m>`` / ``unseen_user_<m>`` of the user split, and
    ``unseen_share_<slot>`` per slot. Undefined (None) values are left out."""
    out: dict[str, float] = {}

    def put(key: str, v) -> None:
        if v is not None and not isinstance(v, bool) and isinstance(v, (int, float, np.integer, np.floating)):
            out[key] = float(v)

    for k, v in result["metrics"].items():
        put(k, v)
    split = result.get("user_split")
    if split:
        for side in ("seen", "unseen"):
            for k, v in split[side].items():
                put(f"{side}_user_{k}", v)
    for slot, c in (result.get("coverage") or {}).items():
        put(f"unseen_share_{slot}", c["unseen_share"])
    return out
