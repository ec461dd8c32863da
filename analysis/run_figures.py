"""Figures of one run, from its layers.csv: what the W&B logger attaches to the run as images
(and what a notebook draws for one run directory).

    run_figures(layers, title) -> {"per_layer_rates": Figure, "per_layer_stages": Figure}
layers: one row per layer with layer, hit_rate and, when present, last_step_overlap,
precision, t_<stage>_us (prr.metrics.per_layer's table).
"""

from __future__ import annotations

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from .figures import require
from .style import DOUBLE, STAGE_ORDER, method_color, new_figure, stage_color

RATES = {"hit_rate": ("hit rate |P∩A|/|A|", "ema"), "last_step_overlap": ("last-step overlap", "last_step"),
         "precision": ("precision |P∩A|/|P|", "oracle")}


def per_layer_rates(layers: pd.DataFrame, title: str = "") -> Figure:
    """Hit rate, last-step overlap and precision (%) against layer. Columns: layer, hit_rate
    (last_step_overlap, precision optional)."""
    require(layers, ["layer", "hit_rate"], "per_layer_rates")
    fig, (ax,) = new_figure(DOUBLE)
    layers = layers.sort_values("layer")
    for col, (label, method) in RATES.items():
        if col in layers.columns and layers[col].notna().any():
            ax.plot(layers["layer"], 100 * layers[col], marker="o", color=method_color(method), label=label)
    ax.set_xlabel("layer (index)")
    ax.set_ylabel("rate (%)")
    ax.set_ylim(0, 105)
    ax.set_title(title)
    ax.legend(loc="lower right", ncols=3)
    return fig


def per_layer_stages(layers: pd.DataFrame, title: str = "") -> Figure:
    """Median time of each stage per layer-step, stacked, against layer. Columns: layer, t_<stage>_us."""
    cols = [f"t_{s}_us" for s in STAGE_ORDER]
    require(layers, ["layer", *cols], "per_layer_stages")
    fig, (ax,) = new_figure(DOUBLE)
    layers = layers.sort_values("layer")
    bottom = np.zeros(len(layers))
    for stage, col in zip(STAGE_ORDER, cols, strict=True):
        height = layers[col].fillna(0).to_numpy()
        ax.bar(layers["layer"], height, 0.8, bottom=bottom, color=stage_color(stage), label=stage)
        bottom += height
    ax.set_xlabel("layer (index)")
    ax.set_ylabel("median time per decode step (µs)")
    ax.set_title(title)
    ax.legend(title="stage", loc="upper right", ncols=5)
    return fig


def run_figures(layers: pd.DataFrame, title: str = "") -> dict[str, Figure]:
    figures = {"per_layer_rates": per_layer_rates(layers, title)}
    if all(f"t_{s}_us" in layers.columns for s in STAGE_ORDER):
        figures["per_layer_stages"] = per_layer_stages(layers, title)
    return figures
