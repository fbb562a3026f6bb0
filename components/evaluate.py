"""Component 4: evaluate the model on the evaluation split: metrics, ROC curve and an HTML report."""

from kfp import dsl
from kfp.dsl import HTML, ClassificationMetrics, Dataset, Input, Metrics, Model, Output

from components import BASE_IMAGE


@dsl.component(base_image=BASE_IMAGE, install_kfp_package=False)
def evaluate(
    dataset: Input[Dataset],
    model: Input[Model],
    metrics: Output[Metrics],
    roc: Output[ClassificationMetrics],
    report: Output[HTML],
    min_auc: float,
    max_auc_drop: float,
    max_logloss_increase: float,
    max_ne: float,
    lr_margin: float,
    user_slot: str = "user",
    blessed_dir: str = "",
) -> str:
    """AUC (sklearn), GAUC over ``user_slot``, logloss, normalized entropy and calibration on the eval split
    (read-only lookups), also split by whether the row's user was seen in training, and per-slot coverage.
    Logs the scalars as ``metrics`` (``seen_user_auc``, ``unseen_share_<slot>``, ...), the ROC curve as
    ``roc``, and writes the HTML ``report``, whose "Model gate" section shows what the ``gate`` component will
    decide with the same thresholds against the latest blessed model in ``blessed_dir`` (empty: threshold
    only). The latest blessed model is re-scored on the same evaluation rows, and its metrics travel with the
    new ones (key ``baseline_on_this_eval_data``) so that the gate compares the two models on the same data.
    The thresholds are those of ``gate`` (no defaults here: the pipeline's come from
    ``persia_core.evaluate.gate``'s ``DEFAULT_*``). Returns the overall metrics as a JSON string (the input of
    the ``gate`` component)."""
    from persia_core.train.processes import die_with_local_runner

    die_with_local_runner()  # a task of run_local ends with it, even a SIGKILLed one, not running on orphaned

    import json

    from persia_core.evaluate.gate import evaluate_gate
    from persia_core.evaluate.report import write_report
    from persia_core.evaluate.run import evaluate as run
    from persia_core.evaluate.run import flat_metrics

    r = run(model.path, dataset.path, user_slot=user_slot)
    m = r["metrics"]
    for k, v in flat_metrics(r).items():
        metrics.log_metric(k, v)
    if r["roc"] is not None:
        roc.log_roc_curve(r["roc"]["fpr"], r["roc"]["tpr"], r["roc"]["thresholds"])
    from persia_core.preprocess.pipeline import malformed_summary

    # the latest blessed model is re-scored on these same rows; its metrics travel on to the gate step
    decision, carried = evaluate_gate(
        m, blessed_dir, dataset.path, min_auc, max_auc_drop, max_logloss_increase, max_ne, lr_margin=lr_margin
    )
    details = {"model": model.uri, "dataset": dataset.uri, "blessed_dir": blessed_dir or "(none)"}
    bad = malformed_summary(dataset.path)
    if bad is not None:
        reasons = ", ".join(f"{k}: {v}" for k, v in bad["by_reason"].items())
        details["malformed rows set aside"] = f"{bad['rows']}" + (
            f" ({reasons}) in {bad['dead_letter']}" if bad["rows"] else ""
        )
    write_report(
        report.path,
        m,
        r["labels"],
        r["preds"],
        r["train_history"],
        r["config"],
        details,
        user_split=r["user_split"],
        coverage=r["coverage"],
        gate=decision,
    )
    return json.dumps(carried)
