"""The Vertex AI target of the pipeline: its compile-time settings and the CustomJob's worker-pool template.

``VertexSettings`` holds what a Vertex AI compile fixes (images, region, machine types, GPUs, shards per server,
ranks per replica, ...), read from ``PERSIA_*`` variables or compile flags, and builds the training CustomJob's
``workerPoolSpecs`` template (one pool per role: primary, NN workers, parameter servers). The pipeline passes the
template and the job settings to the ``components.vertex_train`` step, whose launcher (``components.custom_job``)
fills in the run's paths and counts. ``compiling_for`` switches the pipeline body to this target while it is
compiled.

Under ``kfp.local`` the local target runs the plain ``components.train`` (LocalCluster) instead.
"""

import dataclasses
import os
import re
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from persia_core.cluster_spec import (
    CPU_NN_MACHINE_TYPE,
    GPU_ONLY_FAMILIES,
    Machine,
    nn_machine_problem,
    replica_args,
    worker_pool_specs,
)
from pipelines.compile_target import CompileTarget

GPU_NN_MACHINE_TYPE = "a2-highgpu-1g"
"""The NN pools' default machine with the default GPU (one A100); CPU-only: ``CPU_NN_MACHINE_TYPE``."""


@dataclass
class VertexSettings:
    """Compile-time settings of the Vertex AI target (``PERSIA_*`` environment variables or compile flags)."""

    image: str
    """Container image of every step and of the parameter-server pool ($PERSIA_BASE_IMAGE; required)."""
    cuda_image: str = ""
    """Image of the NN pools 0 and 1, e.g. the CUDA build ($PERSIA_CUDA_IMAGE; default: ``image``)."""
    region: str = "us-central1"
    """Where the CustomJob runs ($PERSIA_VERTEX_REGION); the pipeline's own region is chosen at submission."""
    nn_machine_type: str = ""
    """Machine of the NN pools 0 and 1 ($PERSIA_NN_MACHINE_TYPE; default ``a2-highgpu-1g`` with a GPU,
    ``CPU_NN_MACHINE_TYPE`` for CPU-only NN pools)."""
    accelerator_type: str = "NVIDIA_TESLA_A100"
    """GPU of an NN machine ($PERSIA_ACCELERATOR_TYPE; ``none`` or empty with count 0: CPU-only)."""
    accelerator_count: int = 1
    """GPUs per NN machine ($PERSIA_ACCELERATOR_COUNT)."""
    ps_machine_type: str = "n2-highmem-32"
    """High-memory machine of the parameter-server pool 2 ($PERSIA_PS_MACHINE_TYPE)."""
    shards_per_server: int = 1
    """Parameter-server shards (processes) per pool-2 replica ($PERSIA_SHARDS_PER_SERVER)."""
    ranks_per_replica: int = 1
    """NN worker processes (DDP ranks) per NN replica ($PERSIA_RANKS_PER_REPLICA), e.g. one per GPU."""
    embedding_workers: int = 0
    """Embedding workers per NN worker on CPU machines of their own, pool 3 ($PERSIA_EMBEDDING_WORKERS); 0: none,
    each NN worker runs ``trainer.embedding_workers`` beside it on its own machine."""
    ew_machine_type: str = "n2-standard-32"
    """Machine of the embedding-worker pool 3 ($PERSIA_EW_MACHINE_TYPE)."""
    embedding_workers_per_replica: int = 30
    """Embedding-worker processes per pool-3 replica ($PERSIA_EMBEDDING_WORKERS_PER_REPLICA): about one per core
    of ``ew_machine_type``, less two for the system."""
    nn_replicas: int = 2
    """NN replicas in the compiled template (replaced at run time from ``trainer.num_workers``)."""
    ps_replicas: int = 2
    """Parameter-server replicas in the compiled template (replaced at run time from ``embedding.num_shards``)."""
    service_account: str = ""
    """Service account of the CustomJob ($PERSIA_SERVICE_ACCOUNT; empty: the pipeline's)."""
    network: str = ""
    """VPC network of the CustomJob, ``projects/NUMBER/global/networks/NAME`` ($PERSIA_NETWORK; optional)."""
    ps_token_secret: str = ""
    """Secret Manager version holding the parameter servers' token ($PERSIA_PS_TOKEN_SECRET); empty: a fresh
    random token per job, passed in the job's environment."""
    boot_disk_gb: int = 100
    timeout_s: int = 0
    """CustomJob timeout in seconds (0: Vertex AI's default, 7 days)."""

    ENV = {
        "image": "PERSIA_BASE_IMAGE",
        "cuda_image": "PERSIA_CUDA_IMAGE",
        "region": "PERSIA_VERTEX_REGION",
        "nn_machine_type": "PERSIA_NN_MACHINE_TYPE",
        "accelerator_type": "PERSIA_ACCELERATOR_TYPE",
        "accelerator_count": "PERSIA_ACCELERATOR_COUNT",
        "ps_machine_type": "PERSIA_PS_MACHINE_TYPE",
        "shards_per_server": "PERSIA_SHARDS_PER_SERVER",
        "ranks_per_replica": "PERSIA_RANKS_PER_REPLICA",
        "embedding_workers": "PERSIA_EMBEDDING_WORKERS",
        "ew_machine_type": "PERSIA_EW_MACHINE_TYPE",
        "embedding_workers_per_replica": "PERSIA_EMBEDDING_WORKERS_PER_REPLICA",
        "service_account": "PERSIA_SERVICE_ACCOUNT",
        "network": "PERSIA_NETWORK",
        "ps_token_secret": "PERSIA_PS_TOKEN_SECRET",
    }

    def __post_init__(self) -> None:
        if not self.image:
            raise ValueError(
                "a Vertex AI compile needs the image that holds the project: set PERSIA_BASE_IMAGE "
                "(e.g. us-central1-docker.pkg.dev/PROJECT/persia/persia-kfp:TAG, built and pushed "
                "with `make image` / cloudbuild.yaml; see README 'Run on Google Cloud')"
            )
        for name in (
            "accelerator_count",
            "shards_per_server",
            "ranks_per_replica",
            "embedding_workers",
            "embedding_workers_per_replica",
            "nn_replicas",
            "ps_replicas",
            "boot_disk_gb",
            "timeout_s",
        ):
            low = 0 if name in ("accelerator_count", "timeout_s", "embedding_workers") else 1
            if getattr(self, name) < low:
                raise ValueError(f"vertex setting {name} must be >= {low}, got {getattr(self, name)}")
        for name in ("image", "cuda_image"):  # Vertex AI pulls from a registry: a local tag cannot be found there
            value = getattr(self, name)
            if value and ("/" not in value or any(c.isspace() for c in value)):
                raise ValueError(
                    f"vertex setting {name}={value!r} is not a registry image (e.g. "
                    f"us-central1-docker.pkg.dev/PROJECT/persia/persia-kfp:TAG): Vertex AI cannot "
                    f"pull a local tag"
                )
        if not re.fullmatch(r"[a-z]+-[a-z]+\d+", self.region):
            raise ValueError(
                f"vertex setting region={self.region!r} (PERSIA_VERTEX_REGION) is not a Google Cloud "
                f"region such as us-central1 or europe-west4"
            )
        for name in ("nn_machine_type", "ps_machine_type", "ew_machine_type"):
            value = getattr(self, name)
            if value and not re.fullmatch(r"[a-z][a-z0-9]*-[a-z0-9]+(-[a-z0-9]+)*", value):
                raise ValueError(
                    f"vertex setting {name}={value!r} is not a Compute Engine machine type such as "
                    f"n2-highmem-32 or a2-highgpu-1g"
                )
        if self.accelerator_type.lower() == "none":  # PERSIA_ACCELERATOR_TYPE=none: a CPU-only NN pool
            self.accelerator_type, self.accelerator_count = "", 0
        # Vertex AI's enum names: NVIDIA_TESLA_A100 (gcloud's nvidia-tesla-a100 spelling accepted)
        self.accelerator_type = self.accelerator_type.upper().replace("-", "_")
        if bool(self.accelerator_type) != (self.accelerator_count > 0):
            raise ValueError(
                "vertex settings accelerator_type and accelerator_count go together (both or neither; "
                "PERSIA_ACCELERATOR_TYPE=none for CPU-only NN machines)"
            )
        if not self.nn_machine_type:
            self.nn_machine_type = GPU_NN_MACHINE_TYPE if self.accelerator_count else CPU_NN_MACHINE_TYPE
        if not self.accelerator_count and self.nn_machine_type.startswith(GPU_ONLY_FAMILIES):
            raise ValueError(
                f"vertex settings: nn_machine_type={self.nn_machine_type!r} (PERSIA_NN_MACHINE_TYPE) "
                f"carries GPUs, but the NN pools are CPU-only: name its GPU (PERSIA_ACCELERATOR_TYPE "
                f"and _COUNT), or a CPU machine such as {CPU_NN_MACHINE_TYPE}"
            )
        why = nn_machine_problem(
            self.accelerator_type, self.nn_machine_type, self.accelerator_count, "accelerator_count"
        )
        if why:
            raise ValueError(
                f"vertex settings: {why} (PERSIA_ACCELERATOR_TYPE, PERSIA_NN_MACHINE_TYPE, PERSIA_ACCELERATOR_COUNT)"
            )
        if self.accelerator_count and not self.cuda_image:
            warnings.warn(
                f"vertex settings: the NN machines carry {self.accelerator_count} {self.accelerator_type} "
                f"GPU(s) but no CUDA image is set (PERSIA_CUDA_IMAGE): they run {self.image}, whose torch "
                f"may be the CPU build",
                stacklevel=3,
            )  # 2 is the dataclass's generated __init__
        if self.accelerator_count and self.ranks_per_replica > self.accelerator_count:
            raise ValueError(
                f"vertex settings: {self.ranks_per_replica} ranks per NN replica but "
                f"{self.accelerator_count} GPU(s) per machine (one rank per GPU)"
            )

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> "VertexSettings":
        """Settings from ``PERSIA_*`` variables (``environ``, default ``os.environ``), then ``overrides`` (None
        values ignored)."""
        env: Mapping[str, str] = os.environ if environ is None else environ
        kw: dict[str, Any] = {}
        types = {f.name: f.type for f in dataclasses.fields(cls)}
        for name, var in cls.ENV.items():
            if env.get(var, "") != "":
                raw = env[var]
                try:
                    kw[name] = int(raw) if types[name] in (int, "int") else raw
                except ValueError as e:
                    raise ValueError(f"{var}={raw!r}: expected an integer") from e
        kw.update({k: v for k, v in overrides.items() if v is not None})
        kw.setdefault("image", "")
        return cls(**kw)

    def worker_pool_specs(self) -> list[dict]:
        """The CustomJob's ``workerPoolSpecs`` template (see module docstring)."""
        nn = Machine(
            self.nn_machine_type, self.accelerator_type, self.accelerator_count, boot_disk_gb=self.boot_disk_gb
        )
        ps = Machine(self.ps_machine_type, boot_disk_gb=self.boot_disk_gb)
        args = replica_args(
            self.shards_per_server, self.ranks_per_replica, self.embedding_workers, self.embedding_workers_per_replica
        )
        ew_replicas = 0
        if self.embedding_workers:
            workers = self.nn_replicas * self.ranks_per_replica * self.embedding_workers
            ew_replicas = -(-workers // self.embedding_workers_per_replica)  # replaced at run time
        return worker_pool_specs(
            nn,
            ps,
            self.nn_replicas,
            self.ps_replicas,
            self.image,
            args,
            nn_image=self.cuda_image or self.image,
            ew_machine=Machine(self.ew_machine_type, boot_disk_gb=self.boot_disk_gb),
            ew_replicas=ew_replicas,
        )


_target: CompileTarget[VertexSettings] = CompileTarget()
compiling_for = _target.compiling_for
"""While active, the pipeline body builds the Vertex AI target with the given settings."""
current_settings = _target.current
"""The Vertex AI settings while that target is compiled; None otherwise."""
