"""Fixtures of the evaluation tests: a hand-made Model artifact (no training); ``trained`` is in tests/conftest.py."""

from __future__ import annotations

import io
import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from persia_core.config import RunConfig
from persia_core.data import schema as S
from persia_core.embedding.layout import model_slot_order, table_layouts
from persia_core.embedding.reference import LocalEmbedding
from persia_core.embedding.shard_tables import shard_file_bytes
from persia_core.hashing import feature_ids
from persia_core.model_store import ModelManifest, shard_file_name, write_manifest
from persia_core.models import build_model


def make_model(model_dir: str, config: RunConfig, seen: dict[str, list[str]], num_dense: int = 1) -> str:
    """A Model artifact whose shards hold rows exactly for the values ``seen[slot]`` (hashed as preprocess
    does), with a freshly initialized dense network (seeded). Same files as ``launcher.train`` writes."""
    os.makedirs(os.path.join(model_dir, "shards"), exist_ok=True)
    emb = LocalEmbedding(config.embedding, config.embedding.num_shards, config.trainer.seed)
    table_of = {s.name: s.table for s in config.slots}
    for slot, values in seen.items():
        emb.lookup(table_of[slot], np.array(feature_ids(slot, values), dtype=np.uint64))  # inserts the rows
    files = []
    for s, tables in enumerate(emb.shards):
        rel = shard_file_name(s)
        with open(os.path.join(model_dir, rel), "wb") as f:
            f.write(shard_file_bytes(tables))
        files.append(rel)
    torch.manual_seed(config.trainer.seed)
    layouts = table_layouts(config)
    dense = build_model(
        config.model, len(model_slot_order(config)), layouts[0].dim, num_dense, [0.0] * num_dense, [1.0] * num_dense
    )
    buf = io.BytesIO()
    torch.save(dense.state_dict(), buf)
    with open(os.path.join(model_dir, "dense.pt"), "wb") as f:
        f.write(buf.getvalue())
    manifest = ModelManifest(
        config=config.to_dict(),
        shard_files=files,
        slots=config.slot_names,
        dense=[f"d{i}" for i in range(num_dense)],
        dense_mean=[0.0] * num_dense,
        dense_std=[1.0] * num_dense,
    )
    write_manifest(model_dir, manifest)
    return model_dir


def write_eval_rows(data_dir: str, rows: list[dict], slots: list[str]) -> str:
    """A preprocess-output folder whose eval split holds ``rows`` (``{"label", "x", slot: [values]}``, the
    values hashed per slot) and whose train split is empty."""
    os.makedirs(os.path.join(data_dir, "eval"), exist_ok=True)
    cols = {
        S.LABEL: pa.array([float(r["label"]) for r in rows], pa.float32()),
        S.DENSE: pa.array([[float(r.get("x", 0.0))] for r in rows], pa.list_(pa.float32())),
        **{
            S.slot_column(s): pa.array([feature_ids(s, r.get(s, [])) for r in rows], pa.list_(pa.uint64()))
            for s in slots
        },
        S.TS: pa.array(np.arange(len(rows)), pa.int64()),
        S.SOURCE: pa.array([f"hand:{i + 1}" for i in range(len(rows))], pa.string()),
    }
    rel = "eval/eval-00000-of-00001.parquet"
    pq.write_table(pa.table(cols, schema=S.arrow_schema(slots)), os.path.join(data_dir, rel))
    schema = {
        "slots": slots,
        "dense": ["x"],
        "dense_mean": [0.0],
        "dense_std": [1.0],
        "rows": {"train": 0, "eval": len(rows), "malformed": 0, "read": len(rows)},
        "train_files": [],
        "eval_files": [rel],
    }
    with open(os.path.join(data_dir, S.SCHEMA_FILE), "w") as f:
        json.dump(schema, f)
    return data_dir


@pytest.fixture(scope="session")
def model_factory():
    """``make_model(model_dir, config, seen, num_dense=1)``: a hand-made Model artifact (see ``make_model``)."""
    return make_model


@pytest.fixture(scope="session")
def eval_rows_writer():
    """``write_eval_rows(data_dir, rows, slots)``: a dataset whose eval split is ``rows``."""
    return write_eval_rows
