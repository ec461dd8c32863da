"""Predictors: rank the blocks the next decode step will probably select (set P). The classes
are imported on first use, not with the package, so that prr.predictors.options (their
constructors) loads without torch: run.py checks predictor values before torch is imported."""

from __future__ import annotations

from prr.lazy_exports import lazy_getattr

_HOMES = {
    "Predictor": "prr.predictors.base",
    "CrossLayerPredictor": "prr.predictors.cross_layer",
    "EmaPredictor": "prr.predictors.ema",
    "EmaMembershipPredictor": "prr.predictors.ema_membership",
    "LastStepPredictor": "prr.predictors.last_step",
    "NoPredictor": "prr.predictors.none",
    "OraclePredictor": "prr.predictors.oracle",
    "QuerySimilarityPredictor": "prr.predictors.query_similarity",
    "SpinPredictor": "prr.predictors.spin",
}

__all__ = sorted(_HOMES)

__getattr__ = lazy_getattr(__name__, _HOMES)
