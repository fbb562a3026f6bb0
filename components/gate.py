"""Component 5 (model gate): decide whether the new model is blessed, and copy it when it is.

The thresholds (``min_auc``, ``max_auc_drop``, ``max_logloss_increase``, ``max_ne``, ``lr_margin``) have no
defaults here: a component's source runs as it is written, where a default naming
``persia_core.evaluate.decision``'s ``DEFAULT_*`` constants could not be resolved, so the pipeline passes all five
(its defaults are those constants). Wire the
components with ``dsl.If``::

    g = gate(metrics_json=ev.outputs["Output"], blessed_dir=blessed_dir, min_auc=..., max_ne=..., ...)
    with dsl.If(g.outputs["Output"] == "bless"):
        bless_model(model=trained.outputs["model"], metrics_json=ev.outputs["Output"], blessed_dir=blessed_dir)
"""

from kfp import dsl
from kfp.dsl import Input, Markdown, Metrics, Model, Output

from components import BASE_IMAGE


@dsl.component(base_image=BASE_IMAGE, install_kfp_package=False)
def gate(
    metrics_json: str,
    blessed_dir: str,
    decision: Output[Markdown],
    gate_metrics: Output[Metrics],
    min_auc: float,
    max_auc_drop: float,
    max_logloss_increase: float,
    max_ne: float,
    lr_margin: float,
) -> str:
    """Compare the new model's metrics (``metrics_json``, the evaluate component's output) with the latest
    blessed model in ``blessed_dir`` (local, /gcs/ or gs://; empty or none blessed yet: ``min_auc`` only), and
    with ``max_ne``: a normalized entropy at or above it is never blessed, nor an AUC more than ``lr_margin`` below
    the LR reference's (the evaluate step's ``lr_auc``).
    Writes the decision and its reasons to ``decision`` (Markdown) and ``gate_metrics`` (``blessed`` 1/0 and
    the compared values); returns ``"bless"`` or ``"reject"``."""
    from persia_core.train.processes import die_with_local_runner

    die_with_local_runner()  # a task of run_local ends with it, even a SIGKILLed one, not running on orphaned

    import json

    from persia_core.evaluate.gate import gate as run

    d = run(json.loads(metrics_json), blessed_dir, min_auc, max_auc_drop, max_logloss_increase, max_ne, lr_margin)
    lines = [f"# Model gate: **{d['decision']}**", ""] + [f"- {r}" for r in d["reasons"]]
    with open(decision.path, "w") as f:
        f.write("\n".join(lines) + "\n")
    gate_metrics.log_metric("blessed", 1.0 if d["bless"] else 0.0)
    new = json.loads(metrics_json)
    gate_metrics.log_metric("max_ne", float(max_ne))
    gate_metrics.log_metric("lr_margin", float(lr_margin))
    for name, src in (
        ("auc", new),
        ("logloss", new),
        ("ne", new),
        ("lr_auc", new),
        ("baseline_auc", d["baseline"] or {}),
        ("baseline_logloss", d["baseline"] or {}),
    ):
        v = src.get(name.replace("baseline_", ""))
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            gate_metrics.log_metric(name, float(v))
    return d["decision"]


@dsl.component(base_image=BASE_IMAGE, install_kfp_package=False)
def bless_model(model: Input[Model], metrics_json: str, blessed_dir: str) -> str:
    """Copy the Model artifact into ``blessed_dir`` as the latest blessed model (files first, the
    ``BLESSED.json`` marker last); returns the path of the blessed copy."""
    from persia_core.train.processes import die_with_local_runner

    die_with_local_runner()  # a task of run_local ends with it, even a SIGKILLed one, not running on orphaned

    import json

    from persia_core import io
    from persia_core.evaluate.gate import bless

    marker = bless(model.path, json.loads(metrics_json), blessed_dir)
    return io.join(blessed_dir, marker["model"])
