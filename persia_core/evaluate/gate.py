"""The model gate: bless a new model only when its evaluation beats a threshold and the latest blessed model.

A blessed-model location (local, ``/gcs/...`` or ``gs://bucket/prefix``) holds::

    BLESSED.json          the marker: {"format", "model": "models/<version>", "metrics", "source", "blessed_at",
                          "decision"}; written last, in one write (a local rename or one GCS object upload)
    models/<version>/     a full copy of each blessed Model artifact (manifest.json, dense.pt, shards/, ...)

Blessing copies the Model artifact into a new ``models/<version>/`` folder and only then replaces the marker,
so a crash half-way through a copy leaves the previous blessed model (and its marker) intact, and a reader never
takes a half-copied folder for the blessed model: the latest blessed model is the folder the marker names
(:func:`latest_blessed_model`). The next gate compares with that model re-scored on the new model's evaluation
rows (:func:`rescore_baseline`), or, when it cannot score them, with its stored metrics (:func:`read_baseline`).
Locally, versions older than the previous one are removed after the marker moves; on ``gs://`` they are left
for a bucket lifecycle rule.

The decision itself is ``persia_core.evaluate.decision.decide``.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import secrets
import shutil

from persia_core import io
from persia_core.evaluate.decision import (
    DEFAULT_LR_MARGIN,
    DEFAULT_MAX_AUC_DROP,
    DEFAULT_MAX_LOGLOSS_INCREASE,
    DEFAULT_MAX_NE,
    DEFAULT_MIN_AUC,
    decide,
)
from persia_core.evaluate.run import LoadedModel, evaluate
from persia_core.model_store import (
    BLESSED_FORMAT,
    BLESSED_MARKER,
    BLESSED_MODELS_DIR,
    MANIFEST,
    read_marker,
)

log = logging.getLogger("persia.gate")


def read_baseline(blessed_dir: str) -> dict | None:
    """The evaluation metrics of the latest blessed model in ``blessed_dir``, or ``None`` when there is none
    (an empty ``blessed_dir`` string included)."""
    marker = read_marker(blessed_dir)
    return dict(marker["metrics"]) if marker is not None else None


RESCORED_KEY = "baseline_on_this_eval_data"
"""Key under which the evaluate step hands the latest blessed model's metrics on the same evaluation rows to the
gate, inside the new model's metrics JSON (:func:`rescore_baseline`)."""


UNLOADABLE = "unloadable"
"""``source`` of what :func:`rescore_baseline` returns when the latest blessed model itself cannot be loaded."""


def rescore_baseline(blessed_dir: str, data_dir: str, batch_size: int = 4096) -> dict | None:
    """The latest blessed model of ``blessed_dir`` scored on the evaluation split of ``data_dir``: the baseline
    the new model, scored on the same rows, is compared with. The metrics stored at blessing came from that day's
    evaluation rows, and two evaluation splits differ by more than two models do (MovieLens: 0.0003 AUC between
    identical retrains, more between days), so comparing across them blessed or kept a model by the data's luck.

    Returns its metrics (``auc``, ``logloss``, ``ne``, ``count``, ...) with ``"source": "re-scored"``; None when
    nothing is blessed there, or when the blessed model cannot score this data (other slots): the gate then falls
    back to the stored metrics, and says so; or ``{"source": UNLOADABLE, "model", "error"}`` when the blessed
    model itself cannot be loaded (a corrupt or missing file): the gate then judges the new model on the
    absolute thresholds alone, so that a sound model replaces a broken one, which a warm start could not use."""
    marker = read_marker(blessed_dir) if blessed_dir else None
    if marker is None:
        return None
    path = io.join(blessed_dir, marker["model"])
    try:
        model = LoadedModel(path)
    except Exception as e:  # noqa: BLE001 - a broken blessed model must not fail today's run
        error = f"{type(e).__name__}: {e}"[:500]
        log.warning(
            "the latest blessed model %s cannot be loaded (%s): the gate judges the new model on the "
            "absolute thresholds alone",
            path,
            error,
        )
        return {"source": UNLOADABLE, "model": marker["model"], "error": error}
    try:
        # the LR reference is the new model's evaluate step's (same train split, same fit): not fitted again
        m = evaluate(path, data_dir, batch_size=batch_size, user_slot="", model=model, lr_reference=False)["metrics"]
    except Exception as e:  # noqa: BLE001 - any failure of the old model must not fail today's run
        log.warning(
            "the latest blessed model in %s cannot score %s (%s: %s): the gate compares with the metrics "
            "stored when it was blessed",
            blessed_dir,
            data_dir,
            type(e).__name__,
            e,
        )
        return None
    return {**m, "source": "re-scored", "model": marker["model"]}


def evaluate_gate(
    metrics: dict,
    blessed_dir: str,
    data_dir: str,
    min_auc: float = DEFAULT_MIN_AUC,
    max_auc_drop: float = DEFAULT_MAX_AUC_DROP,
    max_logloss_increase: float = DEFAULT_MAX_LOGLOSS_INCREASE,
    max_ne: float = DEFAULT_MAX_NE,
    batch_size: int = 4096,
    lr_margin: float | None = DEFAULT_LR_MARGIN,
) -> tuple[dict, dict]:
    """The gate of a model just evaluated on ``data_dir``'s evaluation split (its ``metrics``): re-scores the
    latest blessed model of ``blessed_dir`` on the same rows (:func:`rescore_baseline`) and decides (:func:`gate`).
    Returns ``(decision, metrics carrying the re-scored baseline under RESCORED_KEY)``: the second is what the
    evaluate step hands to the gate step, which decides again from it alone."""
    baseline = rescore_baseline(blessed_dir, data_dir, batch_size)
    carried = {**metrics, RESCORED_KEY: baseline} if baseline is not None else dict(metrics)
    return gate(carried, blessed_dir, min_auc, max_auc_drop, max_logloss_increase, max_ne, lr_margin), carried


def gate(
    metrics: dict,
    blessed_dir: str,
    min_auc: float = DEFAULT_MIN_AUC,
    max_auc_drop: float = DEFAULT_MAX_AUC_DROP,
    max_logloss_increase: float = DEFAULT_MAX_LOGLOSS_INCREASE,
    max_ne: float = DEFAULT_MAX_NE,
    lr_margin: float | None = DEFAULT_LR_MARGIN,
) -> dict:
    """:func:`decide` against the latest blessed model in ``blessed_dir`` (none when it is empty or holds no
    marker): its metrics on the same evaluation rows when ``metrics`` carries them (``metrics[RESCORED_KEY]``,
    from :func:`rescore_baseline`), else the metrics stored when it was blessed; none when the re-score found
    the latest blessed model unloadable (the new model is then judged on the absolute thresholds, so a sound
    one replaces a broken one). Returns the decision with
    ``"baseline"`` (the baseline metrics or None), ``"baseline_source"`` and ``"blessed_dir"`` added; the reasons
    say which baseline was used."""
    metrics = dict(metrics)
    rescored = metrics.pop(RESCORED_KEY, None)
    marker = read_marker(blessed_dir)
    stored = dict(marker["metrics"]) if marker is not None else None
    # the re-scored baseline counts only if it is still the latest blessed model (another run may have blessed
    # one between the evaluate and gate steps)
    current = rescored is not None and marker is not None and rescored.get("model") == marker["model"]
    unloadable = current and rescored.get("source") == UNLOADABLE
    baseline = None if unloadable else rescored if current else stored
    out = decide(metrics, baseline, min_auc, max_auc_drop, max_logloss_increase, max_ne, lr_margin)
    if unloadable and marker is not None:
        source = (
            f"none: the latest blessed model {marker['model']} cannot be loaded ({rescored.get('error')}); "
            f"the new model is judged on the absolute thresholds alone, so a sound one replaces it"
        )
    elif baseline is None:
        source = "none"
    elif baseline is rescored:
        source = f"the latest blessed model re-scored on this evaluation data ({rescored.get('count')} rows)"
    else:
        source = "the metrics stored when the latest blessed model was blessed (on that day's evaluation data)"
    if source != "none":
        out["reasons"].append(f"baseline: {source}")
    out["baseline"] = baseline
    out["baseline_source"] = source
    out["blessed_dir"] = blessed_dir
    return out


SKIPPED_ON_BLESS = ("checkpoints/", "deltas/")
"""Parts of a Model artifact that a blessed copy leaves out: training checkpoints and incremental exports."""


def _files_under(root: str) -> list[str]:
    """Relative paths of the model files under ``root`` (local, ``/gcs/`` or ``gs://``), sorted, without the
    folders in ``SKIPPED_ON_BLESS``."""
    return [f for f in io.walk_files(root) if not f.startswith(SKIPPED_ON_BLESS)]


def _new_version() -> str:
    now = datetime.datetime.now(datetime.UTC)
    return f"{now:%Y%m%dT%H%M%S}Z-{secrets.token_hex(3)}"


def bless(model_dir: str, metrics: dict, blessed_dir: str, decision: dict | None = None) -> dict:
    """Copy the Model artifact ``model_dir`` into ``blessed_dir`` as the latest blessed model.

    Writes every file of ``model_dir`` to ``blessed_dir/models/<version>/``, then the marker ``BLESSED.json``
    (last; it names the version and holds ``metrics``, the baseline of the next gate, and ``decision`` when
    given). Locally, blessed versions older than the one the marker named before are then removed (never a
    version another run may be writing at the same time).

    Returns the marker dict. Raises ``FileNotFoundError`` when ``model_dir`` is not a Model artifact (no
    ``manifest.json``), ``ValueError`` for an empty ``blessed_dir``.
    """
    if not blessed_dir:
        raise ValueError("bless: blessed_dir must not be empty")
    metrics = {k: v for k, v in metrics.items() if k != RESCORED_KEY}
    if not io.exists(io.join(model_dir, MANIFEST)):
        raise FileNotFoundError(f"{io.join(model_dir, MANIFEST)}: not a trained model (no {MANIFEST})")
    try:
        previous = read_marker(blessed_dir)
    except ValueError:
        previous = None  # an unreadable marker is replaced
    version = _new_version()
    rel = f"{BLESSED_MODELS_DIR}/{version}"
    files = _files_under(model_dir)
    for f in files:
        io.write_bytes(io.join(blessed_dir, rel, f), io.read_bytes(io.join(model_dir, f)))
    marker = {
        "format": BLESSED_FORMAT,
        "model": rel,
        "metrics": {k: v for k, v in metrics.items() if v is None or isinstance(v, (bool, int, float, str))},
        "source": str(model_dir),
        "files": len(files),
        "blessed_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }
    if decision is not None:
        marker["decision"] = {"decision": decision.get("decision"), "reasons": list(decision.get("reasons", []))}
    io.write_text(io.join(blessed_dir, BLESSED_MARKER), json.dumps(marker, indent=1, sort_keys=True) + "\n")
    log.info("blessed %s -> %s (%d files)", model_dir, io.join(blessed_dir, rel), len(files))
    if not io.is_gcs(blessed_dir) and previous is not None:
        # remove only versions older than the one the marker named before: versions are named by time, so one
        # another run is blessing at the same moment is newer and kept, and the marker never names a deleted one
        before = previous["model"].rpartition("/")[2]
        models = os.path.join(blessed_dir, BLESSED_MODELS_DIR)
        for name in os.listdir(models):
            if name < before and name != version:
                shutil.rmtree(os.path.join(models, name), ignore_errors=True)
    return marker
