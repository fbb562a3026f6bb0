"""Shard files: exact round trip of rows, optimizer state and recency; integrity checks; re-sharding; deltas."""

import os

import numpy as np
import pytest
from support import tiny_config

from persia_core.config import OptimizerConfig
from persia_core.embedding import shard_file as F
from persia_core.embedding import shard_tables as T
from persia_core.embedding.checksums import file_crc32c
from persia_core.embedding.delta import (
    apply_deltas,
    delta_path,
    deltas_after,
    list_deltas,
    load_with_deltas,
    superseded_deltas,
)
from persia_core.embedding.reshard import reshard
from persia_core.embedding.table import EmbeddingTable
from persia_core.hashing import shard_of
from persia_core.ps.shard import ParameterServerShard

OPTIMIZERS = ["sgd", "rowwise_adagrad", "adagrad", "adam"]


def _trained_table(opt: str, capacity: int = 3000, steps: int = 12, seed: int = 0) -> EmbeddingTable:
    t = EmbeddingTable(4, OptimizerConfig(name=opt, lr=0.05), capacity, 0.1, 0)
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        ids = np.unique(rng.integers(0, 5000, 600).astype(np.uint64))
        t.lookup(ids)
        t.apply_gradients(ids, rng.normal(size=(len(ids), 4)).astype(np.float32))
    return t


def _assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


@pytest.mark.parametrize("opt", OPTIMIZERS)
def test_shard_file_round_trip_keeps_rows_optimizer_state_and_recency_and_training_continues_identically(tmp_path, opt):
    t = _trained_table(opt)
    assert t.stats()["evictions"] > 0  # the recency list has been exercised
    path = str(tmp_path / "shard.npz")
    nbytes, crc = T.write_shard_file(path, {"default": t}, server={"note": 1})
    assert (nbytes, crc) == file_crc32c(path)
    with np.load(path) as z:  # a standard npz, no pickles
        assert "default.keys" in z.files and "__meta__" in z.files
    u = EmbeddingTable(4, OptimizerConfig(name=opt, lr=0.05), 3000, 0.1, 0)
    assert T.load_shard_file(path, {"default": u}, nbytes, crc) == {"note": 1}
    _assert_same(t.state_dict(), u.state_dict())
    rng = np.random.default_rng(7)
    for _ in range(3):  # the same lookups (with evictions) and updates give the same tables
        ids = np.unique(rng.integers(0, 7000, 700).astype(np.uint64))
        np.testing.assert_array_equal(t.lookup(ids), u.lookup(ids))
        g = rng.normal(size=(len(ids), 4)).astype(np.float32)
        t.apply_gradients(ids, g)
        u.apply_gradients(ids, g)
    _assert_same(t.state_dict(), u.state_dict())


def test_array_data_is_64_byte_aligned_in_the_file(tmp_path):
    path = str(tmp_path / "s.npz")
    T.write_shard_file(path, {"default": _trained_table("adam")})
    with open(path, "rb", buffering=0) as f:
        members = F._members(f, os.path.getsize(path), path)
    assert members and all(m.data % 64 == 0 for m in members)


def test_corrupt_or_partial_shard_file_is_refused_naming_the_check(tmp_path):
    path = str(tmp_path / "s.npz")
    nbytes, crc = T.write_shard_file(path, {"default": _trained_table("rowwise_adagrad")})
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0x01
    bad = str(tmp_path / "bad.npz")
    open(bad, "wb").write(data)
    fresh = {"default": EmbeddingTable(4, OptimizerConfig(), 3000)}
    with pytest.raises(F.ShardFileError, match="CRC-32C .* does not match"):
        T.load_shard_file(bad, fresh, nbytes, crc)
    with pytest.raises(F.ShardFileError, match="zip CRC-32 mismatch"):  # no manifest: the zip's own CRCs
        T.load_shard_file(bad, fresh)
    open(bad, "wb").write(data[: nbytes // 2])
    with pytest.raises(F.ShardFileError, match="manifest says"):
        T.load_shard_file(bad, fresh, nbytes, crc)
    with pytest.raises(F.ShardFileError, match="not a complete shard file"):
        T.load_shard_file(bad, fresh)
    assert fresh["default"].size == 0  # nothing half-loaded


def test_shard_file_of_another_dim_or_optimizer_is_refused_naming_the_table(tmp_path):
    path = str(tmp_path / "s.npz")
    T.write_shard_file(path, {"default": _trained_table("adam")})
    with pytest.raises(F.ShardFileError, match="table 'default'.*optimizer"):
        T.load_shard_file(path, {"default": EmbeddingTable(4, OptimizerConfig(name="sgd"), 3000)})
    with pytest.raises(F.ShardFileError, match="table 'default'.*dim"):
        T.load_shard_file(path, {"default": EmbeddingTable(8, OptimizerConfig(name="adam"), 3000)})


def test_reshard_two_to_three_shards_preserves_every_row_and_its_optimizer_state(tmp_path):
    cfg = tiny_config()
    emb = cfg.embedding
    old = [T.make_tables(emb.tables, emb.shard_memory_bytes) for _ in range(2)]
    rng = np.random.default_rng(0)
    for _ in range(5):
        ids = np.unique(rng.integers(0, 3000, 800).astype(np.uint64))
        own = shard_of(ids, 2)
        for s in range(2):
            part = ids[own == s]
            old[s]["default"].lookup(part)
            old[s]["default"].apply_gradients(part, rng.normal(size=(len(part), 4)).astype(np.float32))
    paths = [str(tmp_path / f"old{s}.npz") for s in range(2)]
    for p, tables in zip(paths, old, strict=True):
        T.write_shard_file(p, tables)
    new, report = reshard([F.read_shard_file(p).tables for p in paths], 3)
    new_paths = [str(tmp_path / f"new{s}.npz") for s in range(3)]
    for p, tables in zip(new_paths, new, strict=True):
        F.write_shard_arrays(p, tables)
    before = {}
    for tables in old:
        sd = tables["default"].state_dict()
        before.update({int(k): (w, a) for k, w, a in zip(sd["keys"], sd["weights"], sd["acc"], strict=True)})
    assert report["rows"]["default"] == len(before) and report["dropped"]["default"] == 0
    after = {}
    for s, p in enumerate(new_paths):
        tables = T.make_tables(emb.tables, emb.shard_memory_bytes)
        T.load_shard_file(p, tables)
        sd = tables["default"].state_dict()
        assert (shard_of(sd["keys"], 3) == s).all()  # routed by the new plan
        after.update({int(k): (w, a) for k, w, a in zip(sd["keys"], sd["weights"], sd["acc"], strict=True)})
    assert after.keys() == before.keys()
    for k, (w, a) in before.items():
        np.testing.assert_array_equal(after[k][0], w)
        assert after[k][1] == a


def test_reshard_beyond_capacity_keeps_the_most_recent_rows(tmp_path):
    t = _trained_table("rowwise_adagrad")
    recent = t.state_dict()["keys"]
    new, report = reshard(
        [{"default": F.TableArrays(t.state_dict(), {"layout": "lru", "dim": 4})}], 1, {"default": 1000}
    )
    assert report["dropped"]["default"] == len(recent) - 1000
    np.testing.assert_array_equal(np.sort(new[0]["default"].arrays["keys"]), np.sort(recent[:1000]))


class _Trainer:
    """Lookups (creating rows) and one async push of random gradients per call, on a shard's ``default`` table."""

    def __init__(self, shard: ParameterServerShard, seed: int):
        self.shard, self.rng, self.seq = shard, np.random.default_rng(seed), 0

    def __call__(self, n_ids: int, hi: int) -> None:
        ids = np.unique(self.rng.integers(0, hi, n_ids).astype(np.uint64))
        self.shard.lookup("default", ids)
        self.seq += 1
        meta = {"table": "default", "client": "c", "seq": self.seq, "step": 0, "sync_workers": 0}
        self.shard.push(meta, ids, self.rng.normal(size=(len(ids), 4)).astype(np.float32), None)


def _by_key(sd: dict) -> dict:
    o = np.argsort(sd["keys"])
    return {k: sd[k][o] for k in ("keys", "weights", "acc")}


def _exporting_shard(tmp_path, seed: int) -> tuple[ParameterServerShard, str, _Trainer]:
    """A one-shard server of ``tiny_config`` (1,500 rows) exporting deltas on demand, its delta folder and a
    trainer of it."""
    shard = ParameterServerShard(tiny_config(), 0, 1, capacities={"default": 1500})
    deltas = str(tmp_path / "deltas")
    shard.start_deltas(deltas, every_s=0)
    return shard, deltas, _Trainer(shard, seed)


def test_delta_exports_applied_to_the_full_dump_give_the_current_table(tmp_path):
    shard, deltas, train_a_bit = _exporting_shard(tmp_path, 0)
    by_key = _by_key
    for _ in range(3):
        train_a_bit(400, 1000)
    full = str(tmp_path / "full.npz")
    shard.dump(full)  # records delta_seq 0: every delta after it applies
    for _ in range(2):
        train_a_bit(300, 1000)
    assert shard.export_delta().endswith("delta-00000001.npz")
    later = str(tmp_path / "later.npz")
    shard.dump(later)  # records delta_seq 1
    for _ in range(4):  # past capacity: rows are evicted, so the delta also carries their keys (tombstones)
        train_a_bit(500, 4000)
    assert shard.tables["default"].stats()["evictions"] > 0
    assert shard.export_delta().endswith("delta-00000002.npz")
    current = by_key(shard.tables["default"].state_dict())
    for base in (full, later):
        got = by_key(load_with_deltas(base, deltas, 0)["default"])
        for k in current:
            np.testing.assert_array_equal(got[k], current[k], err_msg=f"{base} {k}")


def test_a_delta_after_evictions_holds_the_changed_rows_and_the_evicted_keys_and_reproduces_the_table(tmp_path):
    # issue "Online serving": a delta records the rows changed and the keys evicted since the previous one, not
    # every live key, so its size follows the change; dump + deltas give the table exactly, a key evicted and
    # recreated within the interval included (its new row and reset optimizer state)
    shard, deltas, train_a_bit = _exporting_shard(tmp_path, 2)
    table = shard.tables["default"]
    for _ in range(3):
        train_a_bit(600, 1500)
    shard.lookup("default", np.arange(1500, dtype=np.uint64))
    assert table.size == 1500  # full: every new ID now evicts a row
    shard.export_delta()  # everything so far
    full = str(tmp_path / "full.npz")
    shard.dump(full)  # delta_seq 1
    before = set(table.state_dict()["keys"].tolist())
    new_ids = np.arange(10_000, 10_040, dtype=np.uint64)
    shard.lookup("default", new_ids)  # 40 rows evicted, the least recently used
    gone = sorted(before - set(table.state_dict()["keys"].tolist()))
    assert len(gone) == 40
    again = np.array(gone[:3], dtype=np.uint64)  # evicted, then recreated (evicting 3 more) and trained
    shard.lookup("default", again)
    meta = {"table": "default", "client": "c", "seq": 99, "step": 0, "sync_workers": 0}
    shard.push(meta, again, np.full((3, 4), 0.5, np.float32), None)
    path = shard.export_delta()
    delta = F.read_shard_file(path, build_index=False).tables["default"].arrays
    after = set(table.state_dict()["keys"].tolist())
    assert "live_keys" not in delta
    assert sorted(delta["keys"].tolist()) == sorted(new_ids.tolist() + again.tolist())  # the changed rows only
    assert delta["evicted_keys"].tolist() == sorted(before - after | set(again.tolist()))  # 43 tombstones
    assert len(delta["keys"]) + len(delta["evicted_keys"]) < 0.1 * table.size
    current = _by_key(table.state_dict())
    got = _by_key(load_with_deltas(full, deltas, 0)["default"])
    for k in current:
        np.testing.assert_array_equal(got[k], current[k], err_msg=k)
    # the recreated keys start over: their accumulators hold one push, not their history before eviction
    acc = dict(zip(current["keys"].tolist(), current["acc"].tolist(), strict=True))
    full_acc = _by_key(T.lru_state_dict(F.read_shard_file(full, build_index=False).tables["default"]))
    old_acc = dict(zip(full_acc["keys"].tolist(), full_acc["acc"].tolist(), strict=True))
    assert all(acc[int(k)] < old_acc[int(k)] for k in again)


def test_loading_an_earlier_dump_marks_the_later_deltas_superseded_and_exports_a_rollback(tmp_path):
    # epochs: auto loads the best epoch's dump back into the servers at the end: the deltas written after that
    # dump hold rows of a discarded model. They are marked superseded (load_with_deltas skips them), and a
    # rollback delta holds the loaded rows of every ID changed since plus the live keys, so a consumer that
    # already applied every delta in order (online serving) also ends at the loaded state
    shard, deltas, train_a_bit = _exporting_shard(tmp_path, 1)
    by_key = _by_key

    base = str(tmp_path / "base.npz")
    shard.dump(base)  # delta_seq 0
    train_a_bit(300, 1000)
    assert shard.export_delta().endswith("delta-00000001.npz")
    train_a_bit(300, 1000)  # changes not exported yet when the best dump is taken
    best = str(tmp_path / "best.npz")
    shard.dump(best)  # delta_seq 1
    kept = by_key(shard.tables["default"].state_dict())
    train_a_bit(300, 2000)  # the discarded epochs: new IDs too
    assert shard.export_delta().endswith("delta-00000002.npz")
    train_a_bit(300, 2000)
    assert shard.export_delta().endswith("delta-00000003.npz")
    train_a_bit(300, 2000)  # pending at the load
    shard.load(best)
    assert by_key(shard.tables["default"].state_dict())["keys"].tolist() == kept["keys"].tolist()
    assert superseded_deltas(deltas, 0) == {2, 3}
    assert [seq for seq, _ in list_deltas(deltas, 0)] == [1, 2, 3, 4]  # 4: the rollback
    assert deltas_after(deltas, 0, 1) == [delta_path(deltas, 0, 4)]
    for start in (base, best):  # a full dump and the deltas after it, superseded ones skipped
        got = by_key(load_with_deltas(start, deltas, 0)["default"])
        for k in kept:
            np.testing.assert_array_equal(got[k], kept[k], err_msg=f"{start} {k}")
    contents = F.read_shard_file(base, build_index=False)
    online = apply_deltas(
        {n: T.lru_state_dict(ta) for n, ta in contents.tables.items()}, [p for _, p in list_deltas(deltas, 0)]
    )
    got = by_key(online["default"])
    for k in kept:
        np.testing.assert_array_equal(got[k], kept[k], err_msg=f"every delta in order: {k}")
    # training goes on from the loaded state: the next delta follows the rollback
    train_a_bit(100, 1000)
    assert shard.export_delta().endswith("delta-00000005.npz")
    # a shard restarted from the base dump (delta_seq 0) removes every later delta and the marks with them
    again = ParameterServerShard(tiny_config(), 0, 1, capacities={"default": 1500})
    again.load(base)
    again.start_deltas(deltas, every_s=0)
    assert list_deltas(deltas, 0) == [] and superseded_deltas(deltas, 0) == set()


def test_delta_export_runs_every_t_seconds_on_its_own(tmp_path):
    import time

    from persia_core.embedding.delta import list_deltas

    shard = ParameterServerShard(tiny_config(), 0, 1)
    shard.start_deltas(str(tmp_path / "d"), every_s=0.05)
    try:
        shard.lookup("default", np.arange(10, dtype=np.uint64))
        deadline = time.monotonic() + 10
        while not list_deltas(str(tmp_path / "d"), 0) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert list_deltas(str(tmp_path / "d"), 0)
    finally:
        shard.exporter.stop()


@pytest.mark.parametrize("small", [False, True])  # small: fewer than 1024 rows, the state-dict path
def test_admission_sightings_survive_a_shard_file_round_trip(tmp_path, small):
    """An ID seen twice before a checkpoint is admitted on its third sighting after the restart, not its fifth."""

    def table():
        return EmbeddingTable(4, OptimizerConfig(name="adagrad", lr=0.05), 3000, 0.1, 0, admit_after_sightings=3)

    t = table()
    if not small:
        t.lookup(np.arange(2000, 3500, dtype=np.uint64))  # 1500 IDs seen three times: admitted
        t.lookup(np.arange(2000, 3500, dtype=np.uint64))
        t.lookup(np.arange(2000, 3500, dtype=np.uint64))
    pending = np.array([7, 2**64 - 1], dtype=np.uint64)
    t.lookup(pending)
    t.lookup(pending)
    assert not t.contains(pending).any()
    path = str(tmp_path / "shard.npz")
    T.write_shard_file(path, {"default": t})
    back = table()
    T.load_shard_file(path, {"default": back})
    np.testing.assert_array_equal(back.sketch, t.sketch)
    back.lookup(pending)
    assert back.contains(pending).all()
    fresh = table()  # without the sketch the same sighting is only the first
    fresh.lookup(pending)
    assert not fresh.contains(pending).any()


def test_shard_files_of_format_2_with_a_linked_recency_list_still_load(tmp_path, monkeypatch):
    """Files written before the recency queue (persia-shard/2: rows in table order plus a prev/next list) load
    with the same rows, state and recency order."""
    t = _trained_table("adagrad", capacity=3000)
    sd = t.state_dict()  # most recent first
    n = len(sd["keys"])
    perm = np.random.default_rng(5).permutation(n)  # rows stored in an arbitrary table order
    pos = np.empty(n, np.int64)
    pos[perm] = np.arange(n)  # recency rank i is stored at row pos[i]
    arrays = {k: np.empty_like(v) for k, v in sd.items()}
    for k, v in sd.items():
        arrays[k][pos] = v
    prev, nxt = np.full(n, -1, np.int32), np.full(n, -1, np.int32)
    nxt[pos[:-1]] = pos[1:]
    prev[pos[1:]] = pos[:-1]
    counters = np.zeros(4, np.int64)
    counters[0] = n
    arrays.update({"prev": prev, "nxt": nxt, "head_tail": np.array([pos[0], pos[-1]], np.int32), "counters": counters})
    ta = F.TableArrays(arrays, {"dim": 4, "optimizer": "adagrad", "layout": "storage", "rows": n, "step": int(t.step)})
    monkeypatch.setattr(F, "SHARD_FORMAT", "persia-shard/2")
    path = str(tmp_path / "old.npz")
    F.write_shard_arrays(path, {"default": ta})
    monkeypatch.undo()
    with np.load(path) as z:
        assert "__meta__" in z.files and "default.nxt" in z.files
    u = EmbeddingTable(4, OptimizerConfig(name="adagrad", lr=0.05), 3000, 0.1, 0)
    T.load_shard_file(path, {"default": u})
    _assert_same(sd, u.state_dict())


def _misaligned(t: EmbeddingTable) -> list[str]:
    arrays = {
        "keys": t.keys,
        "weights": t.weights,
        "last_used": t.last_used,
        "index": t.index,
        "qrow": t.qrow,
        "qstep": t.qstep,
        **{f"state.{k}": v for k, v in t.state.items()},
    }
    return [k for k, v in arrays.items() if v.ctypes.data % 64 or not v.flags.c_contiguous]


def test_table_arrays_start_on_a_cache_line_when_made_grown_and_loaded(tmp_path):
    # a 64-byte row (dim 16, fp32) must not straddle two cache lines: numpy alone aligns large arrays to 16 bytes
    t = EmbeddingTable(16, OptimizerConfig(name="rowwise_adagrad", lr=0.05), 50_000, 0.1, 0)
    assert _misaligned(t) == []
    t.lookup(np.arange(20_000, dtype=np.uint64))  # grows past the initial 1024 rows
    t.apply_gradients(np.arange(10, dtype=np.uint64), np.ones((10, 16), np.float32))
    assert len(t.keys) > 1024 and _misaligned(t) == []
    path = str(tmp_path / "s.npz")
    nbytes, crc = T.write_shard_file(path, {"default": t})
    for capacity in (50_000, 15_000):  # restored in place from the file; re-inserted (fewer rows fit)
        u = EmbeddingTable(16, OptimizerConfig(name="rowwise_adagrad", lr=0.05), capacity, 0.1, 0)
        T.load_shard_file(path, {"default": u}, nbytes, crc)
        assert u.size == min(capacity, 20_000) and _misaligned(u) == []
        ids = np.arange(19_990, 20_000, dtype=np.uint64)
        np.testing.assert_array_equal(u.lookup_readonly(ids), t.lookup_readonly(ids))


def test_a_failed_delta_export_loses_nothing_the_next_one_writes_it_under_the_same_number(tmp_path, monkeypatch):
    import persia_core.embedding.delta as D

    shard, deltas, train_a_bit = _exporting_shard(tmp_path, 3)
    train_a_bit(400, 1000)
    shard.export_delta()
    full = str(tmp_path / "full.npz")
    shard.dump(full)  # delta_seq 1
    for _ in range(3):  # changed rows and, past capacity, evicted ones: both must survive the failed write
        train_a_bit(700, 5000)
    assert shard.tables["default"].stats()["evictions"] > 0
    real = D.write_shard_arrays

    def full_disk(*a, **kw):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(D, "write_shard_arrays", full_disk)
    with pytest.raises(OSError, match="No space"):
        shard.export_delta()
    monkeypatch.setattr(D, "write_shard_arrays", real)
    train_a_bit(300, 5000)
    assert shard.export_delta().endswith("delta-00000002.npz")  # the number the failed one would have had
    current = _by_key(shard.tables["default"].state_dict())
    got = _by_key(load_with_deltas(full, deltas, 0)["default"])
    for k in current:
        np.testing.assert_array_equal(got[k], current[k], err_msg=k)


def test_a_delta_folder_that_cannot_be_made_fails_the_server_at_start_naming_it(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("not a folder")
    shard = ParameterServerShard(tiny_config(), 0, 1, capacities={"default": 100})
    with pytest.raises(ValueError, match="afile"):
        shard.start_deltas(str(afile), every_s=1.0)
    # and the local launcher refuses it (and a period that is not a number of seconds) before starting anything
    from persia_core.train.launcher import check_delta_settings

    with pytest.raises(ValueError, match="delta_dir .*afile"):
        check_delta_settings(str(afile / "deltas"), 1.0)
    for bad in (float("nan"), float("inf"), -1.0):
        with pytest.raises(ValueError, match="delta_every_s"):
            check_delta_settings(str(tmp_path / "d"), bad)
    check_delta_settings(str(afile), 0.0)  # no deltas: the folder is not used
