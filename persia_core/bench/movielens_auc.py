"""``make bench-auc``: evaluation AUC on the bundled MovieLens split, mean over seeds, against the LR floor.

The floor (issue "End-to-end"): the AUC that hashed logistic regression on user, movie, year, genres, tags and
user x genre reaches on this exact time split (``floor_auc`` in the output). This runs the same library
calls as the pipeline (preprocess, init_shards, train with 2 parameter servers and 2 NN workers, evaluate) for
each seed, for two feature sets:

- ``shipped``: ``persia_core/configs/movielens.yaml`` as shipped (adds the user's earlier movies as slots and two
  dense history features, all strictly before the rating's timestamp);
- ``floor_features``: the floor's slots only (history off), the same model and trainer.

Prints one line per run and, last, one JSON object with the means.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", default="data/movielens")
    p.add_argument("--seeds", type=int, default=int(os.environ.get("BENCH_SEEDS", 3)))
    args = p.parse_args(argv)
    from persia_core.config import load_config
    from persia_core.embedding.plan import init_shards
    from persia_core.evaluate.run import evaluate
    from persia_core.preprocess.pipeline import run_preprocess
    from persia_core.train.launcher import train

    work = tempfile.mkdtemp(prefix="bench-auc-")
    shipped = load_config("movielens")
    floor = shipped.with_overrides(
        {
            "layout.history_length": 0,
            "slots": [s for s in shipped.to_dict()["slots"] if s["name"] not in ("history", "liked_history")],
        }
    )
    out: dict[str, Any] = {}
    for name, cfg in (("shipped", shipped), ("floor_features", floor)):
        data = os.path.join(work, name, "data")
        run_preprocess(cfg, args.data, data)
        aucs, lls = [], []
        for seed in range(args.seeds):
            c = cfg.with_overrides({"trainer.seed": seed})
            d = os.path.join(work, name, f"seed{seed}")
            init_shards(c, data, os.path.join(d, "init"))
            t0 = time.time()
            train(c, data, os.path.join(d, "model"), init_dir=os.path.join(d, "init"), work_dir=os.path.join(d, "w"))
            m = evaluate(os.path.join(d, "model"), data, lr_reference=False)["metrics"]
            aucs.append(m["auc"])
            lls.append(m["logloss"])
            print(
                f"{name} seed {seed}: AUC={m['auc']:.4f} logloss={m['logloss']:.4f} NE={m['ne']:.4f} "
                f"({time.time() - t0:.1f} s train+eval)",
                flush=True,
            )
        out[name] = {
            "auc_mean": statistics.mean(aucs),
            "auc_std": statistics.pstdev(aucs),
            "logloss_mean": statistics.mean(lls),
            "aucs": aucs,
        }
    out["floor_auc"] = 0.685
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
