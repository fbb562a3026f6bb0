"""The client's row scatter equals fancy assignment."""

import numpy as np
import pytest

from persia_core.ps.client import put_rows


def test_put_rows_equals_fancy_assignment_and_refuses_what_does_not_fit():
    rng = np.random.default_rng(0)
    out, want = np.zeros((50, 3), np.float32), np.zeros((50, 3), np.float32)
    pos = rng.permutation(50)[:20]
    rows = rng.standard_normal((20, 3)).astype(np.float32)
    put_rows(out, pos, rows)
    want[pos] = rows
    np.testing.assert_array_equal(out, want)
    put_rows(out, pos[:0], rows[:0])  # nothing to do
    with pytest.raises(ValueError, match="rows for"):
        put_rows(out, pos, rows[:, :2])
    with pytest.raises(IndexError):
        put_rows(out, np.array([50]), rows[:1])
