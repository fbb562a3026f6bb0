"""A self-contained HTML evaluation report for a click-through-rate model (KFP ``Output[HTML]``).

One file, no external resources: plots are PNGs rendered with matplotlib's Agg canvas (``FigureCanvasAgg`` on a
bare ``matplotlib.figure.Figure``, so the process-wide pyplot backend is neither used nor changed) and embedded
as ``data:image/png;base64`` URIs; the style sheet is inline. All text taken from the arguments is
HTML-escaped. Sections, in order:

1. metrics table (the ``metrics`` dict; floats to 6 significant digits, ``None`` as "undefined");
2. ROC curve with the chance diagonal and the AUC in the legend (omitted with a note when one class only);
3. reliability (calibration) plot with the diagonal, and the count of predictions per bin;
4. with ``user_split``: every metric for rows whose user was seen in training and rows whose user was not;
5. with ``coverage``: per slot, the share of evaluation IDs never seen in training;
6. with ``train_history``: training loss over samples, throughput over time, the max observed staleness, and
   the per-shard table when ``"shards"`` is given;
7. with ``config``: the run config as YAML; with ``extra``: a key/value table.

With ``gate`` (a model-gate decision, ``persia_core.evaluate.gate.decide``) a "Model gate" section with the
decision and its reasons comes right after the metrics table.
"""

from __future__ import annotations

import base64
import dataclasses
import html
import io
from collections.abc import Mapping

import numpy as np
import yaml
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from sklearn.metrics import roc_auc_score

from persia_core.evaluate.metrics import reliability, roc_points, validate
from persia_core.io import write_text

#: Points kept on the plotted ROC curve (see :func:`persia_core.evaluate.metrics.roc_points`).
ROC_PLOT_POINTS = 1000
#: Equal-width bins of the reliability plot.
RELIABILITY_BINS = 10

_HISTORY_LISTS = ("samples", "loss", "elapsed_s")
_HISTORY_SCALARS = ("samples_per_s", "max_staleness")
_SHARD_KEYS = ("shard", "rows", "bytes")

_CSS = """
body { font-family: -apple-system, "Segoe UI", Helvetica, Arial, sans-serif; margin: 2em auto; max-width: 960px;
       color: #222; }
h1 { font-size: 1.6em; } h2 { font-size: 1.25em; margin-top: 1.6em; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; margin: 0.5em 0; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.7em; text-align: left; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
th { background: #f3f3f3; }
img { max-width: 100%; display: block; margin: 0.5em 0; }
pre { background: #f7f7f7; padding: 0.8em; overflow-x: auto; }
p.note { color: #8a4b00; }
.gate { padding: 0.6em 1em; border-radius: 4px; font-weight: bold; display: inline-block; }
.gate.bless { background: #e3f4e1; color: #1d5e1a; border: 1px solid #8fc98a; }
.gate.reject { background: #fbe4e2; color: #8a1c12; border: 1px solid #e29a92; }
"""


def _esc(x) -> str:
    return html.escape(str(x), quote=True)


def _fmt(v) -> str:
    """Display text of a scalar: None -> "undefined", floats to 6 significant digits, ints in full."""
    if v is None:
        return "undefined"
    if isinstance(v, (bool, np.bool_)):
        return str(bool(v))
    if isinstance(v, (int, np.integer)):
        return str(int(v))
    if isinstance(v, (float, np.floating)):
        return f"{float(v):.6g}"
    return str(v)


def _is_num(v) -> bool:
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, (bool, np.bool_))


def _kv_table(d: Mapping, key_header: str = "Name", value_header: str = "Value") -> str:
    rows = []
    for k, v in d.items():
        cls = ' class="num"' if _is_num(v) else ""
        rows.append(f"<tr><td>{_esc(k)}</td><td{cls}>{_esc(_fmt(v))}</td></tr>")
    return (
        f"<table><thead><tr><th>{_esc(key_header)}</th><th>{_esc(value_header)}</th></tr></thead>"
        f"<tbody>{''.join(rows)}</tbody></table>"
    )


#: Rows of the seen/unseen-user table: (metric key, label).
_SPLIT_ROWS = (
    ("auc", "AUC"),
    ("gauc", "GAUC"),
    ("logloss", "Log loss"),
    ("ne", "Normalized entropy"),
    ("calibration", "Calibration (mean pred / base rate)"),
    ("base_rate", "Base rate"),
    ("mean_prediction", "Mean prediction"),
    ("count", "Rows"),
)


def _num_td(v) -> str:
    return f'<td class="num">{_esc(_fmt(v))}</td>'


def _split_table(metrics: Mapping, split: Mapping) -> str:
    """Overall / seen-user / unseen-user metrics side by side (see ``persia_core.evaluate.run.evaluate``)."""
    seen, unseen = split.get("seen") or {}, split.get("unseen") or {}
    rows = "".join(
        f"<tr><td>{_esc(label)}</td>{_num_td(metrics.get(k))}{_num_td(seen.get(k))}{_num_td(unseen.get(k))}</tr>"
        for k, label in _SPLIT_ROWS
        if k in metrics or k in seen or k in unseen
    )
    return (
        "<table><thead><tr><th>Metric</th><th>All rows</th><th>User seen in training</th>"
        f"<th>User not seen in training</th></tr></thead><tbody>{rows}</tbody></table>"
    )


def _coverage_table(coverage: Mapping) -> str:
    """Per slot: ID occurrences and distinct IDs of the evaluation rows, and how many were never seen."""
    rows = "".join(
        f"<tr><td>{_esc(slot)}</td>{_num_td(c.get('ids'))}{_num_td(c.get('unseen_ids'))}"
        f"{_num_td(_pct(c.get('unseen_share')))}{_num_td(c.get('distinct_ids'))}"
        f"{_num_td(c.get('unseen_distinct_ids'))}{_num_td(_pct(c.get('unseen_distinct_share')))}</tr>"
        for slot, c in coverage.items()
    )
    return (
        "<table><thead><tr><th>Slot</th><th>Eval IDs</th><th>Never seen</th><th>Share never seen</th>"
        "<th>Distinct IDs</th><th>Distinct never seen</th><th>Share of distinct never seen</th></tr></thead>"
        f"<tbody>{rows}</tbody></table>"
    )


def _pct(v):
    return None if v is None else f"{100.0 * float(v):.2f}%"


def _gate_section(gate: Mapping) -> str:
    decision = str(gate.get("decision") or ("bless" if gate.get("bless") else "reject"))
    cls = "bless" if decision == "bless" else "reject"
    where = gate.get("blessed_dir")
    if cls == "bless":
        text = (
            "passes the gate: the bless step publishes it as the latest blessed model in " + str(where)
            if where
            else "passes the gate (no blessed-model location is set, so nothing is published)"
        )
    else:
        text = (
            "fails the gate: the latest blessed model in " + str(where) + " stays in place"
            if where
            else "fails the gate: it is not published"
        )
    items = "".join(f"<li>{_esc(r)}</li>" for r in gate.get("reasons", []))
    parts = [
        f'<p><span class="gate {cls}">Decision: {_esc(decision)}</span> {_esc(text)}.</p>',
        f"<ul>{items}</ul>" if items else "",
    ]
    baseline = gate.get("baseline")
    if baseline:
        keys = [k for k in ("auc", "gauc", "logloss", "ne", "calibration", "count") if k in baseline]
        parts += [
            "<p>Baseline (latest blessed model):</p>",
            _kv_table({k: baseline[k] for k in keys}, "Metric", "Baseline"),
        ]
    return "".join(parts)


def _png_img(fig: Figure, alt: str) -> str:
    """Render ``fig`` to PNG with the Agg canvas and return an ``<img>`` tag with a base64 data URI."""
    FigureCanvasAgg(fig)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    data = base64.b64encode(buf.getvalue()).decode("ascii")
    return f'<img alt="{_esc(alt)}" src="data:image/png;base64,{data}">'


def _roc_figure(y: np.ndarray, p: np.ndarray) -> str:
    pts = roc_points(y, p, max_points=ROC_PLOT_POINTS)
    auc = float(roc_auc_score(y, p))
    fig = Figure(figsize=(5.5, 5.0))
    ax = fig.add_subplot()
    ax.plot(pts["fpr"], pts["tpr"], color="tab:blue", lw=2, label=f"Model (AUC = {auc:.4f})")
    ax.plot([0, 1], [0, 1], color="grey", ls="--", lw=1, label="Chance (AUC = 0.5)")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1.01)
    ax.set_xlabel("False positive rate")
    ax.set_ylabel("True positive rate")
    ax.set_title("ROC curve")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    return _png_img(fig, "ROC curve")


def _reliability_figure(y: np.ndarray, p: np.ndarray) -> str:
    rel = reliability(y, p, bins=RELIABILITY_BINS)
    pairs = [(m, r) for m, r in zip(rel["mean_prediction"], rel["observed_rate"], strict=True) if m is not None]
    fig = Figure(figsize=(5.5, 6.5))
    ax, ax_n = fig.subplots(2, 1, gridspec_kw={"height_ratios": [3, 1]})
    ax.plot([0, 1], [0, 1], color="grey", ls="--", lw=1, label="Perfectly calibrated")
    ax.plot(
        [m for m, _ in pairs],
        [r for _, r in pairs],
        marker="o",
        color="tab:orange",
        label=f"Model (ECE = {rel['ece']:.4f})",
    )
    ax.set_xlim(0, 1)
    ax.set_ylim(-0.01, 1.02)
    ax.set_xlabel("Mean predicted probability")
    ax.set_ylabel("Observed positive rate")
    ax.set_title(f"Reliability ({RELIABILITY_BINS} equal-width bins)")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left")
    edges = np.asarray(rel["bin_edges"])
    ax_n.bar(edges[:-1], rel["count"], width=np.diff(edges), align="edge", color="tab:orange", edgecolor="white")
    ax_n.set_xlim(0, 1)
    ax_n.set_xlabel("Predicted probability")
    ax_n.set_ylabel("Examples per bin")
    ax_n.set_title("Prediction histogram")
    fig.tight_layout()
    return _png_img(fig, "Reliability plot")


def _check_history(h: Mapping) -> dict:
    """Validate ``train_history`` (see :func:`write_report`); return it with numpy arrays for the lists."""
    if not isinstance(h, Mapping):
        raise ValueError(f"train_history must be a dict, got {type(h).__name__}")
    missing = [k for k in _HISTORY_LISTS + _HISTORY_SCALARS if k not in h]
    if missing:
        raise ValueError(f"train_history is missing key(s): {', '.join(missing)}")
    out = dict(h)
    for k in _HISTORY_LISTS:
        a = np.asarray(h[k], dtype=np.float64)
        if a.ndim != 1:
            raise ValueError(f"train_history[{k!r}] must be a flat list, got shape {a.shape}")
        out[k] = a
    lens = {k: out[k].shape[0] for k in _HISTORY_LISTS}
    if len(set(lens.values())) != 1:
        raise ValueError(f"train_history lists differ in length: {lens}")
    for k in _HISTORY_SCALARS:
        if not _is_num(h[k]):
            raise ValueError(f"train_history[{k!r}] must be a number, got {h[k]!r}")
    shards = h.get("shards")
    if shards is not None:
        for i, s in enumerate(shards):
            miss = [k for k in _SHARD_KEYS if not isinstance(s, Mapping) or k not in s]
            if miss:
                raise ValueError(f"train_history['shards'][{i}] is missing key(s): {', '.join(miss)}")
    return out


def _loss_figure(h: dict) -> str:
    """Training loss over samples; with ``epochs: auto`` (``h["validation"]``: ``{"step", "logloss"}`` per epoch)
    the validation slice's logloss at each epoch's end too, and the kept epoch marked."""
    fig = Figure(figsize=(6.5, 4.0))
    ax = fig.add_subplot()
    ax.plot(h["samples"], h["loss"], color="tab:blue", lw=1.5, label="Training loss (per step)")
    val = h.get("validation") or []
    steps = list(h.get("step") or [])
    if val and len(steps) == len(h["samples"]):
        at = {int(s) + 1: float(n) for s, n in zip(steps, h["samples"], strict=True)}  # steps trained -> samples
        pts = [(at[int(v["step"])], float(v["logloss"])) for v in val if int(v["step"]) in at]
        if pts:
            ax.plot(*zip(*pts, strict=True), color="tab:orange", marker="o", lw=1.2, label="Validation logloss")
            best = int(h.get("best_step") or 0)
            if best in at:
                ax.axvline(at[best], color="black", ls="--", lw=1, label=f"Kept: epoch {h.get('best_epoch')}")
            ax.legend()
    ax.set_xlabel("Samples seen")
    ax.set_ylabel("Loss")
    ax.set_title("Training loss" + (" and validation logloss" if val else "") + " over samples")
    ax.grid(alpha=0.3)
    return _png_img(fig, "Training loss")


def _throughput_figure(h: dict) -> str:
    """Per-interval throughput ``diff(samples) / diff(elapsed_s)`` at each interval's end, and the run mean."""
    s, t = h["samples"], h["elapsed_s"]
    dt, ds = np.diff(t), np.diff(s)
    ok = dt > 0
    fig = Figure(figsize=(6.5, 4.0))
    ax = fig.add_subplot()
    if ok.any():
        ax.plot(t[1:][ok], ds[ok] / dt[ok], color="tab:green", marker=".", lw=1.2, label="Per logging interval")
    ax.axhline(
        float(h["samples_per_s"]), color="black", ls="--", lw=1, label=f"Run: {h['samples_per_s']:.6g} samples/s"
    )
    ax.set_xlabel("Elapsed time (s)")
    ax.set_ylabel("Throughput (samples/s)")
    ax.set_title("Training throughput over time")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    return _png_img(fig, "Training throughput")


def _shards_table(shards) -> str:
    rows = "".join(
        f'<tr><td class="num">{_esc(_fmt(s["shard"]))}</td><td class="num">{_esc(_fmt(s["rows"]))}</td>'
        f'<td class="num">{_esc(_fmt(s["bytes"]))}</td><td class="num">{_esc(_human_bytes(s["bytes"]))}</td></tr>'
        for s in shards
    )
    return (
        "<table><thead><tr><th>Shard</th><th>Rows</th><th>Bytes</th><th>Size</th></tr></thead>"
        f"<tbody>{rows}</tbody></table>"
    )


def _human_bytes(n) -> str:
    """``n`` bytes in binary units: 512 B, 1.5 KiB, ... up to TiB."""
    n = float(n)
    if abs(n) < 1024:
        return f"{n:.0f} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024
        if abs(n) < 1024 or unit == "TiB":
            break
    return f"{n:.1f} {unit}"


def _plain(x):
    """Turn a config value into YAML-safe builtins (numpy scalars/arrays, tuples, dataclasses, other -> str)."""
    if isinstance(x, Mapping):
        return {str(k): _plain(v) for k, v in x.items()}
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return _plain(dataclasses.asdict(x))
    if isinstance(x, (list, tuple, set)):
        return [_plain(v) for v in x]
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, np.generic):
        return x.item()
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    return str(x)


def write_report(
    path: str,
    metrics: dict,
    labels: np.ndarray,
    preds: np.ndarray,
    train_history: dict | None = None,
    config: dict | None = None,
    extra: dict | None = None,
    user_split: dict | None = None,
    coverage: dict | None = None,
    gate: dict | None = None,
) -> str:
    """Write the evaluation report as one self-contained HTML file and return ``path``.

    Args:
        path: local, ``/gcs/...`` or ``gs://bucket/key`` destination (written with ``persia_core.io.write_text``;
            parent folders are created for local paths).
        metrics: name -> value, shown as a table (e.g. :func:`persia_core.evaluate.metrics.binary_metrics`,
            plus ``gauc``); floats are shown to 6 significant digits and ``None`` as "undefined".
        labels: {0,1}[N]; preds: float[N] in [0, 1] — the evaluation set, used for the ROC curve (sklearn
            ``roc_curve``, AUC from ``roc_auc_score`` in the legend) and the reliability plot
            (:func:`persia_core.evaluate.metrics.reliability`, 10 equal-width bins).
        train_history: optional, with keys ``"samples"``: list[int] cumulative samples at each logged point,
            ``"loss"``: list[float] training loss at those points, ``"elapsed_s"``: list[float] seconds since
            the start of training at those points, ``"samples_per_s"``: float, the run's mean throughput,
            ``"max_staleness"``: int, the largest number of batches the embeddings lagged the dense step, and
            optionally ``"shards"``: list of ``{"shard": int, "rows": int, "bytes": int}``. Adds the loss and
            throughput plots (throughput per logging interval = Δsamples / Δelapsed_s), the staleness line and
            the shard table.
        config: optional run-config dict (numpy values and dataclasses are converted), shown as YAML.
        extra: optional name -> value, shown as a table.
        user_split: optional ``{"slot": str, "seen": metrics, "unseen": metrics}`` (the ``user_split`` of
            :func:`persia_core.evaluate.run.evaluate`), shown as a table beside the overall ``metrics``.
        coverage: optional ``{slot: id_coverage dict}`` (:func:`persia_core.evaluate.metrics.id_coverage`),
            shown as the per-slot table of evaluation IDs never seen in training.
        gate: optional model-gate decision ``{"decision": "bless"|"reject", "reasons": [str], "baseline":
            metrics|None, "blessed_dir": str}`` (:func:`persia_core.evaluate.gate.gate`), shown right after the
            metrics.

    Returns ``path``.

    Raises ``ValueError`` on invalid labels/preds (see :func:`persia_core.evaluate.metrics.validate`) or a
    malformed ``train_history`` (missing key, lists of different lengths, non-numeric scalar, shard entry
    without ``shard``/``rows``/``bytes``), naming the key.
    """
    y, p = validate(labels, preds)
    history = _check_history(train_history) if train_history is not None else None

    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        "<title>Evaluation report</title>",
        f"<style>{_CSS}</style></head><body>",
        "<h1>Evaluation report</h1>",
        f"<p>{_esc(y.shape[0])} evaluation examples, {_esc(int(y.sum()))} positive.</p>",
        "<h2>Metrics</h2>",
        _kv_table(metrics, "Metric", "Value"),
    ]
    if gate is not None:
        parts += ["<h2>Model gate</h2>", _gate_section(gate)]
    parts.append("<h2>ROC curve</h2>")
    if y.min() == y.max():
        parts.append(f'<p class="note">ROC curve undefined: all labels are {_esc(int(y[0]))}.</p>')
    else:
        parts.append(_roc_figure(y, p))
    parts += ["<h2>Calibration</h2>", _reliability_figure(y, p)]
    if user_split:
        parts += [
            "<h2>Users seen and not seen in training</h2>",
            f"<p>Rows split by whether the trained model holds a row for their user "
            f"(slot <code>{_esc(user_split.get('slot', ''))}</code>); GAUC is the impression-weighted "
            "mean of per-user AUC over users with both classes.</p>",
            _split_table(metrics, user_split),
        ]
    if coverage:
        parts += [
            "<h2>Per-slot coverage</h2>",
            "<p>Evaluation IDs of each slot that have no row in the trained shards (never seen in "
            "training); they are looked up as the zero row.</p>",
            _coverage_table(coverage),
        ]

    if history is not None:
        parts += [
            "<h2>Training</h2>",
            f"<p>Max observed staleness: <b>{_esc(_fmt(history['max_staleness']))}</b> batches; "
            f"mean throughput: <b>{_esc(_fmt(history['samples_per_s']))}</b> samples/s.</p>",
        ]
        val = history.get("validation") or []
        if val:
            kept = next((v for v in val if int(v["step"]) == int(history.get("best_step") or -1)), None)
            curve = ", ".join(f"{_fmt(float(v['logloss']))}" for v in val)
            parts.append(
                f"<p>Validation slice (<code>epochs: auto</code>, {_esc(_fmt(int(val[-1]['rows'])))} rows): logloss "
                f"per epoch {_esc(curve)}; kept epoch <b>{_esc(_fmt(history.get('best_epoch')))}</b>"
                + (f" (logloss {_esc(_fmt(float(kept['logloss'])))})" if kept else "")
                + (", stopped early" if history.get("stopped_early") else "")
                + ".</p>"
            )
            vp = history.get("validation_pass")
            if vp:
                parts.append(
                    f"<p>Then the kept model trained one pass over the validation slice "
                    f"(<code>trainer.train_on_validation</code>): {_esc(_fmt(int(vp['steps'])))} steps, train logloss "
                    f"{_esc(_fmt(float(vp['loss'])))}.</p>"
                )
            rf = history.get("refit")
            if rf:
                loss, n = rf.get("loss"), int(rf["epochs"])
                parts.append(
                    f"<p>Then the model was trained again from its initial state for "
                    f"<b>{n}</b> epoch{'' if n == 1 else 's'} on every row of the train split, validation slice "
                    f"included (<code>trainer.refit</code>): {_esc(_fmt(int(rf['steps'])))} steps"
                    + (f", last epoch's train logloss {_esc(_fmt(float(loss)))}" if loss is not None else "")
                    + "; the Model is that run's, and the validation figures above are the selection's.</p>"
                )
        if history["samples"].shape[0] > 0:
            parts += [_loss_figure(history), _throughput_figure(history)]
        else:
            parts.append('<p class="note">No training points were logged.</p>')
        if history.get("shards"):
            parts += ["<h3>Embedding shards</h3>", _shards_table(history["shards"])]

    if config is not None:
        text = yaml.safe_dump(_plain(config), sort_keys=False, default_flow_style=False, allow_unicode=True)
        parts += ["<h2>Run config</h2>", f"<pre>{_esc(text)}</pre>"]
    if extra:
        parts += ["<h2>Details</h2>", _kv_table(extra)]
    parts.append("</body></html>\n")

    write_text(path, "\n".join(parts))
    return path
