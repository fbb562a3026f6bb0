"""XXH3-64 (seed 0, the default secret) of many short keys in one call: the feature IDs of a batch.

The algorithm is xxHash's (Collet, https://xxhash.com, ``doc/xxhash_spec.md``, XXH3 as of v0.8): keys of 0-240
bytes take its short paths (0, 1-3, 4-8, 9-16, 17-128 and 129-240 bytes), written here in full; a longer key
(its striped long path) is flagged for the caller to hash with the ``xxhash`` library. Equal, bit for bit, to
``xxhash.xxh3_64_intdigest`` (``tests/test_hashing.py`` compares every length up to 300 bytes).
"""

from __future__ import annotations

import numpy as np
from numba import njit

MAX_KEY = 240
"""The longest key ``prefixed_xxh3`` hashes itself; longer ones are flagged."""

_M32 = np.uint64(0xFFFFFFFF)
_P32_1 = np.uint64(0x9E3779B1)
_P64_1 = np.uint64(0x9E3779B185EBCA87)
_P64_2 = np.uint64(0xC2B2AE3D27D4EB4F)
_P64_3 = np.uint64(0x165667B19E3779F9)
_PMX1 = np.uint64(0x165667919E3779F9)
_PMX2 = np.uint64(0x9FB21C651E98DF25)
_S8, _S16, _S24, _S28, _S29 = np.uint64(8), np.uint64(16), np.uint64(24), np.uint64(28), np.uint64(29)
_S32, _S33, _S35, _S37, _S40 = np.uint64(32), np.uint64(33), np.uint64(35), np.uint64(37), np.uint64(40)
_S49, _S56 = np.uint64(49), np.uint64(56)

# xxHash's default 192-byte secret (kSecret)
SECRET = np.frombuffer(
    bytes.fromhex(
        "b8fe6c3923a44bbe7c01812cf721ad1cded46de9839097db7240a4a4b7b3671fcb79e64eccc0e578825ad07dccff7221b8084674f743"
        "248ee03590e6813a264c3c2852bb91c300cb88d0658b1b532ea371644897a20df94e3819ef46a9deacd8a8fa763fe39c343ff9dcbbc7"
        "c70b4f1d8a51e04bcdb45931c89f7ec9d9787364eac5ac8334d3ebc3c581a0fffa1363eb170ddd51b7f0da49d316552629d4689e2b16"
        "be587d47a1fc8ff8b8d17ad031ce45cb3a8f95160428afd7fbcabb4b407e"
    ),
    dtype=np.uint8,
)


@njit(nogil=True, cache=True)
def _r64(b, p):
    v = np.uint64(0)
    for i in range(8):
        v |= np.uint64(b[p + i]) << np.uint64(8 * i)
    return v


@njit(nogil=True, cache=True)
def _r32(b, p):
    lo = np.uint64(b[p]) | (np.uint64(b[p + 1]) << _S8)
    return lo | (np.uint64(b[p + 2]) << _S16) | (np.uint64(b[p + 3]) << _S24)


@njit(nogil=True, cache=True)
def _fold64(a, b):
    """The 128-bit product of two uint64, its low and high halves xor-ed (XXH3_mul128_fold64)."""
    a_lo, a_hi, b_lo, b_hi = a & _M32, a >> _S32, b & _M32, b >> _S32
    lo_lo, hi_lo, lo_hi, hi_hi = a_lo * b_lo, a_hi * b_lo, a_lo * b_hi, a_hi * b_hi
    cross = (lo_lo >> _S32) + (hi_lo & _M32) + lo_hi
    upper = (hi_lo >> _S32) + (cross >> _S32) + hi_hi
    lower = (cross << _S32) | (lo_lo & _M32)
    return lower ^ upper


@njit(nogil=True, cache=True)
def _xxh64_avalanche(h):
    h ^= h >> _S33
    h *= _P64_2
    h ^= h >> _S29
    h *= _P64_3
    return h ^ (h >> _S32)


@njit(nogil=True, cache=True)
def _avalanche(h):
    h ^= h >> _S37
    h *= _PMX1
    return h ^ (h >> _S32)


@njit(nogil=True, cache=True)
def _rotl(x, r):
    return (x << np.uint64(r)) | (x >> np.uint64(64 - r))


@njit(nogil=True, cache=True)
def _mix16(b, p, s, sp):
    return _fold64(_r64(b, p) ^ _r64(s, sp), _r64(b, p + 8) ^ _r64(s, sp + 8))


@njit(nogil=True, cache=True)
def xxh3_short(b, n, s):
    """XXH3-64, seed 0, of the first ``n`` (0-240) bytes of ``b: uint8[>= n]`` with secret ``s`` -> uint64."""
    ln = np.uint64(n)
    if n == 0:
        return _xxh64_avalanche(_r64(s, 56) ^ _r64(s, 64))
    if n <= 3:
        combined = (np.uint64(b[0]) << _S16) | (np.uint64(b[n >> 1]) << _S24) | np.uint64(b[n - 1]) | (ln << _S8)
        return _xxh64_avalanche(combined ^ ((_r32(s, 0) ^ _r32(s, 4)) & _M32))
    if n <= 8:
        x = _r32(b, n - 4) + (_r32(b, 0) << _S32)
        h = x ^ (_r64(s, 8) ^ _r64(s, 16))
        h ^= _rotl(h, 49) ^ _rotl(h, 24)
        h *= _PMX2
        h ^= (h >> _S35) + ln
        h *= _PMX2
        return h ^ (h >> _S28)
    if n <= 16:
        lo = _r64(b, 0) ^ (_r64(s, 24) ^ _r64(s, 32))
        hi = _r64(b, n - 8) ^ (_r64(s, 40) ^ _r64(s, 48))
        swapped = np.uint64(0)
        for i in range(8):  # byte swap of lo
            swapped |= ((lo >> np.uint64(8 * i)) & np.uint64(0xFF)) << np.uint64(56 - 8 * i)
        return _avalanche(ln + swapped + hi + _fold64(lo, hi))
    acc = ln * _P64_1
    if n <= 128:
        if n > 32:
            if n > 64:
                if n > 96:
                    acc += _mix16(b, 48, s, 96)
                    acc += _mix16(b, n - 64, s, 112)
                acc += _mix16(b, 32, s, 64)
                acc += _mix16(b, n - 48, s, 80)
            acc += _mix16(b, 16, s, 32)
            acc += _mix16(b, n - 32, s, 48)
        acc += _mix16(b, 0, s, 0)
        acc += _mix16(b, n - 16, s, 16)
        return _avalanche(acc)
    for i in range(8):
        acc += _mix16(b, 16 * i, s, 16 * i)
    acc = _avalanche(acc)
    for i in range(8, n // 16):
        acc += _mix16(b, 16 * i, s, 16 * (i - 8) + 3)
    acc += _mix16(b, n - 16, s, 136 - 17)
    return _avalanche(acc)


@njit(nogil=True, cache=True)
def prefixed_xxh3(prefixes, prefix_bounds, values, value_bounds, prefix_of, out):
    """``out[i] = XXH3_64(prefix[prefix_of[i]] + value[i])``, seed 0, for every value; returns the indices of the
    keys longer than ``MAX_KEY`` bytes (their ``out`` left 0) as ``int64[M]``.

    ``prefixes: uint8[P]`` with ``prefix_bounds: int64[K + 1]`` (prefix k is ``prefixes[bounds[k]:bounds[k+1]]``),
    ``values: uint8[V]`` with ``value_bounds: int64[N + 1]``, ``prefix_of: int64[N]``, ``out: uint64[N]``."""
    n = len(prefix_of)
    key = np.empty(MAX_KEY + 16, np.uint8)
    s = SECRET
    long_keys = np.empty(n, np.int64)
    m = 0
    for i in range(n):
        k = prefix_of[i]
        p0, p1 = prefix_bounds[k], prefix_bounds[k + 1]
        v0, v1 = value_bounds[i], value_bounds[i + 1]
        length = (p1 - p0) + (v1 - v0)
        if length > MAX_KEY:
            out[i] = 0
            long_keys[m] = i
            m += 1
            continue
        j = 0
        for q in range(p0, p1):
            key[j] = prefixes[q]
            j += 1
        for q in range(v0, v1):
            key[j] = values[q]
            j += 1
        out[i] = xxh3_short(key, length, s)
    return long_keys[:m]
