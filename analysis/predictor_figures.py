"""Figures of the predictor study (experiments/predictor_study.py): hit rate against the
speculation budget |P|/K, one line per predictor, one panel per task.

    python -m analysis.predictor_figures [experiments/results/cpu/predictor_study.csv]
"""

from __future__ import annotations

import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; no display needed
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "experiments/results/cpu/predictor_study.csv"
FIGURES = ROOT / "analysis/figures"
NEEDED = ("task", "predictor", "ratio", "hit_rate")
# Baselines dotted/dashed, the EMA family solid, the new predictors dash-dotted: "new vs EMA" first.
LINESTYLE = {"last_step": ":", "ema_fixed": "--", "ema": "-", "ema_calibrated": "-"}

try:  # the shared paper style (colours per method, sizes, byte-stable saving), when present
    from analysis import style
except ImportError:  # plain matplotlib otherwise
    style = None


def colours(names: list[str]) -> dict[str, str]:
    """One colour per predictor: the shared style's where it has one, never two lines alike
    (variants the style does not know can hash to the same reserve colour)."""
    cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    spare = [*getattr(style, "RESERVE", ()), *cycle]
    out: dict[str, str] = {}
    for i, name in enumerate(names):
        c = style.method_color(name) if style is not None else cycle[i % len(cycle)]
        if c in out.values():
            c = next((x for x in spare if x not in out.values()), c)
        out[name] = c
    return out


def plot_hit_rate_vs_budget(df: pd.DataFrame) -> Figure:
    """df: one row per (task, predictor, ratio) with `hit_rate` (the study's CSV) -> the figure:
    hit rate (%) against |P|/K, one line per predictor, one panel per task; where the table has
    them, the 95% interval over prompts (hit_rate_lo, hit_rate_hi) as a band."""
    missing = [c for c in NEEDED if c not in df.columns]
    if missing:
        raise ValueError(f"plot_hit_rate_vs_budget needs columns {list(NEEDED)}; missing {missing} "
                         "(pass experiments/results/cpu/predictor_study.csv)")
    tasks = list(dict.fromkeys(df["task"]))
    names = list(dict.fromkeys(df["predictor"]))
    colour = colours(names)
    size = (3.0 * len(tasks) + 1.4, 2.6)
    if style is not None:
        fig, axes = style.new_figure(size, ncols=len(tasks))
    else:
        fig, grid = plt.subplots(1, len(tasks), figsize=size, squeeze=False)
        axes = list(grid[0])
    for ax, task in zip(axes, tasks, strict=True):
        for name in names:
            rows = df[(df["task"] == task) & (df["predictor"] == name)].sort_values("ratio")
            if rows.empty:
                continue
            ax.plot(rows["ratio"], 100 * rows["hit_rate"], marker=style.marker(name) if style else "o",
                    color=colour[name], linestyle=LINESTYLE.get(name, "-."),
                    label=style.method_label(name) if style else name)
            if "hit_rate_lo" in rows and rows["hit_rate_lo"].notna().any():  # 95% over prompts (--samples)
                ax.fill_between(rows["ratio"], 100 * rows["hit_rate_lo"], 100 * rows["hit_rate_hi"],
                                color=colour[name], alpha=0.15, linewidth=0)
        ax.set_title(task)
        ax.set_xlabel("speculation budget |P| / top-K")
        ax.set_xticks(sorted(df["ratio"].unique()))
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel("hit rate |P∩A|/|A| (%)")
    axes[-1].legend(loc="center left", bbox_to_anchor=(1.02, 0.5))
    return fig


def save_hit_rate_vs_budget(df: pd.DataFrame, out_dir: Path = FIGURES) -> list[Path]:
    """Write predictor_hit_rate_vs_budget.{pdf,png} under out_dir; -> the paths."""
    fig = plot_hit_rate_vs_budget(df)
    name = "predictor_hit_rate_vs_budget"
    if style is not None:
        return style.save(fig, out_dir, name)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / f"{name}.{ext}" for ext in ("pdf", "png")]
    no_dates = {"pdf": {"CreationDate": None, "ModDate": None, "Producer": None, "Creator": None},
                "png": {"Software": None}}  # as style.save: the bytes depend on the data, not the day
    for path in paths:
        fig.savefig(path, dpi=200, bbox_inches="tight", metadata=no_dates[path.suffix[1:]])
    plt.close(fig)
    return paths


if __name__ == "__main__":
    source = Path(sys.argv[1]) if len(sys.argv) > 1 else RESULTS
    for p in save_hit_rate_vs_budget(pd.read_csv(source)):
        print(p)
