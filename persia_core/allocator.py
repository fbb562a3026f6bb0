"""The C allocator's settings for processes that allocate the same large arrays over and over (glibc only)."""

from __future__ import annotations

import ctypes

_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3


def keep_freed_memory() -> bool:
    """Have glibc's allocator keep freed memory for reuse instead of returning it to the kernel: blocks up to
    32 MiB (its largest ``M_MMAP_THRESHOLD``) come from the heap, which is trimmed only past 1 GiB free
    (``M_TRIM_THRESHOLD``) and grows 64 MiB at a time (``M_TOP_PAD``). A process that allocates the same
    multi-MiB arrays every batch then stops paying a page fault and a page clearing per 4 KiB of each. Returns
    False where libc is not glibc (nothing changed)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return all(
        mallopt(opt, value) == 1
        for opt, value in ((_M_MMAP_THRESHOLD, 32 << 20), (_M_TRIM_THRESHOLD, 1 << 30), (_M_TOP_PAD, 64 << 20))
    )
