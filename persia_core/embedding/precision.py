"""Storage precision of embedding weights: float32 rows to and from their stored fp16 / bf16 bit patterns."""

from __future__ import annotations

import numpy as np


def encode(rows: np.ndarray, storage: str) -> np.ndarray:
    """``float32[n, D]`` -> stored form: float32 (fp32), or uint16 bit patterns (fp16: IEEE half; bf16: the top
    16 bits of float32), both rounded to nearest-even."""
    rows = np.ascontiguousarray(rows, dtype=np.float32)
    if storage == "fp32":
        return rows
    if storage == "fp16":
        return rows.astype(np.float16).view(np.uint16)
    bits = rows.view(np.uint32)
    rounding = ((bits >> np.uint32(16)) & np.uint32(1)) + np.uint32(0x7FFF)
    return ((bits + rounding) >> np.uint32(16)).astype(np.uint16)


def decode(stored: np.ndarray, storage: str) -> np.ndarray:
    """Stored rows -> ``float32[n, D]`` (exact: every fp16/bf16 value is a float32)."""
    if storage == "fp32":
        return stored
    if storage == "fp16":
        return stored.view(np.float16).astype(np.float32)
    return (stored.astype(np.uint32) << np.uint32(16)).view(np.float32)
