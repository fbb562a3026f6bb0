"""The Kubeflow target of the pipeline (Kubeflow Pipelines on Kubernetes, e.g. GKE): its compile-time settings.

``KubeflowSettings`` holds what a Kubeflow compile fixes (images, namespace, node pools, GPUs, resources, shards per
server, ranks per replica, embedding workers, ...), read from ``PERSIA_K8S_*`` variables or compile flags. The
pipeline passes them as JSON to the ``components.kubeflow_train`` step, which builds one JobSet per run from them
(``components.jobset``: a replicated job per role, pods found by DNS names) and drives it
(``components.k8s_job``). ``compiling_for`` switches the pipeline body to this target while it is compiled.

Why JobSet (``jobset.x-k8s.io/v1alpha2``, kubernetes-sigs/jobset): it is the Kubernetes workload API for one job of
several roles with their own pod templates; it creates the headless Service and gives every pod a stable DNS name,
fails the whole set when one job fails (no restarts of its own: KFP's retry restarts the step, which resumes from a
checkpoint), and declares success when the primary finishes. Kubeflow Trainer's TrainJob builds on JobSet but
models one trainer role plus initializers: parameter servers and embedding workers fit it only as side cars.
"""

import dataclasses
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from components.jobset import quantity_bytes
from pipelines.compile_target import CompileTarget

CPU_QUANTITY = re.compile(r"^\d+(\.\d+)?m?$")
"""A Kubernetes CPU quantity such as ``8``, ``0.5`` or ``500m``."""
LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$")
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")


def parser(kind: Any) -> Callable[[str], Any]:
    """The parser of a setting's text by its field's type (``int``, ``bool``, else ``str``; or their names)."""
    parsers: dict[str, Callable[[str], Any]] = {"bool": parse_bool, "int": int}
    return parsers.get(getattr(kind, "__name__", str(kind)), str)


def parse_bool(text: str) -> bool:
    """``1``/``true``/``yes`` -> True, ``0``/``false``/``no`` -> False (any case). Raises ``ValueError`` otherwise."""
    value = {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False}.get(text.lower())
    if value is None:
        raise ValueError(f"{text!r} is not 0 or 1")
    return value


@dataclass
class KubeflowSettings:
    """Compile-time settings of the Kubeflow target (``PERSIA_K8S_*`` environment variables or compile flags).

    Node pools: a role's pods get ``nodeSelector: {cloud.google.com/gke-nodepool: <pool>}`` (empty: no selector)
    and tolerate the taint ``<taint_key>=<role>:NoSchedule`` where ``taint_key`` is set (a node pool per role,
    kept for it; ``<role>``: ``nn-worker``, ``parameter-server`` or ``embedding-worker``); NN pods with GPUs also
    tolerate GKE's ``nvidia.com/gpu`` taint."""

    image: str
    """Image of every step and role ($PERSIA_K8S_IMAGE, else $PERSIA_BASE_IMAGE; required)."""
    cuda_image: str = ""
    """Image of the NN workers, e.g. the CUDA build ($PERSIA_K8S_CUDA_IMAGE; default ``image``)."""
    namespace: str = ""
    """Namespace of the training JobSet ($PERSIA_K8S_NAMESPACE; empty: the namespace the step's pod runs in)."""
    service_account: str = ""
    """Kubernetes ServiceAccount of the roles' pods ($PERSIA_K8S_SERVICE_ACCOUNT; with Workload Identity, the
    one bound to a Google service account that can read and write the buckets; empty: the namespace's default)."""
    nn_node_pool: str = ""
    """GKE node pool of the NN workers ($PERSIA_K8S_NN_NODE_POOL), e.g. a pool of a2-highgpu-1g."""
    ps_node_pool: str = ""
    """GKE node pool of the parameter servers ($PERSIA_K8S_PS_NODE_POOL), e.g. n2-highmem-32."""
    ew_node_pool: str = ""
    """GKE node pool of the embedding workers' pods ($PERSIA_K8S_EW_NODE_POOL), e.g. n2-standard-32."""
    taint_key: str = ""
    """Roles tolerate ``<taint_key>=<role>:NoSchedule`` ($PERSIA_K8S_TAINT_KEY; empty: no toleration)."""
    gpus: int = 1
    """GPUs (``nvidia.com/gpu``) per NN pod ($PERSIA_K8S_GPUS; 0: CPU-only NN workers)."""
    accelerator: str = ""
    """GKE GPU type of the NN pods' nodes ($PERSIA_K8S_ACCELERATOR, e.g. nvidia-tesla-a100; empty: any)."""
    nn_cpu: str = "8"
    """CPU request of an NN pod ($PERSIA_K8S_NN_CPU; Kubernetes quantity)."""
    nn_memory: str = "32Gi"
    """Memory request and limit of an NN pod ($PERSIA_K8S_NN_MEMORY)."""
    ps_cpu: str = "8"
    """CPU request of a parameter-server pod ($PERSIA_K8S_PS_CPU); its memory follows from the shard plan."""
    ew_cpu: str = "30"
    """CPU request of an embedding-worker pod ($PERSIA_K8S_EW_CPU)."""
    ew_memory: str = "32Gi"
    """Memory request and limit of an embedding-worker pod ($PERSIA_K8S_EW_MEMORY)."""
    shm_size: str = "16Gi"
    """Size of the memory-backed ``/dev/shm`` of NN pods ($PERSIA_K8S_SHM_SIZE): embedding workers beside an NN
    worker hand it ready batches there (a container's own ``/dev/shm`` is 64 MB)."""
    shards_per_server: int = 1
    """Parameter-server shards (processes) per parameter-server pod ($PERSIA_K8S_SHARDS_PER_SERVER)."""
    ranks_per_replica: int = 1
    """NN worker processes (DDP ranks) per NN pod ($PERSIA_K8S_RANKS_PER_REPLICA), e.g. one per GPU."""
    embedding_workers: int = 0
    """Embedding workers per NN worker in pods of their own ($PERSIA_K8S_EMBEDDING_WORKERS); 0: each NN worker runs
    ``trainer.embedding_workers`` beside it in its own pod (shared memory)."""
    embedding_workers_per_replica: int = 30
    """Embedding-worker processes per embedding-worker pod ($PERSIA_K8S_EMBEDDING_WORKERS_PER_REPLICA)."""
    port: int = 2222
    """Port of each pod's first listener (rendezvous, parameter servers, embedding workers count up from it)."""
    gcs_fuse: bool = True
    """Mount the run's Cloud Storage buckets at ``/gcs/<bucket>`` with GKE's Cloud Storage FUSE CSI driver
    ($PERSIA_K8S_GCS_FUSE; 0 when the paths are on a volume the pods already share)."""
    timeout_s: int = 0
    """Deadline of the training JobSet's jobs, seconds ($PERSIA_K8S_TIMEOUT_S; 0: none)."""

    ENV = {
        "image": "PERSIA_K8S_IMAGE",
        "cuda_image": "PERSIA_K8S_CUDA_IMAGE",
        "namespace": "PERSIA_K8S_NAMESPACE",
        "service_account": "PERSIA_K8S_SERVICE_ACCOUNT",
        "nn_node_pool": "PERSIA_K8S_NN_NODE_POOL",
        "ps_node_pool": "PERSIA_K8S_PS_NODE_POOL",
        "ew_node_pool": "PERSIA_K8S_EW_NODE_POOL",
        "taint_key": "PERSIA_K8S_TAINT_KEY",
        "gpus": "PERSIA_K8S_GPUS",
        "accelerator": "PERSIA_K8S_ACCELERATOR",
        "nn_cpu": "PERSIA_K8S_NN_CPU",
        "nn_memory": "PERSIA_K8S_NN_MEMORY",
        "ps_cpu": "PERSIA_K8S_PS_CPU",
        "ew_cpu": "PERSIA_K8S_EW_CPU",
        "ew_memory": "PERSIA_K8S_EW_MEMORY",
        "shm_size": "PERSIA_K8S_SHM_SIZE",
        "shards_per_server": "PERSIA_K8S_SHARDS_PER_SERVER",
        "ranks_per_replica": "PERSIA_K8S_RANKS_PER_REPLICA",
        "embedding_workers": "PERSIA_K8S_EMBEDDING_WORKERS",
        "embedding_workers_per_replica": "PERSIA_K8S_EMBEDDING_WORKERS_PER_REPLICA",
        "port": "PERSIA_K8S_PORT",
        "gcs_fuse": "PERSIA_K8S_GCS_FUSE",
        "timeout_s": "PERSIA_K8S_TIMEOUT_S",
    }

    def __post_init__(self) -> None:
        if not self.image:
            raise ValueError(
                "a Kubeflow compile needs the image that holds the project: set PERSIA_K8S_IMAGE or "
                "PERSIA_BASE_IMAGE (e.g. us-central1-docker.pkg.dev/PROJECT/persia/persia-kfp:TAG, built and "
                "pushed with `make image` / cloudbuild.yaml; see docs/kubeflow-gke.md)"
            )
        for name in ("image", "cuda_image"):  # the cluster's nodes pull it from a registry: a local tag is not there
            value = getattr(self, name)
            if value and ("/" not in value or any(c.isspace() for c in value)):
                raise ValueError(
                    f"kubeflow setting {name}={value!r} is not a registry image (e.g. "
                    f"us-central1-docker.pkg.dev/PROJECT/persia/persia-kfp:TAG): the cluster cannot pull a local tag"
                )
        for name in ("namespace", "service_account"):
            value = getattr(self, name)
            if value and not DNS_LABEL.match(value):
                raise ValueError(
                    f"kubeflow setting {name}={value!r} ({self.ENV[name]}) is not a Kubernetes name "
                    f"(lower-case letters, digits and '-', at most 63)"
                )
        for name in ("nn_node_pool", "ps_node_pool", "ew_node_pool", "accelerator"):
            value = getattr(self, name)
            if not LABEL_VALUE.match(value):
                raise ValueError(f"kubeflow setting {name}={value!r} ({self.ENV[name]}) is not a label value")
        if self.taint_key and not re.fullmatch(
            r"([a-z0-9.-]+/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?", self.taint_key
        ):
            raise ValueError(f"kubeflow setting taint_key={self.taint_key!r} (PERSIA_K8S_TAINT_KEY) is not a taint key")
        for name in ("nn_cpu", "ps_cpu", "ew_cpu"):
            value = getattr(self, name)
            if not CPU_QUANTITY.match(value) or not float(value.removesuffix("m")) > 0:
                raise ValueError(
                    f"kubeflow setting {name}={value!r} ({self.ENV[name]}) is not a positive CPU quantity such as 8 "
                    f"or 500m"
                )
        for name in ("nn_memory", "ew_memory", "shm_size"):
            value = getattr(self, name)
            try:
                size = quantity_bytes(value)
            except ValueError:
                size = 0
            if size < 1:  # 100m would be a tenth of a byte
                raise ValueError(
                    f"kubeflow setting {name}={value!r} ({self.ENV[name]}) is not a memory size such as 32Gi"
                )
        for name in ("shards_per_server", "ranks_per_replica", "embedding_workers_per_replica", "port"):
            if getattr(self, name) < 1:
                raise ValueError(f"kubeflow setting {name} must be >= 1, got {getattr(self, name)}")
        for name in ("gpus", "embedding_workers", "timeout_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"kubeflow setting {name} must be >= 0, got {getattr(self, name)}")
        if self.port > 65535 - 64:
            raise ValueError(f"kubeflow setting port={self.port}: the roles count ports up from it, keep it <= 65471")
        if self.accelerator and not self.gpus:
            raise ValueError(
                f"kubeflow settings: accelerator={self.accelerator!r} (PERSIA_K8S_ACCELERATOR) but no GPUs per NN pod "
                f"(PERSIA_K8S_GPUS=0)"
            )
        if self.gpus and self.ranks_per_replica > self.gpus:
            raise ValueError(
                f"kubeflow settings: {self.ranks_per_replica} ranks per NN pod but {self.gpus} GPU(s) per pod "
                f"(one rank per GPU)"
            )

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> "KubeflowSettings":
        """Settings from ``PERSIA_K8S_*`` variables (``environ``, default ``os.environ``; the image falls back to
        ``PERSIA_BASE_IMAGE``), then ``overrides`` (None values ignored). Raises ``ValueError`` naming the
        variable that does not parse."""
        env: Mapping[str, str] = os.environ if environ is None else environ
        unknown = sorted(v for v in env if v.startswith("PERSIA_K8S_") and v not in cls.ENV.values())
        if unknown:  # a misspelt setting would be ignored
            raise ValueError(f"{', '.join(unknown)}: not a setting of the Kubeflow target ({sorted(cls.ENV.values())})")
        kw: dict[str, Any] = {}
        types = {f.name: f.type for f in dataclasses.fields(cls)}
        for name, var in cls.ENV.items():
            raw = env.get(var, "")
            if raw == "":
                continue
            try:
                kw[name] = parser(types[name])(raw)
            except ValueError as e:
                raise ValueError(
                    f"{var}={raw!r}: expected {'0 or 1' if parser(types[name]) is parse_bool else 'an integer'}"
                ) from e
        kw.update({k: v for k, v in overrides.items() if v is not None})
        kw.setdefault("image", env.get("PERSIA_BASE_IMAGE", ""))
        return cls(**kw)

    def to_json(self) -> dict[str, Any]:
        """The settings as the train step receives them (a JSON object of the fields)."""
        return dataclasses.asdict(self)


_target: CompileTarget[KubeflowSettings] = CompileTarget()
compiling_for = _target.compiling_for
"""While active, the pipeline body builds the Kubeflow target with the given settings."""
current_settings = _target.current
"""The Kubeflow settings while that target is compiled; None otherwise."""
