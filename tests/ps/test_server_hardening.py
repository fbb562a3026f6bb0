"""A token holder's malformed or hostile requests get an error status and change nothing (real gRPC servers)."""

import os
import subprocess
import sys
import time

import numpy as np
import pytest
from support import tiny_config

from persia_core.ps import shm as shm_mod
from persia_core.ps import wire
from persia_core.ps.client import EmbeddingClient, ParameterServerError

IDS = np.array([3, 11, 2**64 - 1], dtype=np.uint64)


def _owner_and_client(cluster, **kw):
    cfg, shards, addrs = cluster
    client = EmbeddingClient(addrs, cfg.embedding, token="s3cret", retries=0, timeout_s=5.0, **kw)
    ids = IDS[:1]
    client.lookup("default", ids)
    owner = int(np.argmax([sh.tables["default"].size for sh in shards]))
    return client, owner, ids


@pytest.mark.parametrize("field", ["step_fraction", "lr_scale"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -1.0, 0.0, 1.5, "1"])
def test_a_push_with_a_step_fraction_or_lr_scale_outside_0_1_is_refused_and_changes_nothing(cluster, field, value):
    client, owner, ids = _owner_and_client(cluster)
    before = client.lookup_readonly("default", ids)
    meta = {"table": "default", "client": "c", "seq": 1, field: value}
    with pytest.raises(ParameterServerError, match=f"INVALID_ARGUMENT.*{field}"):
        client.call("Push", owner, meta, {"ids": ids, "grads": np.ones((1, 4), np.float32)})
    np.testing.assert_array_equal(client.lookup_readonly("default", ids), before)
    client.close()


@pytest.mark.parametrize(
    "meta, arrays, match",
    [
        ({"client": 7, "seq": 1}, None, "client must be a non-empty string"),
        ({"client": "c", "seq": 1.9}, None, "seq must be an integer"),
        ({"client": "c", "seq": True}, None, "seq must be an integer"),
        ({"client": "c", "seq": 1, "epochs_trained": -1.0}, None, "epochs_trained must be a finite number >= 0"),
        ({"client": "c", "seq": 1, "epochs_trained": float("inf")}, None, "epochs_trained must be a finite"),
        ({"client": "c", "seq": 1, "epochs_trained": "2"}, None, "epochs_trained must be a finite"),
        ({"client": "c", "seq": -1}, None, "seq must be an integer"),
        (
            {"client": "c", "seq": 1},
            {"ids": np.array([3], np.int32), "grads": np.ones((1, 4), np.float32)},
            "ids must be uint64",
        ),
        (
            {"client": "c", "seq": 1},
            {"ids": IDS[:1], "grads": np.ones((1, 3), np.float32)},
            r"grads must be float32\[1, 4\]",
        ),
        (
            {"client": "c", "seq": 1},
            {"ids": IDS[:2], "grads": np.ones((1, 4), np.float32)},
            r"grads must be float32\[2, 4\]",
        ),
    ],
)
def test_a_malformed_push_is_refused_naming_the_field(cluster, meta, arrays, match):
    client, owner, ids = _owner_and_client(cluster)
    before = client.lookup_readonly("default", ids)
    with pytest.raises(ParameterServerError, match="INVALID_ARGUMENT.*" + match):
        client.call(
            "Push", owner, {"table": "default", **meta}, arrays or {"ids": ids, "grads": np.ones((1, 4), np.float32)}
        )
    np.testing.assert_array_equal(client.lookup_readonly("default", ids), before)
    client.close()


def test_lookups_of_ids_that_are_not_uint64_are_refused_not_converted(cluster):
    client, owner, _ = _owner_and_client(cluster)
    for method in ("Lookup", "LookupReadonly", "Contains"):
        with pytest.raises(ParameterServerError, match="INVALID_ARGUMENT.*ids must be uint64"):
            client.call(method, owner, {"table": "default"}, {"ids": np.array([1.0, 2.0], np.float32)})
    client.close()


def test_in_sync_mode_a_bad_push_is_refused_at_once_and_the_step_still_completes(cluster):
    cfg, _, addrs = cluster
    a, b = (
        EmbeddingClient(addrs, cfg.embedding, token="s3cret", client_id=w, retries=0, timeout_s=10.0)
        for w in ("wa", "wb")
    )
    a.lookup("default", IDS)
    before = a.lookup_readonly("default", IDS)
    bad = np.full((3, 4), np.nan, np.float32)
    t0 = time.monotonic()
    with pytest.raises(ParameterServerError, match="INVALID_ARGUMENT.*NaN"):
        b.push("default", IDS, bad, step=5, sync_workers=2).result(timeout=30)
    assert time.monotonic() - t0 < 5  # refused on arrival, not after waiting out the step
    good = [np.full((3, 4), 0.25, np.float32), np.full((3, 4), 0.5, np.float32)]
    futs = [
        a.push("default", IDS, good[0], step=5, sync_workers=2),
        b.push("default", IDS, good[1], step=5, sync_workers=2),
    ]  # b's corrected push, a new sequence number
    for f in futs:
        f.result(timeout=30)
    after = a.lookup_readonly("default", IDS)
    assert np.isfinite(after).all() and not np.array_equal(after, before)
    from persia_core.embedding.reference import LocalEmbedding

    ref = LocalEmbedding(cfg.embedding, 1)
    ref.lookup("default", IDS)
    ref.push("default", IDS, good[0] + good[1])
    np.testing.assert_allclose(after, ref.lookup_readonly("default", IDS), atol=1e-7)
    a.close()
    b.close()


def test_a_second_push_of_one_client_to_the_same_sync_step_is_refused(cluster):
    client, owner, ids = _owner_and_client(cluster)
    meta = {"table": "default", "client": "w0", "step": 9, "sync_workers": 2}
    arrays = {"ids": ids, "grads": np.ones((1, 4), np.float32)}
    import threading

    first = threading.Thread(
        target=lambda: pytest.raises(ParameterServerError, client.call, "Push", owner, {**meta, "seq": 1}, arrays, 1.5),
        daemon=True,
    )
    first.start()  # waits for the second worker of step 9 (and times out within 2 x 1.5 s: there is none)
    time.sleep(0.5)
    with pytest.raises(ParameterServerError, match="INVALID_ARGUMENT.*already pushed step 9"):
        client.call("Push", owner, {**meta, "seq": 2}, arrays)
    first.join(timeout=15)
    client.close()


@pytest.mark.parametrize("target", ["/dev/zero", "fifo", "folder"])
def test_load_refuses_anything_but_a_regular_file_at_once(cluster, tmp_path, target):
    client, owner, _ = _owner_and_client(cluster)
    path = {"/dev/zero": "/dev/zero", "fifo": str(tmp_path / "fifo"), "folder": str(tmp_path)}[target]
    if target == "fifo":
        os.mkfifo(path)
    t0 = time.monotonic()
    with pytest.raises(ParameterServerError, match="INVALID_ARGUMENT.*not a regular file"):
        client.call("Load", owner, {"path": path})
    assert time.monotonic() - t0 < 5
    assert client.stats()[owner]["shard"] == owner  # still serving
    client.close()


def test_a_refused_load_leaves_the_shard_as_it_was(cluster, tmp_path):
    import zipfile

    client, owner, _ = _owner_and_client(cluster)
    many = np.arange(1, 200, dtype=np.uint64)
    client.lookup("default", many)
    good = str(tmp_path / "good.npz")
    client.call("Dump", owner, {"path": good})
    arrays = {}
    with zipfile.ZipFile(good) as z:
        for member in z.namelist():
            with z.open(member) as f:
                arrays[member[: -len(".npy")]] = np.lib.format.read_array(f, allow_pickle=False)
    assert len(arrays["default.keys"]) >= 2
    arrays["default.keys"][1] = arrays["default.keys"][0]  # one feature ID in two rows
    arrays["default.weights"] += 100.0
    bad = str(tmp_path / "bad.npz")
    np.savez(bad, **arrays)
    before = client.lookup_readonly("default", many)
    with pytest.raises(ParameterServerError, match="INVALID_ARGUMENT.*duplicate"):
        client.call("Load", owner, {"path": bad})
    np.testing.assert_array_equal(client.lookup_readonly("default", many), before)
    assert client.stats()[owner]["tables"]["default"]["rows"] == len(arrays["default.keys"])
    client.close()


@pytest.mark.skipif(not shm_mod.available(), reason="no writable /dev/shm")
def test_a_segment_truncated_after_it_was_mapped_is_refused_not_a_crash():
    seg = shm_mod.Segment(1 << 16)
    cache = shm_mod.SegmentCache()
    try:
        assert len(cache.get(seg.name, seg.size)) == seg.size
        os.truncate(seg.path, 0)
        with pytest.raises(shm_mod.ShmUnavailable, match="no longer"):
            cache.get(seg.name, seg.size)
    finally:
        seg.close()


@pytest.mark.parametrize(
    "header",
    [
        b"[1, 2]",
        b'{"meta": [], "arrays": []}',
        b'{"meta": {}, "arrays": [["ids", "uint64", [-1], 0, -8]]}',
        b'{"meta": {}, "arrays": [["ids", "uint64", ["2"], 0, 16]]}',
        b'{"meta": {}, "arrays": [["ids", "uint64", [2], 0]]}',
    ],
)
def test_wire_decode_refuses_malformed_headers_with_value_error(header):
    import struct

    msg = wire.MAGIC + struct.pack("<I", len(header)) + header + bytes(16)
    with pytest.raises(ValueError):
        wire.decode(msg)


def test_wire_round_trip_keeps_values_of_strided_big_endian_empty_and_scalar_arrays():
    # encode writes byte views, not copies: every layout must still arrive as its values in little-endian order
    rng = np.random.default_rng(0)
    rows = rng.normal(size=(300, 16)).astype(np.float32)
    arrays = {
        "rows": rows,
        "strided": rows[::3, 1:9].T,
        "big": rows.astype(">f4"),
        "ids": np.array([0, 2**63, 2**64 - 1], dtype=">u8"),
        "empty": np.zeros((0, 4), np.int32),
        "scalar": np.array(7, dtype=np.int64),
    }
    meta, got = wire.decode(wire.encode({"k": 1}, arrays))
    assert meta == {"k": 1} and set(got) == set(arrays)
    for name, a in arrays.items():
        assert got[name].dtype == a.dtype.newbyteorder("<") and got[name].shape == a.shape
        np.testing.assert_array_equal(got[name], a)


@pytest.mark.processes
def test_a_server_bound_beyond_loopback_without_a_token_refuses_to_start(tmp_path):
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(tiny_config().to_yaml())
    env = {k: v for k, v in os.environ.items() if k != "PERSIA_PS_TOKEN"}
    root = os.path.join(os.path.dirname(__file__), "..", "..")
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "persia_core.ps.server",
            "--config",
            str(cfg),
            "--shard",
            "0",
            "--num-shards",
            "1",
            "--host",
            "0.0.0.0",
        ],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2
    assert "without a token" in r.stderr + r.stdout


@pytest.mark.processes
def test_a_server_started_from_a_device_instead_of_a_shard_file_exits_as_refused(tmp_path):
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(tiny_config().to_yaml())
    root = os.path.join(os.path.dirname(__file__), "..", "..")
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "persia_core.ps.server",
            "--config",
            str(cfg),
            "--shard",
            "0",
            "--num-shards",
            "1",
            "--init",
            "/dev/zero",
        ],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=120,
    )
    from persia_core.ps.protocol import EXIT_BAD_INIT

    assert r.returncode == EXIT_BAD_INIT
    assert "not a regular file" in r.stderr + r.stdout


def test_storage_paths_must_lie_strictly_under_a_root(tmp_path):
    from persia_core.ps.storage_roots import check_storage_path, resolve_storage_roots

    root = tmp_path / "run"
    (root / "ckpt").mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    os.symlink(tmp_path / "elsewhere", root / "link")
    roots = resolve_storage_roots([str(root), "gs://bucket/run/"])
    assert check_storage_path(str(root / "ckpt" / "s.npz"), roots) == os.path.realpath(root / "ckpt" / "s.npz")
    assert check_storage_path("gs://bucket/run/ckpt/s.npz", roots) == "gs://bucket/run/ckpt/s.npz"
    assert check_storage_path("/gcs/bucket/run/ckpt/s.npz", roots) == "/gcs/bucket/run/ckpt/s.npz"  # FUSE form
    assert check_storage_path("gs://b2/r/s.npz", resolve_storage_roots(["/gcs/b2/r"])) == "gs://b2/r/s.npz"
    assert check_storage_path("/anything/at/all", []) == "/anything/at/all"  # no roots: any path
    for bad in [
        str(root / ".." / "elsewhere" / "s.npz"),
        str(root / "link" / "s.npz"),
        str(tmp_path / "run2"),
        str(root),
        str(root) + "/",
        "/etc/cron.d/x",
        "gs://bucket/run2/s.npz",
        "gs://bucket/run/",
        "gs://bucket/run/../other/s.npz",
        "gs://other/run/s",
    ]:
        with pytest.raises(PermissionError, match="storage path"):
            check_storage_path(bad, roots)
    with pytest.raises(PermissionError, match="resolves to"):
        check_storage_path(str(root / "link" / "s.npz"), roots)
    for bad in [None, 123, ["x"], ""]:
        with pytest.raises(ValueError, match="path must be a non-empty string"):
            check_storage_path(bad, roots)


@pytest.mark.parametrize(
    "roots, error",
    [
        ("/some/run", TypeError),
        ([""], ValueError),
        (["  "], ValueError),
        (["s3://b/run"], ValueError),
        (["file:///data/run"], ValueError),
        (["GS://b/run"], ValueError),
        (["gs://"], ValueError),
    ],
)
def test_storage_roots_that_would_open_everything_or_write_elsewhere_are_refused(roots, error):
    from persia_core.ps.storage_roots import resolve_storage_roots

    with pytest.raises(error, match="storage root"):
        resolve_storage_roots(roots)


def test_a_root_is_resolved_once_so_a_link_created_there_later_leads_nowhere_new(tmp_path):
    from persia_core.ps.storage_roots import check_storage_path, resolve_storage_roots

    roots = resolve_storage_roots([str(tmp_path / "ckpt")])  # not created yet
    (tmp_path / "elsewhere").mkdir()
    os.symlink(tmp_path / "elsewhere", tmp_path / "ckpt")
    with pytest.raises(PermissionError, match="resolves to"):
        check_storage_path(str(tmp_path / "ckpt" / "s.npz"), roots)


@pytest.mark.processes
def test_a_server_or_serve_shards_given_an_empty_storage_root_refuses_to_start(tmp_path):
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(tiny_config().to_yaml())
    root = os.path.join(os.path.dirname(__file__), "..", "..")
    for cmd in (
        ["-m", "persia_core.ps.server", "--config", str(cfg), "--shard", "0", "--num-shards", "1"],
        ["-m", "persia_core", "serve-shards", "--config", str(cfg)],
    ):
        r = subprocess.run(
            [sys.executable, *cmd, "--storage-root", ""], cwd=root, capture_output=True, text=True, timeout=120
        )
        assert r.returncode == 2, r.stderr
        assert "--storage-root" in r.stderr and "empty" in r.stderr


def test_dump_and_load_outside_the_storage_roots_are_refused_and_write_nothing(tmp_path):
    from persia_core.ps.servicer import serve
    from persia_core.ps.shard import ParameterServerShard

    cfg = tiny_config()
    allowed = tmp_path / "model"
    allowed.mkdir()
    shard = ParameterServerShard(cfg, 0, 1)
    srv, port = serve(shard, "127.0.0.1", 0, token="s3cret", storage_roots=[str(allowed)])
    try:
        client = EmbeddingClient([f"127.0.0.1:{port}"], cfg.embedding, token="s3cret", retries=0, timeout_s=5.0)
        client.lookup("default", IDS)
        inside = allowed / "shard-0.npz"
        meta, _ = client.call("Dump", 0, {"path": str(inside)}, {})
        assert inside.stat().st_size == meta["bytes"] > 0
        outside = tmp_path / "outside.npz"
        for path in (str(outside), str(allowed / ".." / "outside.npz")):
            with pytest.raises(ParameterServerError, match="PERMISSION_DENIED.*not inside this server's storage roots"):
                client.call("Dump", 0, {"path": path}, {})
        assert not outside.exists()
        for path in (None, 123, ["x"]):  # refused as malformed, not written under a made-up name
            with pytest.raises(ParameterServerError, match="INVALID_ARGUMENT.*path must be a non-empty string"):
                client.call("Dump", 0, {"path": path}, {})
        assert sorted(os.listdir(allowed)) == ["shard-0.npz"]  # and no temporary file is left beside it
        outside.write_bytes(inside.read_bytes())  # a valid shard file, but not under the roots
        with pytest.raises(ParameterServerError, match="PERMISSION_DENIED"):
            client.call("Load", 0, {"path": str(outside)}, {})
        client.call("Load", 0, {"path": str(inside)}, {})  # under the root: accepted
        client.close()
    finally:
        srv.stop(0)


@pytest.mark.processes
@pytest.mark.parametrize("value, ok", [("/data/run, /data/ckpt", True), (" ", False), ("/data/run,,/x", False)])
def test_storage_roots_from_the_environment_are_stripped_and_a_blank_one_is_refused(tmp_path, value, ok):
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(tiny_config().to_yaml())
    root = os.path.join(os.path.dirname(__file__), "..", "..")
    env = {**os.environ, "PERSIA_PS_STORAGE_ROOTS": value}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "persia_core.ps.server",
            "--config",
            str(cfg),
            "--shard",
            "0",
            "--num-shards",
            "1",
            "--port-file",
            str(tmp_path / "port"),
        ],
        cwd=root,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        if not ok:
            assert proc.wait(timeout=120) == 2
            assert "PERSIA_PS_STORAGE_ROOTS" in proc.stdout.read() and not (tmp_path / "port").exists()
            return
        deadline = time.monotonic() + 120
        while not (tmp_path / "port").exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (tmp_path / "port").exists()
    finally:
        if proc.poll() is None:
            proc.terminate()
            out = proc.communicate(timeout=30)[0]
            assert "under /data/run, /data/ckpt" in out  # both roots, the second without its leading space
