"""95% intervals for the numbers prr reports: a table cell without n and an interval is not a result.

- `wilson(successes, n)`: a proportion (an accuracy over samples, a hit rate over selections),
  Wilson's score interval; it stays inside [0, 1] and is sensible at 0 / n and n / n, where the
  normal approximation collapses to a point.
- `bootstrap_mean(values_per_prompt)`: a mean over prompts (locality, mass recall, hit rate per
  prompt): the percentile bootstrap that resamples *prompts*, not steps, since steps of one
  prompt are correlated and would make the interval too narrow.

Both return an `Interval` (estimate, low, high, n) whose `str` is the cell prr's tables print.
`score_interval(scores)`: an accuracy over samples, Wilson's where every score is 0 or 1, else
the bootstrap over samples (partial credit). `means_over_prompts(per_prompt, by, rates)` applies `bootstrap_mean` to a table's groups: the
columns a study writes for each rate (`<rate>`, `<rate>_lo`, `<rate>_hi`, `prompts`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

Z95 = 1.959963984540054  # two-sided 95% normal quantile


@dataclass(frozen=True)
class Interval:
    estimate: float
    low: float
    high: float
    n: int  # samples (proportions) or prompts (bootstrap means)

    def __str__(self) -> str:
        return f"{self.estimate:.3f} [{self.low:.3f}, {self.high:.3f}] (n={self.n})"

    def as_dict(self, prefix: str) -> dict[str, float | int]:
        """Flat columns for a results table: prefix, prefix_lo, prefix_hi, prefix_n."""
        return {prefix: self.estimate, f"{prefix}_lo": self.low, f"{prefix}_hi": self.high, f"{prefix}_n": self.n}


def wilson(successes: int, n: int, z: float = Z95) -> Interval:
    """Wilson score interval of successes / n (n >= 1, 0 <= successes <= n)."""
    if n < 1 or not 0 <= successes <= n:
        raise ValueError(f"wilson needs 0 <= successes <= n and n >= 1, got successes={successes}, n={n}")
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return Interval(p, max(0.0, centre - half), min(1.0, centre + half), n)


def bootstrap_mean(values: Sequence[float], resamples: int = 10_000, seed: int = 0,
                   level: float = 0.95) -> Interval:
    """Mean of one value per prompt and its percentile-bootstrap interval over prompts.
    values: [n_prompts] (each already that prompt's mean over its steps). n = 1 gives a
    degenerate interval (the value itself) and says so through n."""
    x = np.asarray(values, dtype=np.float64)
    if x.ndim != 1 or x.size == 0 or not np.isfinite(x).all():
        raise ValueError(f"bootstrap_mean needs a non-empty 1-D list of finite per-prompt values, got {values!r}")
    rng = np.random.default_rng(seed)
    means = x[rng.integers(0, x.size, size=(resamples, x.size))].mean(1)  # [resamples]
    tail = (1 - level) / 2 * 100
    low, high = np.percentile(means, [tail, 100 - tail])
    return Interval(float(x.mean()), float(low), float(high), int(x.size))


def bootstrap_mean_of_groups(groups: Sequence[Sequence[float]], resamples: int = 10_000, seed: int = 0,
                             level: float = 0.95) -> Interval:
    """The mean over groups of each group's mean (groups weighted equally whatever their sizes, e.g.
    RULER's tasks pooled when some tasks have more prompts than others) and its percentile bootstrap
    resampling the values within each group (stratified: every resample keeps each group's size).
    groups: [n_groups][n_g] per-prompt values; n = the values in all groups."""
    arrays = [np.asarray(g, dtype=np.float64) for g in groups]
    if not arrays or any(a.ndim != 1 or a.size == 0 or not np.isfinite(a).all() for a in arrays):
        raise ValueError(f"bootstrap_mean_of_groups needs non-empty 1-D groups of finite values, got {groups!r}")
    rng = np.random.default_rng(seed)
    means = np.mean([a[rng.integers(0, a.size, size=(resamples, a.size))].mean(1) for a in arrays], axis=0)
    tail = (1 - level) / 2 * 100
    low, high = np.percentile(means, [tail, 100 - tail])
    return Interval(float(np.mean([a.mean() for a in arrays])), float(low), float(high), int(sum(a.size for a in arrays)))


def score_interval(scores: Sequence[float]) -> Interval:
    """Accuracy over samples (one score in [0, 1] each) and its 95% interval: Wilson's for 0/1
    scores, else the bootstrap over samples (partial credit, e.g. a share of the answers found)."""
    x = [float(v) for v in scores]
    if all(v in (0.0, 1.0) for v in x):
        return wilson(int(sum(x)), len(x))
    return bootstrap_mean(x)


def means_over_prompts(per_prompt: pd.DataFrame, by: list[str], rates: Sequence[str]) -> pd.DataFrame:
    """per_prompt: one row per prompt and group of `by` (each rate already pooled within its prompt)
    -> one row per group: the `by` columns, each rate's mean over the group's prompts with its 95%
    bootstrap interval over prompts (`<rate>`, `<rate>_lo`, `<rate>_hi`), and `prompts` (n)."""
    rows = []
    for key, group in per_prompt.groupby(by, sort=False):
        row: dict[str, object] = dict(zip(by, key if isinstance(key, tuple) else (key,), strict=True))
        for rate in rates:
            interval = bootstrap_mean(group[rate].tolist())
            row.update({rate: interval.estimate, f"{rate}_lo": interval.low, f"{rate}_hi": interval.high})
        row["prompts"] = len(group)
        rows.append(row)
    return pd.DataFrame(rows)


def median_ratio_interval(runs: list[float], base: list[float], resamples: int = 10_000,
                          seed: int = 0) -> tuple[float, float, float]:
    """median(runs) / median(base) and its 95% percentile-bootstrap interval, each run's steps
    resampled independently (per-token device times of one run are near-independent draws).
    -> (ratio, low, high)."""
    a, b = np.asarray(runs, dtype=np.float64), np.asarray(base, dtype=np.float64)
    rng = np.random.default_rng(seed)
    ratios = (np.median(a[rng.integers(0, a.size, (resamples, a.size))], 1)
              / np.median(b[rng.integers(0, b.size, (resamples, b.size))], 1))
    low, high = np.percentile(ratios, [2.5, 97.5])
    return float(np.median(a) / np.median(b)), float(low), float(high)
