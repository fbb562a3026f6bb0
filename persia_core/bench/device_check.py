"""``make device-check``: the GPU tests and the GPU benchmark, in one unattended command.

Runs with the machine's own Python as it is (no ``.venv``): needs torch with CUDA, numba, grpcio, pyarrow,
numpy, scikit-learn, xxhash and pyyaml. On a machine without CUDA (or a ``python3`` without torch) it says so,
writes ``{"skipped": <why>, "gpu": null, ...}`` as ``device_check.json`` and its last line, and exits 0.

1. ``pytest tests/train/test_gpu.py`` (GPU path equals the CPU path; fp16 transfer).
2. The Criteo-shaped DLRM (bottom 13-512-256-64-16, top 512-256-1, dim 16, 26 slots of 100k IDs with a Zipf
   skew) at batch 16384 on one GPU, embeddings held by parameter-server processes in host RAM (gRPC on
   127.0.0.1), staleness K = 4: samples/s of the training loop, and the eval AUC against the planted ceiling.
3. The dense part alone on the GPU, given its embeddings (the ceiling of the design on this GPU).

Writes every figure to ``<out>/device_check.json`` and prints it as the last line.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
import time
import types


def dense_ceiling(batch: int, steps: int = 50) -> float:
    """Samples/s of DLRM forward+backward+Adam on the GPU with random embeddings already there."""
    import torch

    from persia_core.config import ModelConfig
    from persia_core.models import build_model

    dev = torch.device("cuda")
    model = build_model(ModelConfig(kind="dlrm", hidden=[512, 256], bottom=[512, 256, 64]), 26, 16, 13).to(dev)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    emb = torch.randn(batch, 26, 16, device=dev, requires_grad=True)
    dense = torch.randn(batch, 13, device=dev)
    labels = (torch.rand(batch, device=dev) < 0.25).float()
    for i in range(steps + 10):
        if i == 10:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(model(emb, dense), labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
    torch.cuda.synchronize()
    return batch * steps / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "device_outputs"), help="folder for device_check.json")
    p.add_argument("--train-rows", type=int, default=3_000_000)
    p.add_argument("--eval-rows", type=int, default=500_000)
    p.add_argument("--batch", type=int, default=16384)
    p.add_argument("--shards", type=int, default=8, help="parameter-server processes")
    p.add_argument("--embedding-workers", type=int, default=0, help="per NN worker (0: from the machine's cores)")
    p.add_argument("--prefetch-threads", type=int, default=2, help="batches each embedding worker prepares ahead")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--skip-tests", action="store_true")
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    torch: types.ModuleType | None
    try:
        torch = importlib.import_module("torch")
    except ImportError:
        torch = None
    if torch is None or not torch.cuda.is_available():
        why = (
            f"{sys.executable} has no torch: run with a python3 that has a CUDA build of torch"
            if torch is None
            else "CUDA is not available on this machine"
        )
        skipped = {"skipped": why, "gpu": None, "python": sys.executable}
        with open(os.path.join(args.out, "device_check.json"), "w") as f:
            json.dump(skipped, f, indent=1)
        print(f"device-check: {why}; the GPU tests and benchmark did not run")
        print(json.dumps(skipped))
        return 0
    result: dict = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "cpus": os.cpu_count()}
    t_all = time.time()
    if not args.skip_tests:
        t0 = time.time()
        r = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/train/test_gpu.py"],
            capture_output=True,
            text=True,
        )
        result["gpu_tests"] = {
            "exit_code": r.returncode,
            "tail": r.stdout.strip().splitlines()[-3:],
            "seconds": time.time() - t0,
        }
        print("gpu tests:", result["gpu_tests"], flush=True)
    result["dense_only_sps"] = dense_ceiling(args.batch)
    print(f"dense part alone: {result['dense_only_sps']:.0f} samples/s", flush=True)

    from persia_core.bench.criteo_synth import criteo_config_dict, write_criteo_synth
    from persia_core.config import RunConfig
    from persia_core.evaluate.run import evaluate
    from persia_core.train.launcher import train

    work = os.path.join(args.out, "work")
    t0 = time.time()
    schema = write_criteo_synth(os.path.join(work, "data"), args.train_rows, args.eval_rows, seed=0, train_shards=4)
    result["datagen_seconds"] = time.time() - t0
    print(f"data: {args.train_rows:,} train rows in {result['datagen_seconds']:.0f} s", flush=True)
    cfg = RunConfig.from_dict(criteo_config_dict(batch_size=args.batch, num_workers=1, staleness=4)).with_overrides(
        {
            "embedding.num_shards": args.shards,
            "embedding.shard_memory_bytes": 1 << 30,
            "trainer.device": "cuda",
            "trainer.epochs": args.epochs,
            "trainer.prefetch_threads": args.prefetch_threads,
            "trainer.embedding_workers": args.embedding_workers,
            "trainer.threads_per_worker": 4,
        }
    )
    for fp16 in (False, True):
        name = "fp16" if fp16 else "fp32"
        c = cfg.with_overrides({"trainer.fp16_transfer": fp16})
        t0 = time.time()
        train(
            c, os.path.join(work, "data"), os.path.join(work, f"model_{name}"), work_dir=os.path.join(work, f"w_{name}")
        )
        hist = json.load(open(os.path.join(work, f"model_{name}", "train_metrics.json")))
        ev = evaluate(os.path.join(work, f"model_{name}"), os.path.join(work, "data"), lr_reference=False)["metrics"]
        result[f"hybrid_{name}"] = {
            "samples_per_s": hist["samples_per_s"],
            "train_seconds": hist["train_seconds"],
            "wait_seconds_rank0": hist["wait_seconds_rank0"],
            "max_staleness": hist["max_staleness"],
            "fp16_fallbacks": hist.get("fp16_fallbacks"),
            "auc": ev["auc"],
            "logloss": ev["logloss"],
            "wall_seconds": time.time() - t0,
            "device": hist.get("device"),
            "embedding_workers": hist.get("embedding_workers"),
            "utilization": hist.get("utilization"),
            "phase_seconds": hist.get("phase_seconds"),
            "embedding_worker_phase_seconds": hist.get("embedding_worker_phase_seconds"),
        }
        print(
            f"hybrid {name}: {hist['samples_per_s']:.0f} samples/s, AUC {ev['auc']:.4f} "
            f"(planted {schema['synthetic']['planted_auc']:.4f})",
            flush=True,
        )
        if time.time() - t_all > 360:
            break
    result["planted_auc"] = schema["synthetic"]["planted_auc"]
    result["batch"] = args.batch
    result["target_samples_per_s"] = 1_000_000
    result["total_seconds"] = time.time() - t_all
    with open(os.path.join(args.out, "device_check.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
