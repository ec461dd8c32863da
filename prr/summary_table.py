"""The readable table printed at the end of a run."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # annotations only: run.py's checks import this module's importers before any run
    import pandas as pd

from prr.step_record import STAGES


def format_summary(summary: dict[str, Any], layers: pd.DataFrame) -> str:
    def num(key: str, fmt: str = "{:.3f}") -> str:
        value = summary.get(key)
        return "n/a" if value is None else fmt.format(value)

    if summary.get("engine") == "graph":  # the CUDA-graph engine records less (prr/runtime/graph_run.py)
        rows = summary.get("row_tokens") or []
        ragged = f" (rows hold its last {'/'.join(map(str, rows))})" if len(set(rows)) > 1 else ""
        lines = [
            "",
            f"prr run (engine=graph, {summary['variant']}): {summary['model']} | repair={summary['repair_mode']} | "
            f"prompt {summary['prompt_tokens']} tokens{ragged}, block {summary['block_size']}, top-K {summary['topk_blocks']} "
            f"blocks, |P| {summary['predicted_blocks']} | {summary['device']}",
            f"  hit rate |P∩A|/|A|         {num('hit_rate')}",
            f"  per-token latency          median {num('token_latency_median_ms', '{:.2f}')} ms, p90 "
            f"{num('token_latency_p90_ms', '{:.2f}')} ms ({num('tokens_per_s', '{:.1f}')} tok/s), "
            f"{summary.get('decode_steps')} steps",
            *reuse_lines(summary),
        ]
        if not layers.empty and layers["hit_rate"].notna().any():
            lines += ["", "  per layer:", layers.to_string(index=False, float_format=lambda x: f"{x:.3f}")]
        return "\n".join(lines)
    lines = [
        "",
        f"prr run: {summary['model']} | mode={summary['mode']} repair={summary['repair_mode']} | "
        f"prompt {summary['prompt_tokens']} tokens, block {summary['block_size']}, top-K {summary['topk_blocks']} blocks | "
        f"{summary['device']}",
        f"  hit rate |P∩A|/|A|         {num('hit_rate')}",
        f"  hit rate at K (|P| = |A|)  {num('hit_rate_at_k')}   (predictor ranking, budget aside)",
        f"  precision |P∩A|/|P|        {num('precision')}",
        f"  last-step overlap          {num('last_step_overlap')}",
        f"  attention-mass recall      {num('mean_mass_recall')}",
        f"  output rel. error vs dense {num('mean_output_relerr', '{:.2e}')}",
        f"  |A| / |P| / misses (mean)  {num('mean_selected_blocks', '{:.1f}')} / {num('mean_predicted_blocks', '{:.1f}')}"
        f" / {num('mean_misses', '{:.1f}')}",
        "  stage time per layer-step  (median) " + "  ".join(f"{s} {num(f't_{s}_us', '{:.0f}')}µs" for s in STAGES),
        f"  attention stage per layer  measured {num('t_attention_measured_us', '{:.0f}')}µs, "
        f"with speculate∥select {num('t_attention_overlapped_us', '{:.0f}')}µs (model)",
        f"  per-token latency          median {num('token_latency_median_ms', '{:.1f}')} ms "
        f"({num('tokens_per_s', '{:.1f}')} tok/s), {summary.get('decode_steps')} steps; "
        f"measurement work excluded ({num('measurement_overhead_ms', '{:.1f}')} ms/token)",
        *reuse_lines(summary),
    ]
    if not layers.empty:
        cols = [c for c in ("layer", "hit_rate", "hit_rate_at_k", "precision", "last_step_overlap", "mass_recall", "output_relerr") if c in layers]
        lines += ["", "  per layer:", layers[cols].to_string(index=False, float_format=lambda x: f"{x:.3f}")]
    return "\n".join(lines)


def reuse_lines(summary: dict[str, Any]) -> list[str]:
    """The selection reuse's line (an approximation: selections skipped), or none without reuse."""
    reuse = summary.get("reuse")
    if not reuse:
        return []
    total = reuse["selections_made"] + reuse["selections_skipped"]
    return [f"  selection reuse            {reuse['policy']} (an approximation): {reuse['selections_skipped']} of {total} "
            "layer selections skipped; hit rates against the A attended"]
