"""Contestant (d) of ``make bench``: TorchRec on CPU, run as a subprocess of its own environment.

TorchRec 1.8 needs fbgemm-gpu-cpu 1.8, which needs torch 2.13, and its declared dependency would pull the GPU
fbgemm, so it lives in ``.venv-torchrec`` (``requirements-torchrec.txt``, installed with ``--no-deps``).

Model: a ``FusedEmbeddingBagCollection`` (one ``EmbeddingBagConfig`` per slot, sum pooling, rows uniform in
``[-init_scale, init_scale]``) whose row-wise Adagrad (``torchrec.optim.RowWiseAdagrad``: FBGEMM's
``EXACT_ROWWISE_ADAGRAD``, applied inside the backward pass) updates the tables; the dense part is TorchRec's
own DLRM (``torchrec.models.dlrm.DLRM``: DenseArch, InteractionArch, OverArch) when the run config's model is
``dlrm``, else ``persia_core.models.DNN`` on the pooled embeddings; Adam on the dense parameters. Data, batches,
ID dropout and metrics are those of contestant (c) (``persia_core.bench.baselines``), so the two differ only in
the embedding and dense modules.

``main(argv)`` runs inside ``.venv-torchrec`` and prints one JSON object as its last stdout line;
``run_torchrec(...)`` (main environment) starts it and returns that object, or ``{"sps": None, "error": ...}``
when the environment is missing or the run fails.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_PYTHON = REPO_ROOT / ".venv-torchrec" / "bin" / "python"


def run_torchrec(
    data_dir: str,
    config_path: str,
    samples: int,
    seed: int = 0,
    batch_size: int = 0,
    threads: int = 0,
    python: str = "",
    timeout_s: float = 3600.0,
    log=None,
) -> dict:
    """Run :func:`main` in the TorchRec environment (``python``, default ``$TORCHREC_PYTHON`` or
    ``.venv-torchrec/bin/python``) and return its JSON result; never raises for a failed contestant:
    returns ``{"sps": None, "auc": None, "logloss": None, "error": "<why>"}`` instead. ``log(line)`` gets its
    progress lines."""
    python = python or os.environ.get("TORCHREC_PYTHON", "") or str(DEFAULT_PYTHON)
    failed = {"sps": None, "auc": None, "logloss": None}
    if not os.path.exists(python):
        return {**failed, "error": f"TorchRec environment not found: {python} (create it with make venv-torchrec)"}
    cmd = [
        python,
        "-m",
        "persia_core.bench.torchrec_contestant",
        "--data",
        data_dir,
        "--config",
        config_path,
        "--samples",
        str(samples),
        "--seed",
        str(seed),
        "--batch-size",
        str(batch_size),
        "--threads",
        str(threads),
    ]
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), PYTHONUNBUFFERED="1")
    try:
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=str(REPO_ROOT)
        )
    except OSError as e:
        return {**failed, "error": f"cannot start {python}: {e}"}
    lines: list[str] = []
    deadline = time.monotonic() + timeout_s
    assert proc.stdout is not None
    for line in proc.stdout:
        line = line.rstrip("\n")
        lines.append(line)
        if log is not None and line.startswith("torchrec:"):
            log(line)
        if time.monotonic() > deadline:
            proc.kill()
            break
    rc = proc.wait()
    result = None
    for line in reversed(lines):
        if line.startswith("{"):
            try:
                result = json.loads(line)
            except ValueError:
                pass
            break
    if rc != 0 or result is None:
        tail = "\n".join(lines[-8:])
        return {**failed, "error": f"TorchRec contestant exited with code {rc}: {tail}"}
    return result


def _build(config, data, seed: int):
    import torch
    from torchrec.models.dlrm import DLRM
    from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
    from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection
    from torchrec.optim import RowWiseAdagrad

    table = config.embedding.tables[0]
    opt = table.optimizer
    torch.manual_seed(seed)
    tables = [
        EmbeddingBagConfig(
            name=f"t_{s}",
            embedding_dim=table.dim,
            num_embeddings=max(v, 1),
            feature_names=[s],
            pooling=PoolingType.SUM,
            weight_init_min=-table.init_scale,
            weight_init_max=table.init_scale,
        )
        for s, v in zip(data.slots, data.vocab, strict=True)
    ]
    ebc = FusedEmbeddingBagCollection(
        tables,
        optimizer_type=RowWiseAdagrad,
        optimizer_kwargs={"lr": opt.lr, "eps": opt.eps},
        device=torch.device("cpu"),
    )
    if config.model.kind == "dlrm":
        model = DLRM(
            ebc,
            dense_in_features=len(data.dense_mean),
            dense_arch_layer_sizes=[*config.model.bottom, table.dim],
            over_arch_layer_sizes=[*config.model.hidden, 1],
        )
        mean = torch.tensor(data.dense_mean, dtype=torch.float32)
        std = torch.tensor(data.dense_std, dtype=torch.float32)

        def forward(kjt, x):
            return model((x - mean) / std, kjt).squeeze(1)
    else:
        from persia_core.models import DNN

        dense = DNN(
            len(data.slots),
            table.dim,
            len(data.dense_mean),
            list(config.model.hidden),
            list(config.model.bottom),
            data.dense_mean,
            data.dense_std,
        )
        model = torch.nn.ModuleDict({"ebc": ebc, "dense": dense})

        def forward(kjt, x):
            pooled = ebc(kjt).values()  # [B, S*D], slots in config order
            return dense(pooled.view(x.shape[0], len(data.slots), table.dim), x)

    ebc_params = {id(p) for p in ebc.parameters()}
    dense_params = [p for p in model.parameters() if id(p) not in ebc_params]
    return model, forward, dense_params


def train_and_evaluate(data_dir: str, config_path: str, samples: int, seed: int, batch_size: int, threads: int) -> dict:
    """Contestant (d) in this process (TorchRec environment); returns the same keys as ``run_plain_torch``."""
    import numpy as np
    import torch
    import torch.nn.functional as F
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from persia_core.bench.baselines import eval_metrics, load_indexed, train_loop
    from persia_core.config import load_config

    torch.set_flush_denormal(True)
    torch.set_num_threads(threads or os.cpu_count() or 1)
    config = load_config(config_path)
    data = load_indexed(data_dir, [s.name for s in config.slots])
    print(f"torchrec: data indexed in {data.seconds:.1f} s ({len(data.train)} train rows)", file=sys.stderr)
    model, forward, dense_params = _build(config, data, seed)
    opt_d = torch.optim.Adam(dense_params, lr=config.trainer.dense_lr)
    keys = list(data.slots)

    def kjt(v, ln):
        return KeyedJaggedTensor(keys=keys, values=v, lengths=ln)

    def step(v, ln, x, y):
        logits = forward(kjt(v, ln), x)
        loss = F.binary_cross_entropy_with_logits(logits, y)
        opt_d.zero_grad(set_to_none=True)
        loss.backward()  # the fused row-wise Adagrad updates the tables here
        opt_d.step()
        return float(loss.detach())

    rates = {s.name: s.id_dropout for s in config.slots}
    dropout = np.array([rates.get(s, 0.0) for s in data.slots])
    out = train_loop(
        step,
        data,
        batch_size or config.trainer.batch_size,
        samples,
        seed,
        dropout,
        lambda m: print(f"torchrec: {m}", file=sys.stderr, flush=True),
    )
    t0 = time.perf_counter()
    model.eval()
    preds = []
    ev = data.eval
    with torch.no_grad():
        for start in range(0, len(ev), 16384):
            rows = np.arange(start, min(start + 16384, len(ev)))
            v, ln = ev.batch(rows)
            preds.append(
                torch.sigmoid(
                    forward(kjt(torch.from_numpy(v), torch.from_numpy(ln)), torch.from_numpy(ev.dense[rows]))
                ).numpy()
            )
    out.update(eval_metrics(ev.labels, np.concatenate(preds)))
    out["eval_seconds"] = time.perf_counter() - t0
    import torchrec

    out["torchrec_version"] = getattr(torchrec, "__version__", "")
    out["torch_version"] = torch.__version__
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="TorchRec contestant of make bench (runs in .venv-torchrec)")
    p.add_argument("--data", required=True, help="preprocessed dataset folder (Parquet shards + schema.json)")
    p.add_argument("--config", required=True, help="run config YAML")
    p.add_argument("--samples", type=int, required=True, help="training samples")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=0, help="0: the config's trainer.batch_size")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: all cores)")
    args = p.parse_args(argv)
    out = train_and_evaluate(args.data, args.config, args.samples, args.seed, args.batch_size, args.threads)
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
