"""The training JobSet of the Kubeflow target: one run's roles as replicated jobs on Kubernetes, and their Secret.

One JobSet (``jobset.x-k8s.io/v1alpha2``) per attempt of the train step, its replicated jobs numbered as Vertex AI
numbers worker pools, so that every pod runs the same entry point as a Vertex AI replica::

    pool 0  primary            1 pod       NN worker of DDP rank 0; writes the Model
    pool 1  nn-worker          M / g - 1   the other NN workers (g = ranks per pod); absent when M = g
    pool 2  parameter-server   N / k       k shards each, memory from the shard plan
    pool 3  embedding-worker   M * E / e   only with E = embedding workers per NN worker in pods of their own

Each replicated job is one Indexed Job of that many pods (``backoffLimit: 0``: a failed pod fails the job, the job
fails the set, and KFP's retry of the step starts a new attempt that resumes from the newest checkpoint). JobSet
creates the headless Service and names pod i of a role ``<jobset>-<role>-0-<i>.<jobset>``; those names form
``CLUSTER_SPEC``, the variable Vertex AI sets, and each pod's own index comes from its Job completion index
(``$(PERSIA_TASK_INDEX)`` expanded by the kubelet), so ``persia_core.cluster`` finds its role and peers by one code
path on both. The parameter servers' token is read from a per-attempt Secret. Paths on Cloud Storage are given in
``/gcs/<bucket>/...`` form, each bucket mounted there by GKE's Cloud Storage FUSE CSI driver.
"""

import hashlib
import json
import secrets
from typing import Any

from components.custom_job import replica_counts, run_flags, run_paths
from persia_core import io
from persia_core.cluster_spec import DEVICE_ENV, ENTRY_COMMAND, ps_pod_memory_bytes, replica_args
from persia_core.ps.protocol import TOKEN_ENV

API_VERSION = "jobset.x-k8s.io/v1alpha2"
ROLE_JOBS = {0: "primary", 1: "nn-worker", 2: "parameter-server", 3: "embedding-worker"}
"""Pool index -> replicated-job name (the role's part of its pods' DNS names)."""
INDEX_ENV = "PERSIA_TASK_INDEX"
COMPLETION_INDEX = "metadata.annotations['batch.kubernetes.io/job-completion-index']"
"""Where a pod of an Indexed Job reads its index (Kubernetes' downward API)."""
RUN_KEY_LABEL = "persia-kfp/run-key"
"""Label of every object of a train step: the same on each attempt, so a retry finds the previous attempt's."""
ROLE_LABEL = "persia-kfp/role"
REPLICATED_JOB_LABEL = "jobset.sigs.k8s.io/replicatedjob-name"
JOBSET_NAME_LABEL = "jobset.sigs.k8s.io/jobset-name"
"""Labels the JobSet controller puts on its Jobs and pods."""
NODE_POOL_LABEL = "cloud.google.com/gke-nodepool"
"""The node label GKE gives every node of a node pool: a role's pods are placed on its pool through it."""
ACCELERATOR_LABEL = "cloud.google.com/gke-accelerator"
"""The node label of a GKE GPU node pool (the GPU type, e.g. ``nvidia-tesla-a100``)."""
TOKEN_KEY = "token"
CONTAINER = "persia"
GCS_FUSE_DRIVER = "gcsfuse.csi.storage.gke.io"
GPU_DRIVER_LIBS = "/usr/local/nvidia/lib64"
"""Where GKE mounts the NVIDIA driver's libraries into a container that requests GPUs (the container must put it
on ``LD_LIBRARY_PATH`` itself)."""
UNITS = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}


def require_cloud_storage(artifacts: dict[str, str]) -> None:
    """Refuse artifact URIs (name -> URI) that are not on Cloud Storage: the roles' pods reach the run's folders
    only there (mounted at ``/gcs/``). Raises ``ValueError`` naming the artifact and the setting to change."""
    for name, uri in artifacts.items():
        if not io.is_gcs(io.to_uri(uri)):
            raise ValueError(
                f"artifact {name} is at {uri}, not on Cloud Storage: the Kubeflow target's training pods use "
                f"the run's artifacts at gs:// (mounted at /gcs/). Set the pipeline root to a gs:// folder "
                f"(defaultPipelineRoot in the kfp-launcher ConfigMap, or pipeline_root when the run is created)"
            )


def run_key(model_uri: str) -> str:
    """The label value shared by every attempt of one train step: 16 hex of SHA-256 of its Model's URI."""
    return hashlib.sha256(io.to_uri(model_uri).encode()).hexdigest()[:16]


def jobset_name(key: str, attempt: str = "") -> str:
    """``persia-<8 hex of the run key>-<attempt>``: short enough that every pod's DNS name stays a DNS label."""
    return f"persia-{key[:8]}-{attempt or secrets.token_hex(2)}"


def secret_name(name: str) -> str:
    """The Secret holding the token of JobSet ``name``'s parameter servers (found by name, never listed)."""
    return f"{name}-token"


def pod_host(name: str, pool: int, index: int) -> str:
    """The DNS name of pod ``index`` of ``pool`` in JobSet ``name`` (JobSet's ``enableDNSHostnames``)."""
    return f"{name}-{ROLE_JOBS[pool]}-0-{index}.{name}"


def _mebibytes(n: int) -> str:
    return f"{-(-n // (1 << 20))}Mi"


def quantity_bytes(q: str) -> int:
    """Bytes of a Kubernetes memory quantity (``64Gi``, ``500M``, ``1073741824``). Raises ``ValueError`` for
    another form."""
    for unit in sorted(UNITS, key=len, reverse=True):
        if q.endswith(unit) and q[: -len(unit)].replace(".", "", 1).isdigit():
            return int(float(q[: -len(unit)]) * UNITS[unit])
    if q.replace(".", "", 1).isdigit():
        return int(float(q))
    raise ValueError(f"{q!r} is not a memory quantity such as 64Gi or 500M")


def _buckets(paths: list[str]) -> list[str]:
    out: list[str] = []
    for p in paths:
        uri = io.to_uri(p)
        if io.is_gcs(uri):
            bucket = io.split_gcs(uri)[0]
            if bucket not in out:
                out.append(bucket)
    return out


def jobset_manifests(
    settings: dict[str, Any],
    dataset_uri: str,
    shards_uri: str,
    model_uri: str,
    name: str,
    namespace: str,
    token: str,
    owner: dict[str, Any] | None = None,
    checkpoint_every_s: float = 0.0,
    checkpoint_every_steps: int = 0,
    delta_dir: str = "",
    delta_every_s: float = 0.0,
) -> dict[str, dict]:
    """The Secret and the JobSet of one attempt: ``{"secret": ..., "jobset": ...}`` (Kubernetes objects as dicts).

    ``settings``: ``pipelines.kubeflow.KubeflowSettings`` as JSON. Counts follow the run config in ``shards_uri``
    (``trainer.num_workers``, ``embedding.num_shards``) and each parameter-server pod's memory its shard plan
    (``persia_core.cluster_spec.ps_pod_memory_bytes``); an NN pod's memory
    limit holds its ``/dev/shm`` too. ``owner``: an ``ownerReferences`` entry (the step's pod) put on both objects,
    so that deleting the step's pod deletes them. Checkpoint and delta flags as
    on Vertex AI (``components.custom_job.run_flags``). Raises ``ValueError`` when the counts do not divide or the
    shard plan is missing."""
    s = settings
    args = replica_args(
        s["shards_per_server"], s["ranks_per_replica"], s["embedding_workers"], s["embedding_workers_per_replica"]
    )
    m, n, ew_pods, k, g = replica_counts(args, shards_uri)
    try:
        plan = json.loads(io.read_text(io.join(shards_uri, "shard_plan.json")))
    except FileNotFoundError as e:
        raise ValueError(f"{io.join(shards_uri, 'shard_plan.json')}: no shard plan (init_shards writes it)") from e
    ps_memory = _mebibytes(ps_pod_memory_bytes(k, int(plan["shard_memory_bytes"])))
    paths, _ = run_paths(dataset_uri, shards_uri, model_uri)
    entry, worker = run_flags(model_uri, checkpoint_every_s, checkpoint_every_steps, delta_dir, delta_every_s)
    filled = []
    for a in args + entry + worker:
        for p, v in paths.items():
            a = a.replace("{{" + p + "}}", v)
        filled.append(a)
    counts = {0: 1, 1: m // g - 1, 2: n // k, 3: ew_pods}
    port = int(s["port"])
    cluster = {
        f"workerpool{pool}": [f"{pod_host(name, pool, i)}:{port}" for i in range(c)]
        for pool, c in counts.items()
        if c > 0
    }
    token_secret = secret_name(name)
    key = run_key(model_uri)
    labels = {"app.kubernetes.io/name": "persia-kfp", "app.kubernetes.io/component": "train", RUN_KEY_LABEL: key}
    metadata: dict[str, Any] = {"name": name, "namespace": namespace, "labels": dict(labels)}
    if owner:
        metadata["ownerReferences"] = [dict(owner)]
    buckets = _buckets(list(paths.values()) + [delta_dir or io.join(model_uri, "deltas")]) if s["gcs_fuse"] else []

    def job(pool: int) -> dict:
        role = ROLE_JOBS[pool]
        nn = pool in (0, 1)
        spec = json.dumps({"cluster": cluster, "environment": "kubernetes", "task": {"type": f"workerpool{pool}"}})
        spec = spec[:-2] + ', "index": $(' + INDEX_ENV + ")}}"  # an integer once the kubelet expands it
        env = [
            {"name": INDEX_ENV, "valueFrom": {"fieldRef": {"fieldPath": COMPLETION_INDEX}}},
            {"name": TOKEN_ENV, "valueFrom": {"secretKeyRef": {"name": token_secret, "key": TOKEN_KEY}}},
            {"name": "CLUSTER_SPEC", "value": spec},
            {"name": "PYTHONUNBUFFERED", "value": "1"},
        ]
        if nn:
            # the memory-backed /dev/shm counts against the container's memory: the limit holds both
            limit = _mebibytes(quantity_bytes(s["nn_memory"]) + quantity_bytes(s["shm_size"]))
            requests = {"cpu": s["nn_cpu"], "memory": s["nn_memory"]}
            limits: dict[str, Any] = {"memory": limit}
            if s["gpus"]:
                requests["nvidia.com/gpu"] = limits["nvidia.com/gpu"] = str(s["gpus"])
                env.append({"name": "LD_LIBRARY_PATH", "value": GPU_DRIVER_LIBS})
                env.append({"name": DEVICE_ENV, "value": "cuda"})  # no silent fallback to the CPU
            pool_name, image = s["nn_node_pool"], s["cuda_image"] or s["image"]
        elif pool == 2:
            requests, limits = {"cpu": s["ps_cpu"], "memory": ps_memory}, {"memory": ps_memory}
            pool_name, image = s["ps_node_pool"], s["image"]
        else:
            requests, limits = {"cpu": s["ew_cpu"], "memory": s["ew_memory"]}, {"memory": s["ew_memory"]}
            pool_name, image = s["ew_node_pool"], s["image"]
        listeners = 1 if nn else (k if pool == 2 else int(s["embedding_workers_per_replica"]))
        mounts = [{"name": f"gcs-{i}", "mountPath": f"/gcs/{b}"} for i, b in enumerate(buckets)]
        volumes: list[dict[str, Any]] = [
            {
                "name": f"gcs-{i}",
                "csi": {
                    "driver": GCS_FUSE_DRIVER,
                    "volumeAttributes": {"bucketName": b, "mountOptions": "implicit-dirs"},
                },
            }
            for i, b in enumerate(buckets)
        ]
        if nn:  # embedding workers beside the NN worker hand it ready batches in shared memory
            mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
            volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": s["shm_size"]}})
        container: dict[str, Any] = {
            "name": CONTAINER,
            "image": image,
            "command": list(ENTRY_COMMAND),
            "args": list(filled),
            "env": env,
            "ports": [{"containerPort": port + j, "protocol": "TCP"} for j in range(listeners)],
            "resources": {"requests": requests, "limits": limits},
            "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
        }
        if mounts:
            container["volumeMounts"] = mounts
        pod: dict[str, Any] = {
            "restartPolicy": "Never",
            "containers": [container],
            "securityContext": {"seccompProfile": {"type": "RuntimeDefault"}},
        }
        if volumes:
            pod["volumes"] = volumes
        if s["service_account"]:
            pod["serviceAccountName"] = s["service_account"]
        selector = {NODE_POOL_LABEL: pool_name} if pool_name else {}
        if nn and s["gpus"] and s["accelerator"]:
            selector[ACCELERATOR_LABEL] = s["accelerator"]
        if selector:
            pod["nodeSelector"] = selector
        tolerations = []
        if s["taint_key"]:
            kept_for = ROLE_JOBS[1] if nn else role  # the primary runs on the NN workers' node pool
            tolerations.append({"key": s["taint_key"], "operator": "Equal", "value": kept_for, "effect": "NoSchedule"})
        if nn and s["gpus"]:
            tolerations.append({"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"})
        if tolerations:
            pod["tolerations"] = tolerations
        pod_meta: dict[str, Any] = {"labels": dict(labels, **{ROLE_LABEL: role})}
        if buckets:
            pod_meta["annotations"] = {"gke-gcsfuse/volumes": "true"}
        job_spec: dict[str, Any] = {
            "parallelism": counts[pool],
            "completions": counts[pool],
            "completionMode": "Indexed",
            "backoffLimit": 0,
            "template": {"metadata": pod_meta, "spec": pod},
        }
        if s["timeout_s"]:
            job_spec["activeDeadlineSeconds"] = int(s["timeout_s"])
        return {"name": role, "replicas": 1, "template": {"metadata": {"labels": dict(labels)}, "spec": job_spec}}

    jobset = {
        "apiVersion": API_VERSION,
        "kind": "JobSet",
        "metadata": metadata,
        "spec": {
            "network": {"enableDNSHostnames": True, "publishNotReadyAddresses": True},
            "failurePolicy": {"maxRestarts": 0},
            "successPolicy": {"operator": "All", "targetReplicatedJobs": [ROLE_JOBS[0]]},
            "replicatedJobs": [job(pool) for pool, c in counts.items() if c > 0],
        },
    }
    secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": dict(metadata, name=token_secret, labels=dict(labels)),
        "type": "Opaque",
        "stringData": {TOKEN_KEY: token},
    }
    return {"secret": secret, "jobset": jobset}
