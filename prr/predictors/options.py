"""The predictor group's options without torch: each predictor's constructor (its keys, their
types, the checks of their values) and the capabilities the config's cross-checks read
(`uses_budget`, `replays_selections`, `declared_hit_rate`). The predictors of prr.predictors
inherit these constructors unchanged and add the torch work, so that run.py refuses a bad
predictor value before torch is imported (prr.config_check.CHECKED_BEFORE_TORCH names the pairs).
A shortcut for the built-in predictors, not a registry: a new predictor's constructor may live in
its own module, and run.py checks its values there once torch is imported (docs/extending.md)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any


class PredictorOptions:
    """What every predictor declares (last_step and none take no options)."""

    uses_budget: bool = True  # False: |P| is set by the predictor itself (the oracle's P = A)
    # replays_selections: P comes from a serial pass recorded before decoding (the benchmark tool
    # bench_hit_rate); only the graph engine records one (GraphDecoder.prime_predictions).
    replays_selections: bool = False
    # The share of A that P holds when the predictor knows it by construction (bench_hit_rate);
    # None for real predictors, whose hit rate is measured.
    declared_hit_rate: float | None = None


class OraclePredictorOptions(PredictorOptions):
    uses_budget = False  # P = A, whatever |P| the budget asks for


# ema's (alpha, stickiness, recency) where neither calibration nor the config gives one (calibrate=false)
UNCALIBRATED = {"alpha": 0.8, "stickiness": 1.0, "recency": 1.0}


class EmaPredictorOptions(PredictorOptions):
    def __init__(
        self,
        alpha: float | None = None,
        stickiness: float | None = None,
        recency: float | None = None,
        recent_blocks: int = 1,
        calibrate: bool = False,
        per_layer: bool = False,
        burn_in_steps: int = 4,
        alpha_grid: Sequence[float] = (0.0, 0.5, 0.7, 0.8, 0.9, 0.95),
        stickiness_grid: Sequence[float] = (0.0, 0.5, 1.0, 2.0, 4.0),
        recency_grid: Sequence[float] = (0.0, 1.0, 4.0),
    ) -> None:
        """alpha, stickiness, recency: None (the YAML's null) is calibrated on the prefill tail over its
        grid when calibrate=true, else UNCALIBRATED's value; a number is kept either way (calibration
        then searches the others' grids only)."""
        if (alpha is not None and not 0.0 <= alpha < 1.0) or any(not 0.0 <= a < 1.0 for a in alpha_grid):
            raise ValueError(f"predictor.alpha={alpha} and alpha_grid={list(alpha_grid)} must lie in [0, 1)")
        if recent_blocks < 0 or burn_in_steps < 0:
            raise ValueError(f"predictor.recent_blocks={recent_blocks} and burn_in_steps={burn_in_steps} must be >= 0")
        if calibrate and not (alpha_grid and stickiness_grid and recency_grid):
            raise ValueError("predictor.alpha_grid, stickiness_grid and recency_grid must be non-empty when calibrate=true")
        given = {"alpha": alpha, "stickiness": stickiness, "recency": recency}
        self.kept = [name for name, value in given.items() if value is not None]  # never overwritten by calibration
        self.alpha, self.stickiness, self.recency = (UNCALIBRATED[name] if value is None else value
                                                     for name, value in given.items())
        self.recent_blocks = recent_blocks
        self.calibrate_on_prefill = calibrate
        self.per_layer = per_layer
        self.burn_in_steps = burn_in_steps
        grids = {"alpha": alpha_grid, "stickiness": stickiness_grid, "recency": recency_grid}
        # the searched values of α, β, γ (a kept one: its value alone); the grid is their product, α-major
        self.grid_axes = [[given[name]] if name in self.kept else list(grids[name]) for name in grids]
        self.grid = list(itertools.product(*self.grid_axes))
        self._fitted: Any = None  # per-layer (alpha, stickiness, recency) tensors from EmaPredictor.calibrate


class EmaMembershipPredictorOptions(PredictorOptions):
    def __init__(self, alpha: float = 0.8) -> None:
        if not 0.0 <= alpha < 1.0:
            raise ValueError(f"predictor.alpha={alpha} must lie in [0, 1) (0: P = the last step's A)")
        self.alpha = alpha


class QuerySimilarityPredictorOptions(PredictorOptions):
    def __init__(self, cache_size: int = 64, neighbours: int = 2, recent_blocks: int = 1, fill_width: int = 0) -> None:
        """fill_width: blocks in the fill list the update writes for the kernel's propose (0: none).
        It pays where |P| exceeds what the neighbours' lists hold (|P| above the selections' size,
        budget.ratio > 1): the kernel's propose then takes the rest of P from it instead of ranking the
        whole row (H200, 128K, block 16, K = 32: 28.0 -> 8.9 µs at |P| = 128 with fill_width=128, for
        22 µs more per layer on the side stream, kernels_issue33.md); where |P| <= K the list is never
        read and costs 1.5 µs of propose (7.2 -> 8.7). The same P either way."""
        if cache_size < 1:
            raise ValueError(f"predictor.cache_size={cache_size} must be >= 1 (past queries kept per layer and KV head)")
        if not 1 <= neighbours <= cache_size:
            raise ValueError(f"predictor.neighbours={neighbours} must lie in [1, cache_size={cache_size}]")
        if recent_blocks < 0:
            raise ValueError(f"predictor.recent_blocks={recent_blocks} must be >= 0")
        if isinstance(fill_width, bool) or not isinstance(fill_width, int) or fill_width < 0:
            raise ValueError(f"predictor.fill_width={fill_width!r} must be an int >= 0 (0: no fill list)")
        self.cache_size, self.neighbours, self.recent_blocks = cache_size, neighbours, recent_blocks
        self.fill_width = fill_width


class SpinPredictorOptions(PredictorOptions):
    def __init__(
        self,
        alpha_vertical: float = 0.8,
        alpha_diagonal: float = 0.8,
        selection_bonus: float = 1.0,
        explore: float = 0.05,
        seed: int = 0,
    ) -> None:
        for name, a in (("alpha_vertical", alpha_vertical), ("alpha_diagonal", alpha_diagonal)):
            if not 0.0 <= a < 1.0:
                raise ValueError(f"predictor.{name}={a} must lie in [0, 1)")
        if not 0.0 <= explore < 1.0:
            raise ValueError(f"predictor.explore={explore} must lie in [0, 1) (the share of |P| drawn at random)")
        if selection_bonus < 0:
            raise ValueError(f"predictor.selection_bonus={selection_bonus} must be >= 0")
        self.alpha_vertical, self.alpha_diagonal = alpha_vertical, alpha_diagonal
        self.selection_bonus = selection_bonus
        self.explore = explore
        self.seed = seed


class BenchHitRatePredictorOptions(PredictorOptions):
    replays_selections = True  # the engine records a serial pass before decoding (prr/runtime/replay.py)

    def __init__(self, hit_rate: float = 0.7, seed: int = 0) -> None:
        if isinstance(hit_rate, bool) or not 0.0 <= float(hit_rate) <= 1.0:
            raise ValueError(f"predictor.hit_rate={hit_rate!r} must lie in [0, 1] (the share of A that P holds)")
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"predictor.seed={seed!r} must be an int >= 0")
        self.hit_rate, self.seed = float(hit_rate), seed
        self.record: dict[str, Any] = {}

    @property
    def declared_hit_rate(self) -> float:
        return self.hit_rate


class CrossLayerPredictorOptions(PredictorOptions):
    # the temporal half: EmaPredictorOptions for the check, EmaPredictor in CrossLayerPredictor
    temporal_class: type = EmaPredictorOptions

    def __init__(
        self,
        temporal_weight: float = 0.0,
        source_stickiness: float = 1.0,
        alpha: float | None = None,
        stickiness: float | None = None,
        recency: float | None = None,
        recent_blocks: int = 1,
        calibrate: bool = True,
        burn_in_steps: int = 4,
    ) -> None:
        if not 0.0 <= temporal_weight <= 1.0:
            raise ValueError(f"predictor.temporal_weight={temporal_weight} must lie in [0, 1] (0: cross-layer only, "
                             "1: the plain EMA)")
        if source_stickiness < 0:
            raise ValueError(f"predictor.source_stickiness={source_stickiness} must be >= 0")
        self.temporal_weight, self.source_stickiness = temporal_weight, source_stickiness
        self.temporal = self.temporal_class(alpha=alpha, stickiness=stickiness, recency=recency, recent_blocks=recent_blocks,
                                         calibrate=calibrate, burn_in_steps=burn_in_steps)
        # read by prr.config_check (calibration needs enough prefill-tail steps)
        self.calibrate_on_prefill, self.burn_in_steps = calibrate, burn_in_steps
