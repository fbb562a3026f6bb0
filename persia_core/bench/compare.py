"""``make bench``'s comparison on one prepared dataset: every contestant, its best layout or thread count, and
the figures of one JSON line (see ``persia_core.bench.hybrid``); with the progress lines they all print."""

from __future__ import annotations

import os
import shutil
import statistics
import time

from persia_core.bench.engine_runs import evaluate_hybrid, run_hybrid


def log(msg: str) -> None:
    """Print a progress line ``[bench HH:MM:SS] msg`` at once."""
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def loadavg() -> float | None:
    """The 1-minute load average (how busy the shared machine is), or None where the system has none."""
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


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

    load0 = loadavg()
    res: dict = {"dataset": name, "samples": samples, "global_batch": global_batch, "seeds": seeds, **(extra or {})}
    plain: list[dict] = []
    trec: list[dict] = []
    hyb: list[dict] = []
    syn: list[dict] = []
    by_layout: dict[str, dict[str, float]] = {"hybrid": {}, "sync": {}}
    by_threads: dict[str, dict[str, float]] = {"plain_torch": {}, "torchrec": {}}
    best: dict = {}
    load_at: dict[str, float | None] = {}  # 1-min load average as each first-seed run starts (noise indicator)
    for seed in range(seeds):
        # (c) plain PyTorch, in this process; every thread count on the first seed, the fastest afterwards
        data = load_indexed(data_dir, [s.name for s in config.slots])
        log(f"{name} seed {seed}: data indexed for (c) in {data.seconds:.1f} s, {sum(data.vocab)} table rows")
        runs = []
        for th in baseline_threads if seed == 0 else [best["plain_torch"]]:
            log(f"{name} seed {seed}: (c) plain PyTorch, {samples} samples, {th} thread(s)")
            if seed == 0:
                load_at[f"plain_torch_{th}t"] = loadavg()
            r = run_plain_torch(data, config, samples, seed, global_batch, th, progress=lambda m: log(f"  (c) {m}"))
            r["threads"] = th
            log(f"  {r['sps']:.0f} samples/s, AUC {r['auc']:.4f}, logloss {r['logloss']:.4f}")
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
            log(f"{name} seed {seed}: (d) TorchRec, {th} thread(s)")
            if seed == 0:
                load_at[f"torchrec_{th}t"] = loadavg()
            r = run_torchrec(
                data_dir,
                cfg_path,
                samples,
                seed,
                global_batch,
                th,
                python=torchrec_python,
                log=lambda m: log(f"  (d) {m}"),
            )
            if r.get("sps") is None:
                log(f"  could not run: {r.get('error')}")
                runs = [r]
                break
            r["threads"] = th
            log(f"  {r['sps']:.0f} samples/s, AUC {r['auc']:.4f}, logloss {r['logloss']:.4f}")
            if seed == 0:
                by_threads["torchrec"][str(th)] = r["sps"]
            runs.append(r)
        trec.append(max(runs, key=lambda r: r["sps"] or 0.0))
        if trec[-1].get("threads"):
            best.setdefault("torchrec", trec[-1]["threads"])
        # (a) and (b): every layout on the first seed, the fastest afterwards
        for mode, k, out in (("hybrid", 4, hyb), ("sync", 0, syn)):
            tried: list[tuple[dict, tuple[int, int]]] = []
            for m, t in layouts if seed == 0 else [best[mode]]:
                log(f"{name} seed {seed}: ({'a' if k else 'b'}) {mode} K={k}, {m} NN worker(s) x {t} thread(s)")
                if seed == 0:
                    load_at[f"{mode}_{m}x{t}"] = loadavg()
                r = run_hybrid(
                    config, data_dir, os.path.join(work, f"{name}-{mode}-{m}x{t}-s{seed}"), k, m, t, seed, global_batch
                )
                r["layout"] = f"{m}x{t}"
                log(
                    f"  {r['sps']:.0f} samples/s ({r['samples']} samples, max staleness {r['max_staleness']}, "
                    f"{r['wall_seconds']:.0f} s with start-up)"
                )
                if seed == 0:
                    by_layout[mode][r["layout"]] = r["sps"]
                tried.append((r, (m, t)))
            chosen, lay = max(tried, key=lambda x: x[0]["sps"])
            for r, _ in tried:
                if r is not chosen and not keep:
                    shutil.rmtree(os.path.dirname(r["model_dir"]), ignore_errors=True)
            best.setdefault(mode, lay)
            chosen.update(evaluate_hybrid(chosen["model_dir"], data_dir, keep))
            log(
                f"{name} seed {seed}: {mode} AUC {chosen['auc']:.4f}, logloss {chosen['logloss']:.4f} "
                f"(layout {chosen['layout']})"
            )
            out.append(chosen)
    # (a) and (b) with the injected network cost, first seed's best layouts, samples/s only
    delay = {}
    if delay_s or bandwidth:
        for mode, k in (("hybrid", 4), ("sync", 0)):
            m, t = best[mode]
            load_at[f"{mode}_delay"] = loadavg()
            log(
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
            log(f"  {r['sps']:.0f} samples/s (max staleness {r['max_staleness']})")
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
            "loadavg_end": loadavg(),
            "loadavg_by_run": load_at,
            "cpus": os.cpu_count(),
        }
    )
    return _round(res)
