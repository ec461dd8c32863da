"""One cost model for every way prr takes selection off a token's critical path: a variant's
per-token time predicted from its serial DSA run's and the stage map's measured times.

The stage map (experiments/bench_decode.py --parts stage) times one sparse layer's attention
stage per cell (selector, context, block, top-K tokens, batch), in µs: the engine's serial DSA
(`serial_fused_merge`), its selection (`stage_select`) and attention over A (`stage_attend_A`),
and PRR's stage at controlled hit rates (`prr`; the rates in `hit_rate`). A variant changes what
each sparse layer runs; the prediction is the serial run's per-token time minus, summed over the
sparse layers, (serial stage - that layer's stage under the variant):

  serial DSA               serial
  speculation (PRR)        prr(h), linear in h between the map's rates (clamped to them)
  reuse=layers             anchor layers the base stage; the others skip selection: serial - select
  reuse=steps, every N     one step in N the base stage, the others serial - select
  hinted top-k             a selecting layer's stage less `selection_saving_us` (the measured
                           top-k time minus the hinted one at the run's hit rate)

where "base" is serial or prr(h). Reusing layers attend serially over the reused A (nothing to
hide), so their stage is serial's without its selection whatever the base.

The sparse layers are the selector's own (`sparse_layer_count`: all but its YAML's dense_layers):
Quest's 30 of the 8B shape's 32, InfLLM-v2's 32. Pricing InfLLM-v2 with 30 under-predicted its
reuse=layers saving by 2-6% (docs/results/cost_model.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import yaml

REUSE_KINDS = ("none", "layers", "steps")
SELECTOR_CONF = Path(__file__).resolve().parents[1] / "conf" / "selector"


def sparse_layer_count(selector: str, num_layers: int, conf_dir: Path = SELECTOR_CONF) -> int:
    """The layers of a `num_layers`-layer model that `selector` (conf/selector/<selector>.yaml)
    leaves sparse: all but its `dense_layers` (selector=dense lists none: every layer attends
    through the sparse path over all blocks). The layers whose stage a variant changes."""
    path = Path(conf_dir) / f"{selector}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in Path(conf_dir).glob("*.yaml"))
        raise ValueError(f"selector {selector!r} has no {path}: one of {known}")
    dense = (yaml.safe_load(path.read_text()) or {}).get("dense_layers", [])
    outside = [layer for layer in dense if not 0 <= int(layer) < num_layers]
    if outside:
        raise ValueError(f"{path.name}: dense_layers {outside} lie outside a {num_layers}-layer model")
    return num_layers - len(set(dense))


@dataclass(frozen=True)
class Variant:
    """What a run changes against serial DSA: speculation at `hit_rate`; reuse ("layers": of
    `sparse_layers`, `anchors` select; "steps": one step in `every` selects); and a per-layer
    saving of each selection (hinted top-k), µs."""

    speculates: bool = False
    hit_rate: float = math.nan
    reuse: str = "none"
    anchors: int | None = None
    every: int = 1
    selection_saving_us: float = 0.0

    def problems(self) -> list[str]:
        out = []
        if self.reuse not in REUSE_KINDS:
            out.append(f"reuse={self.reuse!r} is not one of {list(REUSE_KINDS)}")
        if self.reuse == "layers" and (self.anchors is None or self.anchors < 1):
            out.append(f"reuse='layers' needs anchors >= 1 (the layers that select), got {self.anchors}")
        if self.every < 1:
            out.append(f"every={self.every} must be >= 1")
        if self.speculates and not math.isfinite(self.hit_rate):
            out.append("a speculating variant needs its measured hit_rate")
        return out


def map_rate_column(stage_map: pd.DataFrame) -> str:
    """The stage map's hit rates as its P had them (round(rate·K) of K blocks: 0.9375 of 32 for a
    requested 0.95), where the map records them; older maps only the requested ones."""
    return "hit_rate" if "hit_rate" in stage_map else "target_hit_rate"


def map_cell(stage_map: pd.DataFrame, selector: str, context: int, block: int, topk_tokens: int,
             batch: int = 1) -> pd.DataFrame:
    """The stage map's rows of one selector, block, budget and batch at the context nearest
    `context` (every hit rate the map timed there); empty where the map has no such cell."""
    cell = stage_map[(stage_map["batch"] == batch) & (stage_map["selector"] == selector)
                     & (stage_map["block"] == block) & (stage_map["topk_tokens"] == topk_tokens)]
    if cell.empty:
        return cell
    nearest = cell.loc[(cell["context"] - context).abs().idxmin(), "context"]
    return cell[cell["context"] == nearest]


def serial_stage_us(cell: pd.DataFrame) -> float:
    """The engine's serial DSA stage of a cell: the map's `serial_fused_merge` (the engine merges
    one-wave split launches inside the split kernel; the map's `serial` adds the merge launch)."""
    if "serial_fused_merge" not in cell:
        raise ValueError("the stage map has no serial_fused_merge column (the engine's serial stage): "
                         "re-run experiments/bench_decode.py --parts stage")
    return float(cell["serial_fused_merge"].median())  # one serial timing per cell, on each hit-rate row


def prr_stage_us(cell: pd.DataFrame, hit_rate: float) -> float:
    """PRR's stage at `hit_rate`: linear between the map's rates, clamped to them (requested rates
    that round to one rate: their mean)."""
    by_rate = cell.groupby(map_rate_column(cell))["prr"].mean()
    return float(np.interp(hit_rate, by_rate.index, by_rate.to_numpy()))


def selection_stage_us(cell: pd.DataFrame) -> float:
    """The selection's part of the serial stage (`stage_select`), what a reusing layer skips."""
    if "stage_select" not in cell:
        raise ValueError("the stage map has no stage_select column: re-run experiments/bench_decode.py --parts stage")
    return float(cell["stage_select"].median())


def predict_token_ms(cell: pd.DataFrame, serial_token_ms: float, sparse_layers: int, variant: Variant) -> float:
    """A variant's per-token ms from its serial DSA run's (`serial_token_ms`, same setting) and
    the stage map's `cell` (`map_cell`) over `sparse_layers` sparse layers; NaN for an empty cell."""
    problems = variant.problems()
    if problems:
        raise ValueError("; ".join(problems))
    if cell.empty:
        return math.nan
    serial = serial_stage_us(cell)
    base = prr_stage_us(cell, variant.hit_rate) if variant.speculates else serial
    selecting = base - variant.selection_saving_us  # a layer that selects this step
    reusing = serial - selection_stage_us(cell) if variant.reuse != "none" else selecting
    if variant.reuse == "layers":
        anchors = min(variant.anchors, sparse_layers)
        per_token_us = anchors * selecting + (sparse_layers - anchors) * reusing
    elif variant.reuse == "steps":
        per_token_us = sparse_layers * (selecting + (variant.every - 1) * reusing) / variant.every
    else:
        per_token_us = sparse_layers * selecting
    return serial_token_ms - (sparse_layers * serial - per_token_us) * 1e-3
