"""The gate's decision: bless a newly evaluated model or not, from its metrics, thresholds and a baseline.

Bless when the new AUC is defined and ``>= min_auc``, its normalized entropy is below ``max_ne``, its AUC is at
most ``lr_margin`` below the LR reference's (where the metrics carry one) and, with a baseline, ``AUC >= baseline
AUC - max_auc_drop`` and ``logloss <= baseline logloss + max_logloss_increase``; the reasons say which check passed
or failed and by how much. A leaf module (no imports): the threshold defaults
are the one home of the values the components, the pipelines and the CLI use.
"""

from __future__ import annotations

#: Defaults of the gate's thresholds (the components and the CLI use the same values).
DEFAULT_MIN_AUC = 0.5
DEFAULT_MAX_AUC_DROP = 0.0
DEFAULT_MAX_LOGLOSS_INCREASE = 0.01
DEFAULT_MAX_NE = 1.0
"""A model whose normalized entropy reaches this is not blessed (1: no better than predicting the base rate)."""
DEFAULT_LR_MARGIN = 0.0
"""How much lower than the LR reference's AUC (hashed logistic regression on the same slots and train split) a
blessed model's AUC may be: 0, not lower. 1 reports the reference without enforcing it."""


def _num(v) -> float | None:
    if v is None or isinstance(v, bool):
        return None
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def check_thresholds(
    min_auc: float = DEFAULT_MIN_AUC,
    max_auc_drop: float = DEFAULT_MAX_AUC_DROP,
    max_logloss_increase: float = DEFAULT_MAX_LOGLOSS_INCREASE,
    max_ne: float = DEFAULT_MAX_NE,
    lr_margin: float | None = DEFAULT_LR_MARGIN,
    as_flags: bool = False,
) -> None:
    """The gate's own checks of its thresholds, also made by the entry points before a run starts (rather than at
    its last step). Raises ``ValueError`` naming the threshold (``--min-auc`` with ``as_flags``) for a ``max_ne``
    <= 0, a ``min_auc`` outside [0, 1] or a negative tolerance (``lr_margin`` included; None: not checked)."""

    def name(n: str) -> str:
        return "--" + n.replace("_", "-") if as_flags else n

    if not max_ne > 0:
        raise ValueError(f"{name('max_ne')} must be > 0, got {max_ne}")
    if not 0.0 <= min_auc <= 1.0:
        raise ValueError(f"{name('min_auc')} must be in [0, 1], got {min_auc}")
    if max_auc_drop < 0:
        raise ValueError(f"{name('max_auc_drop')} must be >= 0, got {max_auc_drop}")
    if max_logloss_increase < 0:
        raise ValueError(f"{name('max_logloss_increase')} must be >= 0, got {max_logloss_increase}")
    if lr_margin is not None and not lr_margin >= 0:
        raise ValueError(f"{name('lr_margin')} must be >= 0, got {lr_margin}")


def decide(
    new_metrics: dict,
    baseline: dict | None,
    min_auc: float = DEFAULT_MIN_AUC,
    max_auc_drop: float = DEFAULT_MAX_AUC_DROP,
    max_logloss_increase: float = DEFAULT_MAX_LOGLOSS_INCREASE,
    max_ne: float = DEFAULT_MAX_NE,
    lr_margin: float | None = DEFAULT_LR_MARGIN,
) -> dict:
    """Decide whether a newly evaluated model is blessed.

    Args:
        new_metrics: the new model's evaluation metrics (``auc``, ``logloss``; ``None`` = undefined).
        baseline: the latest blessed model's metrics (:func:`read_baseline`), or ``None`` when there is none;
            then only ``min_auc`` (and the normalized-entropy check) applies.
        min_auc: the AUC a model needs at least (an absolute threshold).
        max_auc_drop: how much lower than the baseline's AUC the new AUC may be (0: not lower).
        max_logloss_increase: how much higher than the baseline's logloss (nats) the new logloss may be.
        max_ne: the new model's normalized entropy must be below this (an absolute threshold, baseline or not).
        lr_margin: how much lower than the LR reference's AUC (``new_metrics["lr_auc"]``, from
            ``persia_core.evaluate.lr_reference``) the new AUC may be (default 0: not lower); not checked where
            the metrics carry none, or with None.

    Returns ``{"bless": bool, "decision": "bless" | "reject", "reasons": [str, ...]}``: one reason per check, each
    saying whether it passed. A model whose AUC is undefined is rejected, and so is one whose normalized entropy
    (``ne``: logloss / the entropy of the base rate; He et al., ADKDD 2014) is >= ``max_ne`` (default 1: no
    better than predicting the base rate), even when nothing is blessed yet. A baseline AUC or logloss that is
    undefined skips that comparison (said in the reasons).

    Raises ``ValueError`` for a negative tolerance, a ``min_auc`` outside [0, 1] or a ``max_ne`` <= 0.
    """
    check_thresholds(min_auc, max_auc_drop, max_logloss_increase, max_ne, lr_margin)
    reasons: list[str] = []
    ok = True
    auc = _num(new_metrics.get("auc"))
    logloss = _num(new_metrics.get("logloss"))
    if auc is None:
        ok = False
        reasons.append("rejected: the new model's AUC is undefined (one class in the evaluation split)")
    elif auc >= min_auc:
        reasons.append(f"passed: AUC {auc:.6f} >= min_auc {min_auc:.6f}")
    else:
        ok = False
        reasons.append(f"rejected: AUC {auc:.6f} < min_auc {min_auc:.6f}")
    ne = _num(new_metrics.get("ne"))
    if ne is None or ne != ne:
        reasons.append("normalized entropy undefined (one class in the evaluation split): max_ne not checked")
    elif ne < max_ne:
        reasons.append(f"passed: normalized entropy {ne:.6f} < max_ne {max_ne:g}")
    else:
        ok = False
        reasons.append(
            f"rejected: normalized entropy {ne:.6f} >= max_ne {max_ne:g}"
            + (" (logloss no better than predicting the base rate)" if ne >= 1.0 else "")
        )
    lr_auc = _num(new_metrics.get("lr_auc"))
    if lr_margin is not None and lr_auc is not None and auc is not None:
        if auc >= lr_auc - lr_margin:
            reasons.append(f"passed: AUC {auc:.6f} >= LR reference AUC {lr_auc:.6f} - lr_margin {lr_margin:.6f}")
        else:
            ok = False
            reasons.append(
                f"rejected: AUC {auc:.6f} < LR reference AUC {lr_auc:.6f} - lr_margin {lr_margin:.6f} (hashed "
                "logistic regression on the same slots and train split does better)"
            )
    if baseline is None:
        reasons.append("no blessed baseline yet: only the min_auc and normalized-entropy checks apply")
    else:
        base_auc = _num(baseline.get("auc"))
        base_ll = _num(baseline.get("logloss"))
        if base_auc is None:
            reasons.append("baseline AUC undefined: AUC not compared with the baseline")
        elif auc is not None:
            floor = base_auc - max_auc_drop
            if auc >= floor:
                reasons.append(
                    f"passed: AUC {auc:.6f} >= baseline AUC {base_auc:.6f} - max_auc_drop {max_auc_drop:.6f}"
                )
            else:
                ok = False
                reasons.append(
                    f"rejected: AUC {auc:.6f} < baseline AUC {base_auc:.6f} - max_auc_drop "
                    f"{max_auc_drop:.6f} (drop {base_auc - auc:.6f})"
                )
        if base_ll is None or logloss is None:
            reasons.append("logloss undefined: logloss not compared with the baseline")
        elif logloss <= base_ll + max_logloss_increase:
            reasons.append(
                f"passed: logloss {logloss:.6f} <= baseline logloss {base_ll:.6f} + "
                f"max_logloss_increase {max_logloss_increase:.6f}"
            )
        else:
            ok = False
            reasons.append(
                f"rejected: logloss {logloss:.6f} > baseline logloss {base_ll:.6f} + "
                f"max_logloss_increase {max_logloss_increase:.6f} (worse by {logloss - base_ll:.6f})"
            )
    return {"bless": ok, "decision": "bless" if ok else "reject", "reasons": reasons}
