"""numba's on-disk cache for the kernels package, checked against every source file of the package.

numba checks a cached compilation (``*.nbi`` index, ``*.nbc`` code) against a stamp of the one file that defines
the kernel: a SHA-256 of its content. A kernel that calls or inlines a kernel of another module holds a compiled
copy of it, which an edit of that other module alone (or a ``git pull`` that changes only it) would leave stale.
``PackageLocator`` stamps every kernel of the package with a hash of all the package's ``*.py`` files instead, so
that any edit of any of them recompiles every kernel, as when the kernels were one file; with no edit, a new
process loads every kernel from the cache. Where the cache lives stays numba's choice (``NUMBA_CACHE_DIR``, else
``__pycache__`` beside the source, else the user's cache directory).

numba has no public hook for this: ``NUMBA_CACHE_LOCATOR_CLASSES``, its documented way to choose locators, is
process-wide and the user's to set. So importing this module (``kernels/__init__.py`` does, before any kernel is
defined) puts ``PackageLocator`` first in numba's private default list ``CacheImpl._locator_classes`` (numba
0.68.1), where it answers for the files of this package only; ``tests/embedding/test_kernel_cache.py`` pins
these internals. A ``NUMBA_CACHE_LOCATOR_CLASSES`` that is set replaces that list, and with it this check,
unless it names ``persia_core.embedding.kernels.cache.PackageLocator`` first.
"""

from __future__ import annotations

import functools
import hashlib
import os
from collections.abc import Callable
from typing import Any, cast

from numba.core.caching import CacheImpl, _CacheLocator

PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
# numba's own list (the same object), which every cached function's locator is chosen from, first that answers
LOCATORS = cast("list[type[_CacheLocator]]", CacheImpl._locator_classes)


@functools.cache
def _hash_files(directory: str, stats: tuple[tuple[str, int, int], ...]) -> bytes:
    # keyed on each file's (name, mtime, size), so that a file changed while the process runs is hashed again
    h = hashlib.sha256()
    for name, _, _ in stats:
        with open(os.path.join(directory, name), "rb") as f:
            content = f.read()
        h.update(f"{name}\0{len(content)}\0".encode())
        h.update(content)
    return h.digest()


def source_stamp(directory: str) -> bytes:
    """SHA-256 over the names and contents of the ``*.py`` files of ``directory`` (not its subfolders)."""
    names = sorted(n for n in os.listdir(directory) if n.endswith(".py"))
    stats = []
    for name in names:
        st = os.stat(os.path.join(directory, name))
        stats.append((name, st.st_mtime_ns, st.st_size))
    return _hash_files(directory, tuple(stats))


class PackageLocator(_CacheLocator):
    """numba's cache locator for the kernels of this package: the cache directory and file names of the locator
    numba would choose otherwise, the source stamp of the whole package (``source_stamp(PACKAGE_DIR)``)."""

    def __init__(self, inner: _CacheLocator) -> None:
        self._inner = inner

    def get_cache_path(self) -> str:
        return self._inner.get_cache_path()

    def get_source_stamp(self) -> bytes:
        return source_stamp(PACKAGE_DIR)

    def get_disambiguator(self) -> str:
        return self._inner.get_disambiguator()

    @classmethod
    def from_function(cls, py_func: Callable[..., Any], py_file: str) -> PackageLocator | None:
        """The locator for ``py_func`` defined in ``py_file``; ``None`` (numba asks the next locator) for a file
        outside this package, for a package that is no folder of source files (imported from a zip archive, or
        frozen into an executable), or where no other locator can cache it."""
        if os.path.dirname(os.path.abspath(py_file)) != PACKAGE_DIR or not os.path.isdir(PACKAGE_DIR):
            return None
        for other in LOCATORS:
            if other is not cls:
                inner = other.from_function(py_func, py_file)
                if inner is not None:
                    return cls(inner)
        return None


if PackageLocator not in LOCATORS:
    LOCATORS.insert(0, PackageLocator)
