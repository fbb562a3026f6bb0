"""A model loaded for read-only use (``LocalEmbedding.from_shard_files``) holds tables sized to the rows of its
files and reads exactly what the shards loaded into budget-sized tables read; its files are checked as ``load``
checks them; its tables are frozen: reads take no lock, changes raise."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from support import tiny_config

from persia_core.embedding.reference import LocalEmbedding
from persia_core.embedding.shard_file import ShardFileError

CFG = tiny_config()
TABLE = CFG.embedding.tables[0]
N = CFG.embedding.num_shards


@pytest.mark.parametrize("rows", [0, 5, 3000])  # none, fewer than the fast path's 1024, more
def test_tables_sized_to_their_rows_read_what_the_trained_shards_read(tmp_path, rows):
    trained = LocalEmbedding(CFG.embedding, N, seed=3)
    ids = np.unique(np.random.default_rng(rows).integers(1, 2**63, rows, dtype=np.uint64))
    if len(ids):
        trained.lookup(TABLE.name, ids)
        grads = np.random.default_rng(1).normal(size=(len(ids), TABLE.dim)).astype(np.float32)
        trained.push(TABLE.name, ids, grads)
    paths = [str(tmp_path / f"shard-{s}.npz") for s in range(N)]
    dumped = trained.dump(paths)
    budget = LocalEmbedding(CFG.embedding, N, seed=3)
    budget.load(paths, dumped)

    sized = LocalEmbedding.from_shard_files(CFG.embedding, paths, dumped, seed=3)

    for s in range(N):
        t = sized.shards[s][TABLE.name]
        assert t.capacity == max(1, budget.shards[s][TABLE.name].size) == max(1, t.size)
        assert t.capacity < budget.shards[s][TABLE.name].capacity
    unseen = np.arange(1, 50, dtype=np.uint64)
    probe = np.concatenate([ids, unseen])
    np.testing.assert_array_equal(sized.lookup_readonly(TABLE.name, probe), budget.lookup_readonly(TABLE.name, probe))
    np.testing.assert_array_equal(sized.contains(TABLE.name, probe), budget.contains(TABLE.name, probe))
    for s in range(N):
        got, want = sized.shards[s][TABLE.name].state_dict(), budget.shards[s][TABLE.name].state_dict()
        assert got.keys() == want.keys()
        for k in want:
            np.testing.assert_array_equal(got[k], want[k])


def test_a_file_that_differs_from_its_checksum_is_refused(tmp_path):
    trained = LocalEmbedding(CFG.embedding, N, seed=3)
    trained.lookup(TABLE.name, np.arange(1, 100, dtype=np.uint64))
    paths = [str(tmp_path / f"shard-{s}.npz") for s in range(N)]
    dumped = trained.dump(paths)
    with pytest.raises(ShardFileError, match="CRC-32C"):
        LocalEmbedding.from_shard_files(CFG.embedding, paths, [(n, crc ^ 1) for n, crc in dumped])
    with pytest.raises(ValueError, match="for 1 shard files"):
        LocalEmbedding.from_shard_files(CFG.embedding, paths[:1], dumped)


def test_tables_loaded_for_reading_are_frozen_reads_pass_a_held_lock_and_changes_raise(tmp_path):
    trained = LocalEmbedding(CFG.embedding, N, seed=3)
    ids = np.arange(1, 2000, dtype=np.uint64)
    trained.lookup(TABLE.name, ids)
    paths = [str(tmp_path / f"shard-{s}.npz") for s in range(N)]
    dumped = trained.dump(paths)
    sized = LocalEmbedding.from_shard_files(CFG.embedding, paths, dumped, seed=3)
    t = sized.shards[0][TABLE.name]
    assert t.frozen
    mine = ids[t.contains(ids)]
    got: dict = {}

    def read():  # as a request beside a thread that holds the lock (a long state copy, say)
        got["rows"] = t.lookup_readonly(mine)
        got["state"] = t.state_dict()

    with t.lock:
        reader = threading.Thread(target=read)
        reader.start()
        reader.join(timeout=30)
        assert not reader.is_alive(), "a read of a frozen table waited for its lock"
    np.testing.assert_array_equal(got["rows"], trained.lookup_readonly(TABLE.name, mine))
    assert len(got["state"]["keys"]) == t.size == len(mine)
    grads = np.ones((len(mine), TABLE.dim), dtype=np.float32)
    for what, change in [
        ("lookup", lambda: t.lookup(mine)),
        ("apply_gradients", lambda: t.apply_gradients(mine, grads)),
        ("load_state_dict", lambda: t.load_state_dict(got["state"])),
        ("expire", lambda: t.expire(1)),
    ]:
        with pytest.raises(RuntimeError, match=f"{what}: the embedding table is frozen"):
            change()
    np.testing.assert_array_equal(t.lookup_readonly(mine), got["rows"])  # nothing changed
