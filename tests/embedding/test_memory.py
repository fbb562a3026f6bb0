"""persia_core.memory: the accounting the config, the planners and the table share."""

import subprocess
import sys

import numpy as np
import pytest

from persia_core import memory
from persia_core.config import OPTIMIZERS, OptimizerConfig
from persia_core.embedding import kernels
from persia_core.embedding.table import EmbeddingTable


def test_queue_fixed_bytes_match_the_kernels_recency_queue():
    assert memory.QUEUE_FIXED_BYTES == 8 * kernels.queue_size(0)
    for rows in (0, 1, 1000, 1 << 20):
        assert kernels.queue_size(rows) == rows + rows // 4 + memory.QUEUE_FIXED_ENTRIES


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_a_full_table_allocates_what_bytes_per_row_counts(optimizer):
    cap = memory.capacity_for_budget(4 << 20, optimizer, 16)
    t = EmbeddingTable(16, OptimizerConfig(name=optimizer), capacity=cap)
    t.lookup(np.arange(1, cap + 1, dtype=np.uint64))
    assert t.size == cap
    stats = t.stats()
    allocated = stats["bytes_allocated"] - t.sketch.nbytes
    assert allocated == pytest.approx(cap * memory.bytes_per_row(optimizer, 16, cap), abs=8)
    assert allocated <= 4 << 20


@pytest.mark.processes
def test_config_refuses_a_budget_below_1024_rows_without_the_embedding_package():
    """The config's budget check runs wherever the config loads; the config imports no embedding package."""
    code = (
        "import sys\n"
        "from persia_core.config import load_config\n"
        "try:\n"
        "    tables = [{'name': 'default', 'dim': 64}]\n"
        "    load_config('movielens', {'embedding.shard_memory_bytes': 65536, 'embedding.tables': tables})\n"
        "except ValueError as e:\n"
        "    print('refused:', e)\n"
        "print(sorted(m for m in sys.modules if m.startswith('persia_core.embedding')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "refused:" in out and "fewer than 1024 rows" in out
    assert out.strip().endswith("[]")
