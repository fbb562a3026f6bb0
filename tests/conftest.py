"""Shared fixtures (helpers live in ``tests/support.py``, importable as ``support``)."""

import pytest
from support import write_dataset


@pytest.fixture
def tiny_data(tmp_path):
    """A small preprocessed dataset (2 train shards, 1 eval shard) for ``support.tiny_config``."""
    return write_dataset(str(tmp_path / "data"))
