"""The Kubeflow target's training JobSet run as several hosts on this machine.

Every pod of the JobSet that ``components.jobset.jobset_manifests`` builds runs in a network namespace of its own
(an address of its own on a bridge, veth pairs), started with its manifest's command and environment as the kubelet
resolves it, and finds its peers by the generated DNS names (``/etc/netns/<ns>/hosts``; see ``kubeflow_k8s.k8s_local``).
The run must finish with the same Model as the same roles on 127.0.0.1, and a parameter server must refuse a call from
another host that lacks the token while it answers one that carries it.
"""

import json
import os
import shutil
import sys

import numpy as np
import pytest
import torch
from kubeflow_k8s.k8s_local import PodNetwork, pods_of, run_on_localhost, wait_all

from components.jobset import COMPLETION_INDEX, ROLE_JOBS, jobset_manifests, pod_host
from persia_core.cluster import DONE_MARKER
from persia_core.cluster_spec import parse_cluster_spec, ps_addresses
from pipelines.kubeflow import KubeflowSettings

JOBSET = "persia-0123abcd-t1"
NAMESPACE = "persia"
TOKEN = "multihost-test-token"
RUN_TIMEOUT_S = 150
"""Parameter servers poll the control folder every 10 s (the manifests' default): they end up to 10 s after the
primary; the training itself takes about 10 s here."""

PROBE = """
import json, os, socket, sys, time
from persia_core.config import load_config
from persia_core.ps.client import EmbeddingClient, ParameterServerError

addresses, config, wait_s = json.loads(sys.argv[1])
embedding = load_config(config).embedding


def health(token):
    client = EmbeddingClient(addresses, embedding, token=token, retries=0, shared_memory=False)
    try:
        out = []
        for s in range(len(addresses)):
            try:
                client.call("Health", s, timeout_s=5.0)
                out.append("ok")
            except ParameterServerError as e:
                out.append(str(e))
        return out
    finally:
        client.close()


deadline = time.monotonic() + wait_s
while (with_token := health(os.environ["PERSIA_PS_TOKEN"])) != ["ok"] * len(addresses):
    if time.monotonic() > deadline:
        break
    time.sleep(0.5)
print(json.dumps({
    "resolved": [socket.gethostbyname(a.rsplit(":", 1)[0]) for a in addresses],
    "with_token": with_token,
    "without_token": health(""),
    "wrong_token": health("not-" + os.environ["PERSIA_PS_TOKEN"]),
}))
"""
"""Run in one pod's namespace while the servers run: Health of every shard (by the DNS names of the pod's
``CLUSTER_SPEC``) with the token (waiting for the servers), without one and with a wrong one."""


def _flat(state, prefix=""):
    if isinstance(state, dict):
        return {k2: v2 for k, v in state.items() for k2, v2 in _flat(v, f"{prefix}{k}/").items()}
    return {prefix: state}


def assert_same_model(got: str, want: str, data: str) -> dict:
    """The Model in ``got`` equals the one in ``want``, bit for bit wherever the arithmetic decides it.

    Measured (two runs of this config on 127.0.0.1, and each run here against one): at K = 0 with 2 NN workers the
    dense weights, every embedding row's weights and optimizer state, the loss of every step and evaluate()'s
    predictions and metrics are bit-identical from run to run. Each shard sums the step's gradients of both workers
    (two addends per ID, and IEEE addition commutes) and applies them once, so which worker's push arrives first
    cannot change a value; gloo's all-reduce of 2 ranks is deterministic too. So they are compared exactly. Not
    compared: where a shard keeps a row and when it last used it (``keys`` order, ``lru_rows``, ``last_used``: the
    order of the two workers' lookups), hence the shard files' bytes and CRCs, the servers' records of client ids
    (random per process), and timings. Returns ``evaluate(got, data)``."""
    from persia_core.embedding.shard_file import read_shard_file
    from persia_core.evaluate.run import evaluate

    mg, mw = (json.load(open(os.path.join(d, "manifest.json"))) for d in (got, want))
    assert mg["num_shards"] == mw["num_shards"] == 2 and len(mg["shard_files"]) == 2
    for key in ("config", "slots", "dense", "dense_mean", "dense_std", "lineage", "shard_files"):
        assert mg[key] == mw[key], key
    assert mg["summary"]["rows"] == mw["summary"]["rows"] and all(r > 0 for r in mg["summary"]["rows"])
    assert mg["summary"]["final_loss"] == mw["summary"]["final_loss"]
    dg, dw = (_flat(torch.load(os.path.join(d, "dense.pt"), weights_only=False)) for d in (got, want))
    assert dg.keys() == dw.keys()
    for k in dg:
        assert torch.equal(dg[k], dw[k]) if torch.is_tensor(dg[k]) else dg[k] == dw[k], f"dense.pt {k}"
    for f in mg["shard_files"]:
        sg, sw = (read_shard_file(os.path.join(d, f)) for d in (got, want))
        assert sg.tables.keys() == sw.tables.keys()
        for t in sg.tables:
            tg, tw = sg.tables[t], sw.tables[t]
            assert tg.meta == tw.meta and tg.arrays.keys() == tw.arrays.keys(), (f, t)
            og, ow = np.argsort(tg.arrays["keys"]), np.argsort(tw.arrays["keys"])
            assert np.array_equal(tg.arrays["keys"][og], tw.arrays["keys"][ow]), (f, t, "ids")
            for name in ("weights", "acc"):  # the row's embedding and its rowwise-Adagrad accumulator
                assert np.array_equal(tg.arrays[name][og], tw.arrays[name][ow]), (f, t, name)
            assert np.array_equal(tg.arrays["counters"], tw.arrays["counters"]), (f, t, "counters")
    tg_, tw_ = (json.load(open(os.path.join(d, "train_metrics.json"))) for d in (got, want))
    for key in ("step", "samples", "loss", "staleness", "steps", "num_workers", "embedding_workers", "shards"):
        assert tg_[key] == tw_[key], f"train_metrics {key}"
    rg, rw = evaluate(got, data), evaluate(want, data)
    assert np.array_equal(rg["preds"], rw["preds"])
    assert rg["metrics"] == rw["metrics"]
    return rg


def test_kubelet_emulation_expands_env_as_the_kubelet_and_refuses_what_it_does_not_know():
    from kubeflow_k8s.k8s_local import ManifestError, container_env, expand

    assert expand("a $(X) $$(X) $$ $x $(", {"X": "1"}) == "a 1 $(X) $ $x $("
    with pytest.raises(ManifestError, match=r"\$\(Y\)"):
        expand("$(Y)", {"X": "1"})
    secrets = {"s": {"token": "t"}}
    env = [
        {"name": "I", "valueFrom": {"fieldRef": {"fieldPath": COMPLETION_INDEX}}},
        {"name": "T", "valueFrom": {"secretKeyRef": {"name": "s", "key": "token"}}},
        {"name": "S", "value": "$(I)-$(T)"},
    ]
    assert container_env({"env": env}, 3, secrets) == {"I": "3", "T": "t", "S": "3-t"}
    for bad in (
        {"name": "M", "valueFrom": {"configMapKeyRef": {"name": "c", "key": "k"}}},
        {"name": "R", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "K", "valueFrom": {"secretKeyRef": {"name": "s", "key": "other"}}},
        {"name": "L", "value": "$(LATER)"},
    ):
        with pytest.raises(ManifestError):
            container_env({"env": env + [bad, {"name": "LATER", "value": ""}]}, 0, secrets)
    with pytest.raises(ManifestError, match="envFrom"):
        container_env({"env": [], "envFrom": [{"secretRef": {"name": "s"}}]}, 0, secrets)


@pytest.mark.processes
@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "embedding_workers",
    [
        0,  # primary, 1 nn-worker pod, 2 parameter-server pods of 1 shard; embedding workers beside each NN worker
        1,  # and 1 embedding-worker pod of 2 processes: E = 1 per NN worker, over gRPC across hosts
    ],
)
def test_kubeflow_jobset_pods_in_network_namespaces_train_the_localhost_model(tmp_path, tiny_data, embedding_workers):
    from support import tiny_config

    from persia_core.embedding.plan import init_shards

    cfg = tiny_config(num_workers=2, embedding_staleness=0)
    init = str(tmp_path / "shards")
    init_shards(cfg, tiny_data, init)
    settings = KubeflowSettings(
        image="x/y:z",
        gpus=0,
        gcs_fuse=False,
        shards_per_server=1,
        ranks_per_replica=1,
        embedding_workers=embedding_workers,
        embedding_workers_per_replica=2,
    ).to_json()
    model = str(tmp_path / "model")
    manifests = jobset_manifests(settings, tiny_data, init, model, JOBSET, NAMESPACE, TOKEN)
    pods = pods_of(manifests["jobset"], manifests["secret"])
    layout = [(p.role, p.index) for p in pods]
    want = [("primary", 0), ("nn-worker", 0), ("parameter-server", 0), ("parameter-server", 1)]
    assert layout == want + [("embedding-worker", 0)] * embedding_workers
    pool_of = {role: pool for pool, role in ROLE_JOBS.items()}
    for p in pods:
        assert p.dns_name == pod_host(JOBSET, pool_of[p.role], p.index)
        assert p.env["PERSIA_PS_TOKEN"] == TOKEN and json.loads(p.env["CLUSTER_SPEC"])["task"]["index"] == p.index
    by_role = {(p.role, p.index): p for p in pods}
    primary = by_role["primary", 0]
    servers = [p for p in pods if p.role in ("parameter-server", "embedding-worker")]
    logs = tmp_path / "logs"
    logs.mkdir()

    def tails() -> dict:
        return {f.name: f.read_text()[-3000:] for f in sorted(logs.iterdir())}

    with PodNetwork(pods) as net:
        procs = {p.hostname: net.start(p, str(logs / f"{p.hostname}.log")) for p in servers}
        # another host calls the servers by their DNS names: with the token, then without it and with a wrong one
        # (the primary's namespace, before its process starts: the run could otherwise end before the probe)
        addresses = ps_addresses(parse_cluster_spec(primary.env["CLUSTER_SPEC"]), 1)
        config = os.path.join(init, "run_config.yaml")
        probe = net.run(
            primary,
            [sys.executable, "-c", PROBE, json.dumps([addresses, config, 60])],
            {"PERSIA_PS_TOKEN": TOKEN},
            timeout_s=90,
        )
        assert probe.returncode == 0, (probe.stderr[-3000:], tails())
        seen = json.loads(probe.stdout.strip().splitlines()[-1])
        ps_hosts = [p.hostname for p in pods if p.role == "parameter-server"]
        assert seen["resolved"] == [net.addresses[h] for h in ps_hosts]  # each server's own address
        assert net.addresses[primary.hostname] not in seen["resolved"]
        assert seen["with_token"] == ["ok", "ok"], (seen, tails())
        for refused in (seen["without_token"], seen["wrong_token"]):
            assert all("UNAUTHENTICATED" in r and "token" in r for r in refused), seen
        for p in pods:
            if p.hostname not in procs:
                procs[p.hostname] = net.start(p, str(logs / f"{p.hostname}.log"))
        codes = wait_all(procs, RUN_TIMEOUT_S)
        assert all(c == 0 for c in codes.values()), (codes, tails())
    assert os.path.exists(os.path.join(model + "_job", "control", DONE_MARKER))
    primary_log = (logs / f"{primary.hostname}.log").read_text()
    if embedding_workers:
        assert f"1 embedding worker(s) over the network: {by_role['embedding-worker', 0].dns_name}:" in primary_log

    # the same roles on 127.0.0.1 (Vertex-style CLUSTER_SPEC, free ports), from the manifests of another Model
    reference = str(tmp_path / "reference")
    ref = jobset_manifests(settings, tiny_data, init, reference, JOBSET, NAMESPACE, TOKEN)
    flags = ["--host", "127.0.0.1", "--poll-s", "0.2", "--ps-wait-s", "120"]
    for attempt in range(3):  # a free port may be taken by another test's process before a role binds it
        try:
            run_on_localhost(pods_of(ref["jobset"], ref["secret"]), {3: 2}, flags, str(logs), timeout_s=RUN_TIMEOUT_S)
            break
        except AssertionError as e:
            if "address already in use" not in str(e).lower() or attempt == 2:
                raise
            for folder in (reference, reference + "_job"):  # start over on fresh ports
                shutil.rmtree(folder, ignore_errors=True)
    result = assert_same_model(model, reference, tiny_data)
    assert 0.0 < result["metrics"]["auc"] < 1.0
