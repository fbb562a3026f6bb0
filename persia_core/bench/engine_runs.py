"""``make bench``'s contestants (a) and (b): the hybrid engine (``init_shards`` + ``train``) at staleness K, and
the evaluation of the model it leaves."""

from __future__ import annotations

import json
import os
import shutil
import time


def run_hybrid(
    config,
    data_dir: str,
    work_dir: str,
    staleness: int,
    workers: int,
    threads: int,
    seed: int,
    global_batch: int,
    delay_s: float = 0.0,
    bandwidth: float = 0.0,
) -> dict:
    """Contestants (a)/(b): ``init_shards`` + ``train`` with K = ``staleness``, ``workers`` NN workers of
    ``threads`` torch threads and per-worker batch ``global_batch // workers``. The model is left in
    ``work_dir/model``. Returns ``{"sps", "max_staleness", "samples", "train_seconds", "wall_seconds",
    "model_dir"}`` (sps: the trainer's own samples/s over its training loop)."""
    from persia_core.embedding.plan import init_shards
    from persia_core.train.launcher import train

    if global_batch % workers:
        raise ValueError(f"global batch {global_batch} is not divisible by {workers} NN workers")
    overrides: dict[str, float] = {
        "trainer.embedding_staleness": staleness,
        "trainer.num_workers": workers,
        "trainer.threads_per_worker": threads,
        "trainer.batch_size": global_batch // workers,
        "trainer.seed": seed,
    }
    if delay_s or bandwidth:
        overrides.update({"trainer.network_delay_s": delay_s, "trainer.network_bandwidth_bytes_per_s": bandwidth})
    cfg = config.with_overrides(overrides)
    if os.path.exists(work_dir):
        shutil.rmtree(work_dir)
    init_dir, model_dir = os.path.join(work_dir, "init"), os.path.join(work_dir, "model")
    t0 = time.time()
    init_shards(cfg, data_dir, init_dir)
    manifest = train(cfg, data_dir, model_dir, init_dir=init_dir, work_dir=os.path.join(work_dir, "run"))
    with open(os.path.join(model_dir, "train_metrics.json")) as f:
        hist = json.load(f)
    shutil.rmtree(init_dir, ignore_errors=True)
    s = manifest["summary"]
    return {
        "sps": s["samples_per_s"],
        "max_staleness": s["max_staleness"],
        "samples": hist["samples"][-1] if hist.get("samples") else 0,
        "train_seconds": hist.get("train_seconds"),
        "wall_seconds": time.time() - t0,
        "model_dir": model_dir,
    }


def evaluate_hybrid(model_dir: str, data_dir: str, keep: bool = False) -> dict:
    """AUC/logloss/NE of a trained model on the eval split (``persia_core.evaluate.run.evaluate``); deletes
    the model folder afterwards unless ``keep``."""
    from persia_core.evaluate.run import evaluate

    t0 = time.time()
    m = evaluate(model_dir, data_dir, lr_reference=False)["metrics"]
    if not keep:
        shutil.rmtree(os.path.dirname(model_dir), ignore_errors=True)
    return {"auc": m["auc"], "logloss": m["logloss"], "ne": m["ne"], "eval_seconds": time.time() - t0}
