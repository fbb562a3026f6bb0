"""``persia evaluate`` and ``predict``: a Model's metrics, report and gate on the eval split; scores of rows."""

from __future__ import annotations

import json

from persia_core import io
from persia_core.argchecks import check_output_file, float_in, int_at_least
from persia_core.cli.common import EXIT_OK, AddCommand, print_json
from persia_core.evaluate import decision as G
from persia_core.model_store import read_marker


def cmd_evaluate(args, _extra) -> int:
    from persia_core.evaluate.gate import bless, evaluate_gate
    from persia_core.evaluate.report import write_report
    from persia_core.evaluate.run import evaluate

    # flag combinations and outputs first: the evaluation may take long
    if args.bless and not args.blessed_dir:
        raise ValueError("--bless needs --blessed-dir (the latest-blessed-model location to copy the model to)")
    check_output_file("--report", args.report)
    check_output_file("--metrics-json", args.metrics_json)
    read_marker(args.blessed_dir)  # an unreadable BLESSED.json: refused now, naming it
    r = evaluate(args.model, args.data, batch_size=args.batch_size, user_slot=args.user_slot)
    m = r["metrics"]
    decision, _ = evaluate_gate(
        m,
        args.blessed_dir,
        args.data,
        args.min_auc,
        args.max_auc_drop,
        args.max_logloss_increase,
        args.max_ne,
        args.batch_size,
        args.lr_margin,
    )  # blessed model, same rows
    write_report(
        args.report,
        m,
        r["labels"],
        r["preds"],
        r["train_history"],
        r["config"],
        {"model": args.model, "dataset": args.data, "blessed_dir": args.blessed_dir or "(none)"},
        user_split=r["user_split"],
        coverage=r["coverage"],
        gate=decision,
    )
    out = {
        "metrics": m,
        "user_split": r["user_split"],
        "coverage": r["coverage"],
        "report": args.report,
        "gate": {"decision": decision["decision"], "reasons": decision["reasons"], "baseline": decision["baseline"]},
    }
    if args.bless:
        if decision["bless"]:
            marker = bless(r["model_dir"], m, args.blessed_dir, decision)  # a blessed location: the model scored
            out["blessed_model"] = io.join(args.blessed_dir, marker["model"])
    if args.metrics_json:
        io.write_text(args.metrics_json, json.dumps(out, indent=1, default=str) + "\n")
    print_json(out)
    return EXIT_OK


def cmd_predict(args, _extra) -> int:
    from persia_core.evaluate.predict import predict

    r = predict(
        args.model,
        args.input,
        args.output,
        config=args.config,
        batch_size=args.batch_size,
        dead_letter=args.dead_letter,
    )
    print_json({"output": r["output"], "rows": r["rows"], "malformed": r["malformed"]})
    return EXIT_OK


def add_commands(add: AddCommand) -> None:
    """Add the parsers of ``evaluate`` and ``predict``."""
    sp = add(
        "evaluate",
        "Evaluate a Model on the eval split: metrics, seen/unseen users, coverage, HTML report, model gate.",
        cmd_evaluate,
    )
    sp.add_argument("--model", required=True, help="Model folder (from train), or a blessed-model location")
    sp.add_argument("--data", required=True, help="preprocess output folder (its eval split is scored)")
    sp.add_argument("--report", default="report.html", help="HTML report to write (default report.html)")
    sp.add_argument("--metrics-json", default="", help="also write the results as JSON to this file")
    sp.add_argument(
        "--user-slot",
        default="user",
        help="slot that names the user, for GAUC and the "
        "seen/unseen-user split (default user, skipped when the "
        "model has no such slot; '' skips it; another name that "
        "is not a slot of the model is refused)",
    )
    sp.add_argument("--batch-size", type=int_at_least(1), default=4096, help="rows scored per batch (default 4096)")
    sp.add_argument(
        "--blessed-dir",
        default="",
        help="latest-blessed-model location to compare with (local or gs://); empty: only --min-auc applies",
    )
    sp.add_argument(
        "--min-auc",
        type=float_in(0.0, 1.0),
        default=G.DEFAULT_MIN_AUC,
        help=f"gate: AUC needed at least (default {G.DEFAULT_MIN_AUC})",
    )
    sp.add_argument(
        "--max-auc-drop",
        type=float_in(0.0),
        default=G.DEFAULT_MAX_AUC_DROP,
        help=f"gate: allowed AUC drop below the blessed model's (default {G.DEFAULT_MAX_AUC_DROP})",
    )
    sp.add_argument(
        "--max-logloss-increase",
        type=float_in(0.0),
        default=G.DEFAULT_MAX_LOGLOSS_INCREASE,
        help="gate: allowed logloss increase over the blessed model's, in nats "
        f"(default {G.DEFAULT_MAX_LOGLOSS_INCREASE})",
    )
    sp.add_argument(
        "--max-ne",
        type=float_in(1e-9),
        default=G.DEFAULT_MAX_NE,
        help="gate: normalized entropy the model must stay below, baseline or not (default "
        f"{G.DEFAULT_MAX_NE:g}: better than predicting the base rate)",
    )
    sp.add_argument(
        "--lr-margin",
        type=float_in(0.0),
        default=G.DEFAULT_LR_MARGIN,
        help="gate: how far below the LR reference's AUC (hashed logistic regression on the same slots and train "
        f"split) the model's AUC may be (default {G.DEFAULT_LR_MARGIN:g}: not below; 1: reported, not enforced)",
    )
    sp.add_argument("--bless", action="store_true", help="copy the model to --blessed-dir when the gate blesses it")

    sp = add(
        "predict",
        "Score rows with a Model: a Parquet file/folder of preprocessed rows, or a file of raw "
        "rows of the layout; writes source,probability[,label] as CSV or Parquet.",
        cmd_predict,
    )
    sp.add_argument("--model", required=True, help="Model folder (from train), or a blessed-model location")
    sp.add_argument("--input", required=True, help=".parquet file or folder of preprocessed rows, or a raw file")
    sp.add_argument("--output", required=True, help="predictions file: .parquet for Parquet, else CSV")
    sp.add_argument("--config", default=None, help="run config whose layout parses raw rows (default: the model's own)")
    sp.add_argument("--batch-size", type=int_at_least(1), default=4096, help="rows scored per batch (default 4096)")
    sp.add_argument(
        "--dead-letter",
        default="",
        help="JSON-lines file for raw rows that do not parse: they are "
        "counted and set aside, the rest scored (default: the first "
        "one stops the run, naming file:line)",
    )
