"""Shared fixtures (helpers live in ``tests/support.py``, importable as ``support``), and the ``processes`` marker.

A test that starts a process (a parameter server, DDP ranks, a kfp.local task, a CLI in a subprocess) carries
``@pytest.mark.processes``; ``make test-fast`` runs every other test. With ``PERSIA_TEST_FAST=1`` (as
``make test-fast`` sets it) starting a process raises, so an unmarked test that starts one fails, naming itself.
"""

import gc
import multiprocessing.process
import os
import signal
import subprocess

import pytest
from support import tiny_config, write_dataset

FAST = os.environ.get("PERSIA_TEST_FAST") == "1"


class ProcessStartedError(RuntimeError):
    """A test run by ``make test-fast`` started a process."""


def _refuse(*args, **kwargs):
    raise ProcessStartedError(
        "this test starts a process: mark it @pytest.mark.processes (make test-fast runs only tests that start none)"
    )


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "processes: starts processes (servers, DDP ranks, kfp.local tasks, CLIs); make test-fast skips it"
    )


@pytest.fixture(scope="session", autouse=True)
def _sigint_as_in_a_terminal():
    """A shell without job control starts background jobs (``make test &``, ``nohup``) with SIGINT ignored, and
    every process a test starts inherits that: the Ctrl-C tests' children then never see their SIGINT. The tests
    run as from a terminal instead."""
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    yield


@pytest.fixture(scope="session", autouse=True)
def _no_process_in_fast_tests():
    """With ``PERSIA_TEST_FAST=1``, starting a process raises, for the whole session: a session fixture starts before
    any module-scoped one (which may start servers), and after pytest-xdist's own start-up of its workers."""
    if FAST:
        subprocess.Popen.__init__ = _refuse  # type: ignore[method-assign]
        multiprocessing.process.BaseProcess.start = _refuse  # type: ignore[method-assign]
        os.fork = _refuse
        os.posix_spawn = _refuse
        os.posix_spawnp = _refuse
    yield


@pytest.fixture(scope="session", autouse=True)
def _session_heap_frozen():
    """The objects alive once the tests are collected (the imported libraries, torch, Beam, scikit-learn, and the
    collected tests: millions) are moved out of the garbage collector's scans (``gc.freeze``). Each full collection
    scanned them all, about 0.5 s, and an in-process test collects often: ``run_worker`` twice per run, and the
    collector itself whenever enough objects have survived."""
    gc.collect()
    gc.freeze()
    yield


@pytest.fixture(autouse=True)
def _heap_refrozen():
    """After a test whose code unfroze the heap (``run_worker`` does, on return), the next test freezes it again:
    its young garbage is collected first (generations 0 and 1; the older was just collected in full by the code
    that unfroze it), so no garbage of one test is kept frozen for the rest of the session."""
    if gc.get_freeze_count() == 0:
        gc.collect(1)
        gc.freeze()
    yield


@pytest.fixture
def tiny_data(tmp_path):
    """A small preprocessed dataset (2 train shards, 1 eval shard) for ``support.tiny_config``."""
    return write_dataset(str(tmp_path / "data"))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One tiny trained model per test module: ``(model_dir, data_dir)`` (about 8 s of training)."""
    from persia_core.train.launcher import train

    root = tmp_path_factory.mktemp("trained")
    data = write_dataset(str(root / "data"), rows=256, eval_rows=200)
    model = str(root / "model")
    train(tiny_config(), data, model, work_dir=str(root / "work"))
    return model, data
