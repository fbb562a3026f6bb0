"""Test helpers: a tiny run config and a preprocessed dataset written directly with pyarrow (no Beam)."""

from __future__ import annotations

import json
import os
import socket

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from persia_core.config import RunConfig
from persia_core.data import schema as S
from persia_core.hashing import feature_ids


def tiny_config(**trainer) -> RunConfig:
    """A small run config over the delimited layout's fields a, b, tags (multi-hot)."""
    d = {
        "layout": {
            "kind": "delimited",
            "columns": ["label", "x", "a", "b", "tags"],
            "label_column": "label",
            "dense_columns": ["x"],
        },
        "slots": [{"name": "a", "source": "a"}, {"name": "b", "source": "b"}, {"name": "tags", "source": "tags"}],
        "embedding": {
            "tables": [
                {"name": "default", "dim": 4, "init_scale": 0.1, "optimizer": {"name": "rowwise_adagrad", "lr": 0.1}}
            ],
            "num_shards": 2,
            "shard_memory_bytes": 1 << 22,
        },
        "model": {"kind": "dnn", "hidden": [8], "bottom": [4]},
        "trainer": {
            "batch_size": 16,
            "epochs": 1,
            "embedding_staleness": 0,
            "num_workers": 1,
            "seed": 0,
            "shuffle": False,
            **trainer,
        },
    }
    return RunConfig.from_dict(d)


def write_dataset(
    out_dir: str,
    rows: int = 256,
    shards: int = 2,
    seed: int = 0,
    shard_rows: list[int] | None = None,
    eval_rows: int = 64,
) -> str:
    """Write train/eval Parquet shards + schema.json for ``tiny_config``'s slots; labels follow a planted model."""
    rng = np.random.default_rng(seed)
    slots = ["a", "b", "tags"]

    def make(n: int, start: int) -> pa.Table:
        a = rng.integers(0, 20, n)
        b = rng.integers(0, 50, n)
        ntags = rng.integers(0, 3, n)
        x = rng.normal(size=n).astype(np.float32)
        logit = (a % 3 - 1.0) + 0.5 * x
        label = (rng.random(n) < 1 / (1 + np.exp(-logit))).astype(np.float32)
        tags = [[str(t) for t in rng.integers(0, 10, k)] for k in ntags]
        cols = {
            S.LABEL: pa.array(label, pa.float32()),
            S.DENSE: pa.array([[float(v)] for v in x], pa.list_(pa.float32())),
            S.slot_column("a"): pa.array([feature_ids("a", [str(v)]) for v in a], pa.list_(pa.uint64())),
            S.slot_column("b"): pa.array([feature_ids("b", [str(v)]) for v in b], pa.list_(pa.uint64())),
            S.slot_column("tags"): pa.array([feature_ids("tags", t) for t in tags], pa.list_(pa.uint64())),
            S.TS: pa.array(np.arange(start, start + n), pa.int64()),
            S.SOURCE: pa.array([f"synthetic:{i}" for i in range(start, start + n)], pa.string()),
        }
        return pa.table(cols, schema=S.arrow_schema(slots))

    sizes = shard_rows or [rows // shards] * shards
    os.makedirs(os.path.join(out_dir, "train"), exist_ok=True)
    os.makedirs(os.path.join(out_dir, "eval"), exist_ok=True)
    train_files, start = [], 0
    for i, n in enumerate(sizes):
        rel = f"train/train-{i:05d}-of-{len(sizes):05d}.parquet"
        pq.write_table(make(n, start), os.path.join(out_dir, rel))
        train_files.append(rel)
        start += n
    pq.write_table(make(eval_rows, start), os.path.join(out_dir, "eval/eval-00000-of-00001.parquet"))
    schema = {
        "slots": slots,
        "dense": ["x"],
        "dense_mean": [0.0],
        "dense_std": [1.0],
        "rows": {"train": sum(sizes), "eval": eval_rows, "malformed": 0, "read": sum(sizes) + eval_rows},
        "distinct_ids": {"a": 20, "b": 50, "tags": 10},
        "split": {"by": "row_order", "cutoff": sum(sizes)},
        "train_files": train_files,
        "eval_files": ["eval/eval-00000-of-00001.parquet"],
    }
    with open(os.path.join(out_dir, S.SCHEMA_FILE), "w") as f:
        json.dump(schema, f)
    return out_dir


def free_port_run(k: int) -> int:
    """A port p such that p .. p+k-1 were free on 127.0.0.1 a moment ago."""
    for _ in range(100):
        s0 = socket.socket()
        s0.bind(("127.0.0.1", 0))
        p = s0.getsockname()[1]
        s0.close()
        socks = []
        try:
            for q in range(p, p + k):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", q))
            return p
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no run of free ports")
