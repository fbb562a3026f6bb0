"""The Vertex AI target of the pipeline: compile-time settings, the train step as a CustomJob with one worker pool
per role, and the scheduled run's input path.

The train step (``train`` below, a lightweight component with the same inputs and outputs as
``components.train``) submits a CustomJob whose pools Vertex AI numbers as

    pool 0  primary: 1 x NN machine (GPU)       NN worker of DDP rank 0; writes the Model
    pool 1  NN workers: M - 1 x NN machine      the other DDP ranks ({} when M = 1)
    pool 2  parameter servers: N / k x PS machine (high memory), k shards each

and every replica runs ``python -m persia_core.cluster`` (roles from ``CLUSTER_SPEC``). The worker-pool specs are
compiled into the pipeline as a template (machine types, images, the command with ``{{dataset}}``,
``{{shards}}``, ``{{model}}``, ``{{control}}`` placeholders and the compile-time default counts); at run time the
launcher fills the paths (``/gcs/`` form) and sets pool 1 and 2 counts from the run config that preprocess
wrote (``trainer.num_workers``, ``embedding.num_shards``), so the pipeline parameters stay authoritative.

Under ``kfp.local`` the local target runs the plain ``components.train`` (LocalCluster) instead.
"""

import contextlib
import dataclasses
import datetime as _dt
import json
import os
import re
import secrets
import warnings
from dataclasses import dataclass

from kfp import dsl
from kfp.dsl import Artifact, Dataset, Input, Metrics, Model, Output

from components import BASE_IMAGE

PLACEHOLDERS = ("dataset", "shards", "model", "control")
TOKEN_ENV, TOKEN_SECRET_ENV = "PERSIA_PS_TOKEN", "PERSIA_PS_TOKEN_SECRET"


GPU_MACHINE_FAMILIES = (
    ("NVIDIA_TESLA_A100", "a2-"),
    ("NVIDIA_A100_80GB", "a2-"),
    ("NVIDIA_H100", "a3-"),
    ("NVIDIA_H200", "a3-"),
    ("NVIDIA_L4", "g2-"),
    ("NVIDIA_TESLA_T4", "n1-"),
    ("NVIDIA_TESLA_V100", "n1-"),
    ("NVIDIA_TESLA_P100", "n1-"),
    ("NVIDIA_TESLA_P4", "n1-"),
    ("NVIDIA_B200", "a4-"),
)
"""GPU type prefix -> the Compute Engine machine family that carries it (Vertex AI refuses other pairs)."""
GPU_ONLY_FAMILIES = ("a2-", "a3-", "a4-", "g2-")
"""Machine families that exist only with their GPUs attached (Vertex AI refuses them without an accelerator)."""
GPU_NN_MACHINE_TYPE = "a2-highgpu-1g"
CPU_NN_MACHINE_TYPE = "n2-standard-16"
"""The NN pools' default machines: with the default GPU (one A100), and CPU-only."""


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
            "nn_replicas",
            "ps_replicas",
            "boot_disk_gb",
            "timeout_s",
        ):
            low = 0 if name in ("accelerator_count", "timeout_s") else 1
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
        for name in ("nn_machine_type", "ps_machine_type"):
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
        known = [prefix for prefix, _ in GPU_MACHINE_FAMILIES]
        if self.accelerator_type and not self.accelerator_type.startswith(tuple(known)):
            raise ValueError(
                f"vertex setting accelerator_type={self.accelerator_type!r} (PERSIA_ACCELERATOR_TYPE) "
                f"is not a GPU this project knows: {known}"
            )
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
        family = next((f for prefix, f in GPU_MACHINE_FAMILIES if self.accelerator_type.startswith(prefix)), None)
        if family and not self.nn_machine_type.startswith(family):
            raise ValueError(
                f"vertex settings: {self.accelerator_type} GPUs come only on {family}* machines, not "
                f"nn_machine_type={self.nn_machine_type!r} (PERSIA_NN_MACHINE_TYPE)"
            )
        gpus = re.search(r"-(\d+)g$", self.nn_machine_type)  # a2-highgpu-2g, a3-highgpu-8g: a fixed GPU count
        if self.accelerator_count and gpus and int(gpus.group(1)) != self.accelerator_count:
            raise ValueError(
                f"vertex settings: {self.nn_machine_type} carries {gpus.group(1)} GPU(s), not "
                f"accelerator_count={self.accelerator_count} (PERSIA_ACCELERATOR_COUNT)"
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
    def from_env(cls, environ: dict | None = None, **overrides) -> "VertexSettings":
        """Settings from ``PERSIA_*`` variables, then ``overrides`` (None values ignored)."""
        environ = os.environ if environ is None else environ
        kw = {}
        types = {f.name: f.type for f in dataclasses.fields(cls)}
        for name, var in cls.ENV.items():
            if environ.get(var, "") != "":
                raw = environ[var]
                try:
                    kw[name] = int(raw) if types[name] in (int, "int") else raw
                except ValueError as e:
                    raise ValueError(f"{var}={raw!r}: expected an integer") from e
        kw.update({k: v for k, v in overrides.items() if v is not None})
        kw.setdefault("image", "")
        return cls(**kw)

    def worker_pool_specs(self) -> list[dict]:
        """The CustomJob's ``workerPoolSpecs`` template (see module docstring)."""
        from persia_core.cluster import Machine, worker_pool_specs

        nn = Machine(
            self.nn_machine_type, self.accelerator_type, self.accelerator_count, boot_disk_gb=self.boot_disk_gb
        )
        ps = Machine(self.ps_machine_type, boot_disk_gb=self.boot_disk_gb)
        args = [
            "--config",
            "{{shards}}/run_config.yaml",
            "--data",
            "{{dataset}}",
            "--init",
            "{{shards}}",
            "--out",
            "{{model}}",
            "--control",
            "{{control}}",
            "--shards-per-server",
            str(self.shards_per_server),
            "--ranks-per-replica",
            str(self.ranks_per_replica),
        ]
        return worker_pool_specs(
            nn, ps, self.nn_replicas, self.ps_replicas, self.image, args, nn_image=self.cuda_image or self.image
        )


_settings: VertexSettings | None = None


@contextlib.contextmanager
def compiling_for(settings: VertexSettings):
    """While active, the pipeline body builds the Vertex AI target with ``settings``."""
    global _settings
    old, _settings = _settings, settings
    try:
        yield settings
    finally:
        _settings = old


def current_settings() -> VertexSettings | None:
    """The Vertex AI settings while compiling that target; None for the local target."""
    return _settings


# ---------------------------------------------------------------------------------------- scheduled input

_DATE_TOKEN = re.compile(r"\{date(?:([+-])(\d+)([dh]))?(?::([^{}]*))?\}")


def parse_schedule_time(value: str, now: _dt.datetime | None = None) -> _dt.datetime:
    """The run's scheduled time (UTC) from ``dsl.PIPELINE_JOB_SCHEDULE_TIME_UTC_PLACEHOLDER``'s value
    (RFC 3339, e.g. ``2025-03-02T03:00:00Z``); a run that was not scheduled (empty or unresolved value) uses
    ``now`` (default: the current UTC time). Raises ``ValueError`` for an unparsable time."""
    value = (value or "").strip()
    if not value or value.startswith("{{"):
        return (now or _dt.datetime.now(_dt.UTC)).astimezone(_dt.UTC)
    m = re.fullmatch(r"(\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}:\d{2})(\.\d+)?(Z|[+-]\d{2}:\d{2})?", value)
    if not m:
        raise ValueError(f"schedule time {value!r} is not an RFC 3339 time")
    frac = (m.group(2) or "")[:7]  # Python keeps microseconds
    tz = m.group(3) or "Z"
    t = _dt.datetime.fromisoformat(m.group(1) + frac + ("+00:00" if tz == "Z" else tz))
    return t.astimezone(_dt.UTC)


def resolve_data_path(template: str, schedule_time: str, now: _dt.datetime | None = None) -> str:
    """Fill ``{date}`` tokens of a data path from the scheduled time, so a recurring run reads its own partition.

    Tokens: ``{date}`` (``%Y-%m-%d``), ``{date:FORMAT}`` (strftime), ``{date-1d}`` / ``{date+2h:FORMAT}``
    (offset in days or hours). E.g. ``gs://b/criteo/dt={date-1d}/`` at 2025-03-02T03:00Z is
    ``gs://b/criteo/dt=2025-03-01/``. A path without tokens is returned unchanged."""
    if "{date" not in template:
        return template
    t = parse_schedule_time(schedule_time, now)

    def fill(m: re.Match) -> str:
        sign, amount, unit, fmt = m.groups()
        when = t
        if amount:
            delta = _dt.timedelta(days=int(amount)) if unit == "d" else _dt.timedelta(hours=int(amount))
            when = t + delta if sign == "+" else t - delta
        return when.strftime(fmt or "%Y-%m-%d")

    try:
        out = _DATE_TOKEN.sub(fill, template)
    except OverflowError:
        raise ValueError(f"data path {template!r}: a date offset beyond the calendar") from None
    if "{date" in out:
        raise ValueError(
            f"data path {template!r}: unrecognized date token (use {{date}}, {{date:%Y%m%d}}, "
            f"{{date-1d}}, {{date+3h:%H}})"
        )
    return out


def check_cloud_folders(blessed_dir: str, warm_start_from: str) -> None:
    """Raises ``ValueError`` unless ``blessed_dir`` is a Cloud Storage folder (gs:// or /gcs/) and
    ``warm_start_from`` is empty or one."""
    cloud = ("gs://", "/gcs/")
    if not blessed_dir.startswith(cloud):
        raise ValueError(
            f"blessed_dir {blessed_dir!r} is a folder inside the run's container, gone when it ends: "
            "set blessed_dir to gs://BUCKET/blessed/<config> (and, for daily retraining, "
            "warm_start_from to the same folder)"
        )
    if warm_start_from and not warm_start_from.startswith(cloud):
        raise ValueError(f"warm_start_from {warm_start_from!r} must be a gs:// (or /gcs/) folder on Vertex AI")


@dsl.component(base_image=BASE_IMAGE, install_kfp_package=False)
def resolve_data(template: str, schedule_time: str, blessed_dir: str = "", warm_start_from: str = "") -> str:
    """The data path of this run: ``{date...}`` tokens of ``template`` filled from the scheduled time (the
    current time for a run that was not scheduled). First step of the Vertex AI pipeline, so it also fails the
    run at once (not after training) when ``blessed_dir`` or ``warm_start_from`` is not on Cloud Storage: a
    folder inside the step's container is gone when the step ends (runs started from the UI are not checked
    by ``pipelines.submit``), or when ``warm_start_from`` names nothing and is not ``blessed_dir`` (a typo that
    would start every scheduled run cold: ``check_warm_start_location``)."""
    from pipelines.vertex import check_cloud_folders, resolve_data_path

    check_cloud_folders(blessed_dir, warm_start_from)
    from persia_core.embedding.warm_start import check_warm_start_location

    check_warm_start_location(warm_start_from, blessed_dir)
    path = resolve_data_path(template, schedule_time)
    print(f"data: {path}")
    return path


# ------------------------------------------------------------------------------------------ the CustomJob


def fill_worker_pool_specs(
    template: list[dict], paths: dict[str, str], nn_replicas: int, ps_replicas: int, env: dict[str, str]
) -> list[dict]:
    """The template's placeholders replaced by ``paths``, pool counts set (pool 1 = ``nn_replicas - 1``, an
    empty spec when 0; pool 2 = ``ps_replicas``) and ``env`` added to every container. Raises ``ValueError``
    for a template that is not pools 0..2 or a placeholder without a path."""
    if len(template) != 3 or not template[0] or not template[2]:
        raise ValueError("worker-pool template: expected [primary, NN workers or {}, parameter servers]")
    missing = [p for p in PLACEHOLDERS if p not in paths]
    if missing:
        raise ValueError(f"worker-pool template: no path for {missing}")
    if nn_replicas < 1 or ps_replicas < 1:
        raise ValueError(f"need >= 1 NN replica and >= 1 parameter-server replica, got {nn_replicas}, {ps_replicas}")

    def fill(text: str) -> str:
        for name in PLACEHOLDERS:
            text = text.replace("{{" + name + "}}", paths[name])
        return text

    primary = json.loads(json.dumps(template[0]))
    workers = json.loads(json.dumps(template[1] or template[0]))
    servers = json.loads(json.dumps(template[2]))
    out = []
    for spec, count in ((primary, 1), (workers, nn_replicas - 1), (servers, ps_replicas)):
        if count == 0:
            out.append({})
            continue
        spec["replicaCount"] = count
        c = spec["containerSpec"]
        c["args"] = [fill(a) for a in c.get("args", [])]
        c["command"] = [fill(a) for a in c.get("command", [])]
        c["env"] = [e for e in c.get("env", []) if e["name"] not in env] + [
            {"name": k, "value": v} for k, v in sorted(env.items())
        ]
        out.append(spec)
    return out


def _arg(args: list[str], flag: str, default: int) -> int:
    return int(args[args.index(flag) + 1]) if flag in args else default


def custom_job_request(
    template_json: str,
    dataset_uri: str,
    shards_uri: str,
    model_uri: str,
    ps_token_secret: str = "",
    checkpoint_every_s: float = 0.0,
    checkpoint_every_steps: int = 0,
) -> tuple[list[dict], str]:
    """Worker-pool specs for this run and the job's base output folder (``<model>_job``, gs:// form).

    Counts follow the run config in ``shards_uri``: NN replicas = ``trainer.num_workers / ranks per replica``,
    parameter-server replicas = ``embedding.num_shards / shards per server``. The token is a fresh random one
    in the containers' environment unless ``ps_token_secret`` names a Secret Manager version. With
    ``checkpoint_every_s`` or ``checkpoint_every_steps`` > 0 every replica gets the checkpoint flags, the folder
    being ``<model>/checkpoints`` on Cloud Storage: the workers write checkpoints there, and the replicas of a
    restarted or retried job resume from the newest complete one. Raises ``ValueError`` when the counts do not
    divide."""
    from persia_core import io
    from persia_core.config import load_config

    template = json.loads(template_json)
    args = template[0]["containerSpec"]["args"]
    k, g = _arg(args, "--shards-per-server", 1), _arg(args, "--ranks-per-replica", 1)
    config = load_config(io.join(shards_uri, "run_config.yaml"))
    n, m = config.embedding.num_shards, config.trainer.num_workers
    if n % k or m % g:
        raise ValueError(
            f"embedding.num_shards={n} must be a multiple of shards per server {k} and "
            f"trainer.num_workers={m} of ranks per replica {g}"
        )
    base = io.to_uri(model_uri).rstrip("/") + "_job"
    paths = {
        "dataset": io.to_fuse(dataset_uri),
        "shards": io.to_fuse(shards_uri),
        "model": io.to_fuse(model_uri),
        "control": io.to_fuse(io.join(base, "control")),
    }
    env = {TOKEN_SECRET_ENV: ps_token_secret} if ps_token_secret else {TOKEN_ENV: secrets.token_hex(16)}
    specs = fill_worker_pool_specs(template, paths, m // g, n // k, env)
    if checkpoint_every_s > 0 or checkpoint_every_steps > 0:
        flags = [
            "--",
            "--checkpoint-dir",
            io.to_fuse(io.join(model_uri, "checkpoints")),
            "--checkpoint-every-s",
            str(float(checkpoint_every_s)),
            "--checkpoint-every-steps",
            str(int(checkpoint_every_steps)),
            "--no-checkpoint-at-end",
        ]
        for spec in specs:
            if spec:
                spec["containerSpec"]["args"] = list(spec["containerSpec"]["args"]) + flags
    return specs, base


def run_custom_job(
    template_json: str,
    dataset_uri: str,
    shards_uri: str,
    model_uri: str,
    location: str,
    project: str = "",
    service_account: str = "",
    network: str = "",
    ps_token_secret: str = "",
    timeout_s: int = 0,
    display_name: str = "",
    checkpoint_every_s: float = 0.0,
    checkpoint_every_steps: int = 0,
) -> dict:
    """Submit the training CustomJob, wait for it, and return the Model's manifest (written by the primary).

    Raises ``RuntimeError`` when the job fails (``google.cloud.aiplatform`` raises it with the job's error)."""
    from google.cloud import aiplatform
    from google.cloud.aiplatform.compat.types import custom_job as custom_job_types

    from persia_core import io

    specs, base = custom_job_request(
        template_json, dataset_uri, shards_uri, model_uri, ps_token_secret, checkpoint_every_s, checkpoint_every_steps
    )
    job = aiplatform.CustomJob(
        display_name=display_name or f"persia-train-{secrets.token_hex(4)}",
        worker_pool_specs=[custom_job_types.WorkerPoolSpec.from_json(json.dumps(s)) for s in specs],
        base_output_dir=base,
        staging_bucket=base,
        project=project or None,
        location=location,
        labels={"persia-kfp": "train"},
    )
    job.run(service_account=service_account or None, network=network or None, timeout=timeout_s or None, sync=True)
    manifest = io.join(io.to_fuse(model_uri), "manifest.json")
    return json.loads(io.read_text(manifest))


@dsl.component(base_image=BASE_IMAGE, install_kfp_package=False)
def train(
    dataset: Input[Dataset],
    shards: Input[Artifact],
    model: Output[Model],
    metrics: Output[Metrics],
    worker_pool_specs: str,
    location: str,
    project: str = "",
    service_account: str = "",
    network: str = "",
    ps_token_secret: str = "",
    timeout_s: int = 0,
    checkpoint_every_s: float = 600.0,
    checkpoint_every_steps: int = 0,
):
    """Hybrid training as a Vertex AI CustomJob (pools: primary, NN workers, parameter servers; see
    ``pipelines.vertex``); writes the same Model artifact as the local train step. Checkpoints go to
    ``<model>/checkpoints`` every ``checkpoint_every_s`` seconds / ``checkpoint_every_steps`` steps (0: off),
    and a restarted or retried job resumes from the newest complete one."""
    from pipelines.vertex import run_custom_job

    manifest = run_custom_job(
        worker_pool_specs,
        dataset.uri,
        shards.uri,
        model.uri,
        location,
        project,
        service_account,
        network,
        ps_token_secret,
        timeout_s,
        checkpoint_every_s=checkpoint_every_s,
        checkpoint_every_steps=checkpoint_every_steps,
    )
    summary = manifest["summary"]
    for key in ("samples_per_s", "max_staleness", "final_loss", "wall_seconds"):
        if summary.get(key) is not None:
            metrics.log_metric(key, summary[key])
    model.metadata["framework"] = "persia-kfp"
    model.metadata["num_shards"] = manifest["num_shards"]
