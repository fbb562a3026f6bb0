"""make soak's own parts at a tiny size (the soak itself is not part of make test): its data's distinct-ID counts
are exact, its budget holds the rows asked for, and its model checksums ignore the order rows are held in."""

import numpy as np
import pyarrow.parquet as pq

from persia_core.bench.soak import budget_for_rows, model_checksums, write_soak_data
from persia_core.data.reader import read_schema
from persia_core.embedding.shard_tables import make_tables, write_shard_file
from persia_core.memory import capacity_for_budget


def test_the_soak_data_counts_its_distinct_ids_exactly(tmp_path):
    schema = write_soak_data(str(tmp_path), train_rows=3000, eval_rows=500, fresh=0.5)
    assert schema == read_schema(str(tmp_path))
    ids: dict[str, set] = {}
    for rel in schema["train_files"] + schema["eval_files"]:
        t = pq.read_table(tmp_path / rel)
        for s in schema["slots"]:
            ids.setdefault(s, set()).update(t.column(f"slot_{s}").combine_chunks().values.to_numpy().tolist())
    assert {s: len(v) for s, v in ids.items()} == schema["distinct_ids"]
    assert 0.5 * 3500 * 0.9 < min(schema["distinct_ids"].values())  # about half of each slot's IDs are fresh


def test_the_soak_budget_holds_the_rows_asked_for():
    for rows in (5000, 1_000_000, 52_000_000):
        assert capacity_for_budget(budget_for_rows(rows), "rowwise_adagrad", 16) >= rows


def test_model_checksums_agree_for_the_same_rows_held_in_another_order(tmp_path):
    from persia_core.config import TableConfig

    tables = [TableConfig(name="default", dim=4)]
    ids = np.arange(1, 2001, dtype=np.uint64) * np.uint64(7919)
    for name, order in (("a", ids), ("b", ids[::-1].copy())):
        t = make_tables(tables, 1 << 22)["default"]
        t.lookup(order)
        (tmp_path / name / "shards").mkdir(parents=True)
        write_shard_file(str(tmp_path / name / "shards" / "shard-00000.npz"), {"default": t})
    a, b = model_checksums(str(tmp_path / "a")), model_checksums(str(tmp_path / "b"))
    assert a["shard-00000.npz"]["default"]["rows"] == 2000
    sums_a, sums_b = a["shard-00000.npz"]["default"]["crc32c"], b["shard-00000.npz"]["default"]["crc32c"]
    assert {k for k in sums_a if sums_a[k] == sums_b[k]} >= {"keys", "weights", "acc", "last_used"}
    assert sums_a["keys_by_recency"] != sums_b["keys_by_recency"]  # looked up in the other order
