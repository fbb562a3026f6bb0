"""The Kubeflow target: compiled YAML (train = one JobSet per attempt), its settings, and the JobSet a run gets."""

import json

import pytest
import yaml

from components import custom_job, jobset
from persia_core.cluster_spec import DEVICE_ENV, parse_cluster_spec, placement
from pipelines import kubeflow, vertex
from pipelines.persia_pipeline import compile_pipeline
from pipelines.persia_pipeline import main as compile_main

IMAGE = "us-central1-docker.pkg.dev/test-project/persia/persia-kfp:abc123"
CUDA_IMAGE = "us-central1-docker.pkg.dev/test-project/persia/persia-kfp-cuda:abc123"
ENTRY = ["python", "-m", "persia_core.cluster"]
GIB = 1 << 30


def _settings(**kw) -> kubeflow.KubeflowSettings:
    d = dict(
        image=IMAGE,
        cuda_image=CUDA_IMAGE,
        nn_node_pool="a2-gpu",
        ps_node_pool="highmem",
        ew_node_pool="cpu",
        taint_key="persia-kfp/role",
        accelerator="nvidia-tesla-a100",
        service_account="persia-trainer",
    )
    d.update(kw)
    return kubeflow.KubeflowSettings(**d)


@pytest.fixture(scope="module")
def kubeflow_yaml(tmp_path_factory):
    path = compile_pipeline(str(tmp_path_factory.mktemp("kf") / "kubeflow.yaml"), "kubeflow", _settings())
    return yaml.safe_load(open(path))


def test_kubeflow_yaml_has_the_local_and_vertex_pipeline_parameters(kubeflow_yaml, tmp_path):
    local = yaml.safe_load(open(compile_pipeline(str(tmp_path / "local.yaml"))))
    vertex_settings = vertex.VertexSettings(image=IMAGE, cuda_image=CUDA_IMAGE)
    on_vertex = yaml.safe_load(open(compile_pipeline(str(tmp_path / "vertex.yaml"), "vertex", vertex_settings)))
    for other in (local, on_vertex):
        assert kubeflow_yaml["root"]["inputDefinitions"] == other["root"]["inputDefinitions"]
        assert kubeflow_yaml["root"]["outputDefinitions"] == other["root"]["outputDefinitions"]
    assert kubeflow_yaml["pipelineInfo"]["name"] == "persia-hybrid-training"


def test_kubeflow_yaml_train_step_drives_a_jobset_with_the_compiled_settings(kubeflow_yaml):
    executors = kubeflow_yaml["deploymentSpec"]["executors"]
    assert {e["container"]["image"] for e in executors.values()} == {IMAGE}
    train = kubeflow_yaml["components"]["comp-train"]
    code = "\n".join(executors[train["executorLabel"]]["container"]["command"])
    assert "run_jobset" in code and "jobset_manifests" in code
    assert set(train["outputDefinitions"]["artifacts"]) == {"model", "metrics"}
    params = kubeflow_yaml["root"]["dag"]["tasks"]["train"]["inputs"]["parameters"]
    assert json.loads(params["settings"]["runtimeValue"]["constant"]) == _settings().to_json()
    assert params["delta_dir"] == {"componentInputParameter": "delta_dir"}
    tasks = kubeflow_yaml["root"]["dag"]["tasks"]
    assert "resolve-data" not in tasks and "deploy" not in json.dumps(kubeflow_yaml["components"])
    assert tasks["train"]["retryPolicy"]["maxRetryCount"] == 2  # a retry resumes from the newest checkpoint


def test_kubeflow_compile_cli_reads_persia_k8s_variables_and_flags(monkeypatch, tmp_path, capsys):
    for var in list(kubeflow.KubeflowSettings.ENV.values()) + ["PERSIA_BASE_IMAGE"]:
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(SystemExit):
        compile_main(["--target", "kubeflow", "--output", str(tmp_path / "x.yaml")])
    assert "PERSIA_K8S_IMAGE" in capsys.readouterr().err
    monkeypatch.setenv("PERSIA_BASE_IMAGE", IMAGE)
    monkeypatch.setenv("PERSIA_K8S_PS_NODE_POOL", "ultramem")
    monkeypatch.setenv("PERSIA_K8S_GCS_FUSE", "0")
    out = tmp_path / "kf.yaml"
    compile_main(["--target", "kubeflow", "--output", str(out), "--k8s-gpus", "2", "--k8s-nn-node-pool", "a3"])
    params = yaml.safe_load(open(out))["root"]["dag"]["tasks"]["train"]["inputs"]["parameters"]
    got = json.loads(params["settings"]["runtimeValue"]["constant"])
    assert (got["image"], got["ps_node_pool"], got["nn_node_pool"], got["gpus"]) == (IMAGE, "ultramem", "a3", 2)
    assert got["gcs_fuse"] is False
    monkeypatch.setenv("PERSIA_K8S_GPUS", "two")
    with pytest.raises(SystemExit):
        compile_main(["--target", "kubeflow", "--output", str(out)])
    assert "PERSIA_K8S_GPUS='two'" in capsys.readouterr().err
    monkeypatch.delenv("PERSIA_K8S_GPUS")
    # every setting is a flag; a misspelt variable and another target's flag are refused, not ignored
    compile_main(["--target", "kubeflow", "--output", str(out), "--k8s-taint-key", "pool", "--k8s-gcs-fuse", "1"])
    got = json.loads(
        yaml.safe_load(open(out))["root"]["dag"]["tasks"]["train"]["inputs"]["parameters"]["settings"]["runtimeValue"][
            "constant"
        ]
    )
    assert (got["taint_key"], got["gcs_fuse"]) == ("pool", True)
    for argv, says in (
        (["--target", "kubeflow", "--shards-per-server", "4"], "--shards-per-server: not a setting of the kubeflow"),
        (["--target", "vertex", "--image", IMAGE, "--k8s-gpus", "2"], "--k8s-gpus: not a setting of the vertex"),
    ):
        with pytest.raises(SystemExit):
            compile_main([*argv, "--output", str(out)])
        assert says in capsys.readouterr().err
    monkeypatch.setenv("PERSIA_K8S_GPU", "2")
    with pytest.raises(SystemExit):
        compile_main(["--target", "kubeflow", "--output", str(out)])
    assert "PERSIA_K8S_GPU: not a setting of the Kubeflow target" in capsys.readouterr().err


@pytest.mark.parametrize(
    "kw, says",
    [
        (dict(nn_memory="32GB"), "nn_memory='32GB'"),
        (dict(ps_node_pool="High Mem"), "ps_node_pool"),
        (dict(namespace="Kubeflow"), "namespace='Kubeflow'"),
        (dict(gpus=1, ranks_per_replica=2), "one rank per GPU"),
        (dict(shards_per_server=0), "shards_per_server must be >= 1"),
        (dict(taint_key="bad key"), "taint_key"),
        (dict(image="persia-kfp:local"), "cannot pull a local tag"),
        (dict(nn_memory="0"), "nn_memory='0'"),
        (dict(shm_size="100m"), "not a memory size"),
        (dict(gpus=0, ranks_per_replica=1), "accelerator='nvidia-tesla-a100'"),
    ],
)
def test_kubeflow_settings_refuse_values_kubernetes_would_refuse(kw, says):
    with pytest.raises(ValueError, match=says):
        _settings(**kw)


def _run_folder(tmp_path, num_workers=3, num_shards=4, shard_memory_bytes=6 * GIB):
    from support import tiny_config

    cfg = tiny_config(num_workers=num_workers).with_overrides({"embedding.num_shards": num_shards})
    shards = tmp_path / "shards"
    shards.mkdir(exist_ok=True)
    (shards / "run_config.yaml").write_text(cfg.to_yaml())
    (shards / "shard_plan.json").write_text(json.dumps({"shard_memory_bytes": shard_memory_bytes}))
    return str(shards)


def _pods(js: dict) -> list[tuple[str, int, dict]]:
    """(role, index, container) of every pod the JobSet's Indexed Jobs create."""
    out = []
    for rj in js["spec"]["replicatedJobs"]:
        spec = rj["template"]["spec"]
        assert rj["replicas"] == 1 and spec["completionMode"] == "Indexed" and spec["backoffLimit"] == 0
        assert spec["parallelism"] == spec["completions"]
        for i in range(spec["completions"]):
            out.append((rj["name"], i, spec["template"]["spec"]["containers"][0]))
    return out


def _cluster_spec(container: dict, index: int) -> str:
    env = {e["name"]: e for e in container["env"]}
    assert env[jobset.INDEX_ENV]["valueFrom"]["fieldRef"]["fieldPath"] == jobset.COMPLETION_INDEX
    return env["CLUSTER_SPEC"]["value"].replace(f"$({jobset.INDEX_ENV})", str(index))


def test_jobset_pods_find_their_roles_and_peers_through_the_vertex_cluster_spec(tmp_path):
    shards = _run_folder(tmp_path)  # M = 3 NN workers, N = 4 shards, 2 per parameter-server pod
    s = _settings(shards_per_server=2).to_json()
    name = jobset.jobset_name(jobset.run_key("gs://m/run/model"), "a1")
    owner = {"apiVersion": "v1", "kind": "Pod", "name": "step-pod", "uid": "1234"}
    got = jobset.jobset_manifests(s, "gs://d/data", shards, "gs://m/run/model", name, "team", "tok", owner=owner)
    js, secret = got["jobset"], got["secret"]
    assert js["apiVersion"] == "jobset.x-k8s.io/v1alpha2" and js["metadata"]["namespace"] == "team"
    assert js["metadata"]["ownerReferences"] == secret["metadata"]["ownerReferences"] == [owner]
    assert js["metadata"]["labels"][jobset.RUN_KEY_LABEL] == secret["metadata"]["labels"][jobset.RUN_KEY_LABEL]
    # DNS names from the start, ready or not: the roles look their peers up while those still load their shards
    assert js["spec"]["network"] == {"enableDNSHostnames": True, "publishNotReadyAddresses": True}
    assert js["spec"]["failurePolicy"] == {"maxRestarts": 0}  # a failed pod fails the set; KFP's retry resumes
    assert js["spec"]["successPolicy"] == {"operator": "All", "targetReplicatedJobs": ["primary"]}
    pods = _pods(js)
    assert [(r, i) for r, i, _ in pods] == [
        ("primary", 0),
        ("nn-worker", 0),
        ("nn-worker", 1),
        ("parameter-server", 0),
        ("parameter-server", 1),
    ]
    host = {(r, i): f"{name}-{r}-0-{i}.{name}" for r, i, _ in pods}
    ranks, served = [], []
    for role, i, c in pods:
        spec = parse_cluster_spec(_cluster_spec(c, i))
        place = placement(spec, shards_per_server=2)
        assert place.master_addr == host[("primary", 0)] and place.master_port == 2222
        assert place.ps_addresses == [
            f"{host[('parameter-server', 0)]}:2222",
            f"{host[('parameter-server', 0)]}:2223",
            f"{host[('parameter-server', 1)]}:2222",
            f"{host[('parameter-server', 1)]}:2223",
        ]
        assert spec.pools[2][spec.index].startswith(host[(role, i)]) if role == "parameter-server" else True
        if place.rank >= 0:
            ranks.append(place.rank)
        served += place.shards
        assert c["command"] == ENTRY and c["args"][c["args"].index("--out") + 1] == "/gcs/m/run/model"
        assert c["args"][c["args"].index("--control") + 1] == "/gcs/m/run/model_job/control"
        token = next(e for e in c["env"] if e["name"] == "PERSIA_PS_TOKEN")["valueFrom"]["secretKeyRef"]
        assert token == {"name": secret["metadata"]["name"], "key": jobset.TOKEN_KEY}
    assert sorted(ranks) == [0, 1, 2] and sorted(served) == [0, 1, 2, 3]
    assert secret["stringData"] == {jobset.TOKEN_KEY: "tok"}
    assert max(len(h.split(".")[0]) for h in host.values()) <= 63  # each pod's hostname is a DNS label


def test_jobset_pods_get_their_node_pool_resources_and_volumes(tmp_path):
    shards = _run_folder(tmp_path, shard_memory_bytes=6 * GIB)
    s = _settings(shards_per_server=2, gpus=1).to_json()
    js = jobset.jobset_manifests(s, "gs://d/data", shards, "gs://m/model", "persia-x-1", "ns", "t")["jobset"]
    jobs = {rj["name"]: rj["template"]["spec"]["template"] for rj in js["spec"]["replicatedJobs"]}
    nn, ps = jobs["primary"], jobs["parameter-server"]
    for key in ("nodeSelector", "tolerations", "volumes", "serviceAccountName"):  # the primary is an NN worker
        assert jobs["nn-worker"]["spec"][key] == nn["spec"][key]
    assert {"key": "persia-kfp/role", "operator": "Equal", "value": "nn-worker", "effect": "NoSchedule"} in nn["spec"][
        "tolerations"
    ]
    assert nn["spec"]["nodeSelector"] == {
        jobset.NODE_POOL_LABEL: "a2-gpu",
        jobset.ACCELERATOR_LABEL: "nvidia-tesla-a100",
    }
    assert ps["spec"]["nodeSelector"] == {jobset.NODE_POOL_LABEL: "highmem"}
    assert {"key": "persia-kfp/role", "operator": "Equal", "value": "parameter-server", "effect": "NoSchedule"} in ps[
        "spec"
    ]["tolerations"]
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in nn["spec"]["tolerations"]
    nn_c, ps_c = nn["spec"]["containers"][0], ps["spec"]["containers"][0]
    assert nn_c["image"] == CUDA_IMAGE and ps_c["image"] == IMAGE
    assert nn_c["resources"]["limits"]["nvidia.com/gpu"] == "1"
    # 2 shard processes of a 6 GiB budget and 512 MiB of their own each, plus the pod's entry process's 512 MiB:
    # the parameter servers' memory from the plan
    assert ps_c["resources"]["requests"]["memory"] == ps_c["resources"]["limits"]["memory"] == f"{13 * 1024 + 512}Mi"
    # the NN pods' limit holds their memory-backed /dev/shm (16Gi by default) beside their 32Gi
    assert nn_c["resources"]["requests"]["memory"] == "32Gi" and nn_c["resources"]["limits"]["memory"] == "49152Mi"
    env = {e["name"]: e.get("value") for e in nn_c["env"]}
    assert env["LD_LIBRARY_PATH"] == jobset.GPU_DRIVER_LIBS and env[DEVICE_ENV] == "cuda"
    assert "LD_LIBRARY_PATH" not in {e["name"] for e in ps_c["env"]}
    for c, spec in ((nn_c, nn["spec"]), (ps_c, ps["spec"])):  # what Pod Security's baseline asks, and more
        assert c["securityContext"] == {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
        assert spec["securityContext"] == {"seccompProfile": {"type": "RuntimeDefault"}}
    assert [p["containerPort"] for p in ps_c["ports"]] == [2222, 2223]
    mounts = {m["mountPath"]: m["name"] for m in nn_c["volumeMounts"]}
    assert set(mounts) == {"/gcs/d", "/gcs/m", "/dev/shm"} and "/dev/shm" not in [
        m["mountPath"] for m in ps_c["volumeMounts"]
    ]
    volumes = {v["name"]: v for v in nn["spec"]["volumes"]}
    assert volumes[mounts["/dev/shm"]]["emptyDir"] == {"medium": "Memory", "sizeLimit": "16Gi"}
    assert volumes[mounts["/gcs/m"]]["csi"]["volumeAttributes"]["bucketName"] == "m"
    assert nn["metadata"]["annotations"] == {"gke-gcsfuse/volumes": "true"}
    assert nn["spec"]["serviceAccountName"] == "persia-trainer" and nn["spec"]["restartPolicy"] == "Never"
    local = jobset.jobset_manifests(
        _settings(gcs_fuse=False, gpus=0, ranks_per_replica=1, accelerator="").to_json(),
        "/d",
        shards,
        "/m",
        "n",
        "ns",
        "t",
    )["jobset"]
    local_nn = local["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]
    assert [v["name"] for v in local_nn["spec"]["volumes"]] == ["dshm"] and "annotations" not in local_nn["metadata"]
    assert "nvidia.com/gpu" not in json.dumps(local_nn)


def test_jobset_flags_and_embedding_worker_pods_follow_the_vertex_launcher(tmp_path):
    shards = _run_folder(tmp_path, num_workers=3, num_shards=4)
    kw = dict(checkpoint_every_s=600.0, delta_dir="gs://m/deltas", delta_every_s=30.0)
    s = _settings(embedding_workers=4, embedding_workers_per_replica=6).to_json()
    js = jobset.jobset_manifests(s, "gs://d/data", shards, "gs://m/model", "persia-e-1", "ns", "t", **kw)["jobset"]
    counts = {rj["name"]: rj["template"]["spec"]["completions"] for rj in js["spec"]["replicatedJobs"]}
    assert counts == {"primary": 1, "nn-worker": 2, "parameter-server": 4, "embedding-worker": 2}
    entry, worker = custom_job.run_flags("gs://m/model", **kw)
    for role, i, c in _pods(js):
        assert c["args"][-len(entry + worker) :] == entry + worker
        spec = parse_cluster_spec(_cluster_spec(c, i))
        place = placement(spec, embedding_workers=4, embedding_workers_per_replica=6)
        assert len(place.ew_addresses) == 12
        if role == "embedding-worker":
            assert [p["containerPort"] for p in c["ports"]] == list(range(2222, 2228))
    with pytest.raises(ValueError, match="shard plan"):
        (tmp_path / "shards" / "shard_plan.json").unlink()
        jobset.jobset_manifests(s, "gs://d/data", shards, "gs://m/model", "persia-e-1", "ns", "t")


@pytest.mark.parametrize(
    "kw",
    [
        dict(shards_per_server=2),
        dict(embedding_workers=4, embedding_workers_per_replica=6, taint_key="", service_account=""),
        dict(gpus=0, ranks_per_replica=3, gcs_fuse=False, accelerator="", timeout_s=3600),
    ],
)
def test_jobset_and_secret_validate_against_the_kubernetes_and_jobset_schemas(tmp_path, kw):
    from pipelines.k8s_schema import validate_manifest

    shards = _run_folder(tmp_path)
    owner = {"apiVersion": "v1", "kind": "Pod", "name": "step-pod", "uid": "1234"}
    got = jobset.jobset_manifests(
        _settings(**kw).to_json(), "gs://d/data", shards, "gs://m/model", "persia-v-1", "ns", "t", owner=owner
    )
    validate_manifest(got["jobset"])
    validate_manifest(got["secret"])
    broken = json.loads(json.dumps(got["jobset"]))
    broken["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]["env"][0]["valueFrom"][
        "fieldRef"
    ]["path"] = "x"
    with pytest.raises(ValueError, match=r"containers\[0\]\.env\[0\]\.valueFrom\.fieldRef\.path"):
        validate_manifest(broken)


def test_rbac_manifests_validate_and_bind_the_train_steps_role():
    from importlib.resources import files

    from pipelines.k8s_schema import validate_manifest

    docs = list(yaml.safe_load_all(files("pipelines").joinpath("k8s/rbac.yaml").read_text()))
    for doc in docs:
        validate_manifest(doc)
    by_kind = {d["kind"]: d for d in docs if d["kind"] != "ServiceAccount"}
    accounts = {d["metadata"]["name"] for d in docs if d["kind"] == "ServiceAccount"}
    binding = by_kind["RoleBinding"]
    assert binding["roleRef"]["name"] == by_kind["Role"]["metadata"]["name"]
    # bound to the ServiceAccount KFP standalone runs steps with; the training pods' own has no binding
    assert [(s["kind"], s["name"]) for s in binding["subjects"]] == [("ServiceAccount", "pipeline-runner")]
    assert accounts == {"persia-trainer"}


def test_an_nn_worker_given_gpus_refuses_to_train_on_the_cpu(monkeypatch):
    import torch

    from persia_core.train.worker import resolve_device

    monkeypatch.delenv(DEVICE_ENV, raising=False)
    cuda = torch.cuda.is_available()
    assert resolve_device("auto").type == ("cuda" if cuda else "cpu")
    monkeypatch.setenv(DEVICE_ENV, "cuda")  # as the JobSet sets it in NN pods that requested GPUs
    if cuda:  # the lent GPU machine (make device-check): the GPU, as before
        assert resolve_device("auto").type == "cuda"
    else:
        with pytest.raises(ValueError, match="LD_LIBRARY_PATH"):
            resolve_device("auto")
    assert resolve_device("cpu") == torch.device("cpu")  # a config that asks for the CPU still gets it


def test_the_train_step_refuses_artifacts_off_cloud_storage_naming_the_pipeline_root():
    jobset.require_cloud_storage({"dataset": "gs://b/root/d", "model": "/gcs/b/root/m"})
    with pytest.raises(ValueError, match=r"artifact model is at minio://mlpipeline/v2/m.*defaultPipelineRoot"):
        jobset.require_cloud_storage({"dataset": "gs://b/root/d", "model": "minio://mlpipeline/v2/m"})
