"""``persia serve --deltas`` (``persia_core.serve.deltas.DeltaFeed``) on real delta files: real parameter-server
shards (``ParameterServerShard``) start from the served model's shard files, train, export deltas that name the
served model, and put an earlier dump back (``epochs: auto``), which supersedes the deltas after it. The served
rows end equal to the shards' own rows whether the superseded delta was applied before it was superseded or never;
a delta that cannot be read leaves the served rows as they were, and the next good one applies; a delta whose
predecessor has not arrived waits for it."""

from __future__ import annotations

import os

import numpy as np
import pytest

from persia_core.model_store import manifest_digest
from persia_core.ps.shard import ParameterServerShard
from persia_core.serve.deltas import DeltaFeed
from persia_core.serve.server import load_served

pytestmark = pytest.mark.processes  # the module's trained model


def _by_key(sd: dict) -> dict:
    o = np.argsort(sd["keys"])
    return {k: sd[k][o] for k in ("keys", "weights", "acc")}


def _assert_rows_equal(served, shards) -> None:
    for s, shard in enumerate(shards):
        for name, table in shard.tables.items():
            want = _by_key(table.state_dict())
            got = _by_key(served.model.embedding.shards[s][name].state_dict())
            for k in want:
                np.testing.assert_array_equal(got[k], want[k], err_msg=f"shard {s} {name}.{k}")


def _push(shard: ParameterServerShard, rng, seq: int, n: int = 60) -> None:
    ids = np.unique(rng.integers(0, 5000, n).astype(np.uint64))
    shard.lookup("default", ids)
    meta = {"table": "default", "client": "c", "seq": seq, "step": 0, "sync_workers": 0}
    dim = shard.tables["default"].dim
    shard.push(meta, ids, rng.normal(size=(len(ids), dim)).astype(np.float32), None)


def _shards(model: str, deltas: str) -> tuple[object, list[ParameterServerShard]]:
    """The served model and one exporting shard per shard of it, started from its files."""
    base = load_served(model)
    cfg, manifest = base.model.config, base.model.manifest
    shards = []
    for s in range(manifest.num_shards):
        shard = ParameterServerShard(cfg, s, manifest.num_shards)
        shard.load(os.path.join(base.folder, manifest.shard_files[s]))
        shard.start_deltas(deltas, 0, base_model=manifest_digest(model))
        shards.append(shard)
    return base, shards


def test_the_served_rows_follow_the_deltas_and_superseded_ones_are_undone_or_skipped(trained, tmp_path):
    model, _ = trained
    deltas = str(tmp_path / "deltas")
    base, shards = _shards(model, deltas)
    rng = np.random.default_rng(0)
    early = DeltaFeed(deltas, {"served": base}, load_served)  # polls at every step
    late = DeltaFeed(deltas, {"served": base}, load_served)  # polls only at the end

    for shard in shards:
        _push(shard, rng, 1)
        shard.export_delta()  # delta 1
    early.state["served"] = early.check()
    _assert_rows_equal(early.state["served"], shards)
    dumps = [str(tmp_path / f"kept-{s}.npz") for s in range(len(shards))]
    for shard, dump in zip(shards, dumps, strict=True):
        shard.dump(dump)  # the "best epoch", at delta 1
        _push(shard, rng, 2)
        shard.export_delta()  # delta 2: rows of a model about to be discarded
    early.state["served"] = early.check()
    assert early.status()["applied"] == [2, 2]
    for shard, dump in zip(shards, dumps, strict=True):
        shard.load(dump)  # put back: delta 2 superseded, rollback delta 3 written
    for feed in (early, late):
        feed.state["served"] = feed.check()
        assert feed.status()["applied"] == [3, 3] and feed.status()["error"] is None
        _assert_rows_equal(feed.state["served"], shards)
    assert early.state["served"].version == f"{base.version}+deltas-3.3"

    # an unreadable delta: nothing changes, the error names it; the next good export under that number applies
    bad = os.path.join(deltas, "shard-00000", "delta-00000004.npz")
    with open(bad, "wb") as f:
        f.write(b"not a shard file")
    before = late.state["served"]
    assert late.check() is None and bad in late.status()["error"]
    assert late.state["served"] is before
    _push(shards[0], rng, 3)
    assert shards[0].export_delta() == bad  # the exporter writes delta 4 over it
    late.state["served"] = late.check()
    assert late.status()["applied"] == [4, 3] and late.status()["error"] is None
    _assert_rows_equal(late.state["served"], shards)


def test_a_delta_waits_for_its_predecessor_to_arrive(trained, tmp_path):
    model, _ = trained
    staged, live = str(tmp_path / "staged"), str(tmp_path / "live")
    base, shards = _shards(model, staged)
    rng = np.random.default_rng(1)
    for seq in (1, 2, 3):
        for shard in shards:
            _push(shard, rng, seq)
            shard.export_delta()
    feed = DeltaFeed(live, {"served": base}, load_served)

    def arrive(seq: int) -> None:  # every shard's delta ``seq`` moved into the served folder
        for s in range(len(shards)):
            name = os.path.join(f"shard-{s:05d}", f"delta-{seq:08d}.npz")
            os.makedirs(os.path.dirname(os.path.join(live, name)), exist_ok=True)
            os.replace(os.path.join(staged, name), os.path.join(live, name))

    assert feed.check() is None and feed.status()["applied"] == [0, 0]  # no folder yet: nothing to do
    arrive(1)
    arrive(3)
    feed.state["served"] = feed.check()
    assert feed.status()["applied"] == [1, 1] and "delta 2 is missing" in feed.status()["waiting"]
    assert feed.check() is None  # still waiting
    arrive(2)
    feed.state["served"] = feed.check()
    assert feed.status()["applied"] == [3, 3] and feed.status()["waiting"] is None
    _assert_rows_equal(feed.state["served"], shards)


def test_a_renumbered_folder_is_applied_again_from_the_served_models_own_rows(trained, tmp_path):
    model, _ = trained
    deltas = str(tmp_path / "deltas")
    base, first = _shards(model, deltas)
    rng = np.random.default_rng(2)
    for seq in (1, 2):
        for shard in first:
            _push(shard, rng, seq)
            shard.export_delta()
    feed = DeltaFeed(deltas, {"served": base}, load_served)
    feed.state["served"] = feed.check()
    assert feed.status()["applied"] == [2, 2]
    _, second = _shards(model, deltas)  # the next run from the same model: its servers remove the old deltas
    for shard in second:
        _push(shard, rng, 1)
        shard.export_delta()
    before = feed.state["served"]
    feed.state["served"] = feed.check()
    assert feed.status()["applied"] == [1, 1] and feed.state["served"].version == f"{base.version}+deltas-1.1"
    _assert_rows_equal(feed.state["served"], second)
    _assert_rows_equal(before, first)  # the rows a request in flight holds are left as they were
