"""``make bench-feed``: the CPU cost per sample of feeding one NN worker, per role, against a plain-PyTorch table.

Workload (issue "PERSIA's embedding-worker role"): the synthetic Criteo-shaped set (``criteo_synth``: 26 slots of
one ID each, 13 dense features), embedding dim 16, batch 4096 per NN worker, the dense model reduced to one linear
layer (``model.kind: dnn`` with no hidden or bottom layer, so that what is measured is the sparse path), K = 4,
1 NN worker and 2 parameter servers on this machine (``train``, as ``make run`` does).

CPU time: every process of the job (this one, which supervises it, and all its descendants) is sampled from
``/proc`` (``proc_cpu``) and counted over the NN worker's training loop only (``train_loop_unix`` of
``train_metrics.json``: from the first batch's preparation to the last push applied; start-up and the model's
output are not counted). Roles are told apart by command line: the NN worker (``persia_core.train.worker``),
parameter servers (``persia_core.ps.server``), embedding workers (``persia_core.train.embedding_worker``); the
rest (this supervising process) is ``launcher``. The plain-PyTorch baseline (``baselines.run_plain_torch``, the
same dense model, one thread) is timed over its training steps only.

Output: one line per phase, then one JSON object as the last line: ``sps``, ``plain_torch_sps``, per role
``<role>_cpu_us_per_sample``, ``total_cpu_us_per_sample`` (every process of the job),
``plain_torch_cpu_us_per_sample``, ``embedding_workers``, ``projected_16core_sps`` (= min(4.75e6, 15 / total CPU
seconds per sample): what 15 busy cores of a 16-core machine would feed one GPU at this cost, capped at the
dense ceiling measured on the H200), the NN worker's ``phase_seconds``, and ``dense_step_cpu_us_per_sample``: the
same dense step alone in this process on batches in memory, the part of the NN worker's cost that is not the
sparse path's (on a GPU it runs on the GPU).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import shutil
import subprocess
import sys
import time

from persia_core.argchecks import int_at_least

DENSE_CEILING_SPS = 4.75e6
"""Samples/s of the dense step alone on the lent H200 (issue "PERSIA's embedding-worker role")."""
ROLES = (
    ("nn_worker", "persia_core.train.worker"),
    ("embedding_worker", "persia_core.train.embedding_worker"),
    ("server", "persia_core.ps.server"),
)


def role_of(cmdline: str) -> str:
    """The job role of a process from its command line (``launcher`` for anything else)."""
    for role, module in ROLES:
        if module in cmdline:
            return role
    return "launcher"


def per_sample(cpu_by_pid: dict[int, tuple[str, float]], samples: int) -> dict[str, float]:
    """``<role>_cpu_us_per_sample`` for each role and ``total_cpu_us_per_sample``, from pid -> (cmdline, CPU s)."""
    by_role = {role: 0.0 for role, _ in ROLES} | {"launcher": 0.0}
    for cmdline, cpu in cpu_by_pid.values():
        by_role[role_of(cmdline)] += cpu
    out = {f"{role}_cpu_us_per_sample": round(cpu / samples * 1e6, 3) for role, cpu in by_role.items()}
    out["total_cpu_us_per_sample"] = round(sum(by_role.values()) / samples * 1e6, 3)
    return out


def feed_config(batch_size: int, staleness: int, seed: int, embedding_workers: int = 0):
    """The Criteo-shaped run config with the dense model reduced to one linear layer, 1 NN worker of 1 thread,
    ``embedding_workers`` embedding workers (0: automatic)."""
    from persia_core.bench.criteo_synth import criteo_config_dict
    from persia_core.config import RunConfig

    d = criteo_config_dict(batch_size=batch_size, num_workers=1, staleness=staleness, seed=seed)
    d["model"] = {"kind": "dnn", "hidden": [], "bottom": []}
    d["trainer"]["threads_per_worker"] = 1
    d["trainer"]["embedding_workers"] = embedding_workers
    return RunConfig.from_dict(d)


def dense_step_cpu_us_per_sample(cfg, data_dir: str, batch: int, steps: int = 100) -> float:
    """CPU microseconds per sample of the NN worker's dense step alone (forward, backward to the embeddings,
    Adam), one thread, on batches already in memory, run as the NN worker runs it (``HybridTrainPipeline``:
    gradients set to None, ``fused_step``): the floor under ``nn_worker_cpu_us_per_sample``."""
    import numpy as np
    import torch
    import torch.nn.functional as F

    from persia_core.data.reader import read_schema
    from persia_core.models import fused_step
    from persia_core.models.dense import grad_into
    from persia_core.train.worker import build_dense

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = build_dense(cfg, read_schema(data_dir))
        model.load_kernels()
        params = list(model.parameters())
        opt = torch.optim.Adam(params, lr=cfg.trainer.dense_lr, fused=True)
        rng = np.random.default_rng(0)
        s = len(cfg.slots)
        dim = cfg.embedding.tables[0].dim
        embs = [torch.from_numpy(rng.normal(0, 0.01, (batch, s, dim)).astype(np.float32)) for _ in range(4)]
        grads = [torch.empty_like(e) for e in embs]
        dense = torch.from_numpy(rng.random((batch, len(read_schema(data_dir)["dense"]))).astype(np.float32))
        labels = torch.from_numpy((rng.random(batch) < 0.25).astype(np.float32))

        def step(i: int) -> None:
            # as the NN worker, the gradient written straight into memory of its own (there: the ring's slot; here
            # apart, so that the next steps' embeddings stay what they are)
            emb = grad_into(embs[i % 4].requires_grad_(True), grads[i % 4])
            loss = F.binary_cross_entropy_with_logits(model(emb, dense), labels, reduction="sum") / batch
            for p in params:
                p.grad = None
            loss.backward()
            emb.grad = None
            fused_step(opt)

        for i in range(5):
            step(i)
        c0 = time.process_time()
        for i in range(steps):
            step(i)
        return round((time.process_time() - c0) / (steps * batch) * 1e6, 3)
    finally:
        torch.set_num_threads(threads)


@contextlib.contextmanager
def listening_embedding_workers(count: int, work_dir: str):
    """``count`` embedding-worker processes listening on 127.0.0.1, named to the job's NN worker through
    ``PERSIA_EMBEDDING_WORKER_ADDRESSES`` and sharing its token (``PERSIA_PS_TOKEN``, set here) while the block
    runs; none for 0."""
    if count == 0:
        yield
        return
    from persia_core.ps.protocol import EW_ADDRESSES_ENV, TOKEN_ENV

    saved = {k: os.environ.get(k) for k in (EW_ADDRESSES_ENV, TOKEN_ENV)}
    os.environ[TOKEN_ENV] = saved[TOKEN_ENV] or secrets.token_hex(16)
    procs, addresses = [], []
    try:
        for e in range(count):
            pf = os.path.join(work_dir, f"ew-{e}.port")
            if os.path.exists(pf):
                os.remove(pf)
            cmd = [sys.executable, "-m", "persia_core.train.embedding_worker", "--listen", "127.0.0.1:0"]
            procs.append(subprocess.Popen([*cmd, "--port-file", pf]))
            deadline = time.monotonic() + 120
            while not os.path.exists(pf):
                if procs[-1].poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"embedding worker {e} did not start listening")
                time.sleep(0.05)
            with open(pf) as f:
                addresses.append(f"127.0.0.1:{int(f.read())}")
        os.environ[EW_ADDRESSES_ENV] = ",".join(addresses)
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="persia_core.bench.feed", description=__doc__.split("\n")[0])
    p.add_argument("--samples", type=int_at_least(4096), default=3_000_000, help="training samples (one epoch)")
    p.add_argument("--eval-rows", type=int_at_least(1), default=20_000, help="eval rows of the set")
    p.add_argument("--vocab", type=int_at_least(1), default=100_000, help="IDs per slot")
    p.add_argument("--batch", type=int_at_least(1), default=4096, help="batch per NN worker")
    p.add_argument("--staleness", type=int_at_least(0), default=4, help="K")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--embedding-workers", type=int_at_least(0), default=0, help="embedding workers of the NN worker (0: automatic)"
    )
    p.add_argument("--work", default="bench_outputs/feed", help="work folder (the data set is kept for reruns)")
    p.add_argument("--skip-plain", action="store_true", help="do not run the plain-PyTorch baseline")
    p.add_argument(
        "--network",
        action="store_true",
        help="embedding workers listening on 127.0.0.1 (the gRPC stream transport of other hosts) instead of "
        "beside the NN worker in shared memory; --embedding-workers of them (0: 2)",
    )
    args = p.parse_args(argv)
    from persia_core.bench.baselines import load_indexed, run_plain_torch
    from persia_core.bench.engine_runs import run_hybrid
    from persia_core.bench.hybrid import prepare_criteo
    from persia_core.bench.proc_cpu import ProcessTreeSampler

    data_dir = os.path.join(args.work, f"criteo_synth_{args.samples}_{args.vocab}")
    prepare_criteo(data_dir, args.samples, args.eval_rows, args.vocab)
    cfg = feed_config(args.batch, args.staleness, args.seed, args.embedding_workers)
    run_dir = os.path.join(args.work, "run")
    with (
        ProcessTreeSampler() as sampler,
        listening_embedding_workers(args.embedding_workers or 2 if args.network else 0, args.work),
    ):
        hybrid = run_hybrid(cfg, data_dir, run_dir, args.staleness, 1, 1, args.seed, args.batch)
    with open(os.path.join(hybrid["model_dir"], "train_metrics.json")) as f:
        metrics = json.load(f)
    t0, t1 = metrics["train_loop_unix"]
    samples = int(hybrid["samples"])
    out: dict = {
        "dataset": "criteo_synth",
        "samples": samples,
        "batch": args.batch,
        "staleness": args.staleness,
        "embedding_workers": int(metrics.get("embedding_workers", 0)),
        "transport": "network" if args.network else "shared_memory",
        "sps": round(samples / max(t1 - t0, 1e-9), 1),
        "trainer_sps": round(hybrid["sps"], 1),
        "max_staleness": hybrid["max_staleness"],
        **per_sample(sampler.cpu_between(t0, t1), samples),
        "train_loop_seconds": round(t1 - t0, 3),
        "phase_seconds": metrics.get("phase_seconds"),
        "embedding_worker_phase_seconds": metrics.get("embedding_worker_phase_seconds"),
        "utilization": metrics.get("utilization"),
    }
    print(
        f"hybrid: {out['sps']:.0f} samples/s over {out['train_loop_seconds']:.1f} s; CPU us/sample: NN worker "
        f"{out['nn_worker_cpu_us_per_sample']}, embedding workers {out['embedding_worker_cpu_us_per_sample']}, "
        f"servers {out['server_cpu_us_per_sample']}, launcher {out['launcher_cpu_us_per_sample']}, "
        f"total {out['total_cpu_us_per_sample']}",
        flush=True,
    )
    shutil.rmtree(run_dir, ignore_errors=True)
    out["dense_step_cpu_us_per_sample"] = dense_step_cpu_us_per_sample(cfg, data_dir, args.batch)
    print(
        f"the dense step alone (1 thread, batches in memory): {out['dense_step_cpu_us_per_sample']} CPU us/sample",
        flush=True,
    )
    plain_sps = plain_cpu = None
    if not args.skip_plain:
        data = load_indexed(data_dir)
        t = time.perf_counter()
        plain = run_plain_torch(data, cfg, samples, seed=args.seed, batch_size=args.batch, threads=1)
        plain_sps = round(plain["sps"], 1)
        plain_cpu = round(plain["train_cpu_seconds"] / max(plain["samples"], 1) * 1e6, 3)
        print(
            f"plain PyTorch (1 thread): {plain_sps:.0f} samples/s, {plain_cpu} CPU us/sample "
            f"({time.perf_counter() - t:.0f} s with evaluation)",
            flush=True,
        )
    total_s = out["total_cpu_us_per_sample"] * 1e-6
    out.update(
        {
            "plain_torch_sps": plain_sps,
            "plain_torch_cpu_us_per_sample": plain_cpu,
            "projected_16core_sps": round(min(DENSE_CEILING_SPS, 15 / total_s) if total_s > 0 else DENSE_CEILING_SPS),
        }
    )
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
