"""Metrics of decode steps: per (step, layer, batch row, KV head) rows from the runtime's
records, and their aggregates per layer and per run.

Definitions (A = selected blocks, P = predicted blocks, per KV head):
hit rate |P∩A|/|A|, hit rate at K (the predictor's top-|A| ranked blocks against A,
whatever |P| the budget chose: ranking quality alone), precision |P∩A|/|P|, misses |A\\P|, waste |P\\A|, last-step overlap
|A_t ∩ A_{t−1}|/|A_t|, attention-mass recall Σ_{b∈A} dense mass(b) (mean over the group's
query heads), output relative error ‖o_sparse − o_dense‖/‖o_dense‖.
Run-level rates are pooled (Σ hits / Σ |A|), not means of ratios.
"""

from __future__ import annotations

from typing import Any

import pandas as pd
import torch

from prr.step_record import STAGES, LayerStepRecord


def layer_step_rows(record: LayerStepRecord) -> list[dict[str, Any]]:
    a, p = record.selected, record.predicted  # [B, Hkv, N] bool
    hits = (a & p).sum(-1)
    selected, predicted = a.sum(-1), p.sum(-1)
    columns: dict[str, torch.Tensor] = {
        "selected_blocks": selected,
        "predicted_blocks": predicted,
        "hits": hits,
        "misses": selected - hits,
        "waste": predicted - hits,
    }
    if record.previous is not None:
        columns["overlap_blocks"] = (a & record.previous).sum(-1)
    if record.ranked_at_k is not None:
        columns["hits_at_k"] = (a & record.ranked_at_k).sum(-1)
    if record.block_mass is not None:
        columns["mass_recall"] = (record.block_mass * a).sum(-1)
    if record.output_relerr is not None:
        columns["output_relerr"] = record.output_relerr
    if record.serial_relerr is not None:
        columns["serial_relerr"] = record.serial_relerr
    host = {k: v.detach().cpu().tolist() for k, v in columns.items()}
    rows = []
    for b in range(a.shape[0]):
        for h in range(a.shape[1]):
            row: dict[str, Any] = {"step": record.step, "layer": record.layer, "batch": b, "kv_head": h,
                                   "context_tokens": record.context_tokens, "budget_blocks": record.budget_blocks}
            row.update({k: v[b][h] for k, v in host.items()})
            n_sel, n_pred = row["selected_blocks"], row["predicted_blocks"]
            row["hit_rate"] = row["hits"] / n_sel if n_sel else float("nan")
            row["precision"] = row["hits"] / n_pred if n_pred else float("nan")
            if "overlap_blocks" in row:
                row["overlap"] = row["overlap_blocks"] / n_sel if n_sel else float("nan")
            row.update({f"t_{s}_s": record.timings.get(s, 0.0) for s in STAGES})
            rows.append(row)
    return rows


def critical_path_columns(frame: pd.DataFrame) -> pd.DataFrame:
    """Attention-stage time per layer-step: as measured (stages one after the other) and as
    the PRR critical path would be with speculation fully overlapped with selection."""
    t = {s: frame[f"t_{s}_s"] for s in STAGES}
    frame = frame.assign(
        t_attention_measured_s=sum(t.values()),
        t_attention_overlapped_s=t["predict"] + pd.concat([t["speculate"], t["select"]], axis=1).max(axis=1)
        + t["repair"] + t["merge"],
    )
    return frame


TIMING_WARMUP_STEPS = 2  # first decode steps left out of timing statistics (allocations, caches)


def after_warmup(frame: pd.DataFrame, warmup_steps: int = TIMING_WARMUP_STEPS) -> pd.DataFrame:
    """Rows of decode steps >= warmup_steps (all rows when the run is shorter than that)."""
    later = frame[frame["step"] >= warmup_steps]
    return later if not later.empty else frame


def summarize(steps: pd.DataFrame, tokens: pd.DataFrame) -> dict[str, Any]:
    """Run-level numbers for summary.json, the console table and W&B. Rates are pooled over
    all steps; timings are medians over decode steps after the first TIMING_WARMUP_STEPS."""
    out: dict[str, Any] = {"decode_steps": int(tokens.shape[0])}
    if not tokens.empty:
        timed = after_warmup(tokens)
        out["token_latency_median_ms"] = float(timed["latency_s"].median() * 1e3)
        out["tokens_per_s"] = float(1.0 / timed["latency_s"].median())
        out["measurement_overhead_ms"] = float(timed["measure_s"].median() * 1e3)
    if steps.empty:
        return out
    total = lambda col: float(steps[col].sum())  # noqa: E731
    out["hit_rate"] = total("hits") / max(total("selected_blocks"), 1)
    out["precision"] = total("hits") / total("predicted_blocks") if total("predicted_blocks") else float("nan")
    out["mean_selected_blocks"] = float(steps["selected_blocks"].mean())
    out["mean_predicted_blocks"] = float(steps["predicted_blocks"].mean())
    out["mean_misses"] = float(steps["misses"].mean())
    out["mean_waste"] = float(steps["waste"].mean())
    if "overlap_blocks" in steps:
        out["last_step_overlap"] = total("overlap_blocks") / max(total("selected_blocks"), 1)
    if "hits_at_k" in steps:
        out["hit_rate_at_k"] = total("hits_at_k") / max(total("selected_blocks"), 1)
    for col in ("mass_recall", "output_relerr", "serial_relerr"):
        if col in steps:
            out[f"mean_{col}"] = float(steps[col].mean())
    if "serial_relerr" in steps:
        out["max_serial_relerr"] = float(steps["serial_relerr"].max())
    # Timings are per layer-step; rows repeat them per (batch, KV head), so dedupe first.
    per_layer_step = critical_path_columns(after_warmup(steps).drop_duplicates(["step", "layer"]))
    for s in STAGES:
        out[f"t_{s}_us"] = float(per_layer_step[f"t_{s}_s"].median() * 1e6)
    out["t_attention_measured_us"] = float(per_layer_step["t_attention_measured_s"].median() * 1e6)
    out["t_attention_overlapped_us"] = float(per_layer_step["t_attention_overlapped_s"].median() * 1e6)
    return out


def per_layer(steps: pd.DataFrame) -> pd.DataFrame:
    """One row per layer: pooled hit rate/precision/overlap, mean recall/error, stage times."""
    if steps.empty:
        return pd.DataFrame()
    g = steps.groupby("layer")
    table = pd.DataFrame({
        "hit_rate": g["hits"].sum() / g["selected_blocks"].sum().clip(lower=1),
        "precision": g["hits"].sum() / g["predicted_blocks"].sum().replace(0, float("nan")),
        "selected_blocks": g["selected_blocks"].mean(),
        "predicted_blocks": g["predicted_blocks"].mean(),
    })
    if "overlap_blocks" in steps:
        table["last_step_overlap"] = g["overlap_blocks"].sum() / g["selected_blocks"].sum().clip(lower=1)
    if "hits_at_k" in steps:
        table["hit_rate_at_k"] = g["hits_at_k"].sum() / g["selected_blocks"].sum().clip(lower=1)
    for col in ("mass_recall", "output_relerr"):
        if col in steps:
            table[col] = g[col].mean()
    timing = after_warmup(steps).drop_duplicates(["step", "layer"]).groupby("layer")
    for s in STAGES:
        table[f"t_{s}_us"] = timing[f"t_{s}_s"].median() * 1e6
    return table.reset_index()
