"""``make bench-staleness``: eval AUC of each dense model through the hybrid engine at K = 4 against K = 0.

The setting of ``make bench``'s Criteo-shaped dataset (``persia_core.bench.criteo_synth``: 1,800,000 train rows
unless ``--samples``/``BENCH_SAMPLES``, 1,000,000 eval rows, its config of dim 16, 2 parameter-server shards, one
epoch, global batch 4,096 over 2 NN workers), with ``model.kind`` set to each of ``--models`` (default ``dcnv2``
and ``deepfm``; ``dlrm`` is ``make bench``'s own). Each model trains with K = ``--staleness`` (default 4) and with
K = 0 (fully synchronous) for every seed, through ``init_shards`` + ``train`` as the pipeline does, and is
evaluated on the same eval split.

Prints progress lines, then one JSON line per model: ``model``, ``samples``, ``seeds``, ``staleness``,
``auc_stale`` and ``auc_sync`` (means over seeds), their population std, ``auc_gap`` (K = 0 minus K = K, mean),
``auc_gap_per_seed``, ``logloss_stale``, ``logloss_sync`` and the trainer's samples/s of each (first seed).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile

from persia_core.bench.compare import loadavg, log


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="dcnv2,deepfm", help="comma-separated model.kind values")
    p.add_argument("--samples", type=int, default=int(os.environ.get("BENCH_SAMPLES") or 1_800_000))
    p.add_argument("--seeds", type=int, default=int(os.environ.get("BENCH_SEEDS") or 3))
    p.add_argument("--staleness", type=int, default=4, help="K of the asynchronous runs")
    p.add_argument("--batch-size", type=int, default=4096, help="global batch")
    p.add_argument("--workers", type=int, default=2, help="NN workers")
    p.add_argument("--eval-rows", type=int, default=1_000_000)
    p.add_argument("--work", default="", help="working folder (the dataset is reused from it); default: temporary")
    p.add_argument("--out", default="", help="also append the JSON lines to this file")
    args = p.parse_args(argv)
    if args.samples < 1 or args.seeds < 1 or args.staleness < 1:
        p.error("--samples, --seeds and --staleness must be >= 1")
    from persia_core.bench.criteo_synth import criteo_config_dict
    from persia_core.bench.engine_runs import evaluate_hybrid, run_hybrid
    from persia_core.bench.hybrid import prepare_criteo
    from persia_core.config import RunConfig

    work = args.work or tempfile.mkdtemp(prefix="bench-staleness-")
    data = os.path.join(work, f"criteo-{args.samples}")
    schema = prepare_criteo(data, args.samples, args.eval_rows, 100_000)
    for kind in [m for m in args.models.split(",") if m]:
        d = criteo_config_dict()
        d["model"]["kind"] = kind
        config = RunConfig.from_dict(d)
        runs: dict[int, list[dict]] = {args.staleness: [], 0: []}
        for seed in range(args.seeds):
            for k in runs:
                r = run_hybrid(config, data, os.path.join(work, "run"), k, args.workers, 1, seed, args.batch_size)
                r.update(evaluate_hybrid(r["model_dir"], data))
                runs[k].append(r)
                log(f"{kind} seed {seed} K={k}: AUC {r['auc']:.5f} logloss {r['logloss']:.5f}, {r['sps']:.0f} sps")
        stale, sync = runs[args.staleness], runs[0]
        gaps = [b["auc"] - a["auc"] for a, b in zip(stale, sync, strict=True)]
        line = {
            "model": kind,
            "samples": args.samples,
            "seeds": args.seeds,
            "staleness": args.staleness,
            "auc_stale": round(statistics.mean(r["auc"] for r in stale), 5),
            "auc_sync": round(statistics.mean(r["auc"] for r in sync), 5),
            "auc_stale_std": round(statistics.pstdev(r["auc"] for r in stale), 5),
            "auc_sync_std": round(statistics.pstdev(r["auc"] for r in sync), 5),
            "auc_gap": round(statistics.mean(gaps), 5),
            "auc_gap_per_seed": [round(g, 5) for g in gaps],
            "logloss_stale": round(statistics.mean(r["logloss"] for r in stale), 5),
            "logloss_sync": round(statistics.mean(r["logloss"] for r in sync), 5),
            "sps_stale": round(stale[0]["sps"]),
            "sps_sync": round(sync[0]["sps"]),
            "planted_auc": schema.get("synthetic", {}).get("planted_auc"),
            "loadavg": loadavg(),
        }
        text = json.dumps(line)
        print(text, flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(text + "\n")
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
