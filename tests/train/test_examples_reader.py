"""ParquetExamples against a recomputation with plain pyarrow: one-ID-per-row slots (held as one matrix) and
multi-hot ones, over several files and row groups, and no rows at all."""

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from persia_core.data import schema as S
from persia_core.data.reader import ParquetExamples


def _write(path, ids_by_slot: dict[str, list[list[int]]], start: int, row_group: int) -> None:
    n = len(next(iter(ids_by_slot.values())))
    cols = [
        pa.array(np.arange(n, dtype=np.float32) % 2),
        pa.array([[float(start + i), 0.5] for i in range(n)], pa.list_(pa.float32())),
        *[pa.array(v, pa.list_(pa.uint64())) for v in ids_by_slot.values()],
        pa.array(np.arange(start, start + n, dtype=np.int64)),
        pa.array([f"f:{start + i}" for i in range(n)]),
    ]
    pq.write_table(pa.Table.from_arrays(cols, schema=S.arrow_schema(list(ids_by_slot))), path, row_group_size=row_group)


def _check(files, slots, want: dict[str, list[list[int]]], one_per_row: bool) -> None:
    ex = ParquetExamples([str(f) for f in files], slots, num_dense=2)
    n = len(next(iter(want.values())))
    assert len(ex) == n and ex.dense.shape == (n, 2) and ex.dense[:, 0].tolist() == list(range(n))
    assert ex.ts.tolist() == list(range(n)) and ex.labels.dtype == np.float32
    assert (ex.fixed is not None) == one_per_row
    for s in slots:
        values, offsets = ex.ids[s]
        assert values.dtype == np.uint64 and offsets.dtype == np.int64
        assert [values[offsets[i] : offsets[i + 1]].tolist() for i in range(n)] == want[s]
    if one_per_row:
        assert ex.fixed.shape == (len(slots), n) and ex.fixed.dtype == np.uint64


def test_one_id_per_row_slots_become_one_matrix_across_files_and_row_groups(tmp_path):
    rng = np.random.default_rng(0)
    a = [[int(x)] for x in rng.integers(1, 2**63, 70, dtype=np.uint64)]
    b = [[int(x)] for x in rng.integers(1, 2**63, 70, dtype=np.uint64)]
    _write(tmp_path / "0.parquet", {"a": a[:40], "b": b[:40]}, 0, row_group=16)
    _write(tmp_path / "1.parquet", {"a": a[40:], "b": b[40:]}, 40, row_group=7)
    _check([tmp_path / "0.parquet", tmp_path / "1.parquet"], ["b", "a"], {"a": a, "b": b}, one_per_row=True)


def test_multi_hot_and_empty_bags_keep_their_offsets(tmp_path):
    a = [[1], [2, 3], [], [4], [5, 6, 7]] * 5
    b = [[9]] * 25
    _write(tmp_path / "0.parquet", {"a": a[:12], "b": b[:12]}, 0, row_group=5)
    _write(tmp_path / "1.parquet", {"a": a[12:], "b": b[12:]}, 12, row_group=4)
    _check([tmp_path / "0.parquet", tmp_path / "1.parquet"], ["a", "b"], {"a": a, "b": b}, one_per_row=False)


def test_no_rows_at_all(tmp_path):
    _write(tmp_path / "0.parquet", {"a": [], "b": []}, 0, row_group=4)
    ex = ParquetExamples([str(tmp_path / "0.parquet")], ["a", "b"], num_dense=2)
    assert len(ex) == 0 and ex.dense.shape == (0, 2) and ex.fixed.shape == (2, 0)


def test_a_one_id_per_row_file_then_a_multi_hot_one_keep_every_bag(tmp_path):
    a = [[i + 1] for i in range(10)] + [[1, 2], [], [3]] * 3
    b = [[100 + i] for i in range(19)]
    _write(tmp_path / "0.parquet", {"a": a[:10], "b": b[:10]}, 0, row_group=4)
    _write(tmp_path / "1.parquet", {"a": a[10:], "b": b[10:]}, 10, row_group=4)
    _check([tmp_path / "0.parquet", tmp_path / "1.parquet"], ["a", "b"], {"a": a, "b": b}, one_per_row=False)
