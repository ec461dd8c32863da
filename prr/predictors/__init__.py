from prr.predictors.base import Predictor
from prr.predictors.cross_layer import CrossLayerPredictor
from prr.predictors.ema import EmaPredictor
from prr.predictors.ema_membership import EmaMembershipPredictor
from prr.predictors.last_step import LastStepPredictor
from prr.predictors.none import NoPredictor
from prr.predictors.oracle import OraclePredictor
from prr.predictors.query_similarity import QuerySimilarityPredictor
from prr.predictors.spin import SpinPredictor

__all__ = ["Predictor", "EmaPredictor", "EmaMembershipPredictor", "LastStepPredictor", "NoPredictor", "OraclePredictor",
           "SpinPredictor", "QuerySimilarityPredictor", "CrossLayerPredictor"]
