from prr.predictors.base import Predictor
from prr.predictors.ema import EmaPredictor
from prr.predictors.last_step import LastStepPredictor
from prr.predictors.none import NoPredictor
from prr.predictors.oracle import OraclePredictor

__all__ = ["Predictor", "EmaPredictor", "LastStepPredictor", "NoPredictor", "OraclePredictor"]
