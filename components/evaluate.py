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
) -> str:
    """AUC (sklearn), logloss, normalized entropy and calibration on the eval split (read-only lookups);
    returns them as a JSON string."""
    import json

    from persia_core.evaluate.report import write_report
    from persia_core.evaluate.run import evaluate as run

    r = run(model.path, dataset.path)
    m = r["metrics"]
    for k, v in m.items():
        if v is not None:
            metrics.log_metric(k, v)
    if r["roc"] is not None:
        roc.log_roc_curve(r["roc"]["fpr"], r["roc"]["tpr"], r["roc"]["thresholds"])
    write_report(report.path, m, r["labels"], r["preds"], r["train_history"], r["config"],
                 {"model": model.uri, "dataset": dataset.uri})
    return json.dumps(m)
