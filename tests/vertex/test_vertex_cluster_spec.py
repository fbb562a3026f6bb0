"""persia_core.cluster_spec and persia_core.cluster: roles and peers from Vertex AI's CLUSTER_SPEC, and a whole
CustomJob on 127.0.0.1."""

import json
import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
from support import free_port_run

from persia_core import cluster, cluster_spec

# The shape Vertex AI sets in every replica of a CustomJob (job spec abridged; it is a JSON string there).
VERTEX_CLUSTER_SPEC = {
    "cluster": {
        "workerpool0": ["cmle-training-workerpool0-8c1e3f0a7b-0:2222"],
        "workerpool1": [
            "cmle-training-workerpool1-8c1e3f0a7b-0:2222",
            "cmle-training-workerpool1-8c1e3f0a7b-1:2222",
            "cmle-training-workerpool1-8c1e3f0a7b-2:2222",
        ],
        "workerpool2": ["cmle-training-workerpool2-8c1e3f0a7b-0:2222", "cmle-training-workerpool2-8c1e3f0a7b-1:2222"],
    },
    "environment": "cloud",
    "task": {"type": "workerpool1", "index": 2, "trial": ""},
    "job": json.dumps({"worker_pool_specs": [{"machine_spec": {"machine_type": "a2-highgpu-1g"}, "replica_count": 1}]}),
}


def _spec(task_type: str, index: int, **changes) -> str:
    d = json.loads(json.dumps(VERTEX_CLUSTER_SPEC))
    d["task"] = {"type": task_type, "index": index, "trial": ""}
    d.update(changes)
    return json.dumps(d)


def test_vertex_cluster_spec_parses_pools_and_this_replicas_task():
    spec = cluster_spec.parse_cluster_spec(json.dumps(VERTEX_CLUSTER_SPEC))
    assert spec.pool == 1 and spec.index == 2 and spec.role == cluster_spec.NN_WORKER
    assert sorted(spec.pools) == [0, 1, 2] and len(spec.pools[1]) == 3
    assert spec.environment == "cloud"


def test_vertex_cluster_spec_ranks_world_size_and_rendezvous_of_nn_workers():
    primary = cluster_spec.placement(cluster_spec.parse_cluster_spec(_spec("workerpool0", 0)))
    assert (primary.role, primary.rank, primary.world_size) == (cluster_spec.PRIMARY, 0, 4)
    assert (primary.master_addr, primary.master_port) == ("cmle-training-workerpool0-8c1e3f0a7b-0", 2222)
    ranks = [cluster_spec.placement(cluster_spec.parse_cluster_spec(_spec("workerpool1", i))).rank for i in range(3)]
    assert ranks == [1, 2, 3]
    env = cluster_spec.placement(cluster_spec.parse_cluster_spec(_spec("workerpool1", 2))).env()
    assert env == {
        "RANK": "3",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": "cmle-training-workerpool0-8c1e3f0a7b-0",
        "MASTER_PORT": "2222",
        "PERSIA_PS_ADDRESSES": "cmle-training-workerpool2-8c1e3f0a7b-0:2222,"
        "cmle-training-workerpool2-8c1e3f0a7b-1:2222",
    }


def test_vertex_cluster_spec_parameter_server_shards_and_addresses_with_several_shards_per_replica():
    spec = cluster_spec.parse_cluster_spec(_spec("workerpool2", 1))
    one = cluster_spec.placement(spec)
    assert one.role == cluster_spec.PARAMETER_SERVER and one.shards == [1] and one.ports == [2222]
    three = cluster_spec.placement(spec, shards_per_server=3)
    assert three.shards == [3, 4, 5] and three.ports == [2222, 2223, 2224]
    assert three.ps_addresses == [
        f"cmle-training-workerpool2-8c1e3f0a7b-{r}:{2222 + j}" for r in range(2) for j in range(3)
    ]


def test_vertex_cluster_spec_without_pool_1_is_a_single_nn_worker():
    d = json.loads(_spec("workerpool0", 0))
    del d["cluster"]["workerpool1"]
    place = cluster_spec.placement(cluster_spec.parse_cluster_spec(d))
    assert place.world_size == 1 and place.rank == 0


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda d: d["cluster"].update(workerpool4=["h:1"]), "pool 4 has no role"),
        (lambda d: d["cluster"].update(workerpool0=["a:1", "b:1"]), "exactly 1 replica"),
        (lambda d: d.update(task={"type": "workerpool1", "index": 7}), "not in the cluster"),
        (lambda d: d["cluster"].update(workerpool2=["no-port"]), "host:port"),
        (lambda d: d["cluster"].update(chief=["h:1"]), "unknown pool"),
        (lambda d: d.pop("task"), "task"),
        (lambda d: d.update(task={"type": "workerpool1", "index": "0"}), "task.index"),
    ],
)
def test_vertex_cluster_spec_errors_name_the_field(mutate, message):
    d = json.loads(json.dumps(VERTEX_CLUSTER_SPEC))
    mutate(d)
    with pytest.raises(ValueError, match=message):
        cluster_spec.parse_cluster_spec(json.dumps(d))
    with pytest.raises(ValueError, match="not JSON"):
        cluster_spec.parse_cluster_spec("{nope")


def test_vertex_cluster_spec_pool_3_holds_e_embedding_workers_per_nn_worker_in_rank_order():
    d = json.loads(_spec("workerpool1", 2))  # 4 NN workers
    d["cluster"]["workerpool3"] = [f"ew-{i}:3000" for i in range(4)]  # 4 replicas x 2 processes = 4 x E=2
    spec = cluster_spec.parse_cluster_spec(d)
    assert spec.role == cluster_spec.NN_WORKER
    place = cluster_spec.placement(spec, embedding_workers=2, embedding_workers_per_replica=2)
    assert place.rank == 3
    # embedding worker j (replica j // 2, port 3000 + j % 2) serves rank j // E
    assert place.env()["PERSIA_EMBEDDING_WORKER_ADDRESSES"] == "ew-3:3000,ew-3:3001"
    assert place.rank_ew_addresses(0) == ["ew-0:3000", "ew-0:3001"]
    d["task"] = {"type": "workerpool3", "index": 1}
    ew = cluster_spec.placement(
        cluster_spec.parse_cluster_spec(d), embedding_workers=2, embedding_workers_per_replica=2
    )
    assert ew.role == cluster_spec.EMBEDDING_WORKER and ew.ports == [3000, 3001]
    # without pool 3 the NN worker's environment names none (they run beside it)
    assert (
        "PERSIA_EMBEDDING_WORKER_ADDRESSES"
        not in cluster_spec.placement(cluster_spec.parse_cluster_spec(_spec("workerpool1", 2))).env()
    )
    with pytest.raises(
        ValueError,
        match=r"workerpool3: 4 replicas x 1 embedding workers each = 4, but 4 NN workers x "
        r"--embedding-workers 2 need 8",
    ):
        cluster_spec.placement(spec, embedding_workers=2, embedding_workers_per_replica=1)


def test_vertex_worker_pool_specs_add_the_embedding_worker_pool_as_pool_3():
    nn = cluster_spec.Machine("a2-highgpu-1g", "NVIDIA_TESLA_A100", 1)
    ps, ew = cluster_spec.Machine("n2-highmem-32"), cluster_spec.Machine("n2-standard-32")
    three = cluster_spec.worker_pool_specs(nn, ps, 2, 2, "img", ["--x"])
    four = cluster_spec.worker_pool_specs(nn, ps, 2, 2, "img", ["--x"], ew_machine=ew, ew_replicas=3)
    assert len(three) == 3 and four[:3] == three
    assert four[3]["replicaCount"] == 3 and four[3]["machineSpec"] == {"machineType": "n2-standard-32"}
    assert four[3]["containerSpec"]["command"] == cluster_spec.ENTRY_COMMAND


def test_vertex_cluster_spec_without_parameter_servers_is_refused():
    d = json.loads(_spec("workerpool0", 0))
    del d["cluster"]["workerpool2"]
    with pytest.raises(ValueError, match="workerpool2"):
        cluster_spec.placement(cluster_spec.parse_cluster_spec(d))


def test_vertex_replica_token_comes_from_env_or_secret_manager(monkeypatch):
    assert cluster.resolve_token({"PERSIA_PS_TOKEN": "abc"}) == "abc"
    with pytest.raises(ValueError, match="PERSIA_PS_TOKEN_SECRET"):
        cluster.resolve_token({})
    from google.cloud import secretmanager

    seen = {}

    class Payload:
        data = b"s3cret\n"

    class Resp:
        payload = Payload()

    def access(self, request=None, **kw):
        seen.update(request)
        return Resp()

    from google.auth.credentials import AnonymousCredentials

    monkeypatch.setattr(secretmanager.SecretManagerServiceClient, "access_secret_version", access)
    monkeypatch.setattr("google.auth.default", lambda *a, **k: (AnonymousCredentials(), "p"))
    name = "projects/p/secrets/persia-ps-token/versions/latest"
    assert cluster.resolve_token({"PERSIA_PS_TOKEN_SECRET": name}) == "s3cret"
    assert seen == {"name": name}


def _free_ports(n):
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _run_replicas(tmp_path, cmd, replicas, base, env, tag="", timeout_s=200) -> dict:
    """Start every replica as Vertex AI would and wait for all; asserts they all exit 0. Returns the logs."""
    procs = {}
    try:
        for pool, index in replicas:
            spec = dict(base, task={"type": pool, "index": index, "trial": ""})
            log = open(tmp_path / f"{pool}-{index}{tag}.log", "w")
            procs[(pool, index)] = subprocess.Popen(
                cmd, env=dict(env, CLUSTER_SPEC=json.dumps(spec)), stdout=log, stderr=subprocess.STDOUT
            )
        deadline = time.monotonic() + timeout_s
        while any(p.poll() is None for p in procs.values()) and time.monotonic() < deadline:
            time.sleep(0.2)
        codes = {k: p.poll() for k, p in procs.items()}
        logs = {k: open(tmp_path / f"{k[0]}-{k[1]}{tag}.log").read() for k in procs}
        assert all(c == 0 for c in codes.values()), (codes, {k: v[-2000:] for k, v in logs.items()})
        return logs
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "nn_replicas, ps_replicas, ew_replicas",
    [
        (2, 2, 0),  # primary + 1 NN worker replica, 2 parameter-server replicas of 1 shard
        (1, 1, 0),  # the primary runs 2 DDP ranks, 1 parameter-server replica serves 2 shards
        (2, 2, 2),  # and an embedding-worker pool: 2 replicas of 2 processes, E = 2 per NN worker, over gRPC
    ],
)
@pytest.mark.processes
def test_vertex_cluster_replicas_train_a_model_on_localhost(tmp_path, tiny_data, nn_replicas, ps_replicas, ew_replicas):
    """Replicas started as Vertex AI starts them, with CLUSTER_SPEC pointing at 127.0.0.1: the primary writes
    a whole Model, the parameter servers exit on its done marker, the embedding workers once served."""
    from support import tiny_config

    from persia_core.checkpoints import config_sha256
    from persia_core.embedding.delta import list_deltas
    from persia_core.embedding.plan import init_shards
    from persia_core.embedding.reference import LocalEmbedding
    from persia_core.embedding.shard_file import ShardFileError
    from persia_core.embedding.shard_tables import shard_file_bytes
    from persia_core.evaluate.run import evaluate
    from persia_core.model_store import shard_file_name

    cfg = tiny_config(num_workers=2, embedding_staleness=2)
    init = str(tmp_path / "shards")
    init_shards(cfg, tiny_data, init)
    out, control = str(tmp_path / "model"), str(tmp_path / "control")
    ports = _free_ports(nn_replicas)
    k = 2 // ps_replicas
    ps_ports = [free_port_run(k) for _ in range(ps_replicas)]  # a server replica uses ports p .. p+k-1
    cluster_map = {"workerpool0": [f"127.0.0.1:{ports[0]}"], "workerpool2": [f"127.0.0.1:{p}" for p in ps_ports]}
    if nn_replicas > 1:
        cluster_map["workerpool1"] = [f"127.0.0.1:{p}" for p in ports[1:nn_replicas]]
    if ew_replicas:
        cluster_map["workerpool3"] = [f"127.0.0.1:{free_port_run(2)}" for _ in range(ew_replicas)]
    base = {"cluster": cluster_map, "environment": "cloud"}
    env = dict(os.environ, PERSIA_PS_TOKEN="test-token", OMP_NUM_THREADS="1")
    cmd = [
        sys.executable,
        "-m",
        "persia_core.cluster",
        "--config",
        os.path.join(init, "run_config.yaml"),
        "--data",
        tiny_data,
        "--init",
        init,
        "--out",
        out,
        "--control",
        control,
        "--host",
        "127.0.0.1",
        "--poll-s",
        "0.2",
        "--ps-wait-s",
        "120",
        "--shards-per-server",
        str(2 // ps_replicas),
        "--ranks-per-replica",
        str(2 // nn_replicas),
    ]
    if ew_replicas:
        cmd += ["--embedding-workers", "2", "--embedding-workers-per-replica", "2"]
    deltas = str(tmp_path / "deltas")
    if ps_replicas == 2:  # the servers' incremental exports, into the folder the job was given
        cmd += ["--delta-dir", deltas, "--delta-every-s", "0.2"]
    replicas = (
        [("workerpool3", i) for i in range(ew_replicas)]
        + [("workerpool2", i) for i in range(ps_replicas)]
        + [("workerpool1", i) for i in range(nn_replicas - 1)]
        + [("workerpool0", 0)]
    )
    logs = _run_replicas(tmp_path, cmd, replicas, base, env)
    if ew_replicas:
        assert "2 embedding worker(s) over the network" in logs[("workerpool0", 0)]
        assert json.load(open(os.path.join(out, "train_metrics.json")))["embedding_workers"] == 2
    manifest = json.load(open(os.path.join(out, "manifest.json")))
    assert manifest["num_shards"] == 2 and len(manifest["summary"]["rows"]) == 2
    assert all(list_deltas(deltas, s) for s in (0, 1)) == (ps_replicas == 2)
    assert manifest["deltas"] == ({"dir": deltas, "every_s": 0.2} if ps_replicas == 2 else None)
    assert all(r > 0 for r in manifest["summary"]["rows"])
    assert os.path.exists(os.path.join(control, cluster.DONE_MARKER))
    result = evaluate(out, tiny_data)
    assert 0.0 < result["metrics"]["auc"] < 1.0
    # one manifest writer: a model finished the Vertex way carries the shard CRCs and the lineage a local run's
    # has, so a warm start refuses a shard file swapped for a valid one of another model (the zip CRCs alone
    # do not catch that; before, this manifest had neither and the warm start took the other model's rows)
    assert len(manifest["shard_crc32c"]) == 2 and manifest["lineage"]["config_sha256"] == config_sha256(cfg)
    other = LocalEmbedding(cfg.embedding, 2, seed=7)
    other.lookup(cfg.embedding.tables[0].name, np.arange(1, 500, dtype=np.uint64))
    with open(os.path.join(out, shard_file_name(1)), "wb") as f:
        f.write(shard_file_bytes(other.shards[1]))
    with pytest.raises(ShardFileError, match=r"shard-00001\.npz"):
        init_shards(cfg, tiny_data, str(tmp_path / "warm"), warm_start_from=out)


def test_vertex_replica_entry_point_passes_worker_flags_after_the_separator(monkeypatch):
    seen = {}
    monkeypatch.setattr(cluster, "run_replica", lambda args, spec: seen.update(args=args, spec=spec) or 0)
    monkeypatch.setenv("CLUSTER_SPEC", _spec("workerpool1", 0))
    assert cluster.main(["--config", "c.yaml", "--data", "d", "--out", "m", "--", "--init-dense", "x.pt"]) == 0
    assert seen["args"].worker_args == ["--init-dense", "x.pt"] and seen["args"].host == "0.0.0.0"
    monkeypatch.delenv("CLUSTER_SPEC")
    with pytest.raises(SystemExit):
        cluster.main(["--config", "c.yaml", "--data", "d", "--out", "m"])


@pytest.mark.processes
@pytest.mark.timeout(300)
def test_vertex_job_restarted_after_a_failure_resumes_from_its_newest_checkpoint(tmp_path, tiny_data):
    """A restarted job (same command in every replica, as Vertex AI restarts it) continues from the newest
    complete checkpoint: servers load its shards, the workers its step; a done marker left by the earlier
    attempt does not stop the new servers."""
    from support import tiny_config

    from persia_core import checkpoints as ckpt
    from persia_core.embedding.plan import init_shards

    cfg = tiny_config(num_workers=2, embedding_staleness=2, epochs=2)
    init = str(tmp_path / "shards")
    init_shards(cfg, tiny_data, init)
    out, control, ckpts = str(tmp_path / "model"), str(tmp_path / "control"), str(tmp_path / "ckpt")
    (port,) = _free_ports(1)
    ps_port = free_port_run(2)
    base = {
        "cluster": {"workerpool0": [f"127.0.0.1:{port}"], "workerpool2": [f"127.0.0.1:{ps_port}"]},
        "environment": "cloud",
    }
    env = dict(os.environ, PERSIA_PS_TOKEN="test-token", OMP_NUM_THREADS="1")
    cmd = [
        sys.executable,
        "-m",
        "persia_core.cluster",
        "--config",
        os.path.join(init, "run_config.yaml"),
        "--data",
        tiny_data,
        "--init",
        init,
        "--out",
        out,
        "--control",
        control,
        "--host",
        "127.0.0.1",
        "--poll-s",
        "0.2",
        "--ps-wait-s",
        "120",
        "--shards-per-server",
        "2",
        "--ranks-per-replica",
        "2",
        "--",
        "--checkpoint-dir",
        ckpts,
        "--checkpoint-every-steps",
        "3",
        "--checkpoint-keep",
        "5",
        "--no-checkpoint-at-end",
    ]  # so the newest checkpoint is mid-run, as after a failure
    replicas = [("workerpool2", 0), ("workerpool0", 0)]
    _run_replicas(tmp_path, cmd, replicas, base, env, tag="-first")
    first = json.load(open(os.path.join(out, "train_metrics.json")))
    assert first["resumed_from_step"] == 0
    newest_step, newest = ckpt.list_checkpoints(ckpts)[0]
    assert 0 < newest_step < first["steps"]
    # the restart: the same command again, with the earlier attempt's done marker still in the control folder
    assert os.path.exists(os.path.join(control, cluster.DONE_MARKER))
    time.sleep(1.0)
    logs = _run_replicas(tmp_path, cmd, replicas, base, env, tag="-restart")
    again = json.load(open(os.path.join(out, "train_metrics.json")))
    assert again["resumed_from_step"] == newest_step
    assert again["samples"][-1] == first["samples"][-1]  # the same training, finished
    assert f"resume from {newest}" in logs[("workerpool2", 0)]
