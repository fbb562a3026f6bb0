"""persia_core.model_store: the one manifest writer and reader, and models written before it."""

import json
import os

import numpy as np
import pytest
from support import tiny_config

from persia_core.evaluate.run import LoadedModel
from persia_core.model_store import (
    IncompleteModelError,
    ModelManifest,
    read_manifest,
    shard_file_name,
    write_manifest,
)

# what cluster.finalize_model wrote before there was one writer: no shard CRCs, no lineage, no provenance
OLD_VERTEX_KEYS = (
    "format",
    "config",
    "num_shards",
    "shard_files",
    "dense_file",
    "slots",
    "dense",
    "dense_mean",
    "dense_std",
    "summary",
)


def test_a_manifest_written_before_the_model_store_still_loads(tmp_path, model_factory):
    cfg = tiny_config()
    model = model_factory(str(tmp_path / "m"), cfg, {s.name: ["a", "b"] for s in cfg.slots})
    path = os.path.join(model, "manifest.json")
    full = json.load(open(path))
    with open(path, "w") as f:
        json.dump({k: full[k] for k in OLD_VERTEX_KEYS}, f)
    folder, manifest = read_manifest(model)
    assert folder == model and manifest.shard_crc32c is None and manifest.lineage is None
    assert manifest.num_shards == cfg.embedding.num_shards and manifest.config == full["config"]
    loaded = LoadedModel(model)
    table = cfg.slots[0].table
    assert np.array_equal(
        loaded.embedding.lookup_readonly(table, np.array([1, 2], np.uint64)), np.zeros((2, cfg.embedding.tables[0].dim))
    )


def test_the_writer_refuses_a_manifest_that_lists_a_missing_file_and_round_trips_the_rest(tmp_path):
    cfg = tiny_config()
    m = ModelManifest(
        config=cfg.to_dict(),
        shard_files=[shard_file_name(0)],
        slots=cfg.slot_names,
        dense=["d0"],
        shard_crc32c=[123],
        lineage={"config_sha256": "x"},
    )
    (tmp_path / "dense.pt").write_bytes(b"")
    with pytest.raises(IncompleteModelError, match=r"shards/shard-00000\.npz is missing"):
        write_manifest(str(tmp_path), m)
    assert not (tmp_path / "manifest.json").exists()
    (tmp_path / "shards").mkdir()
    (tmp_path / "shards" / "shard-00000.npz").write_bytes(b"")
    written = write_manifest(str(tmp_path), m)
    assert written["num_shards"] == 1 and json.load(open(tmp_path / "manifest.json")) == written
    assert read_manifest(str(tmp_path))[1] == m


@pytest.mark.parametrize(
    "change, message",
    [
        ({"format": "persia-model/0"}, r"unknown model format 'persia-model/0'"),
        ({"num_shards": 3}, r"num_shards 3 but 1 shard files"),
        ({"slots": None}, r"needs \['slots'\]"),
    ],
)
def test_a_bad_manifest_is_refused_naming_the_file(tmp_path, change, message):
    cfg = tiny_config()
    d = ModelManifest(config=cfg.to_dict(), shard_files=[shard_file_name(0)], slots=cfg.slot_names, dense=[]).to_dict()
    d.update(change)
    d = {k: v for k, v in d.items() if v is not None}
    (tmp_path / "manifest.json").write_text(json.dumps(d))
    with pytest.raises(ValueError, match=rf"manifest\.json: .*{message}"):
        read_manifest(str(tmp_path))
