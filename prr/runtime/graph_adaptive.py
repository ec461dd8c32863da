"""`budget=adaptive` for the graph engine: serial DSA or PRR, chosen online per window of steps.

The engine's P has a static size (a CUDA graph fixes every shape), so instead of resizing P per
layer as the eager runtime's AdaptiveBudget does, the run captures both variants over one
cache and picks, for each window of steps (the windows the host already waits on for EOS),
the one that measured faster. A PRR window whose hit rate (|P ∩ A| / |A| at the engine's
|P|; the eager budget's `min_hit` is the predictor's hit rate at K) fell below `min_hit`
counts as slower whatever its time. The first two windows measure both; afterwards the variant not in
use is re-measured one window in every `probe_every`, so a change of regime (the context
grows, the predictor warms up or degrades) is seen. Per-window times are medians of the
steps' latencies, smoothed over windows of the same variant. The predictor learns inside
PRR's step only, so the first PRR steps after serial ones speculate over a P that has not
seen the serial steps' selections; the hit rate those windows measure includes that.
"""

from __future__ import annotations

from dataclasses import dataclass, field

VARIANTS = ("serial", "prr")


@dataclass
class WindowChoice:
    min_hit: float = 0.3  # PRR below this hit rate is not chosen
    smoothing: float = 0.5  # weight of the past in each variant's running time
    probe_every: int = 8  # windows between re-measurements of the variant not in use
    seconds: dict[str, float] = field(default_factory=dict)  # variant -> smoothed window median (s)
    hit_rate: float | None = None  # PRR's latest window hit rate
    windows: list[dict] = field(default_factory=list)  # what each window ran and measured (the run record)

    def __post_init__(self) -> None:
        if not 0.0 <= self.min_hit <= 1.0:
            raise ValueError(f"budget.min_hit={self.min_hit} must lie in [0, 1]")
        if not 0.0 <= self.smoothing < 1.0:
            raise ValueError(f"budget.smoothing={self.smoothing} must lie in [0, 1)")
        if self.probe_every < 2:
            raise ValueError(f"probe_every={self.probe_every} must be >= 2 (one window in probe_every re-measures)")

    def best(self) -> str:
        """The variant to run, from what was measured so far."""
        if "serial" not in self.seconds or "prr" not in self.seconds:
            return "serial"
        if self.hit_rate is not None and self.hit_rate < self.min_hit:
            return "serial"
        return "prr" if self.seconds["prr"] < self.seconds["serial"] else "serial"

    def next_variant(self) -> str:
        """The variant for the next window: each once first, then the best, re-probing the other."""
        n = len(self.windows)
        if n < len(VARIANTS):
            return VARIANTS[n]
        best = self.best()
        if n % self.probe_every == 0:
            return "prr" if best == "serial" else "serial"
        return best

    def observe(self, variant: str, median_s: float, hit_rate: float | None = None) -> None:
        """One finished window: its variant, the median of its steps' latencies (s), and for
        PRR the share of A its P held."""
        if variant not in VARIANTS:
            raise ValueError(f"variant {variant!r} is not one of {VARIANTS}")
        old = self.seconds.get(variant)
        self.seconds[variant] = median_s if old is None else self.smoothing * old + (1 - self.smoothing) * median_s
        if variant == "prr":
            self.hit_rate = hit_rate
        self.windows.append({"variant": variant, "median_ms": 1e3 * median_s, "hit_rate": hit_rate,
                             "choice_after": self.best()})
