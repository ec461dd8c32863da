"""Which technique pays where (issue 53): per measured cell (selector × context × top-K × batch),
each way of taking selection off a token's critical path as `prr.cost_model` prices it from the
stage map's measured stage times, beside the whole runs that measured it, as a ratio to serial
DSA's per-token time (< 1: it pays).

Techniques: speculation (PRR; EMA at its run's hit rate, P = A replayed at its run's, and hit 1.0:
the most speculation gives with these kernels), reuse=layers (1 sparse layer in 2 and 1 in 4
select: reuse.anchors 2 and 4) and hinted top-k (the selection saving of bench_hinted_topk's cell
with the map cell's rows and candidates). Inputs: the stage map (bench_decode.py --parts stage),
whole runs (bench_engine_runs.py JSON: reuse runs, the PRR matrix, each with its own serial DSA
run) and the hinted top-k benchmark, all of one GPU.

    read_technique_runs(stage_csv, stage_json, reuse_json, matrix_json, hinted_csv) -> a row per (cell, technique)
    technique_map(rows) -> Figure;  technique_table(rows) -> the same as a table
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.figure import Figure as MplFigure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import FixedFormatter

from prr.cost_model import Variant, map_cell, predict_token_ms, sparse_layer_count

from .style import RESERVE, method_color, method_label, new_figure

MODEL_LAYERS = 32  # the runs' model: conf/model/llama-3.1-8b-shape.yaml (Llama-3.1-8B's 32 layers)
KV_HEADS = 8  # its KV heads: a top-k row per (batch row, KV head)
TECHNIQUES = {  # name -> x-axis label
    "prr_ema": "PRR\nEMA",
    "prr_replayed": "PRR\nP = A replay",
    "prr_hit1": "PRR\nhit 1.0",
    "reuse_2": "reuse\n1 in 2\nselect",
    "reuse_4": "reuse\n1 in 4\nselect",
    "hinted_topk": "hinted\ntop-k",
}
SELECTOR_ORDER = ("quest", "infllm_v2")  # panels left to right (others after)
TECHNIQUE_NAMES = {"prr_ema": "PRR, EMA", "prr_replayed": "PRR, P = A replayed", "prr_hit1": "PRR at hit 1.0",
                   "reuse_2": "reuse=layers, 1 in 2 select", "reuse_4": "reuse=layers, 1 in 4 select",
                   "hinted_topk": "hinted top-k"}  # the table's words
HINT_HIT_RATE = 0.7  # bench_hinted_topk's middle rate (its time barely depends on it: 0.6-0.8 within 1%)
COLUMNS = ["gpu", "selector", "context", "block", "topk_tokens", "batch", "sparse_layers", "technique", "hit_rate",
           "serial_ms", "predicted", "measured", "measured_lo", "measured_hi", "note"]


def gpu_name(*metas: dict) -> str:
    """The one GPU every results file names (e.g. 'H100'); mixed GPUs are refused."""
    names = {m.get("gpu") or (m.get("environment") or {}).get("gpu") for m in metas}
    if len(names) != 1 or None in names:
        raise ValueError(f"the technique map's results name the GPUs {sorted(map(str, names))}: draw it from one GPU's")
    full = names.pop()
    short = re.search(r"[A-Z]\d{2,3}", full)
    return short.group(0) if short else full


def run_kind(case: str) -> str | None:
    """A bench_engine_runs case -> its technique (serial: 'serial'; runs the map does not price: None)."""
    name = case.split("@", 1)[0]
    if name.endswith("-none"):
        return "serial"
    for suffix, kind in (("-ema", "prr_ema"), ("-hit1", "prr_replayed"), ("-none+anchors2", "reuse_2"),
                         ("-none+anchors4", "reuse_4")):
        if name.endswith(suffix):
            return kind
    return None


def read_technique_runs(stage_csv: Path, stage_json: Path, reuse_json: Path, matrix_json: Path,
                        hinted_csv: Path) -> pd.DataFrame:
    """One row per (map cell, technique): `COLUMNS`; predicted and measured are per-token times over
    the same session's serial DSA run (measured_lo / _hi: its 95% bootstrap), NaN where not run.
    Techniques without a run (PRR at hit 1.0, hinted top-k) are priced over the first file's serial run."""
    stage_map = pd.read_csv(stage_csv)
    stage_meta = json.loads(Path(stage_json).read_text())  # (its environment names the GPU)
    metas = [json.loads(Path(p).read_text()) for p in (reuse_json, matrix_json)]
    hinted = pd.read_csv(hinted_csv)
    gpu = gpu_name(stage_meta, *metas)
    runs = pd.DataFrame([{**r, "source": i} for i, m in enumerate(metas) for r in m["rows"]])
    runs["kind"] = runs["case"].map(run_kind)
    runs["selector"] = runs["case"].str.split("-", n=1).str[0]
    runs["setting"] = runs["case"].str.split("@", n=1).str[1]
    serial = runs[runs["kind"] == "serial"].set_index(["source", "selector", "setting"])["token_latency_median_ms"]
    rows, priced = [], set()
    for run in runs[runs["kind"].notna() & (runs["kind"] != "serial")].itertuples():
        cell = map_cell(stage_map, run.selector, int(run.prompt_tokens), int(run.block_size),
                        int(run.topk_blocks * run.block_size))
        key = (run.source, run.selector, run.setting)
        if cell.empty or key not in serial.index:
            continue
        layers = sparse_layer_count(run.selector, MODEL_LAYERS)
        serial_ms = float(serial[key])
        variant, hit, note = run_variant(run, layers)
        rows.append({**cell_of(gpu, run, layers), "technique": run.kind, "hit_rate": hit, "serial_ms": serial_ms,
                     "predicted": predict_token_ms(cell, serial_ms, layers, variant) / serial_ms,
                     "measured": run.token_latency_median_ms / serial_ms, "measured_lo": run.median_over_serial_lo,
                     "measured_hi": run.median_over_serial_hi, "note": note + outside_map(cell, hit)})
        if (run.selector, run.setting) in priced:
            continue
        priced.add((run.selector, run.setting))
        serial_ms = float(serial[min(k for k in serial.index if k[1:] == (run.selector, run.setting))])
        nothing = dict(serial_ms=serial_ms, measured=math.nan, measured_lo=math.nan, measured_hi=math.nan)
        rows.append({**cell_of(gpu, run, layers), "technique": "prr_hit1", "hit_rate": 1.0, **nothing,
                     "predicted": predict_token_ms(cell, serial_ms, layers, Variant(speculates=True, hit_rate=1.0))
                     / serial_ms, "note": "no run: the map's PRR stage at hit 1.0"})
        saving, hint_note = hinted_saving(hinted, int(cell["context"].iloc[0]) // int(run.block_size) + 1,
                                          int(run.topk_blocks))
        if math.isfinite(saving):
            rows.append({**cell_of(gpu, run, layers), "technique": "hinted_topk", "hit_rate": HINT_HIT_RATE, **nothing,
                         "note": hint_note, "predicted": predict_token_ms(
                             cell, serial_ms, layers, Variant(selection_saving_us=saving)) / serial_ms})
    if not rows:
        raise ValueError(f"no whole run of {reuse_json} / {matrix_json} has a cell in the stage map {stage_csv}")
    order = {**{s: i for i, s in enumerate(SELECTOR_ORDER)}, **{t: i for i, t in enumerate(TECHNIQUES)}}
    out = pd.DataFrame(rows, columns=COLUMNS)
    return out.sort_values(["selector", "context", "technique"], key=lambda c: c if c.name == "context"
                           else c.map(lambda v: order.get(v, len(order))), ignore_index=True)


def cell_of(gpu: str, run, layers: int) -> dict:
    """A run's cell: its GPU, selector, context (prompt tokens), block, top-K tokens, batch 1."""
    return dict(gpu=gpu, selector=run.selector, context=int(run.prompt_tokens), block=int(run.block_size),
                topk_tokens=int(run.topk_blocks * run.block_size), batch=1, sparse_layers=layers)


def run_variant(run, layers: int) -> tuple[Variant, float, str]:
    """A whole run -> (its Variant, its hit rate, a note). Reuse runs: their own selections a step."""
    if run.kind.startswith("reuse"):
        made, skipped = run.reuse["selections_made"], run.reuse["selections_skipped"]
        if (made + skipped) != layers * run.decode_steps:
            raise ValueError(f"{run.case} selected in {(made + skipped) / run.decode_steps:g} layers a step, its "
                             f"selector's config leaves {layers} sparse")
        anchors = made // run.decode_steps
        return Variant(reuse="layers", anchors=anchors), math.nan, f"{anchors} of {layers} sparse layers select"
    hit = float(run.hit_rate)
    return Variant(speculates=True, hit_rate=hit), hit, f"the run's hit rate {hit:.3f}"


def outside_map(cell: pd.DataFrame, hit: float) -> str:
    """A note where the run's hit rate lies outside the map's rates (the nearest one's stage stood in)."""
    rates = cell["hit_rate"] if "hit_rate" in cell else cell["target_hit_rate"]
    if math.isfinite(hit) and not rates.min() <= hit <= rates.max():
        return f" (outside the map's {rates.min():g}-{rates.max():g}: its {rates.min() if hit < rates.min() else rates.max():g} stage)"
    return ""


def hinted_saving(hinted: pd.DataFrame, candidates: int, k: int) -> tuple[float, str]:
    """µs a selecting layer saves with the hinted top-k: prr's top-k less the hinted one in the
    benchmark's cell with a batch-1 step's rows (KV_HEADS), the cell's candidates (within 1%), the
    nearest k timed and HINT_HIT_RATE; NaN where no such cell was timed."""
    near = hinted[(hinted["rows"] == KV_HEADS) & ((hinted["candidates"] - candidates).abs() <= 0.01 * candidates)
                  & np.isclose(hinted["hit_rate"], HINT_HIT_RATE)]
    if near.empty:
        return math.nan, ""
    timed_k = int(near.loc[(near["k"] - k).abs().idxmin(), "k"])
    row = near[near["k"] == timed_k].iloc[0]
    note = (f"bench_hinted_topk: {KV_HEADS} rows, {int(row['candidates'])} candidates, k = {timed_k}"
            f"{'' if timed_k == k else f' ({k} not timed)'}, hit {HINT_HIT_RATE:g}; no whole run")
    return float(row["prr_us"] - row["hinted_us"]), note


def pays(rows: pd.DataFrame) -> pd.Series:
    """Whether each technique pays (< 1× serial DSA): by its whole run where one was measured,
    else by the prediction."""
    return rows["measured"].where(rows["measured"].notna(), rows["predicted"]) < 1.0


def context_label(tokens: int) -> str:
    return f"{tokens // 1000}K"


def technique_map(rows: pd.DataFrame) -> MplFigure:
    """Per selector (panel) and technique (x), per context (colour): the cost model's per-token
    time over serial DSA as a bar from 1× (down: it saves), filled where the technique pays
    (its whole run's ratio < 1 where measured, else the prediction's), hatched where it does not;
    the measured whole runs as diamonds with their 95% bootstrap. Columns: `COLUMNS`."""
    from .figures import require

    rows = require(rows, COLUMNS, "technique_map")
    selectors = list(dict.fromkeys(rows["selector"]))
    contexts = sorted(set(rows["context"]))
    colors = dict(zip(contexts, RESERVE, strict=False))
    fig, axes = new_figure((7.0, 3.0), ncols=len(selectors))
    width = 0.8 / len(contexts)
    x_of = {t: i for i, t in enumerate(TECHNIQUES)}
    paying = pays(rows)
    for ax, selector in zip(axes, selectors, strict=True):
        mine = rows[rows["selector"] == selector]
        for j, context in enumerate(contexts):
            at = mine[mine["context"] == context]
            x = at["technique"].map(x_of) + (j - (len(contexts) - 1) / 2) * width
            label = context_label(context)
            for pay, style in ((True, dict(color=colors[context])),
                               (False, dict(color="white", edgecolor=colors[context], hatch="////", linewidth=0.8))):
                part = at[paying[at.index] == pay]
                if not part.empty:
                    ax.bar(x[part.index], part["predicted"] - 1.0, width * 0.9, bottom=1.0,
                           label=f"{label}: {'pays' if pay else 'does not pay'}", **style)
            run = at[at["measured"].notna()]
            if not run.empty:
                ax.errorbar(x[run.index], run["measured"], yerr=[run["measured"] - run["measured_lo"],
                                                                   run["measured_hi"] - run["measured"]],
                            fmt="D", markersize=3.5, markerfacecolor="black", markeredgecolor="white",
                            markeredgewidth=0.5, ecolor="black", elinewidth=0.8, label=f"{label}: whole run")
        ax.axhline(1.0, color=method_color("none"), linewidth=0.8, linestyle="--")
        ax.set_xticks(range(len(TECHNIQUES)))
        # A FixedFormatter, not set_xticks(labels=...) (a FuncFormatter there): figure_data records its words.
        ax.xaxis.set_major_formatter(FixedFormatter(list(TECHNIQUES.values())))
        ax.tick_params(axis="x", labelsize=6)
        ax.set_title(f"{method_label(selector)}, batch 1, K = {int(mine['topk_tokens'].iloc[0])} tokens "
                     f"(block {int(mine['block'].iloc[0])}), {mine['gpu'].iloc[0]}")
        ax.set_ylabel("per-token time / serial DSA (×)")
    handles = [Patch(color=colors[c], label=f"{context_label(c)} context") for c in contexts]
    handles += [Patch(facecolor="#BBBBBB", label="cost model, pays (< 1×)"),
                Patch(facecolor="white", edgecolor="#555555", hatch="////", label="cost model, does not pay"),
                Line2D([], [], marker="D", color="black", linestyle="none", markersize=3.5,
                       label="whole run (95% bootstrap)"),
                Line2D([], [], color=method_color("none"), linewidth=0.8, linestyle="--", label="serial DSA")]
    axes[-1].legend(handles=handles, loc="lower left", fontsize="x-small")
    return fig


def technique_table(rows: pd.DataFrame) -> pd.DataFrame:
    """The map as a table: per cell and technique, the model's ratio, the whole run's with its
    95% bootstrap, run / model, and whether it pays."""
    table = pd.DataFrame({
        "selector": rows["selector"].map(method_label), "context": rows["context"].map(context_label),
        "technique": rows["technique"].map(TECHNIQUE_NAMES),
        "hit rate": rows["hit_rate"].map(lambda h: f"{h:.3f}" if math.isfinite(h) else ""),
        "model ×": rows["predicted"].map(lambda r: f"{r:.3f}"),
        "run × [95%]": [f"{r:.3f} [{lo:.3f}, {hi:.3f}]" if math.isfinite(r) else "" for r, lo, hi in
                        zip(rows["measured"], rows["measured_lo"], rows["measured_hi"], strict=True)],
        "run / model": (rows["measured"] / rows["predicted"]).map(lambda r: f"{r:.3f}" if math.isfinite(r) else ""),
        "pays": pays(rows).map({True: "yes", False: "no"}), "note": rows["note"]})
    table.index = pd.Index([f"{s}, {c}, {t}" for s, c, t in zip(table.pop("selector"), table.pop("context"),
                                                                  table.pop("technique"), strict=True)],
                           name=f"selector, context, technique ({rows['gpu'].iloc[0]})")
    return table
