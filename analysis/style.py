"""Paper style for every prr figure: one colour per stage and per method (the same in all
figures), axis labels with units, single/double-column sizes, and saving as PDF + PNG with
no timestamps (re-running `make figures` on the same results gives the same bytes).

Colours: Okabe-Ito (colour-blind safe) for stages and selectors, a second set for predictors,
all distinct, so a colour never means two things. A method with no entry here (a new
predictor) gets a fixed colour from RESERVE chosen by a hash of its name: stable across
figures, but add it to METHOD_COLORS to give it a deliberate one.
"""

from __future__ import annotations

import zlib
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # headless: make figures, CI and notebooks never need a display

import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

# Stage order in stacked plots: the order they run (predict, then speculate beside select, repair, merge).
# The same words as prr.runtime.timing.STAGES (a test checks; not imported here: that would pull in torch).
STAGE_ORDER = ("predict", "select", "speculate", "repair", "merge")

STAGE_COLORS = {
    "predict": "#999999",    # grey
    "select": "#0072B2",     # blue
    "speculate": "#E69F00",  # orange
    "repair": "#D55E00",     # vermillion
    "merge": "#CC79A7",      # reddish purple
}

METHOD_COLORS = {
    # selectors
    "quest": "#009E73",      # bluish green
    "infllm": "#56B4E9",     # sky blue
    "less": "#B59B00",       # dark yellow (Okabe-Ito yellow is too light on white)
    "exact": "#000000",      # black: the selector oracle
    "dense": "#6F6F6F",      # dark grey: the reference
    # predictors
    "none": "#8C564B",       # brown: serial DSA
    "last_step": "#1F4E9C",  # dark blue
    "ema": "#C0143C",        # crimson
    "oracle": "#3B3B3B",     # near black: the 100%-hit bound
    "ema_calibrated": "#F4A6B8",  # light crimson: EMA, calibrated per layer
    "ema_fixed": "#7A0C26",  # dark crimson: EMA, fixed parameters
    "spin": "#7B3294",       # purple
    "query_similarity": "#4D9221",  # green
    "cross_layer": "#17BECF",  # cyan
    "profiled": "#A6761D",   # ochre: the profiled budget (serial DSA where PRR does not pay)
    "ema_membership": "#E7298A",  # magenta: EMA of selection membership (the graph engine's)
}
METHOD_ALIASES = {"serial": "none"}  # bench_decode's word for serial DSA
RESERVE = ("#8DA0CB", "#E78AC3", "#A6D854", "#66C2A5", "#FC8D62", "#B3B3B3", "#E5C494", "#1B9E77", "#7570B3", "#4D4D4D")

METHOD_LABELS = {"last_step": "last step", "ema": "EMA", "none": "serial (none)", "infllm": "InfLLM", "infllm_v2": "InfLLM-v2",
                 "quest": "Quest", "less": "LESS", "exact": "exact top-K", "dense": "dense", "oracle": "oracle",
                 "spin": "SPIN", "query_similarity": "query similarity", "cross_layer": "cross-layer", "cross_layer_ema": "cross-layer + EMA",
                 "ema_calibrated": "EMA (per-layer cal.)", "ema_fixed": "EMA (fixed)",
                 "profiled": "profiled budget (hit 0.90)", "ema_membership": "EMA of membership",
                 "less-trained": "LESS (trained map)"}
MARKERS = {"quest": "o", "infllm": "s", "less": "^", "exact": "D", "dense": "x", "none": "x", "last_step": "s",
           "ema": "o", "oracle": "D", "spin": "v", "query_similarity": "P", "cross_layer": "X", "ema_calibrated": "o",
           "ema_fixed": "o", "profiled": "*", "ema_membership": "h"}

# Sizes in inches: one column of a two-column paper, and the full width.
SINGLE = (3.4, 2.4)
DOUBLE = (7.0, 2.6)

RC = {
    "font.size": 8, "axes.labelsize": 8, "axes.titlesize": 8, "legend.fontsize": 7, "xtick.labelsize": 7,
    "ytick.labelsize": 7, "axes.spines.top": False, "axes.spines.right": False, "axes.grid": True,
    "grid.alpha": 0.3, "grid.linewidth": 0.5, "lines.linewidth": 1.2, "lines.markersize": 3.5,
    "legend.frameon": False, "figure.dpi": 100, "savefig.bbox": "tight", "pdf.fonttype": 42,
    "svg.hashsalt": "prr", "path.simplify": True,
}


def method_color(name: str) -> str:
    name = METHOD_ALIASES.get(name, name)
    if name in STAGE_COLORS:
        raise ValueError(f"{name!r} is a stage; use stage_color")
    return METHOD_COLORS.get(name) or RESERVE[zlib.crc32(name.encode()) % len(RESERVE)]


def stage_color(stage: str) -> str:
    if stage not in STAGE_COLORS:
        raise ValueError(f"stage {stage!r} is not one of {list(STAGE_COLORS)}")
    return STAGE_COLORS[stage]


def method_label(name: str) -> str:
    return METHOD_LABELS.get(name, name)


def marker(name: str) -> str:
    return MARKERS.get(name, "o")


def new_figure(size: tuple[float, float] = SINGLE, ncols: int = 1) -> tuple[Figure, list]:
    """A figure in paper style with `ncols` axes side by side."""
    # Set globally, not in an rc_context: legends and texts added after this call read rcParams then.
    matplotlib.rcParams.update(RC)
    fig, axes = plt.subplots(1, ncols, figsize=size, squeeze=False, layout="constrained")
    return fig, list(axes[0])


def save(fig: Figure, out_dir: str | Path, name: str) -> list[Path]:
    """name.pdf and name.png in out_dir, without creation dates, so the bytes depend only on the data."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / f"{name}.pdf", out_dir / f"{name}.png"]
    fig.savefig(paths[0], metadata={"CreationDate": None, "ModDate": None, "Producer": None, "Creator": None})
    fig.savefig(paths[1], dpi=200, metadata={"Software": None})
    plt.close(fig)
    return paths
