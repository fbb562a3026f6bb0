"""The training CustomJob of the Vertex AI target: the worker-pool template filled for one run, submitted, waited for.

Vertex AI numbers the pools as

    pool 0  primary: 1 x NN machine (GPU)       NN worker of DDP rank 0; writes the Model
    pool 1  NN workers: M - 1 x NN machine      the other DDP ranks ({} when M = 1)
    pool 2  parameter servers: N / k x PS machine (high memory), k shards each
    pool 3  embedding workers: M * E / e x CPU machine, e each (only with ``--embedding-workers E``)

and every replica runs ``python -m persia_core.cluster`` (roles from ``CLUSTER_SPEC``). The template is compiled
into the pipeline (machine types, images, the command with ``{{dataset}}``, ``{{shards}}``, ``{{model}}``,
``{{control}}`` placeholders and the compile-time default counts); at run time :func:`custom_job_request` fills
the paths (``/gcs/`` form) and sets pool 1 and 2 counts from the run config that preprocess wrote
(``trainer.num_workers``, ``embedding.num_shards``), so the pipeline parameters stay authoritative.
"""

import json
import secrets

from persia_core import io
from persia_core.cluster_spec import PATH_PLACEHOLDERS as PLACEHOLDERS
from persia_core.config import load_config
from persia_core.ps.protocol import TOKEN_ENV, TOKEN_SECRET_ENV


def fill_worker_pool_specs(
    template: list[dict],
    paths: dict[str, str],
    nn_replicas: int,
    ps_replicas: int,
    env: dict[str, str],
    ew_replicas: int = 0,
) -> list[dict]:
    """The template's placeholders replaced by ``paths``, pool counts set (pool 1 = ``nn_replicas - 1``, an
    empty spec when 0; pool 2 = ``ps_replicas``; pool 3, where the template has one, = ``ew_replicas``) and
    ``env`` added to every container. Raises ``ValueError`` for a template that is not pools 0..2 (or 0..3) or
    a placeholder without a path."""
    if len(template) not in (3, 4) or not template[0] or not template[2] or (len(template) == 4 and not template[3]):
        raise ValueError(
            "worker-pool template: expected [primary, NN workers or {}, parameter servers, embedding workers?]"
        )
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
    pools = [(primary, 1), (workers, nn_replicas - 1), (servers, ps_replicas)]
    if len(template) == 4:
        if ew_replicas < 1:
            raise ValueError(f"the template has an embedding-worker pool: need >= 1 replica, got {ew_replicas}")
        pools.append((json.loads(json.dumps(template[3])), ew_replicas))
    out: list[dict] = []
    for spec, count in pools:
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


def replica_counts(args: list[str], shards_uri: str) -> tuple[int, int, int, int, int]:
    """``(M, N, embedding-worker replicas, k, g)`` of a run: M = ``trainer.num_workers`` and N =
    ``embedding.num_shards`` of the run config in ``shards_uri``, k = ``--shards-per-server``, g =
    ``--ranks-per-replica`` and the embedding-worker replicas ``M * E / e`` (E = ``--embedding-workers``, e =
    ``--embedding-workers-per-replica``) read from the replicas' ``args``. Raises ``ValueError`` when the counts do
    not divide."""
    k, g = _arg(args, "--shards-per-server", 1), _arg(args, "--ranks-per-replica", 1)
    ew, per = _arg(args, "--embedding-workers", 0), _arg(args, "--embedding-workers-per-replica", 1)
    config = load_config(io.join(shards_uri, "run_config.yaml"))
    n, m = config.embedding.num_shards, config.trainer.num_workers
    if n % k or m % g or (m * ew) % per:
        raise ValueError(
            f"embedding.num_shards={n} must be a multiple of shards per server {k}, "
            f"trainer.num_workers={m} of ranks per replica {g}, and its {m} x {ew} embedding workers "
            f"of embedding workers per replica {per}"
        )
    return m, n, m * ew // per, k, g


def run_paths(dataset_uri: str, shards_uri: str, model_uri: str) -> tuple[dict[str, str], str]:
    """The replicas' folders of one run (``PATH_PLACEHOLDERS`` -> a ``/gcs/`` path) and the job's base folder
    (``<model>_job``, gs:// form; its ``control`` folder holds the done marker)."""
    base = io.to_uri(model_uri).rstrip("/") + "_job"
    paths = {
        "dataset": io.to_fuse(dataset_uri),
        "shards": io.to_fuse(shards_uri),
        "model": io.to_fuse(model_uri),
        "control": io.to_fuse(io.join(base, "control")),
    }
    return paths, base


def run_flags(
    model_uri: str,
    checkpoint_every_s: float = 0.0,
    checkpoint_every_steps: int = 0,
    delta_dir: str = "",
    delta_every_s: float = 0.0,
) -> tuple[list[str], list[str]]:
    """The replicas' flags for one run's deltas and checkpoints: ``(entry-point flags, NN-worker flags after
    "--")``. With ``delta_every_s`` > 0 the parameter servers write deltas every ``delta_every_s`` seconds to
    ``delta_dir`` (empty: ``<model>/deltas``); with ``checkpoint_every_s`` or ``checkpoint_every_steps`` > 0
    checkpoints go to ``<model>/checkpoints`` (paths in ``/gcs/`` form)."""
    entry: list[str] = []
    worker: list[str] = []
    if delta_every_s > 0:
        entry = ["--delta-dir", io.to_fuse(delta_dir or io.join(model_uri, "deltas")), "--delta-every-s"]
        entry.append(str(delta_every_s))
    if checkpoint_every_s > 0 or checkpoint_every_steps > 0:
        worker = [
            "--",
            "--checkpoint-dir",
            io.to_fuse(io.join(model_uri, "checkpoints")),
            "--checkpoint-every-s",
            str(float(checkpoint_every_s)),
            "--checkpoint-every-steps",
            str(int(checkpoint_every_steps)),
            "--no-checkpoint-at-end",
        ]
    return entry, worker


def custom_job_request(
    template_json: str,
    dataset_uri: str,
    shards_uri: str,
    model_uri: str,
    ps_token_secret: str = "",
    checkpoint_every_s: float = 0.0,
    checkpoint_every_steps: int = 0,
    delta_dir: str = "",
    delta_every_s: float = 0.0,
) -> tuple[list[dict], str]:
    """Worker-pool specs for this run and the job's base output folder (``<model>_job``, gs:// form).

    Counts follow the run config in ``shards_uri``: NN replicas = ``trainer.num_workers / ranks per replica``,
    parameter-server replicas = ``embedding.num_shards / shards per server``, embedding-worker replicas (with
    ``--embedding-workers E``) = ``trainer.num_workers * E / embedding workers per replica``. The token is a
    fresh random one in the containers' environment unless ``ps_token_secret`` names a Secret Manager version. With
    ``checkpoint_every_s`` or ``checkpoint_every_steps`` > 0 every replica gets the checkpoint flags, the folder
    being ``<model>/checkpoints`` on Cloud Storage: the workers write checkpoints there, and the replicas of a
    restarted or retried job resume from the newest complete one. With ``delta_every_s`` > 0 the parameter servers
    write incremental exports every ``delta_every_s`` seconds to ``delta_dir`` (a Cloud Storage folder; empty:
    ``<model>/deltas``). Raises ``ValueError`` when the counts do not divide."""
    template = json.loads(template_json)
    m, n, ew_replicas, k, g = replica_counts(template[0]["containerSpec"]["args"], shards_uri)
    paths, base = run_paths(dataset_uri, shards_uri, model_uri)
    env = {TOKEN_SECRET_ENV: ps_token_secret} if ps_token_secret else {TOKEN_ENV: secrets.token_hex(16)}
    specs = fill_worker_pool_specs(template, paths, m // g, n // k, env, ew_replicas)
    entry, worker = run_flags(model_uri, checkpoint_every_s, checkpoint_every_steps, delta_dir, delta_every_s)
    for spec in specs:
        if spec:
            spec["containerSpec"]["args"] = list(spec["containerSpec"]["args"]) + entry + worker
    return specs, base


def record_training(manifest: dict, metrics, model) -> None:
    """Log the Model ``manifest``'s training summary on the step's ``metrics`` artifact (samples/s, max staleness,
    final loss, wall seconds) and tag the ``model`` artifact (framework, number of shards)."""
    summary = manifest["summary"]
    for key in ("samples_per_s", "max_staleness", "final_loss", "wall_seconds"):
        if summary.get(key) is not None:
            metrics.log_metric(key, summary[key])
    model.metadata["framework"] = "persia-kfp"
    model.metadata["num_shards"] = manifest["num_shards"]


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
    delta_dir: str = "",
    delta_every_s: float = 0.0,
) -> dict:
    """Submit the training CustomJob, wait for it, and return the Model's manifest (written by the primary).

    Raises ``RuntimeError`` when the job fails (``google.cloud.aiplatform`` raises it with the job's error)."""
    from google.cloud import aiplatform
    from google.cloud.aiplatform.compat.types import custom_job as custom_job_types  # type: ignore[attr-defined]

    specs, base = custom_job_request(
        template_json,
        dataset_uri,
        shards_uri,
        model_uri,
        ps_token_secret,
        checkpoint_every_s,
        checkpoint_every_steps,
        delta_dir,
        delta_every_s,
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
