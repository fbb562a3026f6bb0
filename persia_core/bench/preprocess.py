"""``make bench-preprocess``: the Beam preprocess of the bundled MovieLens set (105,339 ratings) on the local runner.

Runs ``run_preprocess`` with the shipped ``movielens`` config ``--repeats`` times into a temporary folder and
reports the wall seconds of each run and the rows written. The target (issue "End-to-end"): every rating written
in under a minute on a 2-core machine. Prints one line per run, then one JSON object as the last line.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time

from persia_core.argchecks import int_at_least


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="persia_core.bench.preprocess", description=__doc__.split("\n")[0])
    p.add_argument("--data", default="data/movielens", help="MovieLens folder (default: the bundled one)")
    p.add_argument("--config", default="movielens", help="shipped config name or YAML path")
    p.add_argument("--repeats", type=int_at_least(1), default=2, help="runs (the first includes Beam's warm-up)")
    args = p.parse_args(argv)
    from persia_core.config import load_config
    from persia_core.preprocess.pipeline import run_preprocess

    config = load_config(args.config)
    seconds, rows = [], None
    for i in range(args.repeats):
        out = tempfile.mkdtemp(prefix="bench-preprocess-")
        try:
            t0 = time.perf_counter()
            result = run_preprocess(config, args.data, out)
            seconds.append(time.perf_counter() - t0)
        finally:
            shutil.rmtree(out, ignore_errors=True)
        rows = result["rows"]
        print(
            f"run {i + 1}: {rows['read']} rows read, {rows['train']} train, {rows['eval']} eval in {seconds[-1]:.1f} s"
        )
    print(
        json.dumps(
            {
                "dataset": args.data,
                "rows": rows,
                "seconds": [round(s, 2) for s in seconds],
                "median_seconds": round(statistics.median(seconds), 2),
                "rows_per_s": round(rows["read"] / statistics.median(seconds), 1) if rows else None,
                "under_a_minute": max(seconds) < 60,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
