"""A real Cloud Storage emulator (``gcp-storage-emulator``, in memory) in this process, for tests.

``running_emulator()`` starts it on a free 127.0.0.1 port and points google-cloud-storage at it
(``STORAGE_EMULATOR_HOST``; ``persia_core.io`` then uses anonymous credentials) until the block ends.
"""

import contextlib
import os
import socket

PROJECT_NUMBER = 123456789012
"""The project number the emulator gives its buckets."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_emulator():
    """Yields the emulator's base URL while ``STORAGE_EMULATOR_HOST`` points at it."""
    from gcp_storage_emulator.server import create_server

    port = _free_port()
    server = create_server(
        "127.0.0.1", port, in_memory=True, default_bucket="persia-default", project_number=PROJECT_NUMBER
    )
    server.start()
    url = f"http://127.0.0.1:{port}"
    old = os.environ.get("STORAGE_EMULATOR_HOST")
    os.environ["STORAGE_EMULATOR_HOST"] = url
    try:
        yield url
    finally:
        server.stop()
        if old is None:
            os.environ.pop("STORAGE_EMULATOR_HOST", None)
        else:
            os.environ["STORAGE_EMULATOR_HOST"] = old
