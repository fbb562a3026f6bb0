"""Fixtures for the checkpoint tests: a Cloud Storage emulator (``gcp-storage-emulator``, in-memory, in-process)."""

import os
import socket
import uuid

import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def gcs_bucket():
    """A fresh bucket in a Cloud Storage emulator (``STORAGE_EMULATOR_HOST`` set meanwhile); yields its name."""
    emulator = pytest.importorskip("gcp_storage_emulator.server")
    port = _free_port()
    server = emulator.create_server("127.0.0.1", port, in_memory=True, default_bucket="persia-default")
    server.start()
    old = {k: os.environ.get(k) for k in ("STORAGE_EMULATOR_HOST", "GOOGLE_CLOUD_PROJECT")}
    os.environ["STORAGE_EMULATOR_HOST"] = f"http://127.0.0.1:{port}"
    os.environ["GOOGLE_CLOUD_PROJECT"] = "persia-test"
    try:
        from persia_core import io

        name = f"ckpt-{uuid.uuid4().hex[:10]}"
        io.gcs_client().create_bucket(name)
        yield name
    finally:
        server.stop()
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
