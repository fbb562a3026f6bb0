"""Fixtures of the parameter-server tests: two real gRPC shards on 127.0.0.1."""

import pytest
from support import tiny_config

from persia_core.ps.servicer import serve
from persia_core.ps.shard import ParameterServerShard


@pytest.fixture
def cluster():
    """Two shards of ``tiny_config()`` served on 127.0.0.1 with token ``s3cret``: (config, shards, addresses)."""
    cfg = tiny_config()
    shards = [ParameterServerShard(cfg, s, 2) for s in range(2)]
    servers = [serve(sh, "127.0.0.1", 0, token="s3cret") for sh in shards]
    yield cfg, shards, [f"127.0.0.1:{port}" for _, port in servers]
    for srv, _ in servers:
        srv.stop(0)
