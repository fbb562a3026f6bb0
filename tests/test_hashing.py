"""The compiled XXH3 of a request's keys equals the xxhash library's, so serving hashes as preprocess does."""

import numpy as np
import pytest
import xxhash

from persia_core import hashing
from persia_core.embedding.kernels import prefixed_xxh3


def test_the_compiled_xxh3_equals_xxhash_at_every_key_length_up_to_its_limit():
    rng = np.random.default_rng(0)
    keys = [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in range(0, 301) for _ in range(3)]
    cuts = [int(rng.integers(0, len(k) + 1)) for k in keys]
    prefixes = [k[:c] for k, c in zip(keys, cuts, strict=True)]
    values = [k[c:] for k, c in zip(keys, cuts, strict=True)]
    prefix_bounds = np.concatenate([[0], np.cumsum([len(p) for p in prefixes])]).astype(np.int64)
    value_bounds = np.concatenate([[0], np.cumsum([len(v) for v in values])]).astype(np.int64)
    out = np.zeros(len(keys), np.uint64)
    long_keys = prefixed_xxh3(
        np.frombuffer(b"".join(prefixes), np.uint8),
        prefix_bounds,
        np.frombuffer(b"".join(values), np.uint8),
        value_bounds,
        np.arange(len(keys), dtype=np.int64),
        out,
    )
    assert long_keys.tolist() == [i for i, k in enumerate(keys) if len(k) > 240]
    short = [i for i, k in enumerate(keys) if len(k) <= 240]
    assert [int(out[i]) for i in short] == [xxhash.xxh3_64_intdigest(keys[i]) for i in short]


@pytest.mark.parametrize(
    "values",
    [
        [["a", "bb", ""], [], ["1234567"] * 5],
        [["é", "日本語", "x"], ["plain"], ["\u00ff" * 200]],  # non-ASCII: bytes differ from characters
        [["v" * 250, "w"], ["k" * 239, "k" * 240, "k" * 241]],  # keys over 240 bytes take the library
    ],
)
def test_feature_ids_of_slots_equal_feature_ids_slot_by_slot(values):
    slots = [f"C{k}" for k in range(len(values))]
    got = hashing.feature_ids_of_slots(slots, values)
    assert len(got) == len(slots)
    for slot, ids, vals in zip(slots, got, values, strict=True):
        assert ids.dtype == np.uint64
        assert ids.tolist() == hashing.feature_ids(slot, vals)


def test_feature_ids_of_no_slots_is_empty_and_a_lone_surrogate_is_refused():
    assert hashing.feature_ids_of_slots([], []) == []
    with pytest.raises(UnicodeEncodeError):
        hashing.feature_ids_of_slots(["C1"], [["\ud800"]])
