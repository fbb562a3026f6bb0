"""GPU path of the hybrid trainer (runs where CUDA is available: `make device-check`; skipped elsewhere)."""

import json

import numpy as np
import pytest
import torch
from support import tiny_config, write_dataset

from persia_core.embedding.reference import LocalEmbedding
from persia_core.train.worker import run_worker

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run by make device-check)")


def _run(tmp_path, name, **trainer):
    data = str(tmp_path / "data")
    if not (tmp_path / "data").exists():
        write_dataset(data, rows=256)
    cfg = tiny_config(num_workers=1, epochs=2, **trainer)
    backend = LocalEmbedding(cfg.embedding, 1)
    hist = run_worker(cfg, data, str(tmp_path / name), backend, rank=0, world=1)
    return hist, backend


def test_gpu_dense_path_matches_the_cpu_path(tmp_path):
    cpu, ref = _run(tmp_path, "cpu", device="cpu", embedding_staleness=0)
    gpu, got = _run(tmp_path, "gpu", device="cuda", embedding_staleness=0)
    assert gpu["device"].startswith("cuda")
    np.testing.assert_allclose(gpu["loss"], cpu["loss"], atol=1e-4)
    keys = ref.shards[0]["default"].state_dict()["keys"]
    np.testing.assert_allclose(got.lookup_readonly("default", keys), ref.lookup_readonly("default", keys), atol=1e-4)


def test_gpu_fp16_transfer_trains_close_to_fp32(tmp_path):
    fp32, _ = _run(tmp_path, "fp32", device="cuda", embedding_staleness=2)
    fp16, _ = _run(tmp_path, "fp16", device="cuda", embedding_staleness=2, fp16_transfer=True)
    assert np.isfinite(fp16["loss"]).all()
    assert abs(np.mean(fp16["loss"][-5:]) - np.mean(fp32["loss"][-5:])) < 0.02
    saved = json.load(open(tmp_path / "fp16" / "train_metrics.json"))
    assert saved["fp16_fallbacks"] == 0
