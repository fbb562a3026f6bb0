"""Run the compiled-equivalent pipeline locally with ``kfp.local.SubprocessRunner`` (no cloud account needed).

Each task runs in this interpreter's environment, where the project is installed. Prints where the outputs
are and, as its last line, ``eval: AUC=... logloss=... NE=...``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Run the persia-kfp pipeline with kfp.local on this machine.")
    p.add_argument("--data", default="data/movielens", help="raw data: folder, file or glob")
    p.add_argument("--config", default="movielens", help="run config: shipped name or YAML path")
    p.add_argument("--pipeline-root", default="local_outputs", help="where kfp.local writes artifacts")
    p.add_argument("--parameter-servers", type=int, default=2, help="embedding parameter servers (0 = config's)")
    p.add_argument("--nn-workers", type=int, default=2, help="NN workers / DDP ranks (0 = config's)")
    p.add_argument("--staleness", type=int, default=-1, help="embedding staleness K (-1 = config's)")
    p.add_argument("--epochs", type=int, default=0, help="epochs (0 = config's)")
    p.add_argument("--max-rows", type=int, default=0, help="read only this many examples (0 = all)")
    p.add_argument("--blessed-dir", default="local_outputs/blessed",
                   help="the latest blessed model's location, written by the gate")
    p.add_argument("--warm-start-from", default="",
                   help="start from a previous model, checkpoint or blessed-model location (empty = cold start)")
    p.add_argument("--min-auc", type=float, default=0.5, help="the gate blesses only a model with this eval AUC")
    args = p.parse_args(argv)

    from kfp import local

    from persia_core.evaluate.gate import latest_blessed_model
    from pipelines.persia_pipeline import persia_pipeline

    def absolute(path: str) -> str:
        return path if not path or "://" in path else os.path.abspath(path)

    data = absolute(args.data)
    config = args.config
    if config.endswith((".yaml", ".yml")) and "://" not in config:
        config = os.path.abspath(config)
    root = os.path.abspath(args.pipeline_root)
    local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=root, raise_on_error=True)
    t0 = time.time()
    result = persia_pipeline(data=data, config=config, num_parameter_servers=args.parameter_servers,
                             num_nn_workers=args.nn_workers, embedding_staleness=args.staleness,
                             epochs=args.epochs, max_rows=args.max_rows,
                             blessed_dir=absolute(args.blessed_dir), warm_start_from=absolute(args.warm_start_from),
                             min_auc=args.min_auc)
    metrics = json.loads(result.output)
    print(f"pipeline finished in {time.time() - t0:.1f} s; outputs under {root}")
    reports = sorted(
        (os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs if d.endswith("report") or f == "report"),
        key=os.path.getmtime,
    )
    if reports:
        run_dir = os.path.dirname(os.path.dirname(reports[-1]))
        html = os.path.join(run_dir, "report.html")
        shutil.copyfile(reports[-1], html)
        print(f"report: {html}")
    marker = os.path.join(absolute(args.blessed_dir), "BLESSED.json")
    if os.path.exists(marker) and os.path.getmtime(marker) >= t0:
        print(f"gate: blessed; latest blessed model: {latest_blessed_model(absolute(args.blessed_dir))}")
    else:
        print(f"gate: not blessed (the latest blessed model under {args.blessed_dir} stays)")

    def fmt(v):
        return "undefined" if v is None else f"{v:.4f}"

    print(f"eval: AUC={fmt(metrics['auc'])} logloss={fmt(metrics['logloss'])} NE={fmt(metrics['ne'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
