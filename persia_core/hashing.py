"""Stable 64-bit feature IDs and shard routing.

Feature ID of a value in a slot::

    feature_id(slot, value) = XXH3_64( utf8(slot) + b"\\x1f" + utf8(value) ), seed 0, as an unsigned 64-bit int

``value`` is the field's text as read from the raw file (MovieLens ``"16"``, a genre ``"Comedy"``, a lower-cased
tag, a Criteo ``"68fd1e64"``); a cross of fields joins their values with ``"\\x1e"`` before hashing. XXH3-64 is
the xxHash family's 64-bit hash (Collet, https://xxhash.com, spec ``doc/xxhash_spec.md``), identical on every
platform, process and run, unlike Python's salted ``hash()``. The slot name is part of the key, so equal values in
different slots are different IDs, and every 64-bit value (0 and 2^64-1 included) is a valid ID.

Routing to parameter-server shards: ``shard_of(ids, n) = splitmix64(ids) % n`` (Steele et al., OOPSLA 2014,
the SplitMix64 finalizer), so that the shard does not share bits with the tables' own hash index.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import chain

import numpy as np
import xxhash

SLOT_SEP = b"\x1f"
CROSS_SEP = "\x1e"


def feature_id(slot: str, value: str) -> int:
    """The feature ID (Python int in [0, 2^64)) of ``value`` in ``slot``. See the module docstring."""
    return xxhash.xxh3_64_intdigest(slot.encode("utf-8") + SLOT_SEP + value.encode("utf-8"))


def feature_ids(slot: str, values: Iterable[str]) -> list[int]:
    """``[feature_id(slot, v) for v in values]`` with the slot prefix encoded once."""
    prefix = slot.encode("utf-8") + SLOT_SEP
    h = xxhash.xxh3_64_intdigest
    return [h(prefix + v.encode("utf-8")) for v in values]


def feature_ids_of_slots(slots: Sequence[str], values: Sequence[Sequence[str]]) -> list[np.ndarray]:
    """Per slot k, ``feature_ids(slots[k], values[k])`` as ``uint64[len(values[k])]``: every key of every slot
    hashed in one compiled call (``embedding.kernels.xxh3``; a key over its 240 bytes by ``xxhash``), for the
    batches of a request where a call per value would dominate. Raises ``UnicodeEncodeError`` as ``feature_id``
    does (a lone surrogate)."""
    # lazy: numba, which the tfrecord environment (its own venv) does not install; it hashes with feature_ids
    from persia_core.embedding.kernels import prefixed_xxh3

    flat = list(chain.from_iterable(values))
    counts = np.fromiter(map(len, values), np.int64, len(values))
    joined = "".join(flat)
    buf = joined.encode("utf-8")
    if len(buf) == len(joined):  # ASCII: a value's characters are its bytes
        lengths = np.fromiter(map(len, flat), np.int64, len(flat))
    else:
        encoded = [v.encode("utf-8") for v in flat]
        lengths = np.fromiter(map(len, encoded), np.int64, len(flat))
    value_bounds = np.zeros(len(flat) + 1, np.int64)
    np.cumsum(lengths, out=value_bounds[1:])
    prefixes = [s.encode("utf-8") + SLOT_SEP for s in slots]
    prefix_bounds = np.zeros(len(slots) + 1, np.int64)
    np.cumsum(np.fromiter(map(len, prefixes), np.int64, len(slots)), out=prefix_bounds[1:])
    prefix_of = np.repeat(np.arange(len(slots), dtype=np.int64), counts)
    out = np.empty(len(flat), np.uint64)
    long_keys = prefixed_xxh3(
        np.frombuffer(b"".join(prefixes), np.uint8),
        prefix_bounds,
        np.frombuffer(buf, np.uint8),
        value_bounds,
        prefix_of,
        out,
    )
    for i in long_keys.tolist():  # rare: keys over 240 bytes
        out[i] = xxhash.xxh3_64_intdigest(prefixes[prefix_of[i]] + flat[i].encode("utf-8"))
    return np.split(out, np.cumsum(counts)[:-1]) if len(slots) else []


def cross_values(parts: Sequence[Sequence[str]]) -> list[str]:
    """Values of a crossed slot: every combination of the fields' values, joined by ``\\x1e``.

    ``parts``: one list of values per crossed field (a scalar field is a list of one; a missing one is empty,
    and then the cross is empty). Returns ``len(parts[0]) * len(parts[1]) * ...`` strings.
    """
    out = [""]
    first = True
    for values in parts:
        if first:
            out = list(values)
            first = False
        else:
            out = [a + CROSS_SEP + b for a in out for b in values]
    return out


_SM1 = np.uint64(0xBF58476D1CE4E5B9)
_SM2 = np.uint64(0x94D049BB133111EB)


def splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64 finalizer of ``x: uint64[N]`` -> ``uint64[N]`` (bijective mixing, wrap-around arithmetic)."""
    z = np.asarray(x, dtype=np.uint64).copy()
    with np.errstate(over="ignore"):
        z ^= z >> np.uint64(30)
        z *= _SM1
        z ^= z >> np.uint64(27)
        z *= _SM2
        z ^= z >> np.uint64(31)
    return z


def shard_of(ids: np.ndarray, num_shards: int) -> np.ndarray:
    """Owning shard of each feature ID: ``ids: uint64[N]`` -> ``int64[N]`` in ``[0, num_shards)``."""
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    if num_shards == 1:
        return np.zeros(len(ids), dtype=np.int64)
    return (splitmix64(ids) % np.uint64(num_shards)).astype(np.int64)
