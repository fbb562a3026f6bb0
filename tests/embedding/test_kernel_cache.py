"""numba's on-disk cache of the kernels package: an edit of any module recompiles every kernel, no edit none.

The process test runs a copy of the package under the import name ``kcopy`` (its absolute imports rewritten) with
two small modules added, ``callee.py`` and ``caller.py`` (whose kernel calls the callee's), in fresh processes
with their own ``NUMBA_CACHE_DIR``. numba alone checks a cached kernel against its own file only, so after an edit
of ``callee.py`` alone it would load the caller's stale copy.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numba.core.caching
import pytest

from persia_core.embedding import kernels
from persia_core.embedding.kernels import cache

PACKAGE = Path(kernels.__file__).parent

CALLEE = "from numba import njit\n\n\n@njit(cache=True)\ndef value():\n    return {value}\n"
CALLER = (
    "from numba import njit\n\nfrom kcopy.callee import value\n\n\n"
    "@njit(cache=True)\ndef twice():\n    return 2 * value()\n"
)
# One fresh process: the caller's result, and for it and for a real kernel (dedup, which inlines index.home) how
# many signatures loaded from the cache and how many compiled.
CHILD = """
import json
import numpy as np
import kcopy
from kcopy.caller import twice

result = twice()
kcopy.dedup(np.array([3, 1, 3], dtype=np.uint64))


def counts(dispatcher):
    stats = dispatcher.stats
    return [sum(stats.cache_hits.values()), sum(stats.cache_misses.values())]


print(json.dumps({"twice": result, "caller": counts(twice), "dedup": counts(kcopy.dedup)}))
"""


def _copy_package(dest: Path) -> None:
    dest.mkdir()
    for src in PACKAGE.glob("*.py"):
        text = src.read_text().replace("persia_core.embedding.kernels", "kcopy")
        (dest / src.name).write_text(text)
    (dest / "callee.py").write_text(CALLEE.format(value=1))
    (dest / "caller.py").write_text(CALLER)


def _run(root: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("NUMBA_")}
    # No .pyc: Python checks one against its source by mtime (whole seconds) and size only, so an edit of the same
    # size in the second the last run's .pyc names would run the old code whatever numba's cache does.
    env.update(PYTHONPATH=str(root), NUMBA_CACHE_DIR=str(root / "numba-cache"), PYTHONDONTWRITEBYTECODE="1")
    p = subprocess.run([sys.executable, "-c", CHILD], cwd=root, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.mark.processes
def test_an_edit_of_one_kernel_module_recompiles_the_kernels_of_the_others(tmp_path):
    _copy_package(tmp_path / "kcopy")
    first = _run(tmp_path)
    assert first == {"twice": 2, "caller": [0, 1], "dedup": [0, 1]}
    assert list((tmp_path / "numba-cache").glob("*/caller.twice-*.nbi")), "the cache is not in NUMBA_CACHE_DIR"

    assert _run(tmp_path) == {"twice": 2, "caller": [1, 0], "dedup": [1, 0]}, "no edit: all from the cache"

    for f in (tmp_path / "kcopy").glob("*.py"):  # what a checkout that rewrites files with their content does
        os.utime(f, (f.stat().st_atime + 10, f.stat().st_mtime + 10))
    assert _run(tmp_path) == {"twice": 2, "caller": [1, 0], "dedup": [1, 0]}, "same content: all from the cache"

    (tmp_path / "kcopy" / "callee.py").write_text(CALLEE.format(value=5))
    assert _run(tmp_path) == {"twice": 10, "caller": [0, 1], "dedup": [0, 1]}, "an edit: every kernel recompiles"


def test_every_kernel_of_the_package_is_cached_under_the_package_stamp():
    """Pins the numba internals that ``cache`` relies on: the locator list and each dispatcher's cache."""
    assert numba.core.caching.CacheImpl._locator_classes[0] is cache.PackageLocator
    modules = [m for name, m in sys.modules.items() if name.startswith(kernels.__name__ + ".")]
    dispatchers = {
        v.py_func.__qualname__: v
        for m in modules
        for v in vars(m).values()
        if isinstance(v, numba.core.registry.CPUDispatcher) and v.py_func.__module__ == m.__name__
    }
    assert {"lookup", "find_many", "home", "dedup", "apply_adam"} <= dispatchers.keys()
    for d in dispatchers.values():
        locator = d._cache._impl.locator
        assert isinstance(locator, cache.PackageLocator), d
        assert locator.get_source_stamp() == cache.source_stamp(str(PACKAGE))
        assert d._cache._cache_file._source_stamp == locator.get_source_stamp()
