"""Figure functions and their registry.

Each figure function takes one pandas DataFrame with the columns its docstring lists and
returns a matplotlib Figure (tables: a DataFrame). The registry at the bottom (FIGURES) says,
for each figure, which results files it reads, how to turn them into that DataFrame, and
the command that produces them. `make figures` (make_figures.py) and analysis/figures.ipynb
both walk it; to add a figure, write one function and add one Figure(...) entry.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.figure import Figure as MplFigure
from matplotlib.lines import Line2D
from matplotlib.ticker import FixedFormatter, NullLocator
from matplotlib.transforms import ScaledTranslation

from prr.intervals import Interval, bootstrap_mean, bootstrap_mean_of_groups, score_interval, wilson

from .style import (
    DOUBLE,
    RESERVE,
    SINGLE,
    STAGE_ORDER,
    marker,
    method_color,
    method_label,
    new_figure,
    stage_color,
)
from .technique_map import read_technique_runs, technique_map, technique_table


def require(frame: pd.DataFrame, columns: list[str], figure: str) -> pd.DataFrame:
    """The frame, after checking it has `columns`; the error names what is missing and what is there."""
    missing = [c for c in columns if c not in frame.columns]
    if missing:
        raise KeyError(f"figure {figure!r} needs column(s) {missing}; the DataFrame has {sorted(frame.columns)}")
    if frame.empty:
        raise ValueError(f"figure {figure!r} got an empty DataFrame")
    return frame


def complete(frame: pd.DataFrame) -> pd.DataFrame:
    """Rows of finished runs only (results-store frames carry a status column)."""
    return frame[frame["status"] == "complete"] if "status" in frame.columns else frame


# --- temporal locality ---------------------------------------------------------------------------
def overlap_per_layer(layers: pd.DataFrame) -> MplFigure:
    """Last-step overlap |A_t ∩ A_{t-1}|/|A_t| against layer, one line per selector.
    Columns: selector, layer, last_step_overlap."""
    require(layers, ["selector", "layer", "last_step_overlap"], "overlap_per_layer")
    fig, (ax,) = new_figure(SINGLE)
    for selector, rows in layers.groupby("selector", sort=False):
        rows = rows.sort_values("layer")
        ax.plot(rows["layer"], 100 * rows["last_step_overlap"], marker=marker(selector), color=method_color(selector),
                label=method_label(selector))
    ax.set_xlabel("layer (index)")
    ax.set_ylabel("last-step overlap (% of |A$_t$|)")
    ax.set_ylim(0, 100)
    ax.legend(loc="lower right")
    return fig


def overlap_cdf(steps: pd.DataFrame) -> MplFigure:
    """Empirical CDF of the last-step overlap over (decode step, layer, KV head), one line per
    selector. Columns: selector, overlap (a fraction; NaN rows, e.g. the first step, are left out)."""
    require(steps, ["selector", "overlap"], "overlap_cdf")
    fig, (ax,) = new_figure(SINGLE)
    for selector, rows in steps.groupby("selector", sort=False):
        values = np.sort(rows["overlap"].dropna().to_numpy()) * 100
        if values.size == 0:
            continue
        ax.step(values, np.arange(1, values.size + 1) / values.size, where="post", color=method_color(selector),
                label=f"{method_label(selector)} (median {np.median(values):.0f}%)")
    ax.set_xlabel("last-step overlap (% of |A$_t$|)")
    ax.set_ylabel("fraction of (step, layer, KV head)")
    ax.set_xlim(0, 100)
    ax.set_ylim(0, 1)
    ax.legend(loc="upper left")
    return fig


# --- hit rate --------------------------------------------------------------------------------------
def hit_rate_vs_budget(runs: pd.DataFrame) -> MplFigure:
    """Hit rate |P∩A|/|A| against the speculation budget |P|/K, one line per predictor.
    Columns: predictor, budget.ratio, hit_rate."""
    runs = complete(require(runs, ["predictor", "budget.ratio", "hit_rate"], "hit_rate_vs_budget"))
    fig, (ax,) = new_figure(SINGLE)
    for predictor, rows in runs.groupby("predictor", sort=False):
        rows = rows.sort_values("budget.ratio")
        ax.plot(rows["budget.ratio"], 100 * rows["hit_rate"], marker=marker(predictor),
                color=method_color(predictor), label=method_label(predictor))
    ax.set_xlabel("speculation budget |P| / K (ratio)")
    ax.set_ylabel("hit rate |P∩A|/|A| (%)")
    ax.legend(loc="best")
    return fig


def hit_rate_vs_ema(runs: pd.DataFrame) -> MplFigure:
    """EMA hit rate against alpha (score memory), one line per stickiness, |P| = K, no
    calibration. Columns: predictor.alpha, predictor.stickiness, hit_rate; optional
    last_step_overlap (drawn as the last-step predictor's reference line)."""
    runs = complete(require(runs, ["predictor.alpha", "predictor.stickiness", "hit_rate"], "hit_rate_vs_ema"))
    fig, (ax,) = new_figure(SINGLE)
    values = sorted(runs["predictor.stickiness"].unique())
    shades = np.linspace(0.35, 1.0, len(values))  # parameter values, not methods: shades of EMA's colour
    for shade, stickiness in zip(shades, values, strict=True):
        rows = runs[runs["predictor.stickiness"] == stickiness].sort_values("predictor.alpha")
        ax.plot(rows["predictor.alpha"], 100 * rows["hit_rate"], marker="o", color=method_color("ema"), alpha=shade,
                label=f"stickiness {stickiness:g}")
    if "last_step_overlap" in runs.columns:  # the last-step predictor's hit rate on the same decode
        ax.axhline(100 * runs["last_step_overlap"].median(), color=method_color("last_step"), linestyle="--",
                   linewidth=0.8, label="last step")
    ax.set_xlabel("EMA alpha (weight of past scores)")
    ax.set_ylabel("hit rate |P∩A|/|A| (%)")
    ax.legend(loc="lower left")
    return fig


# --- latency ---------------------------------------------------------------------------------------
def latency_breakdown(runs: pd.DataFrame) -> MplFigure:
    """Median per-layer time of each stage, stacked, against context length; one bar per
    predictor at each context (serial DSA = predictor none). Columns: prompt_tokens,
    predictor, t_predict_us, t_select_us, t_speculate_us, t_repair_us, t_merge_us; optional
    device (the title) and t_measured_us (the layer's time measured end to end, stages
    overlapped where the runtime overlaps them: a black tick on the bar)."""
    stage_cols = [f"t_{s}_us" for s in STAGE_ORDER]
    runs = complete(require(runs, ["prompt_tokens", "predictor", *stage_cols], "latency_breakdown"))
    contexts = sorted(runs["prompt_tokens"].unique())
    predictors = list(dict.fromkeys(runs["predictor"]))
    fig, (ax,) = new_figure(DOUBLE)
    width = 0.8 / len(predictors)
    for j, predictor in enumerate(predictors):
        rows = runs[runs["predictor"] == predictor].set_index("prompt_tokens").reindex(contexts)
        x = np.arange(len(contexts)) + (j - (len(predictors) - 1) / 2) * width
        bottom = np.zeros(len(contexts))
        for stage, col in zip(STAGE_ORDER, stage_cols, strict=True):
            height = rows[col].fillna(0).to_numpy()
            ax.bar(x, height, width * 0.9, bottom=bottom, color=stage_color(stage), edgecolor="white", linewidth=0.3,
                   label=stage if j == 0 else None)
            bottom += height
        if "t_measured_us" in rows.columns:
            ax.scatter(x, rows["t_measured_us"], marker="_", s=120, color="black", zorder=3,
                       label="measured end to end" if j == 0 else None)
            bottom = np.maximum(bottom, rows["t_measured_us"].fillna(0).to_numpy())
        for xi, top in zip(x, bottom, strict=True):
            ax.text(xi, top, method_label(predictor), ha="center", va="bottom", fontsize=6, rotation=90,
                    color=method_color(predictor))
    ax.set_xticks(np.arange(len(contexts)), [f"{c / 1024:.0f}K" if c >= 1024 else str(c) for c in contexts])
    ax.set_xlabel("context length (prompt tokens)")
    ax.set_ylabel("median time per layer-step (µs)")
    if "device" in runs.columns:
        ax.set_title(str(runs["device"].iloc[0]))
    ax.legend(title="stage", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.margins(y=0.45)
    return fig


def speedup(frame: pd.DataFrame, baseline: str = "none") -> MplFigure:
    """Per-token decode speedup over serial DSA (method `baseline`) measured in the same study:
    left against context length, right against the method's hit rate.
    Columns: context_tokens, method, latency_ms (per token), hit_rate."""
    frame = complete(require(frame, ["context_tokens", "method", "latency_ms", "hit_rate"], "speedup"))
    if baseline not in set(frame["method"]):
        raise ValueError(f"speedup needs the serial baseline method {baseline!r} at every context; methods: "
                         f"{sorted(set(frame['method']))}")
    base = frame[frame["method"] == baseline].groupby("context_tokens")["latency_ms"].median()
    frame = frame[frame["method"] != baseline].assign(speedup=lambda f: f["context_tokens"].map(base) / f["latency_ms"])
    fig, (left, right) = new_figure(DOUBLE, ncols=2)
    for method, rows in frame.groupby("method", sort=False):
        rows = rows.sort_values("context_tokens")
        style = {"marker": marker(method), "color": method_color(method), "label": method_label(method)}
        left.plot(rows["context_tokens"] / 1024, rows["speedup"], **style)
        right.plot(100 * rows["hit_rate"], rows["speedup"], linestyle="none", **style)
    for ax in (left, right):
        ax.axhline(1.0, color=method_color(baseline), linewidth=0.8, linestyle="--")
        ax.set_ylabel(f"speedup over {method_label(baseline)} (×)")
    left.set_xlabel("context length (K tokens)")
    right.set_xlabel("hit rate |P∩A|/|A| (%)")
    left.legend(loc="best")
    return fig


def speedup_from_runs(runs: pd.DataFrame) -> pd.DataFrame:
    """The speedup figure's frame from a results-store frame of the speedup sweep."""
    runs = complete(require(runs, ["prompt_tokens", "predictor", "token_latency_median_ms"], "speedup"))
    return pd.DataFrame({"context_tokens": runs["prompt_tokens"], "method": runs["predictor"],
                         "latency_ms": runs["token_latency_median_ms"],
                         "hit_rate": runs.get("hit_rate", pd.Series(np.nan, index=runs.index))})


# bench_decode's token rows -> predictor names. Files before the one-engine change call the
# engine's EMA of selection membership "prr_ema": it is the `ema_membership` predictor.
BENCH_METHODS = {"serial": "none", "prr_ema": "ema_membership", "prr_ema_membership": "ema_membership",
                 "prr_last_step": "last_step", "prr_profiled_0.90": "profiled"}


def first_setting(frame: pd.DataFrame) -> pd.DataFrame:
    """Rows of bench_decode's first (selector, block, top-K) setting at its smallest batch."""
    first = frame.iloc[0]
    keep = (frame["selector"] == first["selector"]) & (frame["block"] == first["block"]) & \
        (frame["topk_tokens"] == first["topk_tokens"]) & (frame["batch"] == frame["batch"].min())
    return frame[keep]


def speedup_from_bench_decode(frame: pd.DataFrame) -> pd.DataFrame:
    """The speedup figure's frame from experiments/bench_decode.py's OUT_token.csv (columns batch,
    context, block, topk_tokens, selector, variant, cuda_graphs, hit_rate, token_us): CUDA graphs
    on, its first setting; serial DSA is the baseline (method none), PRR with real predictors and
    with fixed P at controlled hit rates are the methods (variants prr_*); dense and other
    baselines are left out."""
    frame = require(frame, ["batch", "context", "block", "topk_tokens", "selector", "variant", "cuda_graphs",
                            "hit_rate", "token_us"], "speedup_h200")
    # The baseline (serial) and PRR's variants; dense and other baselines (serial_uncompiled) are left out.
    keep = frame["variant"].eq("serial") | frame["variant"].str.startswith("prr_")
    # One engine configuration: cuBLAS projections, no PDL (the _fused / _fused_pdl variants are
    # another baseline's; README compares them).
    keep &= ~frame["variant"].str.contains("_fused")
    frame = first_setting(frame[frame["cuda_graphs"].astype(bool) & keep])
    method = frame["variant"].map(lambda v: BENCH_METHODS.get(v, v.replace("prr_fixed_", "fixed P, hit ")))
    return pd.DataFrame({"context_tokens": frame["context"], "method": method, "latency_ms": frame["token_us"] / 1e3,
                         "hit_rate": frame["hit_rate"]})


def prr_map(frame: pd.DataFrame) -> MplFigure:
    """Where PRR pays on the attention stage: speedup of PRR over serial DSA against the hit
    rate, one line per (batch, block, top-K) configuration, left Quest, right InfLLM; the
    dotted line at each configuration's 100%-hit point is the overlap ceiling (perfect
    overlap with the same kernels), and where the frame has `stage_overlap` an x at serial /
    (PRR's step up to the join): the most a free repair + merge could give. Columns:
    bench_decode's OUT_stage.csv (selector, batch, context, block, topk_tokens,
    target_hit_rate, serial, prr, prr_ideal_overlap[, stage_overlap])."""
    frame = require(frame, ["selector", "batch", "context", "block", "topk_tokens", "target_hit_rate", "serial", "prr",
                            "prr_ideal_overlap"], "prr_map_h200")
    frame = frame[frame["context"] == frame["context"].max()]  # the longest context: one panel per selector
    selectors = sorted(set(frame["selector"]), key=["quest", "infllm"].index if set(frame["selector"]) <= {
        "quest", "infllm"} else str)
    fig, axes = new_figure(DOUBLE, ncols=len(selectors))
    axes = np.atleast_1d(axes)
    configs = sorted({(b, k, bs) for b, k, bs in zip(frame["batch"], frame["topk_tokens"], frame["block"], strict=True)})
    colors = dict(zip(configs, RESERVE * (len(configs) // len(RESERVE) + 1), strict=False))
    for ax, selector in zip(axes, selectors, strict=True):
        rows = frame[frame["selector"] == selector]
        for (batch, topk, block), cfg in rows.groupby(["batch", "topk_tokens", "block"]):
            cfg = cfg.sort_values("target_hit_rate")
            color = colors[(batch, topk, block)]
            ax.plot(100 * cfg["target_hit_rate"], cfg["serial"] / cfg["prr"], marker="o", color=color,
                    label=f"B={batch}, K={topk // 1024}K, block {block}")
            top = cfg[cfg["target_hit_rate"] == cfg["target_hit_rate"].max()]
            ax.plot(100 * top["target_hit_rate"], top["serial"] / top["prr_ideal_overlap"], marker="_", markersize=14,
                    color=color, linestyle="none")
            if "stage_overlap" in top:
                ax.plot(100 * top["target_hit_rate"], top["serial"] / top["stage_overlap"], marker="x", color=color,
                        linestyle="none")
        ax.axhline(1.0, color=method_color("none"), linewidth=0.8, linestyle="--")
        ax.set_title(f"{method_label(selector)}, {round(int(rows['context'].iloc[0]) / 1024)}K context")
        ax.set_xlabel("hit rate |P∩A|/|A| (%)")
        ax.set_ylabel("attention-stage speedup over serial DSA (×)")
    axes[0].legend(loc="upper left", fontsize="x-small", ncol=2)
    # The key to the markers at 100% hit (in each configuration's colour), in the last panel (beside the
    # configurations' legend when there is one panel).
    key = [Line2D([], [], marker="_", markersize=14, color="#3B3B3B", linestyle="none",
                  label=PRR_MAP_KEY["_"])]
    if "stage_overlap" in frame:
        key.append(Line2D([], [], marker="x", color="#3B3B3B", linestyle="none", label=PRR_MAP_KEY["x"]))
    key.append(Line2D([], [], color=method_color("none"), linewidth=0.8, linestyle="--", label=PRR_MAP_KEY["--"]))
    if len(axes) > 1:
        axes[-1].legend(handles=key, loc="upper left", fontsize="x-small")
    else:
        handles, _ = axes[0].get_legend_handles_labels()
        axes[0].legend(handles=handles + key, loc="upper left", fontsize="x-small", ncol=2)
    return fig


PRR_MAP_KEY = {"_": "bar: ceiling, perfect overlap (same kernels, 100% hit)",
               "x": "×: serial / PRR up to the join (free repair + merge)",
               "--": "serial DSA (1×)"}


# Kernel name -> where a decode token's device time goes (profile_decode.py's rows).
TOKEN_PARTS = (
    # (_dense_gemv_kernel: the fused projections, their norm / SwiGLU / residual add inside)
    ("dense GEMVs (weights)", ("nvjet", "gemv", "_dense_rows", "gemm", "cublas", "splitkreduce", "sm90_xmma")),
    ("q|k|v GEMV + RoPE + KV append (one launch)", ("_qkv_rope_append",)),
    ("select: Quest score", ("_quest_score",)),
    ("select: top-k", ("_topk",)),
    ("select: fused score + top-k", ("_quest_select",)),
    ("attention over A (and 2 dense layers)", ("sparse_decode",)),
    ("merge of split partials", ("merge_partials",)),
    ("KV append + RoPE + metadata", ("_append_token",)),
    ("norms + residual adds, SiLU (compiled)", ("triton_",)),
)


def token_part(kernel: str) -> str:
    name = kernel.lower()
    return next((part for part, keys in TOKEN_PARTS if any(k in name for k in keys)), "other (copies, index, fill)")


def read_profiles(*paths: Path) -> pd.DataFrame:
    """profile_decode CSVs, one `profile` label per file (its name after 'profile_decode_')."""
    return pd.concat([pd.read_csv(p).assign(profile=Path(p).stem.removeprefix("profile_decode_")) for p in paths],
                     ignore_index=True)


def token_profile(frame: pd.DataFrame) -> MplFigure:
    """Where one decode token's device time goes, one stacked bar per profile (kernel time
    summed per step by part; launch gaps are not kernel time). Columns: profile, kernel,
    us_per_step (experiments/profile_decode.py)."""
    frame = require(frame, ["profile", "kernel", "us_per_step"], "token_profile")
    frame = frame.assign(part=frame["kernel"].map(token_part))
    parts = [p for p, _ in TOKEN_PARTS] + ["other (copies, index, fill)"]
    table = frame.pivot_table(index="profile", columns="part", values="us_per_step", aggfunc="sum").reindex(
        columns=parts).fillna(0.0) / 1e3
    table = table.loc[:, table.sum() > 0]
    fig, (ax,) = new_figure(DOUBLE)
    left = np.zeros(len(table))
    colors = RESERVE * (len(table.columns) // len(RESERVE) + 1)
    for color, part in zip(colors, table.columns, strict=False):
        ax.barh(np.arange(len(table)), table[part], left=left, color=color, edgecolor="white", linewidth=0.3,
                label=part)
        left += table[part].to_numpy()
    for y, total in enumerate(left):
        ax.text(total, y, f" {total:.2f} ms", va="center", fontsize=7)
    ax.set_yticks(np.arange(len(table)), list(table.index))
    ax.set_xlabel("device time per decode token (ms, kernels only)")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=3, fontsize="x-small")
    return fig


def stage_breakdown_from_bench_decode(frame: pd.DataFrame, hit_rate: float = 0.9) -> pd.DataFrame:
    """latency_breakdown's frame from bench_decode's OUT_stage.csv (per layer, µs: stage_select,
    stage_speculate, stage_repair, stage_merge, each timed alone) at one controlled hit rate."""
    frame = require(frame, ["batch", "context", "block", "topk_tokens", "selector", "target_hit_rate", "stage_select",
                            "stage_speculate", "stage_repair", "stage_merge"], "latency_breakdown_h200")
    frame = first_setting(frame[np.isclose(frame["target_hit_rate"], hit_rate)])
    zero = pd.Series(0.0, index=frame.index)
    # Serial DSA: select, then attend over A (the runtime's repair stage with P empty).
    serial = pd.DataFrame({"prompt_tokens": frame["context"], "predictor": "none", "t_predict_us": zero,
                           "t_select_us": frame["stage_select"], "t_speculate_us": zero,
                           "t_repair_us": frame.get("stage_attend_A", zero), "t_merge_us": zero,
                           "t_measured_us": frame.get("serial", zero)})
    prr = pd.DataFrame({"prompt_tokens": frame["context"], "predictor": f"fixed P, hit {hit_rate:.2f}",
                        "t_predict_us": zero, **{f"t_{s}_us": frame[f"stage_{s}"] for s in
                                                 ("select", "speculate", "repair", "merge")},
                        "t_measured_us": frame.get("prr", zero)})
    both = pd.concat([serial, prr], ignore_index=True)
    return both.assign(device="H200 (each stage timed alone; tick: measured, speculation overlapped)")


# --- selector fidelity ------------------------------------------------------------------------------
LINESTYLES = ("-", (0, (5, 2)), (0, (1, 1.5)), (0, (6, 2, 1, 2)), (0, (3, 1, 1, 1, 1, 1)))


def selector_fidelity(frame: pd.DataFrame) -> MplFigure:
    """Attention-mass recall (left) and output relative error against dense attention (right)
    against the top-K budget, one line per selector. Columns: selector, budget_tokens,
    mean_mass_recall, mean_output_relerr."""
    cols = ["selector", "budget_tokens", "mean_mass_recall", "mean_output_relerr"]
    require(frame, cols, "selector_fidelity")
    fig, (left, right) = new_figure(DOUBLE, ncols=2)
    # Selectors can coincide (LESS selects as Quest does, so their recall is the same): each line gets its own
    # dash pattern and marker, drawn thinner and with smaller markers than the lines before it, so an earlier
    # line stays visible around a later one on top; a curve equal to an earlier one says so in the legend.
    recalls: dict[str, np.ndarray] = {}
    for i, (selector, rows) in enumerate(frame.groupby("selector", sort=False)):
        rows = rows.sort_values("budget_tokens")
        recall = rows["mean_mass_recall"].to_numpy()
        same = next((method_label(s) for s, r in recalls.items() if len(r) == len(recall) and np.allclose(r, recall)),
                    None)
        recalls[selector] = recall
        style = {"marker": marker(selector), "color": method_color(selector),
                 "linestyle": LINESTYLES[i % len(LINESTYLES)], "linewidth": max(0.7, 2.2 - 0.5 * i),
                 "markersize": max(2.5, 6.0 - 0.9 * i), "markerfacecolor": "none" if i % 2 == 0 else None,
                 "zorder": 2 + i,
                 "label": method_label(selector) + (f": recall = {same}'s" if same else "")}
        left.plot(rows["budget_tokens"], 100 * rows["mean_mass_recall"], **style)
        right.plot(rows["budget_tokens"], 100 * rows["mean_output_relerr"], **style)
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted(frame["budget_tokens"].unique()), [str(b) for b in sorted(frame["budget_tokens"].unique())])
        ax.set_xlabel("top-K budget (tokens)")
    left.set_ylabel("attention-mass recall (%)")
    right.set_ylabel("output error ‖o−o$_{dense}$‖/‖o$_{dense}$‖ (%)")
    right.set_yscale("log")
    right.legend(loc="lower left")  # the corner the falling error curves leave free
    return fig


# --- accuracy -----------------------------------------------------------------------------------------
def accuracy_table(frame: pd.DataFrame, value: str = "score") -> pd.DataFrame:
    """Accuracy table: one row per method, one column per task, plus the mean over tasks.
    Columns: task, method, and `value` (a score in [0, 1]); with `n`, `low` and `high` (one row
    per cell: its samples and 95% interval, accuracy_frame) each cell reads "score [low, high] n=N"
    ("score n=N" where no interval is known) and the mean column stays a number."""
    require(frame, ["task", "method", value], "accuracy_table")
    table = frame.pivot_table(index="method", columns="task", values=value, aggfunc="mean", sort=False)
    mean = table.mean(axis=1)
    if {"n", "low", "high"} <= set(frame.columns):
        cells = frame.assign(cell=[
            f"{r[value]:.3f} [{r['low']:.2f}, {r['high']:.2f}] n={int(r['n'])}" if pd.notna(r["low"])
            else f"{r[value]:.3f} n={int(r['n'])}" for _, r in frame.iterrows()])
        table = cells.pivot_table(index="method", columns="task", values="cell", aggfunc="first", sort=False)
        table = table.reindex(mean.index)
    table["mean"] = mean
    return table


def accuracy_frame(frame: pd.DataFrame) -> pd.DataFrame:
    """accuracy_table's frame from experiments/accuracy_study.py's CSV (task, context_tokens,
    selector, predictor, budget_tokens, accuracy) or from a results-store frame of the accuracy
    sweep (task, selector, predictor, accuracy, optionally topk_blocks/block_size)."""
    frame = complete(require(frame, ["task", "selector", "predictor", "accuracy"], "accuracy_table"))

    def method(row: pd.Series) -> str:
        if row["selector"] == "dense":
            return "dense"
        kind = "serial" if row["predictor"] == "none" else f"PRR {row['predictor']}"
        budget = row.get("budget_tokens")
        return f"{row['selector']} {kind}" + (f" @{int(budget)}" if pd.notna(budget) else "")

    task = frame["task"].astype(str)
    if "context_tokens" in frame.columns:
        task = task + " " + (frame["context_tokens"] // 1024).astype(int).astype(str) + "K"
    out = pd.DataFrame({"task": task, "method": frame.apply(method, axis=1), "score": frame["accuracy"]})
    if "samples" in frame.columns:  # accuracy_study's CSV: each cell's n and 95% interval
        out["n"] = frame["samples"].astype(int)
        out["low"], out["high"] = zip(*[accuracy_interval(r) for _, r in frame.iterrows()], strict=True)
    return out


def accuracy_interval(row: pd.Series) -> tuple[float, float]:
    """A cell's 95% interval (accuracy_lo, accuracy_hi: accuracy_study's, or read_accuracy's from the
    per-sample scores), NaN where neither is known."""
    if pd.notna(row.get("accuracy_lo")) and pd.notna(row.get("accuracy_hi")):
        return float(row["accuracy_lo"]), float(row["accuracy_hi"])
    return float("nan"), float("nan")


ACCURACY_CELL = ["task", "context_tokens", "selector", "predictor", "budget_tokens"]


def csv_stem(path: Path | str) -> str:
    """A results file's name without .csv or .csv.gz (large stores are committed gzipped)."""
    return Path(path).name.removesuffix(".gz").removesuffix(".csv")


def read_accuracy(*paths: Path) -> pd.DataFrame:
    """accuracy_study.py tables, each with its per-sample file (`<name>_samples.csv[.gz]`, given among
    paths) where the table predates its interval columns: each cell's accuracy_lo / accuracy_hi from
    its samples' scores (prr.intervals.score_interval, accuracy_study's rule)."""
    tables, samples = [], {csv_stem(p): Path(p) for p in paths if csv_stem(p).endswith("_samples")}
    for path in (Path(p) for p in paths if not csv_stem(p).endswith("_samples")):
        table = pd.read_csv(path)
        source = samples.get(f"{csv_stem(path)}_samples")
        if source is not None and "accuracy_lo" not in table.columns:
            scores = pd.read_csv(source)
            cells = scores.groupby(ACCURACY_CELL, dropna=False)["score"].apply(lambda s: score_interval(s.tolist()))
            bounds = pd.DataFrame({"accuracy_lo": cells.map(lambda i: i.low), "accuracy_hi": cells.map(lambda i: i.high),
                                   "interval_n": cells.map(lambda i: i.n)}).reset_index()
            table = table.merge(bounds, on=ACCURACY_CELL, how="left")
            if not (table["interval_n"] == table["samples"]).all():
                raise ValueError(f"{source}: its samples do not match {path}'s counts; regenerate the table with "
                                 f"accuracy_study.py --report {source}")
            table = table.drop(columns="interval_n")
        tables.append(table)
    return pd.concat(tables, ignore_index=True)


ACCURACY_PROMPT = ["task", "context_tokens", "sample"]  # a prompt: one task's sample at one context


def complete_prompts(samples: pd.DataFrame) -> pd.DataFrame:
    """The rows of the prompts that every config of their context scored (a row with no score is no
    row), so each config's mean at a context averages the same prompts."""
    samples = samples[samples["score"].notna()]
    twice = samples.duplicated([*ACCURACY_PROMPT, "config"], keep=False)
    if twice.any():
        raise ValueError(f"{int(twice.sum())} rows score the same (task, context, sample, config) twice, e.g. "
                         f"{samples.loc[twice, [*ACCURACY_PROMPT, 'config']].iloc[0].tolist()}")
    configs = samples.groupby("context_tokens")["config"].transform("nunique")
    scored = samples.groupby(ACCURACY_PROMPT)["config"].transform("nunique")
    return samples[scored == configs]


def accuracy_config_label(selector: str, predictor: str) -> str:
    if selector == "dense":
        return "dense"
    return f"{method_label(selector)}, " + ("serial" if predictor == "none" else f"PRR ({method_label(predictor)})")


def accuracy_vs_context_points(samples: pd.DataFrame) -> pd.DataFrame:
    """One row per (context, config): the mean over tasks of each task's mean score on the context's
    complete prompts (complete_prompts; tasks weighted equally, so a context whose tasks have unequal
    numbers of prompts is not tilted towards the fuller ones) and its 95% percentile bootstrap
    resampling prompts within each task (prr.intervals.bootstrap_mean_of_groups); n = prompts.
    Columns of samples: accuracy_study's per-sample store (task, context_tokens, sample, config,
    selector, predictor, budget_tokens, score)."""
    samples = require(samples, [*ACCURACY_PROMPT, "config", "selector", "predictor", "budget_tokens", "score"],
                      "accuracy_vs_context")
    kept = complete_prompts(samples)
    rows = []
    for (context, config), cell in kept.groupby(["context_tokens", "config"], sort=False):
        interval = bootstrap_mean_of_groups([g.tolist() for _, g in cell.groupby("task")["score"]])
        first = cell.iloc[0]
        rows.append({"context_tokens": int(context), "config": config, "selector": first["selector"],
                     "predictor": first["predictor"], "budget_tokens": first["budget_tokens"],
                     "label": accuracy_config_label(first["selector"], first["predictor"]),
                     "mean": interval.estimate, "low": interval.low, "high": interval.high, "n": interval.n})
    return pd.DataFrame(rows).sort_values(["context_tokens", "config"], ignore_index=True)


def context_tick(tokens: int) -> str:
    return f"{tokens / 1024:.0f}K" if tokens >= 1024 else str(tokens)


def accuracy_vs_context(samples: pd.DataFrame) -> MplFigure:
    """Accuracy pooled over tasks against context, one panel per top-K budget: dense (the
    reference, in every panel) and, per selector, serial DSA (solid, filled markers) and PRR
    (dashed, open markers, the selector's colour); each point the mean over tasks of each task's mean
    score on the context's prompts that every config scored, with its 95% bootstrap interval
    (prompts resampled within each task) as an error bar
    (points of one context dodged sideways), n (prompts) under each context's tick.
    Columns: those of accuracy_vs_context_points."""
    points = accuracy_vs_context_points(samples)
    contexts = sorted(points["context_tokens"].unique())
    prompts = points.groupby("context_tokens")["n"].max()
    budgets = sorted(points["budget_tokens"].dropna().unique())
    selectors = list(dict.fromkeys(samples.loc[samples["selector"] != "dense", "selector"]))  # the store's order
    order = {s: i for i, s in enumerate(["dense", *selectors])}
    fig, axes = new_figure((DOUBLE[0], DOUBLE[1] + 0.3), ncols=len(budgets))
    for ax, budget in zip(axes, budgets, strict=True):
        panel = points[(points["budget_tokens"] == budget) | (points["selector"] == "dense")]
        configs = sorted(dict.fromkeys(zip(panel["selector"], panel["predictor"], strict=True)),
                         key=lambda c: (order[c[0]], c[1] != "none", c[1]))
        for i, (selector, predictor) in enumerate(configs):
            rows = panel[(panel["selector"] == selector) & (panel["predictor"] == predictor)].sort_values("context_tokens")
            serial = predictor == "none"
            color = method_color(selector)
            # Each config's points shifted sideways by a few points (display space: the data keep their context).
            shift = ax.transData + ScaledTranslation((i - (len(configs) - 1) / 2) * 3.5 / 72, 0, fig.dpi_scale_trans)
            bars = ax.errorbar(rows["context_tokens"], 100 * rows["mean"],
                               yerr=100 * np.vstack([rows["mean"] - rows["low"], rows["high"] - rows["mean"]]),
                               transform=shift, color=color, marker=marker(selector), markersize=4,
                               markerfacecolor=color if serial else "white", linestyle="-" if serial else "--",
                               elinewidth=0.9, capsize=0, label=rows["label"].iloc[0])
            if not serial:
                bars.lines[2][0].set_linestyle("--")
        ax.set_xscale("log", base=2)
        ax.set_xticks(contexts)
        # A FixedFormatter, not set_xticks(labels=...) (a FuncFormatter there): figure_data records its words.
        ax.xaxis.set_major_formatter(FixedFormatter([f"{context_tick(c)}\nn={prompts[c]}" for c in contexts]))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xlim(contexts[0] / 1.5, contexts[-1] * 1.5)
        ax.set_title(f"top-K budget {int(budget):,} tokens", fontsize="small")
        ax.set_xlabel("context (tokens; n: prompts)")
    # Limits from the points (autoscaling skips artists drawn through the shifted transform); one range for all panels.
    low, high = 100 * points["low"].min(), 100 * points["high"].max()
    pad = max(2.0, 0.08 * (high - low))
    for ax in axes:
        ax.set_ylim(max(low - pad, 0.0), min(high + pad, 100.0))
    axes[0].set_ylabel("accuracy (mean score, %)")
    axes[-1].legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="x-small")
    return fig


PREDICTOR_STUDY_INPUTS = tuple(f"experiments/results/{where}/issue34/predictor_study_qwen_{stem}_by_predictor.csv"
                               for where, stem in (("cpu", "4096_20prompts"), ("cpu", "8192_20prompts"),
                                                   ("cpu", "16384_20prompts"), ("h200", "32768_20prompts")))


def read_predictor_study(*paths: Path) -> pd.DataFrame:
    """predictor_study.py's _by_predictor tables, one per context -> one frame with context_tokens
    (from the command each row carries: --context-tokens N)."""
    frames = []
    for path in paths:
        frame = pd.read_csv(path)
        words = shlex.split(frame["command"].iloc[0])
        frame["context_tokens"] = int(words[words.index("--context-tokens") + 1])
        frames.append(frame)
    return pd.concat(frames, ignore_index=True)


def predictor_hit_rate_vs_context(frame: pd.DataFrame, ratio: float = 1.0) -> MplFigure:
    """Hit rate |P∩A|/|A| at |P| = ratio·K against context, one line per predictor measured at every
    context, each point the
    mean over prompts with its 95% bootstrap interval over prompts as an error bar; n (prompts)
    under each context's tick. Columns: context_tokens, predictor, ratio, hit_rate, hit_rate_lo,
    hit_rate_hi, prompts."""
    frame = require(frame, ["context_tokens", "predictor", "ratio", "hit_rate", "hit_rate_lo", "hit_rate_hi", "prompts"],
                    "predictor_hit_rate_vs_context")
    frame = frame[np.isclose(frame["ratio"], ratio)]
    contexts = sorted(frame["context_tokens"].unique())
    # Only the predictors measured at every context: a line with a gap would compare other prompts.
    everywhere = frame.groupby("predictor")["context_tokens"].nunique() == len(contexts)
    frame = frame[frame["predictor"].map(everywhere)]
    prompts = frame.groupby("context_tokens")["prompts"].max()
    fig, axes = new_figure(SINGLE)
    ax = axes[0]
    names = list(dict.fromkeys(frame["predictor"]))
    for i, name in enumerate(names):
        rows = frame[frame["predictor"] == name].sort_values("context_tokens")
        shift = ax.transData + ScaledTranslation((i - (len(names) - 1) / 2) * 2.5 / 72, 0, fig.dpi_scale_trans)
        ax.errorbar(rows["context_tokens"], 100 * rows["hit_rate"],
                    yerr=100 * np.vstack([rows["hit_rate"] - rows["hit_rate_lo"], rows["hit_rate_hi"] - rows["hit_rate"]]),
                    transform=shift, color=method_color(name), marker=marker(name), markersize=3.5,
                    elinewidth=0.9, capsize=0, label=method_label(name))
    ax.set_xscale("log", base=2)
    ax.set_xticks(contexts)
    ax.xaxis.set_major_formatter(FixedFormatter([f"{context_tick(c)}\nn={prompts[c]}" for c in contexts]))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xlim(contexts[0] / 1.5, contexts[-1] * 1.5)
    low, high = 100 * frame["hit_rate_lo"].min(), 100 * frame["hit_rate_hi"].max()
    ax.set_ylim(max(low - 3.0, 0.0), min(high + 3.0, 100.0))
    ax.set_xlabel("context (tokens; n: prompts)")
    ax.set_ylabel(f"hit rate at |P| = {ratio:g}·K (%)")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="x-small")
    return fig


def paired_median_ratio(runs: list[float], base: list[float], resamples: int = 10_000, seed: int = 0):
    """median(runs) / median(base), runs[i] and base[i] one prompt's two measurements, and its 95%
    percentile-bootstrap interval resampling *prompts* (pairs kept together; prr.intervals'
    median_ratio_interval resamples two runs' steps independently) -> Interval (n: prompts)."""
    a, b = np.asarray(runs, dtype=np.float64), np.asarray(base, dtype=np.float64)
    if a.shape != b.shape or a.ndim != 1 or a.size == 0:
        raise ValueError(f"paired_median_ratio needs two equal-length non-empty lists, got {a.shape} and {b.shape}")
    picks = np.random.default_rng(seed).integers(0, a.size, size=(resamples, a.size))  # [resamples, prompts]
    ratios = np.median(a[picks], 1) / np.median(b[picks], 1)
    low, high = np.percentile(ratios, [2.5, 97.5])
    return Interval(float(np.median(a) / np.median(b)), float(low), float(high), int(a.size))


def _cell(interval: Interval | None, digits: int = 3) -> str:
    if interval is None:
        return "–"
    return f"{interval.estimate:.{digits}f} [{interval.low:.{digits}f}, {interval.high:.{digits}f}]"


def _identity_cell(same: int, n: int) -> str:
    interval = wilson(same, n)
    return (f"{same:,} / {n:,} = {100 * interval.estimate:.1f}% "
            f"[{100 * interval.low:.1f}, {100 * interval.high:.1f}]")


POOLED_COLUMNS = ["config", "prompts n", "accuracy, serial / PRR", "= dense, serial / PRR", "PRR = serial tokens",
                  "PRR / serial time", "hit (PRR)"]


def captured_rows(samples: pd.DataFrame) -> pd.Series:
    """Rows whose decode_s includes building its config's engine (on a GPU, capturing its graphs):
    the store's includes_capture where written, else each (command, config)'s first row in store
    order (a process's first batch of that config; stores before the column) -> bool Series."""
    derived = ~samples.duplicated(["command", "config"]) if "command" in samples else pd.Series(False, samples.index)
    if "includes_capture" not in samples:
        return derived
    written = samples["includes_capture"]
    return written.where(written.notna(), derived).astype(bool)


def accuracy_pooled(samples: pd.DataFrame) -> pd.DataFrame:
    """RULER's tasks pooled, per context (the index): a dense row, one row per (selector, top-K
    budget) pairing serial DSA (predictor none) with PRR (any other predictor), and an "all sparse"
    row pooling PRR = serial tokens over the context's pairs. Only the prompts every config of the
    context scored count (complete_prompts). Cells: accuracy (mean over tasks of each task's mean
    score, 95% bootstrap resampling prompts within each task: accuracy_vs_context_points); "= dense": decodes whose token_ids equal dense's for
    the same prompt; PRR = serial tokens: k / n with Wilson's 95% interval; PRR / serial time: ratio of
    the median decode_s over the prompts whose two decodes each ran alone (batch_rows 1; missing: 1)
    and built no engine (captured_rows), 95% bootstrap over prompts (paired_median_ratio), n given
    where prompts were dropped; hit: PRR's hit_rate of the decodes that ran alone (a batch's PRR is
    calibrated on the batch's prefill tails), mean over prompts with its 95% bootstrap. Columns of
    samples: accuracy_study's store (task, context_tokens, sample, config, selector, predictor,
    budget_tokens, score, token_ids, decode_s, hit_rate, optionally batch_rows, includes_capture,
    command)."""
    samples = require(samples, [*ACCURACY_PROMPT, "config", "selector", "predictor", "budget_tokens", "score",
                                "token_ids", "decode_s", "hit_rate"], "accuracy_pooled")
    accuracies = {(int(p.context_tokens), p.config): Interval(p.mean, p.low, p.high, int(p.n))
                  for p in accuracy_vs_context_points(samples).itertuples()}
    kept = complete_prompts(samples.assign(captured=captured_rows(samples))).copy()
    kept["tokens"] = kept["token_ids"].map(lambda s: tuple(json.loads(s)))
    kept["alone"] = kept["batch_rows"].fillna(1).astype(int).eq(1) if "batch_rows" in kept else True
    selectors = list(dict.fromkeys(samples.loc[samples["selector"] != "dense", "selector"]))  # the store's order
    rows: list[dict[str, object]] = []
    for context, at in kept.groupby("context_tokens", sort=True):
        context = int(context)
        by_config = {c: g.set_index(["task", "sample"]).sort_index() for c, g in at.groupby("config")}
        n = at.groupby(["task", "sample"]).ngroups
        dense = next((g for g in by_config.values() if g["selector"].iloc[0] == "dense"), None)

        def equals(frame: pd.DataFrame | None, other: pd.DataFrame | None) -> int | None:
            if frame is None or other is None:
                return None
            return int((frame["tokens"] == other["tokens"]).sum())  # same prompts, same order (sorted index)

        if dense is not None:
            rows.append({"context": context_tick(context), "config": "dense", "prompts n": n,
                         "accuracy, serial / PRR": _cell(accuracies[context, dense["config"].iloc[0]]),
                         "= dense, serial / PRR": f"{n:,} / {n:,}"})
        same_total = pairs_total = 0
        sparse = at[at["selector"] != "dense"]
        budgets = sorted(sparse["budget_tokens"].unique())
        for selector in sorted(sparse["selector"].unique(), key=selectors.index):
            for budget in budgets:
                cell = sparse[(sparse["selector"] == selector) & (sparse["budget_tokens"] == budget)]
                if cell.empty:
                    continue
                serial_configs = cell.loc[cell["predictor"] == "none", "config"].unique()
                prr_configs = cell.loc[cell["predictor"] != "none", "config"].unique()
                if len(serial_configs) > 1 or len(prr_configs) > 1:
                    raise ValueError(f"{context_tick(context)} {selector} {int(budget)}: more than one serial or PRR "
                                     f"config ({[*serial_configs, *prr_configs]}); accuracy_pooled pairs one of each")
                serial = by_config[serial_configs[0]] if len(serial_configs) else None
                prr = by_config[prr_configs[0]] if len(prr_configs) else None
                eq = [equals(f, dense) for f in (serial, prr)]
                row = {"context": context_tick(context), "config": f"{selector} {int(budget):,}", "prompts n": n,
                       "accuracy, serial / PRR": " / ".join(_cell(None if f is None else accuracies[context, f["config"].iloc[0]])
                                                            for f in (serial, prr)),
                       "= dense, serial / PRR": " / ".join("–" if k is None else f"{k:,}" for k in eq)}
                if serial is not None and prr is not None:
                    same = equals(prr, serial)
                    same_total, pairs_total = same_total + same, pairs_total + n
                    row["PRR = serial tokens"] = _identity_cell(same, n)
                    matched = prr["alone"] & serial["alone"] & ~prr["captured"] & ~serial["captured"]
                    if matched.any():
                        ratio = paired_median_ratio(prr.loc[matched, "decode_s"].tolist(),
                                                    serial.loc[matched, "decode_s"].tolist())
                        row["PRR / serial time"] = _cell(ratio, 2) + ("" if ratio.n == n else f" (n={ratio.n})")
                if prr is not None:
                    hits = prr.loc[prr["alone"], "hit_rate"].dropna()
                    if len(hits):
                        hit = bootstrap_mean(hits.tolist())
                        row["hit (PRR)"] = _cell(hit) + ("" if hit.n == n else f" (n={hit.n})")
                rows.append(row)
        if pairs_total:
            rows.append({"context": context_tick(context), "config": "all sparse", "prompts n": n,
                         "PRR = serial tokens": _identity_cell(same_total, pairs_total)})
    table = pd.DataFrame(rows, columns=["context", *POOLED_COLUMNS]).fillna("").set_index("context")
    table["prompts n"] = table["prompts n"].map(lambda v: f"{int(v):,}" if v != "" else "")
    return table


def table_markdown(table: pd.DataFrame, digits: int = 3) -> str:
    """A table as GitHub markdown (no extra dependency)."""
    header = [table.index.name or "", *map(str, table.columns)]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for index, row in table.iterrows():
        cells = [f"{v:.{digits}f}" if isinstance(v, float) else str(v) for v in row]
        lines.append("| " + " | ".join([str(index), *cells]) + " |")
    return "\n".join(lines) + "\n"


# --- results files -> frames ------------------------------------------------------------------------
def read_sweep_csv(path: Path) -> pd.DataFrame:
    """A results CSV written by experiments/collect_sweep.py. Older files carry the Hydra
    overrides as one `overrides` column ("predictor=ema budget.ratio=1.5 ..."): those become
    columns (predictor, budget.ratio, ...)."""
    frame = pd.read_csv(path)
    if "overrides" in frame.columns:
        parsed = frame["overrides"].fillna("").map(lambda s: dict(kv.split("=", 1) for kv in shlex.split(s) if "=" in kv))
        extra = pd.DataFrame(list(parsed), index=frame.index)
        for col in extra.columns:
            if col not in frame.columns:
                frame[col] = _numeric_or_text(extra[col])
    return frame


def read_sweep_csvs(*paths: Path) -> pd.DataFrame:
    """Several collect_sweep.py CSVs (parts of one study, e.g. its contexts in two device calls) as one frame."""
    return pd.concat([read_sweep_csv(p) for p in paths], ignore_index=True)


def _numeric_or_text(column: pd.Series) -> pd.Series:
    numbers = pd.to_numeric(column, errors="coerce")
    return numbers if numbers.notna().all() else column


def first_budget(frame: pd.DataFrame, budget_tokens: int = 512) -> pd.DataFrame:
    """Rows at one top-K budget (the configs' default, 512 tokens) of a per-layer fidelity file."""
    return frame[frame["budget_tokens"] == budget_tokens]


def predictor_study(frame: pd.DataFrame) -> MplFigure:
    """The predictor study's figure (analysis/predictor_figures.py, issue #9): hit rate against
    |P|/K per predictor, one panel per task. Columns: task, predictor, ratio, hit_rate."""
    from .predictor_figures import plot_hit_rate_vs_budget

    return plot_hit_rate_vs_budget(frame)


THROUGHPUT_PANELS = (("uniform", "32512", "32K per row"), ("uniform", "130816", "128K per row"),
                     ("mixed", "65280/7936", "half 8K, half 64K"))
THROUGHPUT_LABELS = {"dense": "dense", "serial": "serial DSA", "prr": "PRR (P at 90% of A)"}


def throughput(frame: pd.DataFrame) -> MplFigure:
    """Decode throughput against batch size, one panel per kind of batch (uniform 32K, uniform
    128K, ragged half 8K / half 64K): tokens/s of dense, serial DSA and PRR, and the tokens/s the
    sparse step's byte floor allows (dashed). Columns: kind, contexts, batch, variant,
    tokens_per_s, floor_us (experiments/bench_throughput.py; skipped cells have no tokens_per_s)."""
    frame = require(frame, ["kind", "contexts", "batch", "variant", "tokens_per_s", "floor_us"], "throughput")
    frame = frame[frame["tokens_per_s"].notna()].assign(contexts=lambda f: f["contexts"].astype(str))
    fig, axes = new_figure(DOUBLE, ncols=len(THROUGHPUT_PANELS))
    for ax, (kind, contexts, title) in zip(axes, THROUGHPUT_PANELS, strict=True):
        cell = frame[(frame["kind"] == kind) & (frame["contexts"] == contexts)]
        for variant, label in THROUGHPUT_LABELS.items():
            rows = cell[cell["variant"] == variant].sort_values("batch")
            ax.plot(rows["batch"], rows["tokens_per_s"], marker=marker(variant), color=method_color(variant),
                    label=label)
        floor = cell[cell["variant"] == "serial"].sort_values("batch")
        ax.plot(floor["batch"], floor["batch"] / (floor["floor_us"] * 1e-6), color="#6F6F6F", linestyle="--",
                linewidth=0.8, label="sparse byte floor")
        ax.set_xscale("log", base=2)
        ax.set_title(title, fontsize="small")
        ax.set_xlabel("batch (rows)")
    axes[0].set_ylabel("tokens / s")
    axes[0].legend(loc="upper left", fontsize="x-small")
    return fig


# --- locality at long contexts on real weights (experiments/locality_study.py) ------------------------
LOCALITY_PANELS = {"last_step_overlap": "last-step overlap", "ema_hit_x1.0": "EMA hit rate, |P| = K",
                   "ema_hit_x2.0": "EMA hit rate, |P| = 2K"}
LOCALITY_TASK = "niah_multikey_2"  # the task every model and context has
# The paper's anchors (GLM-4-9B): last-step overlap ≈ 68%, EMA hit rate ≈ 98% (|P| not stated relative to K).
PAPER_LOCALITY = {"last_step_overlap": 68.0, "ema_hit_x1.0": 98.0, "ema_hit_x2.0": 98.0}


def read_locality(*paths: Path) -> pd.DataFrame:
    """locality_study.py tables (per task, or by context where one task ran) -> LOCALITY_TASK's rows."""
    frame = pd.concat([pd.read_csv(p) for p in paths], ignore_index=True)
    if "task" in frame.columns:
        frame = frame[frame["task"].isna() | (frame["task"] == LOCALITY_TASK)]
    return frame


def locality_vs_context(frame: pd.DataFrame, topk_blocks: int = 64) -> MplFigure:
    """Last-step overlap and EMA hit rate at |P| = K and 2K against context, K = topk_blocks blocks:
    one line per selector variant (colour) and model (solid: the first model, dashed: others).
    Columns: model, context_tokens, variant, topk_blocks, last_step_overlap, ema_hit_x1.0, ema_hit_x2.0;
    where a table has them, each rate's 95% interval over prompts (<rate>_lo, <rate>_hi) as a band."""
    frame = require(frame, ["model", "context_tokens", "variant", "topk_blocks", *LOCALITY_PANELS], "locality_vs_context")
    frame = frame[frame["topk_blocks"] == topk_blocks]
    fig, axes = new_figure(DOUBLE, ncols=len(LOCALITY_PANELS))
    models = sorted(frame["model"].unique(), key=lambda m: -frame[frame["model"] == m]["context_tokens"].max())
    for ax, (column, title) in zip(axes, LOCALITY_PANELS.items(), strict=True):
        for (model, variant), rows in frame.groupby(["model", "variant"], sort=False):
            rows = rows.sort_values("context_tokens")
            ax.plot(rows["context_tokens"], 100 * rows[column], marker=marker(variant), color=method_color(variant),
                    linestyle="-" if model == models[0] else "--", label=f"{method_label(variant)}, {model}")
            if f"{column}_lo" in rows and rows[f"{column}_lo"].notna().any():  # 95% over prompts (locality_study)
                ax.fill_between(rows["context_tokens"], 100 * rows[f"{column}_lo"], 100 * rows[f"{column}_hi"],
                                color=method_color(variant), alpha=0.15, linewidth=0)
        ax.axhline(PAPER_LOCALITY[column], color="#6F6F6F", linestyle=":", linewidth=0.8, label="paper (GLM-4-9B)")
        ax.set_xscale("log", base=2)
        ax.set_title(title, fontsize="small")
        ax.set_xlabel("context (tokens)")
    axes[0].set_ylabel(f"% of A (K = {topk_blocks} blocks)")
    axes[0].legend(loc="lower left", fontsize="xx-small")
    return fig


def locality_table(frame: pd.DataFrame) -> pd.DataFrame:
    """The README's locality table: one row per model, context and selector variant, K = 64 blocks.
    Columns: those of locality_vs_context plus mass_recall."""
    frame = require(frame, ["model", "context_tokens", "variant", "topk_blocks", "mass_recall", *LOCALITY_PANELS],
                    "locality_table")
    rows = frame[frame["topk_blocks"] == 64].sort_values(["model", "context_tokens", "variant"])
    columns = ["last_step_overlap", "ema_hit_x1.0", "ema_hit_x1.5", "ema_hit_x2.0", "mass_recall"]
    table = (100 * rows[columns]).round(1)
    table.index = pd.Index([f"{m} {c} {v}" for m, c, v in zip(rows["model"], rows["context_tokens"], rows["variant"],
                                                              strict=True)], name="model, context, selector")
    return table


@dataclass(frozen=True)
class Figure:
    """One registry entry: a figure (or table) name, the results files it reads (relative to the
    repo root), how to turn them into the figure function's DataFrame, and the command that
    produces the files (printed when one is missing)."""

    name: str
    draw: Callable[[pd.DataFrame], MplFigure | pd.DataFrame]
    inputs: tuple[str, ...]
    load: Callable[..., pd.DataFrame]
    command: str
    caption: str


CPU = "experiments/results/cpu"
COLLECT = "python experiments/collect_sweep.py"
LOCALITY_INPUTS = (f"{CPU}/locality_long_smollm2.csv", f"{CPU}/locality_long_qwen_4096.csv",
                   "experiments/results/h200/locality_long_qwen_8192_by_context.csv",
                   "experiments/results/h200/locality_long_qwen_16384.csv",
                   "experiments/results/h200/locality_long_qwen_32768.csv")
LOCALITY_COMMAND = ("the commands in docs/results/locality.md (locality_study.py on the CPU; "
                    "experiments/h200_long_context.sh locality on an H200)")
H100 = "experiments/results/h100"
SESSION6 = "experiments/results/h200/session6_20261207"
SPEEDUP_SWEEP_INPUTS = (f"{SESSION6}/speedup_8b_short.csv", f"{SESSION6}/speedup_8b_long.csv")
TECHNIQUE_MAP_INPUTS = (f"{H100}/issue52_followup_20261207/bench_decode_stage_infllm_v2_stage.csv",
                        f"{H100}/issue52_followup_20261207/bench_decode_stage_infllm_v2.json",
                        f"{H100}/selection_runs_20261207/engine_reuse_layers.json",
                        f"{H100}/issue52_followup_20261207/engine_matrix_infllm_v2.json",
                        f"{H100}/hinted_topk_20261207/bench_hinted_topk.csv")
TECHNIQUE_MAP_COMMAND = ("the device calls in experiments/results/h100/{issue52_followup,selection_runs,hinted_topk}"
                         "_20261207/README.md (bench_decode.py --parts stage, bench_engine_runs.py, bench_hinted_topk.py)")
FIGURES: list[Figure] = [
    Figure("locality_overlap_per_layer", overlap_per_layer, (f"{CPU}/locality_smollm2_per_layer.csv",), pd.read_csv,
           f"python run.py -m +experiment=locality && {COLLECT} multirun/locality {CPU}/locality_smollm2 --per-layer "
           "--steps overlap",
           "Temporal locality per layer: last-step overlap of the top-K selection, SmolLM2-135M, K = 512 tokens"),
    Figure("locality_overlap_cdf", overlap_cdf, (f"{CPU}/locality_smollm2_steps.csv",), pd.read_csv,
           f"python run.py -m +experiment=locality && {COLLECT} multirun/locality {CPU}/locality_smollm2 --per-layer "
           "--steps overlap",
           "CDF of last-step overlap over (step, layer, KV head), SmolLM2-135M, K = 512 tokens"),
    Figure("hit_rate_vs_budget", hit_rate_vs_budget, (f"{CPU}/hit_rate_vs_budget_smollm2.csv",), read_sweep_csv,
           f"python run.py -m +experiment=hit_rate_predictors && {COLLECT} multirun/hit_rate_predictors "
           f"{CPU}/hit_rate_vs_budget_smollm2",
           "Hit rate of each predictor against the speculation budget |P|/K, Quest, SmolLM2-135M"),
    Figure("hit_rate_vs_ema", hit_rate_vs_ema, (f"{CPU}/hit_rate_ema_smollm2.csv",), read_sweep_csv,
           f"python run.py -m +experiment=hit_rate_ema && {COLLECT} multirun/hit_rate_ema {CPU}/hit_rate_ema_smollm2",
           "EMA hit rate against its parameters (no calibration), Quest, SmolLM2-135M"),
    Figure("latency_breakdown_cpu", latency_breakdown, (f"{CPU}/latency_breakdown_smollm2.csv",), read_sweep_csv,
           f"python run.py -m +experiment=latency_breakdown && {COLLECT} multirun/latency_breakdown "
           f"{CPU}/latency_breakdown_smollm2",
           "Per-layer stage times against context, SmolLM2-135M on the CPU (stages serial)"),
    Figure("speedup_h200", lambda f: speedup(speedup_from_bench_decode(f)),
           ("experiments/results/h200/bench_decode_token.csv",), pd.read_csv,
           "python experiments/bench_decode.py --parts token (on an H200)",
           "Per-token decode speedup of PRR over serial DSA, Llama-3.1-8B shape, batch 1, CUDA graphs, H200"),
    Figure("latency_breakdown_h200", lambda f: latency_breakdown(stage_breakdown_from_bench_decode(f)),
           ("experiments/results/h200/bench_decode_stage.csv",), pd.read_csv,
           "python experiments/bench_decode.py --parts stage (on an H200)",
           "Per-layer attention-stage times against context (each stage alone, hit rate 0.90), 8B shape, H200"),
    Figure("token_profile_h200", token_profile,
           ("experiments/results/h200/profile_decode_serial_quest_1x131072_bs16_k2048.csv",
            "experiments/results/h200/profile_decode_serial_quest_1x131072_bs16_k2048_fused.csv",
            "experiments/results/h200/profile_decode_serial_quest_1x131072_bs64_k2048.csv",
            "experiments/results/h200/profile_decode_serial_quest_1x131072_bs64_k2048_fused.csv"), read_profiles,
           "python experiments/profile_decode.py [--block 64] [--projections fused] (on an H200)",
           "Where a decode token's device time goes: serial DSA (Quest, top-K 2K), Llama-3.1-8B shape, batch 1, "
           "128K context, H200"),
    Figure("prr_map_h200", prr_map, ("experiments/results/h200/bench_decode_stage.csv",), pd.read_csv,
           "python experiments/bench_decode.py --parts stage (on an H200)",
           "Attention-stage speedup of PRR over serial DSA against hit rate (bars: perfect-overlap ceiling), 8B shape, H200"),
    Figure("speedup_sweep", lambda f: speedup(speedup_from_runs(f)), SPEEDUP_SWEEP_INPUTS, read_sweep_csvs,
           "experiments/h100_speedup_sweep.sh PART=short and PART=long (python run.py -m +experiment=speedup, "
           f"half of the contexts each, then {COLLECT}; experiments/results/h200/session6_20261207/README.md)",
           "Per-token decode speedup of PRR over serial DSA through run.py, Llama-3.1-8B shape, random bf16 weights, "
           "H200 (the ema run at 124K failed in the sweep: missing)"),
    Figure("throughput_h200", throughput, ("experiments/results/h200/bench_throughput.csv",), pd.read_csv,
           "python experiments/bench_throughput.py (on an H200)",
           "Decode throughput against batch: dense, serial DSA and PRR, uniform and ragged batches, 8B shape, H200"),
    Figure("locality_vs_context", locality_vs_context, LOCALITY_INPUTS, read_locality, LOCALITY_COMMAND,
           "Temporal locality against context on real weights: last-step overlap and EMA hit rate, K = 64 blocks of 16, "
           "RULER niah_multikey_2; Qwen2.5-Coder-0.5B (H200 bf16 at 8K-32K, CPU fp32 at 4K), SmolLM2-135M (CPU)"),
    Figure("locality_long_context", locality_table, LOCALITY_INPUTS, read_locality, LOCALITY_COMMAND,
           "Locality at long contexts (%, K = 64 blocks of 16, RULER niah_multikey_2): last-step overlap, EMA hit "
           "rate at |P| = K, 1.5K and 2K, attention-mass recall of A"),
    Figure("predictor_hit_rate_vs_budget", predictor_study, (f"{CPU}/predictor_study.csv",), pd.read_csv,
           "python experiments/predictor_study.py",
           "Hit rate of every predictor against |P|/K, per task, SmolLM2-135M (replayed shadow-mode decodes)"),
    Figure("accuracy", lambda f: accuracy_table(accuracy_frame(f)), (f"{CPU}/accuracy.csv", f"{CPU}/accuracy_samples.csv"),
           read_accuracy,
           "python experiments/accuracy_study.py",
           "Accuracy (RULER string match, mean over samples) per task and context; SmolLM2-135M on the CPU"),
    Figure("accuracy_4k", lambda f: accuracy_table(accuracy_frame(f)), (f"{CPU}/accuracy_4k.csv", f"{CPU}/accuracy_4k_samples.csv"),
           read_accuracy,
           "python experiments/accuracy_study.py --tasks ruler_niah_multikey --contexts 4096 --budgets 256,1024,2048 "
           "--ema-budgets 1024 --out experiments/results/cpu/accuracy_4k",
           "Accuracy at 4K tokens (RULER string match, mean over samples); SmolLM2-135M on the CPU"),
    Figure("accuracy_qwen", lambda f: accuracy_table(accuracy_frame(f)),
           (f"{CPU}/accuracy_qwen_4096.csv", f"{CPU}/accuracy_qwen_4096_samples.csv", f"{CPU}/accuracy_qwen_4096_more.csv",
            f"{CPU}/accuracy_qwen_4096_more_samples.csv", "experiments/results/h200/accuracy_qwen.csv",
            "experiments/results/h200/accuracy_qwen_samples.csv"),
           read_accuracy,
           "the commands in docs/results/accuracy.md (accuracy_study.py on the CPU at 4K; "
           "experiments/h200_long_context.sh accuracy on an H200)",
           "Accuracy on RULER's own tasks (string match, mean over samples), Qwen2.5-Coder-0.5B: 4K on the CPU "
           "(fp32), 8K-32K on an H200 (bf16); 2 samples per task and context (fwe, qa_1, niah_multikey_2: 1)"),
    Figure("accuracy_qwen_matrix", lambda f: accuracy_table(accuracy_frame(f)),
           ("experiments/results/h200/accuracy_qwen_matrix.csv", "experiments/results/h200/accuracy_qwen_matrix_samples.csv.gz"),
           read_accuracy,
           "bash experiments/h200_long_context.sh campaign 4096,8192,16384,32768 (device calls, the commands in "
           "docs/results/accuracy.md)",
           "Accuracy on RULER's 13 tasks at 4K-32K, Qwen2.5-Coder-0.5B on an H200 (bf16, graph engine): dense, every "
           "selector at 1,024 and 2,048 tokens, serial and PRR (ema); n samples per task and context in each cell"),
    Figure("accuracy_qwen_vs_context", accuracy_vs_context, ("experiments/results/h200/accuracy_qwen_matrix_samples.csv.gz",),
           pd.read_csv,
           "bash experiments/h200_long_context.sh campaign 4096,8192,16384,32768 (docs/results/accuracy.md)",
           "Accuracy against context, RULER's 13 tasks pooled, Qwen2.5-Coder-0.5B on an H200 (bf16, graph engine): "
           "the mean over tasks of each task's mean score (tasks weighted equally; a prompt: one task's sample at that "
           "context) with its 95% percentile-bootstrap interval resampling prompts within each task; only prompts that every config of the context scored count, so every point at a "
           "context averages the same n prompts (under the tick). Left top-K budget 1,024 tokens, right 2,048: dense "
           "(the reference, in both), each selector serial (solid, filled) and PRR with EMA (dashed, open)"),
    Figure("predictor_hit_rate_vs_context", predictor_hit_rate_vs_context, PREDICTOR_STUDY_INPUTS, read_predictor_study,
           "python experiments/predictor_study.py ... --context-tokens N (CPU, 4K-16K) and bash experiments/h200_long_context.sh "
           "predictors 32768 (H200); the commands in docs/results/accuracy.md",
           "Predictor hit rate |P∩A|/|A| at |P| = K against context, Qwen2.5-Coder-0.5B, RULER niah_multikey_2 and qa_2 "
           "(10 prompts each), Quest top-32 blocks of 16, 64 shadow steps: mean over prompts with its 95% bootstrap "
           "over prompts; 4K-16K on the CPU (eager, fp32), 32K on an H200 (graph engine, bf16)"),
    Figure("accuracy_qwen_pooled", accuracy_pooled, ("experiments/results/h200/accuracy_qwen_matrix_samples.csv.gz",),
           pd.read_csv,
           "bash experiments/h200_long_context.sh campaign 4096,8192,16384,32768 (docs/results/accuracy.md)",
           "Accuracy matrix pooled over RULER's 13 tasks, per context, Qwen2.5-Coder-0.5B on an H200 (bf16, graph "
           "engine). A prompt is one task's sample at that context; only prompts that every config of the context "
           "scored count (prompts n). config: dense, or a selector at a top-K budget (tokens), serial DSA "
           "(predictor none) against PRR (EMA, |P| = K). accuracy, serial / PRR: the mean over tasks of each task's mean "
           "score (tasks weighted equally, whatever their prompts) with its 95% percentile bootstrap resampling prompts "
           "within each task (10,000 resamples, seed 0). = dense, serial / PRR: decodes whose "
           "tokens equal dense's for the same prompt. PRR = serial tokens: PRR decodes whose tokens equal serial's, "
           "k / n with Wilson's 95% interval; the last row of a context pools every sparse config. PRR / serial time: "
           "median wall time per request (decode_s: prefill replay and decode) of PRR over serial's, on the same "
           "prompts, with a 95% bootstrap that resamples prompts (pairs kept) and recomputes the ratio of medians; only "
           "prompts whose two decodes each ran alone (batch_rows 1) and built no engine (a config's first batch in a "
           "process builds and captures it) count (n given where fewer). hit (PRR): PRR's EMA hit rate of the decodes "
           "that ran alone (a batch's PRR is calibrated on the batch), mean over prompts with its 95% bootstrap"),
    Figure("accuracy_smollm2_ruler", lambda f: accuracy_table(accuracy_frame(f)),
           (f"{CPU}/accuracy_smollm2_ruler.csv", f"{CPU}/accuracy_smollm2_ruler_samples.csv"), read_accuracy,
           "the command in docs/results/accuracy.md (accuracy_study.py --model smollm2-135m --tasks ruler:...)",
           "Accuracy on RULER's own tasks (string match, mean over 2 samples), SmolLM2-135M at 4K and 8K on the CPU"),
    Figure("technique_map_h100", technique_map, TECHNIQUE_MAP_INPUTS, read_technique_runs, TECHNIQUE_MAP_COMMAND,
           "Which technique pays where: per-token time over serial DSA of each way of taking selection off the "
           "critical path, as prr.cost_model prices it from the stage map's measured stage times (bars from 1×: filled "
           "where it pays, by the whole run where one was measured, else by the model), and the whole runs (diamonds, "
           "95% bootstrap over 24 steps); Llama-3.1-8B shape, random bf16 weights, batch 1, block 64, K = 8 blocks, "
           "H100 (docs/results/cost_model.md)"),
    Figure("technique_map_h100_table", technique_table, TECHNIQUE_MAP_INPUTS, read_technique_runs,
           TECHNIQUE_MAP_COMMAND,
           "Which technique pays where (H100, 8B shape, batch 1, block 64, K = 512 tokens): prr.cost_model's per-token "
           "time over serial DSA from the stage map, the whole run's (median over 24 steps, 95% bootstrap) where one "
           "ran, run / model, and whether it pays (< 1×: by the run where measured, else by the model)"),
    Figure("selector_fidelity", selector_fidelity, (f"{CPU}/selector_fidelity.csv",), pd.read_csv,
           "python experiments/selector_fidelity.py",
           "Selector fidelity against the top-K budget, shadow mode, SmolLM2-135M"),
    Figure("selector_overlap_per_layer", overlap_per_layer, (f"{CPU}/selector_fidelity_per_layer.csv",),
           lambda p: first_budget(pd.read_csv(p)),
           "python experiments/selector_fidelity.py",
           "Last-step overlap per layer at K = 512 tokens (layers 0-1 dense), SmolLM2-135M"),
]


def registry() -> dict[str, Figure]:
    names = [f.name for f in FIGURES]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"figure names registered twice: {duplicates}")
    return {f.name: f for f in FIGURES}
