"""Fixtures of the GCS tests: a real Cloud Storage emulator (see ``emulator.py``) and a fresh bucket per test."""

import uuid

import pytest
from gcs.emulator import running_emulator


@pytest.fixture(scope="session")
def gcs_emulator():
    """The emulator's base URL; ``STORAGE_EMULATOR_HOST`` points at it for the session."""
    with running_emulator() as url:
        yield url


@pytest.fixture
def gcs_bucket(gcs_emulator):
    """A new bucket in the emulator; its name (no scheme)."""
    from persia_core import io

    name = f"b-{uuid.uuid4().hex[:12]}"
    client = io.gcs_client()
    bucket = client.create_bucket(name)
    yield name
    for blob in client.list_blobs(name):
        blob.delete()
    bucket.delete()
