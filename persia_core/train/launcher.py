"""Local training (``train``): check the inputs, start the job's processes, resume from a checkpoint, and
collect the Model artifact.

The parameter servers and NN workers run as local processes (``persia_core.train.local_cluster``: their roles,
and how a failure of one fails the job). When every worker exits 0, each server dumps its shard into the model
folder and ``manifest.json`` is written last (``persia_core.train.model_output``).

Checkpoints and resume (``persia_core.checkpoints``): with checkpoint settings, the workers write
checkpoints under ``<model_dir>/checkpoints`` (or the given folder). ``train`` started again on the same output
(a KFP retry) finds the newest complete checkpoint there and continues from it in new processes; a checkpoint
whose files are partial or corrupt is refused, with the reason logged, and the previous one is used. A checkpoint
of another shard count is re-sharded first (``persia_core.train.resume``).

Model folder::

    manifest.json          format, config, tables, shard files, dense file, slots, dense feature stats, summary,
                           lineage, the checkpoint the run resumed from
    dense.pt               dense model state_dict (load with torch.load(..., weights_only=True))
    shards/shard-SSSSS.npz one per parameter-server shard (``persia_core.embedding.shard_file``; no pickles)
    train_metrics.json     loss curve, samples/s, observed staleness
    checkpoints/           the newest checkpoints (when enabled)
    deltas/                incremental exports (when enabled; ``persia_core.embedding.delta``)
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
import time

from persia_core import checkpoints as ckpt
from persia_core import io
from persia_core.config import RunConfig
from persia_core.data.reader import check_shards_readable, read_schema
from persia_core.embedding.delta import check_delta_settings
from persia_core.model_store import DENSE_FILE, MANIFEST, METRICS_FILE, shard_file_name
from persia_core.ps.client import EmbeddingClient
from persia_core.train.local_cluster import InitRefused, LocalCluster, TrainingFailed, check_local_process_count
from persia_core.train.model_output import finish_model
from persia_core.train.processes import sigterm_as_interrupt
from persia_core.train.resume import checkpoint_inits

log = logging.getLogger("persia.launcher")

KEEP_WORK_DIR_ENV = "PERSIA_KEEP_WORK_DIR"
"""Set (to anything) to keep a failed run's temporary work folder (port files, process logs), named in the log;
by default it is removed, its logs copied to ``<model_dir>/logs`` first."""


def check_config_matches_data(config: RunConfig, schema: dict, data_dir: str) -> None:
    """Raise ``ValueError`` naming the slots of ``config`` that the preprocessed data in ``data_dir`` (its
    ``schema``) does not hold, when its train split has no row, or when the model cannot be built on the data's
    dense features (``ModelConfig.check_fits``), before any process starts."""
    rows = schema.get("rows", {})
    if rows.get("train") == 0:
        raise ValueError(
            f"{io.join(data_dir, 'schema.json')}: the train split holds no row ({rows.get('read', '?')} "
            f"read, {rows.get('malformed', '?')} malformed, {rows.get('eval', '?')} in the eval split); "
            f"nothing to train on"
        )
    missing = [s.name for s in config.slots if s.name not in schema.get("slots", [])]
    if missing:
        raise ValueError(
            f"{io.join(data_dir, 'schema.json')}: the data has no slot(s) {missing} of the run "
            f"config; it holds {schema.get('slots', [])} (was it preprocessed with another config?)"
        )
    config.model.check_fits(len(config.slots), config.embedding.tables[0].dim, len(schema.get("dense", [])))


def check_plan_matches_config(plan: dict, config: RunConfig, init_dir: str) -> None:
    """Raise ``ValueError`` when the shard plan of ``init_dir`` was made for another shard count or other
    embedding tables than ``config`` has: its shard files route feature IDs by ``hash % num_shards`` and hold
    rows of the planned dims, so serving them under another layout would misplace or lose rows."""
    where = io.join(init_dir, "shard_plan.json")
    n = config.embedding.num_shards
    if int(plan.get("num_shards", n)) != n:
        raise ValueError(
            f"{where}: the initial shards were planned for {plan['num_shards']} shards, but "
            f"embedding.num_shards is {n}; run init-shards again with embedding.num_shards={n} "
            f"(it re-shards a warm start), or train with embedding.num_shards={plan['num_shards']}"
        )
    planned = plan.get("tables", {})
    for t in config.embedding.tables:
        p = planned.get(t.name)
        if p is None:
            raise ValueError(
                f"{where}: no embedding table {t.name!r} in the plan (it has {sorted(planned)}); "
                f"run init-shards again with this config"
            )
        for field, have in (("dim", t.dim), ("optimizer", t.optimizer.name)):
            if p.get(field, have) != have:
                raise ValueError(
                    f"{where}: table {t.name!r} was planned with {field} {p[field]!r}, but the config "
                    f"has {have!r}; run init-shards again with this config"
                )


def train(
    config: RunConfig,
    data_dir: str,
    model_dir: str,
    init_dir: str = "",
    work_dir: str = "",
    checkpoint=None,
    resume_from: str = "auto",
    delta_every_s: float = 0.0,
    delta_dir: str = "",
) -> dict:
    """Run hybrid training with ``embedding.num_shards`` parameter servers and ``trainer.num_workers`` NN
    workers on this machine; write the Model artifact to ``model_dir`` (see module docstring).

    Args:
        init_dir: the ``init_shards`` output (shard plan, initial shard states, warm-start dense weights).
        checkpoint: ``CheckpointSettings`` (default: from the config, see
            ``persia_core.checkpoints.checkpoint_settings``).
        resume_from: ``"auto"``: continue from the newest complete checkpoint in the checkpoint folder, if any;
            a checkpoint folder: continue from exactly that one; ``""``: start afresh.
        delta_every_s, delta_dir: incremental export every T seconds (0: ``trainer.delta_every_s`` where the
            config has it, else off) to ``delta_dir`` (default ``<model_dir>/deltas``).

    Returns the manifest. Raises ``TrainingFailed`` when a process fails, ``CheckpointError`` when the checkpoint
    named by ``resume_from`` is refused or belongs to another run, ``FileNotFoundError`` for missing inputs
    (``data_dir``'s schema, ``init_dir``, ``resume_from``), ``ValueError`` when the config does not match the data
    or the shard plan of ``init_dir`` (checked before anything is written or started), ``Terminated`` (a
    ``KeyboardInterrupt``) on SIGTERM, after stopping every process it started."""
    with sigterm_as_interrupt():
        return _train(
            config, data_dir, model_dir, init_dir, work_dir, checkpoint, resume_from, delta_every_s, delta_dir
        )


def _train(
    config: RunConfig,
    data_dir: str,
    model_dir: str,
    init_dir: str,
    work_dir: str,
    checkpoint,
    resume_from: str,
    delta_every_s: float,
    delta_dir: str,
) -> dict:
    check_local_process_count(config.embedding.num_shards, config.trainer.num_workers)
    schema = read_schema(data_dir)
    check_config_matches_data(config, schema, data_dir)
    check_shards_readable(data_dir, "train")
    settings = ckpt.checkpoint_settings(config, model_dir, checkpoint)
    if resume_from not in ("", "auto") and not io.exists(resume_from):
        raise FileNotFoundError(f"resume_from {resume_from}: no such checkpoint folder")
    if resume_from == "" and (settings.periodic or settings.at_end):
        earlier = [p for _, p in ckpt.list_checkpoints(settings.dir) if io.exists(io.join(p, ckpt.MANIFEST))]
        if earlier:  # they would prune this run's checkpoints (higher steps), and a retry would resume them
            raise ValueError(
                f"resume_from '': {settings.dir} holds checkpoints of an earlier run "
                f"({', '.join(os.path.basename(p) for p in earlier[:3])}"
                f"{' ...' if len(earlier) > 3 else ''}); to start afresh, remove them or write to a new "
                f"output (or checkpoint) folder"
            )
    plan_path = io.join(init_dir, "shard_plan.json") if init_dir else ""
    plan = {}
    if init_dir:
        if not io.exists(plan_path):
            raise FileNotFoundError(
                f"init_dir {init_dir}: "
                + ("not an init_shards output (no shard_plan.json)" if io.exists(init_dir) else "no such folder")
            )
        plan = json.loads(io.read_text(plan_path))
        # a checkpoint to resume from brings its own shards (re-sharded to any count); the init shards do not
        resuming = resume_from not in ("", "auto") or (resume_from == "auto" and ckpt.list_checkpoints(settings.dir))
        if not resuming:
            check_plan_matches_config(plan, config, init_dir)
    io.makedirs(model_dir)
    own_work_dir = not work_dir
    work_dir = work_dir or tempfile.mkdtemp(prefix="persia-train-")
    os.makedirs(work_dir, exist_ok=True)
    try:
        manifest = _run(
            config,
            data_dir,
            model_dir,
            init_dir,
            plan,
            work_dir,
            settings,
            resume_from,
            schema,
            delta_every_s,
            delta_dir,
        )
    except BaseException as e:  # a failure, a refusal, SIGTERM: keep the logs, not a temporary folder
        _copy_logs(work_dir, model_dir)
        _remove_partial_model(model_dir)
        if not own_work_dir:
            raise
        if os.environ.get(KEEP_WORK_DIR_ENV):
            log.error("train failed; its work folder is kept in %s (%s is set)", work_dir, KEEP_WORK_DIR_ENV)
            raise
        shutil.rmtree(work_dir, ignore_errors=True)
        if isinstance(e, TrainingFailed):  # its message points into the work folder for the logs
            raise type(e)(str(e).replace(os.path.join(work_dir, "logs"), io.join(model_dir, "logs"), 1)).with_traceback(
                e.__traceback__
            ) from None
        raise
    if own_work_dir:
        shutil.rmtree(work_dir, ignore_errors=True)
    return manifest


SHARD_NAME = re.compile(r"shard-\d{5,}\.npz")
"""A shard file's name in a Model's ``shards/`` (``model_store.shard_file_name``)."""


def _remove_partial_model(model_dir: str) -> None:
    """Remove what a failed run wrote of its Model into local ``model_dir`` (dense weights, metrics, shard files,
    and the temporary files of writes cut short), so that no partial model is left; the logs and the checkpoints
    stay. Nothing is removed from a folder that holds a manifest (a finished Model), nor through the Cloud Storage
    API (a gs:// output is written by the servers' atomic uploads only, which leave nothing half written)."""
    if io.is_gcs(model_dir) or not os.path.isdir(model_dir) or os.path.exists(os.path.join(model_dir, MANIFEST)):
        return
    shards = os.path.join(model_dir, "shards")
    candidates = [(model_dir, n) for n in os.listdir(model_dir)]
    candidates += [(shards, n) for n in os.listdir(shards)] if os.path.isdir(shards) else []
    for folder, name in candidates:
        base = name.split(".tmp-", 1)[0]  # ``io.atomic_local_file``'s temporary names
        ours = base in (DENSE_FILE, METRICS_FILE) if folder == model_dir else SHARD_NAME.fullmatch(base) is not None
        path = os.path.join(folder, name)
        if ours and os.path.isfile(path) and not os.path.islink(path):
            os.remove(path)


def _copy_logs(work_dir: str, model_dir: str) -> None:
    """Copy the job's process logs (``<work_dir>/logs``) to ``<model_dir>/logs``."""
    logs = os.path.join(work_dir, "logs")
    for name in sorted(os.listdir(logs)) if os.path.isdir(logs) else []:
        with open(os.path.join(logs, name), "rb") as f:
            io.write_bytes(io.join(model_dir, "logs", name), f.read())


def _run(
    config: RunConfig,
    data_dir: str,
    model_dir: str,
    init_dir: str,
    plan: dict,
    work_dir: str,
    settings: ckpt.CheckpointSettings,
    resume_from: str,
    schema: dict,
    delta_every_s: float,
    delta_dir: str,
) -> dict:
    """The run of ``_train`` once its inputs are checked and its work folder made; returns the manifest."""
    plan_path = io.join(init_dir, "shard_plan.json") if init_dir else ""
    cfg_path = os.path.join(work_dir, "run_config.yaml")
    with open(cfg_path, "w") as f:
        f.write(config.to_yaml())
    n, m = config.embedding.num_shards, config.trainer.num_workers
    info = ckpt.lineage(config, data_dir)
    lineage_path = os.path.join(work_dir, "lineage.json")
    with open(lineage_path, "w") as f:
        json.dump(info, f)
    delta_every_s = delta_every_s or config.trainer.delta_every_s
    delta_dir = delta_dir or (io.join(model_dir, "deltas") if delta_every_s > 0 else "")
    check_delta_settings(delta_dir, delta_every_s)
    t0 = time.time()
    refused: set[str] = set()
    reasons: list[str] = []
    while True:
        chosen = None
        if resume_from == "auto":
            chosen = ckpt.find_latest(settings.dir, skip=refused, refusals=reasons)
        elif resume_from:
            chosen = (resume_from, ckpt.verify(resume_from, deep=True, deep_roles=("dense", "worker")))
        inits = None
        worker_args = ["--lineage", lineage_path]
        if settings.periodic or settings.at_end:
            worker_args += [
                "--checkpoint-dir",
                settings.dir,
                "--checkpoint-every-steps",
                str(settings.every_steps),
                "--checkpoint-every-s",
                str(settings.every_s),
                "--checkpoint-keep",
                str(settings.keep),
            ]
            if not settings.at_end:
                worker_args.append("--no-checkpoint-at-end")
        if chosen is not None:
            ckpt.check_lineage(chosen[1], info, chosen[0])
            try:
                inits = checkpoint_inits(chosen[0], chosen[1], n, config, plan_path, work_dir)
            except ckpt.CheckpointError as e:  # a shard file refused while re-sharding it
                if resume_from != "auto":
                    raise
                log.warning("checkpoint %s refused while re-sharding it, trying the previous one: %s", chosen[0], e)
                reasons.append(str(e))
                refused.add(chosen[0])
                continue
            worker_args += ["--resume", chosen[0]]
            log.info("resuming from %s (step %d)", chosen[0], chosen[1]["step"])
        elif plan.get("warm_start", {}).get("dense_file"):
            worker_args += ["--init-dense", io.join(init_dir, plan["warm_start"]["dense_file"])]
        try:
            # the servers write their shards only into this run's model and checkpoint folders
            with LocalCluster(
                cfg_path,
                n,
                m,
                work_dir,
                plan_path,
                init_dir,
                delta_dir,
                delta_every_s,
                storage_roots=[r for r in (model_dir, settings.dir) if r],
            ) as cluster:
                addresses = cluster.start_servers(inits=inits)
                cluster.start_workers(data_dir, model_dir, worker_args)
                cluster.wait_workers()
                client = EmbeddingClient(addresses, config.embedding, token=cluster.token)
                done = False
                try:
                    dumped = cluster.run_watched(
                        client.dump, [io.join(model_dir, shard_file_name(s)) for s in range(n)]
                    )
                    stats = cluster.run_watched(client.stats)
                    done = True
                finally:  # a failure or SIGTERM: the dump in flight is cancelled, not waited for
                    client.close(cancel=not done)
            break
        except InitRefused as e:
            if chosen is None or resume_from != "auto":
                raise ckpt.CheckpointError(f"{chosen[0] if chosen else init_dir}: {e}") from e
            log.warning("checkpoint %s refused by a parameter server, trying the previous one: %s", chosen[0], e)
            reasons.append(str(e))
            refused.add(chosen[0])
    _copy_logs(work_dir, model_dir)
    last = ckpt.list_checkpoints(settings.dir)
    manifest = finish_model(
        model_dir,
        config,
        schema,
        dumped,
        stats,
        wall_seconds=time.time() - t0,
        lineage=info,
        resumed_from=chosen[0] if chosen is not None else None,
        checkpoints_refused=reasons,
        last_checkpoint=last[0][1] if last else None,
        warm_start=plan.get("warm_start"),
        deltas={"dir": delta_dir, "every_s": delta_every_s} if delta_every_s > 0 else None,
    )
    return manifest
