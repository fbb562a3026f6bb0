"""``make bench``: the hybrid engine side by side with fully synchronous training, plain PyTorch and TorchRec.

Contestants, each trained on the same data, model and number of training samples, then evaluated on the same
evaluation split (issue "Hybrid engine at speed"):

    (a) hybrid     this project, staleness K = 4: 2 parameter-server processes + NN workers (``train``)
    (b) sync       the same engine with K = 0 (fully synchronous)
    (c) plain      plain PyTorch in one process (``persia_core.bench.baselines``)
    (d) torchrec   TorchRec's fused EmbeddingBagCollection + its DLRM, in ``.venv-torchrec``
                   (``persia_core.bench.torchrec_contestant``); null with ``torchrec_error`` if it cannot run

(a) and (b) also run with an injected network cost per parameter-server call (``trainer.network_delay_s``,
default 2 ms round trip) for samples/s only. NN-worker layouts ``MxT`` (M workers of T torch threads) are all
tried for (a) and (b) on the first seed, and so are torch thread counts (``--baseline-threads``, default 1 and
2) for (c) and (d); each contestant keeps its fastest, and later seeds use it (on a shared 2-core machine two
OpenMP threads collapse when anything else runs, so no contestant is held to one setting). The global batch is
the same for everyone (per-worker batch = global / M).

Datasets: the bundled MovieLens (preprocessed once with the shipped config; one pass over its train split
whatever ``--samples`` says, the shipped config's epochs) and the synthetic Criteo-shaped set
(``persia_core.bench.criteo_synth``: ``--samples`` train rows, one pass; 1,000,000 eval rows). samples/s are
from the first seed, AUC/logloss are means over the seeds. Progress lines first, then one JSON object per
dataset, the Criteo-shaped set last. The machine is shared: ratios measured in the same run are what count,
and ``loadavg`` says how busy it was.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

DEFAULT_SAMPLES = 1_800_000
"""About 60 s per contestant for plain PyTorch (~30k samples/s at batch 4096 on the 2-core machine)."""


def _log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _loadavg() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def parse_layouts(text: str) -> list[tuple[int, int]]:
    """``"1x2,2x1"`` -> ``[(1, 2), (2, 1)]`` (NN workers x torch threads each). Raises ``ValueError``."""
    out = []
    for part in [p for p in text.split(",") if p.strip()]:
        try:
            m, t = (int(v) for v in part.lower().split("x"))
        except ValueError:
            raise ValueError(f"--layouts: {part!r} is not MxT (workers x threads), e.g. 1x2") from None
        if m < 1 or t < 1:
            raise ValueError(f"--layouts: {part!r} needs M >= 1 and T >= 1")
        out.append((m, t))
    if not out:
        raise ValueError("--layouts: give at least one MxT")
    return out


def run_hybrid(
    config,
    data_dir: str,
    work_dir: str,
    staleness: int,
    workers: int,
    threads: int,
    seed: int,
    global_batch: int,
    delay_s: float = 0.0,
    bandwidth: float = 0.0,
) -> dict:
    """Contestants (a)/(b): ``init_shards`` + ``train`` with K = ``staleness``, ``workers`` NN workers of
    ``threads`` torch threads and per-worker batch ``global_batch // workers``. The model is left in
    ``work_dir/model``. Returns ``{"sps", "max_staleness", "samples", "train_seconds", "wall_seconds",
    "model_dir"}`` (sps: the trainer's own samples/s over its training loop)."""
    from persia_core.embedding.plan import init_shards
    from persia_core.train.launcher import train

    if global_batch % workers:
        raise ValueError(f"global batch {global_batch} is not divisible by {workers} NN workers")
    overrides = {
        "trainer.embedding_staleness": staleness,
        "trainer.num_workers": workers,
        "trainer.threads_per_worker": threads,
        "trainer.batch_size": global_batch // workers,
        "trainer.seed": seed,
    }
    if delay_s or bandwidth:
        overrides.update({"trainer.network_delay_s": delay_s, "trainer.network_bandwidth_bytes_per_s": bandwidth})
    cfg = config.with_overrides(overrides)
    if os.path.exists(work_dir):
        shutil.rmtree(work_dir)
    init_dir, model_dir = os.path.join(work_dir, "init"), os.path.join(work_dir, "model")
    t0 = time.time()
    init_shards(cfg, data_dir, init_dir)
    manifest = train(cfg, data_dir, model_dir, init_dir=init_dir, work_dir=os.path.join(work_dir, "run"))
    with open(os.path.join(model_dir, "train_metrics.json")) as f:
        hist = json.load(f)
    shutil.rmtree(init_dir, ignore_errors=True)
    s = manifest["summary"]
    return {
        "sps": s["samples_per_s"],
        "max_staleness": s["max_staleness"],
        "samples": hist["samples"][-1] if hist.get("samples") else 0,
        "train_seconds": hist.get("train_seconds"),
        "wall_seconds": time.time() - t0,
        "model_dir": model_dir,
    }


def evaluate_hybrid(model_dir: str, data_dir: str, keep: bool = False) -> dict:
    """AUC/logloss/NE of a trained model on the eval split (``persia_core.evaluate.run.evaluate``); deletes
    the model folder afterwards unless ``keep``."""
    from persia_core.evaluate.run import evaluate

    t0 = time.time()
    m = evaluate(model_dir, data_dir)["metrics"]
    if not keep:
        shutil.rmtree(os.path.dirname(model_dir), ignore_errors=True)
    return {"auc": m["auc"], "logloss": m["logloss"], "ne": m["ne"], "eval_seconds": time.time() - t0}


def _mean(values: list) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.fmean(vals) if vals else None


def _ratio(a, b) -> float | None:
    return a / b if a is not None and b else None


def _round(d: dict) -> dict:
    def r(v):
        if isinstance(v, float):
            return round(v, 6) if abs(v) < 10 else round(v, 1)
        if isinstance(v, list):
            return [r(x) for x in v]
        if isinstance(v, dict):
            return {k: r(x) for k, x in v.items()}
        return v

    return {k: r(v) for k, v in d.items()}


def bench_dataset(
    name: str,
    config,
    data_dir: str,
    work: str,
    samples: int,
    global_batch: int,
    seeds: int,
    layouts: list[tuple[int, int]],
    delay_s: float,
    bandwidth: float,
    torchrec_python: str,
    baseline_threads: list[int] | None = None,
    keep: bool = False,
    extra: dict | None = None,
) -> dict:
    """All contestants on one prepared dataset; returns its JSON line as a dict (see module docstring).
    ``samples``: training rows per contestant (the hybrid engine trains on its train split x epochs, which the
    caller made equal to ``samples``)."""
    import gc

    baseline_threads = baseline_threads or [os.cpu_count() or 1]
    from persia_core.bench.baselines import load_indexed, run_plain_torch
    from persia_core.bench.torchrec_contestant import run_torchrec

    load0 = _loadavg()
    res: dict = {"dataset": name, "samples": samples, "global_batch": global_batch, "seeds": seeds, **(extra or {})}
    plain, trec, hyb, syn = [], [], [], []
    by_layout: dict[str, dict[str, float]] = {"hybrid": {}, "sync": {}}
    by_threads: dict[str, dict[str, float]] = {"plain_torch": {}, "torchrec": {}}
    best: dict = {}
    load_at: dict[str, float | None] = {}  # 1-min load average as each first-seed run starts (noise indicator)
    for seed in range(seeds):
        # (c) plain PyTorch, in this process; every thread count on the first seed, the fastest afterwards
        data = load_indexed(data_dir, [s.name for s in config.slots])
        _log(f"{name} seed {seed}: data indexed for (c) in {data.seconds:.1f} s, {sum(data.vocab)} table rows")
        runs = []
        for th in baseline_threads if seed == 0 else [best["plain_torch"]]:
            _log(f"{name} seed {seed}: (c) plain PyTorch, {samples} samples, {th} thread(s)")
            if seed == 0:
                load_at[f"plain_torch_{th}t"] = _loadavg()
            r = run_plain_torch(data, config, samples, seed, global_batch, th, progress=lambda m: _log(f"  (c) {m}"))
            r["threads"] = th
            _log(f"  {r['sps']:.0f} samples/s, AUC {r['auc']:.4f}, logloss {r['logloss']:.4f}")
            if seed == 0:
                by_threads["plain_torch"][str(th)] = r["sps"]
            runs.append(r)
        del data
        gc.collect()
        plain.append(max(runs, key=lambda r: r["sps"]))
        best.setdefault("plain_torch", plain[-1]["threads"])
        # (d) TorchRec, in its own environment; the same choice of threads
        cfg_path = os.path.join(work, f"{name}-config.yaml")
        with open(cfg_path, "w") as f:
            f.write(config.to_yaml())
        runs = []
        for th in baseline_threads if seed == 0 else [best.get("torchrec", baseline_threads[0])]:
            _log(f"{name} seed {seed}: (d) TorchRec, {th} thread(s)")
            if seed == 0:
                load_at[f"torchrec_{th}t"] = _loadavg()
            r = run_torchrec(
                data_dir,
                cfg_path,
                samples,
                seed,
                global_batch,
                th,
                python=torchrec_python,
                log=lambda m: _log(f"  (d) {m}"),
            )
            if r.get("sps") is None:
                _log(f"  could not run: {r.get('error')}")
                runs = [r]
                break
            r["threads"] = th
            _log(f"  {r['sps']:.0f} samples/s, AUC {r['auc']:.4f}, logloss {r['logloss']:.4f}")
            if seed == 0:
                by_threads["torchrec"][str(th)] = r["sps"]
            runs.append(r)
        trec.append(max(runs, key=lambda r: r["sps"] or 0.0))
        if trec[-1].get("threads"):
            best.setdefault("torchrec", trec[-1]["threads"])
        # (a) and (b): every layout on the first seed, the fastest afterwards
        for mode, k, out in (("hybrid", 4, hyb), ("sync", 0, syn)):
            runs = []
            for m, t in layouts if seed == 0 else [best[mode]]:
                _log(f"{name} seed {seed}: ({'a' if k else 'b'}) {mode} K={k}, {m} NN worker(s) x {t} thread(s)")
                if seed == 0:
                    load_at[f"{mode}_{m}x{t}"] = _loadavg()
                r = run_hybrid(
                    config, data_dir, os.path.join(work, f"{name}-{mode}-{m}x{t}-s{seed}"), k, m, t, seed, global_batch
                )
                r["layout"] = f"{m}x{t}"
                _log(
                    f"  {r['sps']:.0f} samples/s ({r['samples']} samples, max staleness {r['max_staleness']}, "
                    f"{r['wall_seconds']:.0f} s with start-up)"
                )
                if seed == 0:
                    by_layout[mode][r["layout"]] = r["sps"]
                runs.append((r, (m, t)))
            chosen, lay = max(runs, key=lambda x: x[0]["sps"])
            for r, _ in runs:
                if r is not chosen and not keep:
                    shutil.rmtree(os.path.dirname(r["model_dir"]), ignore_errors=True)
            best.setdefault(mode, lay)
            chosen.update(evaluate_hybrid(chosen["model_dir"], data_dir, keep))
            _log(
                f"{name} seed {seed}: {mode} AUC {chosen['auc']:.4f}, logloss {chosen['logloss']:.4f} "
                f"(layout {chosen['layout']})"
            )
            out.append(chosen)
    # (a) and (b) with the injected network cost, first seed's best layouts, samples/s only
    delay = {}
    if delay_s or bandwidth:
        for mode, k in (("hybrid", 4), ("sync", 0)):
            m, t = best[mode]
            load_at[f"{mode}_delay"] = _loadavg()
            _log(
                f"{name}: {mode} K={k} with injected delay {delay_s * 1e3:.1f} ms/call"
                + (f", bandwidth {bandwidth:.3g} B/s" if bandwidth else "")
                + f", layout {m}x{t}"
            )
            r = run_hybrid(
                config,
                data_dir,
                os.path.join(work, f"{name}-{mode}-delay"),
                k,
                m,
                t,
                0,
                global_batch,
                delay_s,
                bandwidth,
            )
            if not keep:
                shutil.rmtree(os.path.dirname(r["model_dir"]), ignore_errors=True)
            _log(f"  {r['sps']:.0f} samples/s (max staleness {r['max_staleness']})")
            delay[mode] = r
    p0, t0, h0, s0 = plain[0], trec[0], hyb[0], syn[0]
    res.update(
        {
            "hybrid_sps": h0["sps"],
            "sync_sps": s0["sps"],
            "plain_torch_sps": p0["sps"],
            "torchrec_sps": t0.get("sps"),
            "hybrid_auc": _mean([r["auc"] for r in hyb]),
            "sync_auc": _mean([r["auc"] for r in syn]),
            "plain_torch_auc": _mean([r["auc"] for r in plain]),
            "torchrec_auc": _mean([r.get("auc") for r in trec]),
            "hybrid_logloss": _mean([r["logloss"] for r in hyb]),
            "sync_logloss": _mean([r["logloss"] for r in syn]),
            "plain_torch_logloss": _mean([r["logloss"] for r in plain]),
            "torchrec_logloss": _mean([r.get("logloss") for r in trec]),
            "max_staleness": h0["max_staleness"],
            "sync_max_staleness": s0["max_staleness"],
            "hybrid_delay_sps": delay["hybrid"]["sps"] if delay else None,
            "sync_delay_sps": delay["sync"]["sps"] if delay else None,
            "delay_max_staleness": delay["hybrid"]["max_staleness"] if delay else None,
            "network_delay_s": delay_s,
            "network_bandwidth_bytes_per_s": bandwidth,
        }
    )
    if t0.get("sps") is None:
        res["torchrec_error"] = t0.get("error", "unknown")
    res.update(
        {
            "hybrid_vs_plain_torch": _ratio(res["hybrid_sps"], res["plain_torch_sps"]),
            "sync_vs_plain_torch": _ratio(res["sync_sps"], res["plain_torch_sps"]),
            "torchrec_vs_plain_torch": _ratio(res["torchrec_sps"], res["plain_torch_sps"]),
            "hybrid_vs_torchrec": _ratio(res["hybrid_sps"], res["torchrec_sps"]),
            "hybrid_vs_sync": _ratio(res["hybrid_sps"], res["sync_sps"]),
            "hybrid_delay_vs_sync_delay": _ratio(res["hybrid_delay_sps"], res["sync_delay_sps"]),
            "hybrid_minus_sync_auc": (res["hybrid_auc"] - res["sync_auc"])
            if res["hybrid_auc"] is not None and res["sync_auc"] is not None
            else None,
            "hybrid_layout": h0["layout"],
            "sync_layout": s0["layout"],
            "hybrid_sps_by_layout": by_layout["hybrid"],
            "sync_sps_by_layout": by_layout["sync"],
            "plain_torch_threads": p0.get("threads"),
            "torchrec_threads": t0.get("threads"),
            "plain_torch_sps_by_threads": by_threads["plain_torch"],
            "torchrec_sps_by_threads": by_threads["torchrec"],
            "hybrid_aucs": [r["auc"] for r in hyb],
            "sync_aucs": [r["auc"] for r in syn],
            "plain_torch_aucs": [r["auc"] for r in plain],
            "torchrec_aucs": [r.get("auc") for r in trec],
            "hybrid_train_wall_s": h0["wall_seconds"],
            "plain_torch_train_s": p0["train_seconds"],
            "plain_torch_table_rows": p0.get("table_rows"),
            "loadavg_start": load0,
            "loadavg_end": _loadavg(),
            "loadavg_by_run": load_at,
            "cpus": os.cpu_count(),
        }
    )
    return _round(res)


def prepare_movielens(data: str, out_dir: str):
    """Preprocess the bundled MovieLens with the shipped config into ``out_dir`` (reused when it is there).
    Returns (config, schema)."""
    from persia_core.config import load_config
    from persia_core.data.reader import read_schema
    from persia_core.preprocess.pipeline import run_preprocess

    config = load_config("movielens")
    if os.path.exists(os.path.join(out_dir, "schema.json")):
        return config, read_schema(out_dir)
    _log(f"movielens: preprocessing {data} -> {out_dir}")
    return config, run_preprocess(config, data, out_dir)


def prepare_criteo(out_dir: str, samples: int, eval_rows: int, vocab: int):
    """Write the Criteo-shaped set (``samples`` train rows) into ``out_dir`` unless it is already there.
    Returns its schema."""
    from persia_core.bench.criteo_synth import write_criteo_synth
    from persia_core.data.reader import read_schema

    if os.path.exists(os.path.join(out_dir, "schema.json")):
        return read_schema(out_dir)
    _log(f"criteo_synth: writing {samples} train + {eval_rows} eval rows -> {out_dir}")
    schema = write_criteo_synth(out_dir, samples, eval_rows, vocab=vocab)
    _log(
        f"criteo_synth: written in {schema['synthetic']['seconds']:.0f} s, planted AUC "
        f"{schema['synthetic']['planted_auc']:.4f}"
    )
    return schema


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--samples",
        type=int,
        default=int(os.environ.get("BENCH_SAMPLES") or DEFAULT_SAMPLES),
        help="training samples per contestant on the Criteo-shaped set (env BENCH_SAMPLES)",
    )
    p.add_argument(
        "--seeds",
        type=int,
        default=int(os.environ.get("BENCH_SEEDS") or 3),
        help="seeds; AUC is the mean over them, samples/s from the first (env BENCH_SEEDS)",
    )
    p.add_argument("--datasets", default="movielens,criteo", help="comma-separated: movielens, criteo")
    p.add_argument(
        "--layouts",
        default=os.environ.get("BENCH_LAYOUTS", "1x1,1x2,2x1"),
        help="NN-worker layouts MxT tried for (a) and (b): M workers x T torch threads (env BENCH_LAYOUTS)",
    )
    p.add_argument(
        "--baseline-threads",
        default=os.environ.get("BENCH_BASELINE_THREADS", "1,2"),
        help="torch threads tried for (c) and (d) on the first seed, fastest kept (env BENCH_BASELINE_THREADS)",
    )
    p.add_argument(
        "--delay",
        type=float,
        default=float(os.environ.get("BENCH_DELAY_S") or 0.002),
        help="injected seconds per parameter-server call (env BENCH_DELAY_S; 0 and no bandwidth: skip)",
    )
    p.add_argument(
        "--bandwidth",
        type=float,
        default=float(os.environ.get("BENCH_BANDWIDTH") or 0.0),
        help="injected bandwidth cap of parameter-server calls, bytes/s (env BENCH_BANDWIDTH; 0: none)",
    )
    p.add_argument("--batch-size", type=int, default=4096, help="global batch on the Criteo-shaped set")
    p.add_argument("--eval-rows", type=int, default=1_000_000, help="eval rows of the Criteo-shaped set")
    p.add_argument("--vocab", type=int, default=100_000, help="IDs per slot of the Criteo-shaped set")
    p.add_argument("--movielens-data", default="data/movielens")
    p.add_argument("--work", default="", help="working folder (datasets are reused from it); default: temporary")
    p.add_argument(
        "--torchrec-python",
        default="",
        help="python of the TorchRec environment (default: $TORCHREC_PYTHON or .venv-torchrec/bin/python)",
    )
    p.add_argument("--out", default="", help="also write the JSON lines to this file")
    p.add_argument("--keep", action="store_true", help="keep the trained models")
    args = p.parse_args(argv)
    from persia_core.config import RunConfig

    if args.samples < 1 or args.seeds < 1:
        raise ValueError("--samples and --seeds must be >= 1")
    datasets = [d for d in args.datasets.split(",") if d]
    unknown = [d for d in datasets if d not in ("movielens", "criteo")]
    if unknown:
        raise ValueError(f"--datasets: unknown {unknown} (known: movielens, criteo)")
    layouts = parse_layouts(args.layouts)
    try:
        baseline_threads = [int(v) for v in args.baseline_threads.split(",") if v.strip()]
    except ValueError:
        raise ValueError(
            f"--baseline-threads: expected comma-separated integers, got {args.baseline_threads!r}"
        ) from None
    if not baseline_threads or min(baseline_threads) < 1:
        raise ValueError("--baseline-threads: give at least one thread count >= 1")
    work = args.work or tempfile.mkdtemp(prefix="bench-hybrid-")
    os.makedirs(work, exist_ok=True)
    _log(
        f"work folder {work}; {args.samples} samples, {args.seeds} seed(s), layouts {args.layouts}, "
        f"{os.cpu_count()} CPUs, load {_loadavg()}"
    )
    lines = []
    common = dict(
        seeds=args.seeds,
        layouts=layouts,
        delay_s=args.delay,
        bandwidth=args.bandwidth,
        torchrec_python=args.torchrec_python,
        baseline_threads=baseline_threads,
        keep=args.keep,
    )
    for name in sorted(datasets, key=lambda d: d != "movielens"):  # MovieLens first, the Criteo-shaped set last
        if name == "movielens":
            data_dir = os.path.join(work, "movielens")
            config, schema = prepare_movielens(args.movielens_data, data_dir)
            tc = config.trainer
            samples = int(schema["rows"]["train"]) * tc.epochs
            line = bench_dataset(
                "movielens",
                config,
                data_dir,
                work,
                samples,
                tc.batch_size * tc.num_workers,
                extra={"train_rows": schema["rows"]["train"], "eval_rows": schema["rows"]["eval"]},
                **common,
            )
        else:
            from persia_core.bench.criteo_synth import criteo_config_dict

            data_dir = os.path.join(work, f"criteo_synth-{args.samples}-{args.eval_rows}-{args.vocab}")
            schema = prepare_criteo(data_dir, args.samples, args.eval_rows, args.vocab)
            config = RunConfig.from_dict(criteo_config_dict(args.batch_size))
            line = bench_dataset(
                "criteo_synth",
                config,
                data_dir,
                work,
                args.samples,
                args.batch_size,
                extra={
                    "train_rows": args.samples,
                    "eval_rows": args.eval_rows,
                    "vocab_per_slot": args.vocab,
                    "planted_auc": schema["synthetic"]["planted_auc"],
                },
                **common,
            )
        lines.append(json.dumps(line))
        _log(f"{name} done")
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)
    for line in lines:
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
