"""Checkpoints in one process: exact resume of the worker loop, the manifest's checks, Cloud Storage, lineage."""

import os
import shutil

import numpy as np
import pytest
import torch
from support import tiny_config, write_dataset

from persia_core import checkpoints as ckpt
from persia_core import io
from persia_core.embedding.reference import LocalEmbedding
from persia_core.embedding.shard_tables import load_shard_file
from persia_core.model_store import shard_file_name
from persia_core.train.checkpointer import Checkpointer, load_dense
from persia_core.train.worker import run_worker


def _run(cfg, data, out, ckpt_dir, every, resume=None, backend=None):
    os.makedirs(out, exist_ok=True)
    backend = backend or LocalEmbedding(cfg.embedding, seed=cfg.trainer.seed)
    settings = ckpt.CheckpointSettings(dir=ckpt_dir, every_steps=every, keep=10)
    cp = Checkpointer(settings, 0, 1, backend, backend.num_shards, {"note": "test"})
    hist = run_worker(cfg, data, out, backend, 0, 1, checkpointer=cp, resume=resume)
    return hist, backend


def _restore(cfg, path, manifest):
    backend = LocalEmbedding(cfg.embedding, seed=cfg.trainer.seed)
    for e in manifest["files"]:
        if e["role"] == "shard":
            load_shard_file(io.join(path, e["path"]), backend.shards[e["shard"]], e["bytes"], e["crc32c"])
    return backend


def test_resume_in_process_continues_exactly_the_uninterrupted_run(tmp_path):
    data = write_dataset(str(tmp_path / "data"), rows=160)
    cfg = tiny_config(epochs=2, shuffle=True, embedding_staleness=0)
    cfg.embedding.tables[0].optimizer.name = "adam"
    full_hist, full = _run(cfg, data, str(tmp_path / "a"), str(tmp_path / "a-ckpt"), every=7)
    steps = [s for s, _ in ckpt.list_checkpoints(str(tmp_path / "a-ckpt"))]
    assert steps == [20, 14, 7]  # every 7 steps and at the end
    path = ckpt.checkpoint_path(str(tmp_path / "a-ckpt"), 7)
    manifest = ckpt.verify(path)
    assert manifest["step"] == 7 and manifest["lineage"] == {"note": "test"}
    hist, resumed = _run(
        cfg,
        data,
        str(tmp_path / "b"),
        str(tmp_path / "b-ckpt"),
        every=7,
        resume=(path, manifest),
        backend=_restore(cfg, path, manifest),
    )
    assert hist["step"] == full_hist["step"] and hist["samples"] == full_hist["samples"]
    np.testing.assert_allclose(hist["loss"], full_hist["loss"], atol=1e-6, rtol=0)
    a = torch.load(tmp_path / "a" / "dense.pt", weights_only=True)
    b = torch.load(tmp_path / "b" / "dense.pt", weights_only=True)
    for k in a:
        np.testing.assert_allclose(a[k].numpy(), b[k].numpy(), atol=1e-6, rtol=0)
    for sa, sb in zip(full.state_dicts(), resumed.state_dicts(), strict=True):
        for k in ("keys", "weights", "m", "v", "steps"):
            np.testing.assert_allclose(sa["default"][k], sb["default"][k], atol=1e-6, rtol=0, err_msg=k)
    # the final checkpoints hold the same dense optimizer (Adam) state
    da, oa = load_dense(open(os.path.join(ckpt.checkpoint_path(str(tmp_path / "a-ckpt"), 20), "dense.pt"), "rb").read())
    db, ob = load_dense(open(os.path.join(ckpt.checkpoint_path(str(tmp_path / "b-ckpt"), 20), "dense.pt"), "rb").read())
    for i, st in oa["state"].items():
        for k in ("exp_avg", "exp_avg_sq"):
            np.testing.assert_allclose(st[k].numpy(), ob["state"][i][k].numpy(), atol=1e-6, rtol=0)


@pytest.fixture(scope="module")
def trained_checkpoints(tmp_path_factory) -> str:
    """The checkpoint folder of one training run (6 steps: checkpoints at 2, 4, 6), made once for the module;
    each test edits a copy of it (``_two_checkpoints``)."""
    root = tmp_path_factory.mktemp("two_checkpoints")
    data = write_dataset(str(root / "data"), rows=96)
    folder = str(root / "ckpt")
    _run(tiny_config(epochs=1), data, str(root / "out"), folder, every=2)
    return folder


def _two_checkpoints(tmp_path, trained: str):
    """A copy of ``trained`` (the ``trained_checkpoints`` fixture) in ``tmp_path``: ``(folder, checkpoint paths,
    newest first)``."""
    folder = str(tmp_path / "ckpt")
    shutil.copytree(trained, folder)
    return folder, [p for _, p in ckpt.list_checkpoints(folder)]


def test_partial_or_corrupt_checkpoint_is_refused_with_a_clear_error_and_the_previous_one_is_used(
    tmp_path, trained_checkpoints
):
    folder, (newest, previous, *_) = _two_checkpoints(tmp_path, trained_checkpoints)
    assert ckpt.find_latest(folder)[0] == newest
    # a flipped byte in the dense file: refused by its CRC-32C, the previous checkpoint is used
    dense = os.path.join(newest, "dense.pt")
    data = bytearray(open(dense, "rb").read())
    data[-10] ^= 0xFF
    open(dense, "wb").write(data)
    with pytest.raises(ckpt.CheckpointError, match=r"dense\.pt: CRC-32C .* does not match"):
        ckpt.verify(newest)
    reasons = []
    assert ckpt.find_latest(folder, refusals=reasons)[0] == previous
    assert "dense.pt" in reasons[0]
    # a truncated shard file: refused by its size, even without reading it
    shard = os.path.join(previous, "shards", "shard-00001.npz")
    with open(shard, "r+b") as f:
        f.truncate(100)
    with pytest.raises(ckpt.CheckpointError, match=r"shard-00001\.npz: 100 bytes, the manifest says"):
        ckpt.verify(previous, deep=False)
    # a checkpoint whose manifest was never written (the run died while writing it) is not complete
    os.remove(os.path.join(previous, ckpt.MANIFEST))
    with pytest.raises(ckpt.CheckpointError, match="no manifest.json .*partial"):
        ckpt.verify(previous)
    assert ckpt.find_latest(folder)[0] == ckpt.checkpoint_path(folder, 2)


def test_a_manifest_that_lost_a_shard_or_was_edited_is_refused(tmp_path, trained_checkpoints):
    import json

    folder, (newest, *_) = _two_checkpoints(tmp_path, trained_checkpoints)
    mpath = os.path.join(newest, ckpt.MANIFEST)
    manifest = json.load(open(mpath))
    # one shard's entry removed (and its file): before, the checkpoint was re-sharded from the shard left, and the
    # other shard's trained rows were lost silently
    manifest["files"] = [e for e in manifest["files"] if e["path"] != shard_file_name(1)]
    os.remove(os.path.join(newest, shard_file_name(1)))
    manifest["manifest_crc32c"] = ckpt.manifest_crc(manifest)  # even with its checksum made to match
    json.dump(manifest, open(mpath, "w"))
    with pytest.raises(ckpt.CheckpointError, match=r"lists no shards/shard-00001\.npz .*incomplete"):
        ckpt.verify(newest)
    # any other edit of the manifest: its own CRC-32C no longer matches
    manifest["step"] += 1
    json.dump(manifest, open(mpath, "w"))
    with pytest.raises(ckpt.CheckpointError, match="edited or corrupt manifest"):
        ckpt.verify(newest)


def test_a_manifest_of_the_current_format_without_its_own_crc_is_refused_and_an_older_one_warned(
    tmp_path, trained_checkpoints, caplog
):
    # issue 20, left alone before: a manifest whose manifest_crc32c was taken out was accepted, so any edit that
    # also dropped the field went through
    import json
    import logging

    folder, (newest, *_) = _two_checkpoints(tmp_path, trained_checkpoints)
    mpath = os.path.join(newest, ckpt.MANIFEST)
    manifest = json.load(open(mpath))
    assert manifest["format"] == ckpt.FORMAT == "persia-checkpoint/2" and "manifest_crc32c" in manifest
    del manifest["manifest_crc32c"]
    json.dump(manifest, open(mpath, "w"))
    with pytest.raises(ckpt.CheckpointError, match=r"carries no CRC-32C of its own"):
        ckpt.verify(newest)
    # a manifest of format 1 (written before its CRC was added) still loads, with a warning naming it
    manifest["format"] = "persia-checkpoint/1"
    json.dump(manifest, open(mpath, "w"))
    caplog.set_level(logging.WARNING, logger="persia.checkpoint")
    assert ckpt.verify(newest)["step"] == manifest["step"]
    assert any(mpath in r.getMessage() and "no CRC-32C" in r.getMessage() for r in caplog.records)
    assert ckpt.find_latest(folder)[0] == newest


@pytest.mark.parametrize(
    "content",
    [
        "null",
        '{"format": "persia-checkpoint/1", "files": [{"path": "dense.pt"}]}',
        '{"format": "persia-checkpoint/1", "files": "dense.pt"}',
    ],
)
def test_a_malformed_manifest_is_refused_as_a_checkpoint_error(tmp_path, content):
    # before: AttributeError or KeyError, which escaped find_latest and failed the run instead of falling back
    path = tmp_path / "ckpt-0000000001"
    path.mkdir()
    (path / ckpt.MANIFEST).write_text(content)
    with pytest.raises(ckpt.CheckpointError, match="malformed manifest"):
        ckpt.verify(str(path))


def test_when_every_complete_checkpoint_is_refused_resume_fails_instead_of_starting_afresh(
    tmp_path, trained_checkpoints
):
    folder, paths = _two_checkpoints(tmp_path, trained_checkpoints)
    for p in paths:
        dense = os.path.join(p, "dense.pt")
        open(dense, "r+b").truncate(10)
    with pytest.raises(
        ckpt.CheckpointError,
        match=r"every checkpoint under .* is refused \(3 complete ones: "
        r".*dense\.pt.*remove the checkpoints",
    ):
        ckpt.find_latest(folder)
    # only partial checkpoints (a run stopped while writing its first): a fresh start, nothing is lost
    for p in paths:
        os.remove(os.path.join(p, ckpt.MANIFEST))
    assert ckpt.find_latest(folder) is None


def test_prune_keeps_the_newest_complete_checkpoints_and_drops_leftovers(tmp_path, trained_checkpoints):
    folder, paths = _two_checkpoints(tmp_path, trained_checkpoints)
    assert len(paths) == 3
    os.remove(os.path.join(paths[1], ckpt.MANIFEST))  # an interrupted write
    removed = ckpt.prune(folder, keep=1)
    assert [p for _, p in ckpt.list_checkpoints(folder)] == [paths[0]] and len(removed) == 2


def test_checkpoint_on_cloud_storage_is_whole_or_ignored(tmp_path, gcs_bucket):
    data = write_dataset(str(tmp_path / "data"), rows=96)
    cfg = tiny_config(epochs=1)
    folder = f"gs://{gcs_bucket}/run1/checkpoints"
    _run(cfg, data, str(tmp_path / "out"), folder, every=3)
    found = ckpt.list_checkpoints(folder)
    assert [s for s, _ in found] == [6, 3]
    newest, previous = found[0][1], found[1][1]
    manifest = ckpt.verify(newest)
    assert {e["role"] for e in manifest["files"]} == {"shard", "dense", "worker"}
    backend = _restore(cfg, newest, manifest)
    assert sum(t["tables"]["default"]["rows"] for t in backend.stats()) > 0
    # overwrite one object of the newest checkpoint: refused, the previous one is used
    shard = io.join(newest, "shards/shard-00000.npz")
    raw = bytearray(io.read_bytes(shard))
    raw[len(raw) // 2] ^= 1
    io.write_bytes(shard, bytes(raw))
    with pytest.raises(ckpt.CheckpointError, match="CRC-32C"):
        ckpt.verify(newest)
    assert ckpt.find_latest(folder, deep_roles=None)[0] == previous


@pytest.mark.processes
def test_resume_refuses_a_checkpoint_of_another_run_naming_the_difference(tmp_path):
    data = write_dataset(str(tmp_path / "data"), rows=96)
    cfg = tiny_config(epochs=1)
    info = ckpt.lineage(cfg, data)
    assert info["config_sha256"] == ckpt.config_sha256(cfg) and len(info["data"]["train_files"]) == 2
    assert info["code_version"] != "unknown"
    manifest = {"lineage": info}
    more_epochs = cfg.with_overrides({"trainer.epochs": 3, "embedding.num_shards": 3})
    ckpt.check_lineage(manifest, ckpt.lineage(more_epochs, data), "ckpt")  # allowed to differ
    # execution settings: checkpointing more or less often must not block the resume (it did: the prefix
    # "trainer.checkpoint" matched no key)
    settings = cfg.with_overrides(
        {
            "trainer.checkpoint_every_steps": 7,
            "trainer.checkpoint_every_s": 60.0,
            "trainer.checkpoint_keep": 5,
            "trainer.delta_every_s": 30.0,
            "trainer.shared_memory": False,
        }
    )
    ckpt.check_lineage(manifest, ckpt.lineage(settings, data), "ckpt")
    other = cfg.with_overrides({"trainer.batch_size": 8})
    with pytest.raises(ckpt.CheckpointError, match=r"trainer\.batch_size: 16 -> 8"):
        ckpt.check_lineage(manifest, ckpt.lineage(other, data), "ckpt")
    other_data = write_dataset(str(tmp_path / "data2"), rows=96, seed=5)
    with pytest.raises(ckpt.CheckpointError, match="input data differs"):
        ckpt.check_lineage(manifest, ckpt.lineage(cfg, other_data), "ckpt")


def test_reshard_on_resume_routes_a_two_shard_checkpoint_to_three_servers(tmp_path, trained_checkpoints):
    from persia_core.hashing import shard_of
    from persia_core.train.resume import checkpoint_inits

    folder, (newest, *_) = _two_checkpoints(tmp_path, trained_checkpoints)
    manifest = ckpt.verify(newest)
    cfg = tiny_config(epochs=1).with_overrides({"embedding.num_shards": 3})
    inits = checkpoint_inits(newest, manifest, 3, cfg, "", str(tmp_path / "work"))
    assert len(inits) == 3
    before = _restore(tiny_config(epochs=1), newest, manifest).state_dicts()
    rows = {
        int(k): (w, a)
        for sd in before
        for k, w, a in zip(sd["default"]["keys"], sd["default"]["weights"], sd["default"]["acc"], strict=True)
    }
    after = LocalEmbedding(cfg.embedding, seed=0)
    seen = 0
    for s, init in enumerate(inits):
        load_shard_file(init["path"], after.shards[s], init["bytes"], init["crc32c"])
        sd = after.shards[s]["default"].state_dict()
        assert (shard_of(sd["keys"], 3) == s).all()
        for k, w, a in zip(sd["keys"], sd["weights"], sd["acc"], strict=True):
            np.testing.assert_array_equal(w, rows[int(k)][0])
            assert a == rows[int(k)][1]
        seen += len(sd["keys"])
    assert seen == len(rows)


def test_a_resume_at_another_staleness_says_which_steps_ran_at_which(tmp_path, caplog):
    # K is an execution setting a resume may change (RESUME_MAY_DIFFER); the run's metrics then record the K of
    # each stretch of steps, and the change is logged, instead of the last K alone
    data = write_dataset(str(tmp_path / "data"), rows=160)
    cfg = tiny_config(epochs=1, embedding_staleness=0)
    first, _ = _run(cfg, data, str(tmp_path / "a"), str(tmp_path / "a-ckpt"), every=4)
    assert first["staleness_segments"] == [[0, 0]]
    path = ckpt.checkpoint_path(str(tmp_path / "a-ckpt"), 4)
    manifest = ckpt.verify(path)
    again = tiny_config(epochs=1, embedding_staleness=2)
    with caplog.at_level("WARNING", logger="persia.worker"):
        hist, _ = _run(
            again,
            data,
            str(tmp_path / "b"),
            str(tmp_path / "b-ckpt"),
            4,
            (path, manifest),
            _restore(cfg, path, manifest),
        )
    assert hist["staleness_segments"] == [[0, 0], [4, 2]] and hist["embedding_staleness"] == 2
    assert any("from step 4 on; the checkpoint's steps ran at 0" in r.getMessage() for r in caplog.records)
