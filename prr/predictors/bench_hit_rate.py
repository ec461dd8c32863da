"""`bench_hit_rate`: a BENCHMARK TOOL, not a prediction method. P is the true selection A of
the step with a chosen fraction of it swapped for blocks outside A, so whole runs can be timed at
a controlled hit rate (50%, 70%, 90%: the hit rates of bench_decode.py's stage map), which real
predictors on random weights (8-20%) never reach. It knows A before the step runs because it
replays a recorded trajectory; no method can.

How, without putting the selection on the step's critical path (the oracle predictor selects
first, then speculates, which times another step than PRR's):

1. record: before decoding, the engine runs a serial-DSA pass of the run's steps from the
   prompt's end (`prr/runtime/replay.py`, called by `GraphDecoder.prime_predictions`), in which
   `update` writes each sparse layer's A into a device table at the layer's step counter;
2. script: the engine rewinds to the prompt's end (checkpoint / restore) and `finish_recording`
   builds P for every step, layer, row and KV head from the recorded A (`swapped_predictions`,
   seeded, deterministic);
3. replay: the run decodes as PRR from the same state, each step's input being the recorded
   pass's next token (teacher forcing: `GraphDecoder.forced_tokens`), so step t selects the
   recorded A_t. P is history-only: `update` (side stream, after A) advances the layer's step
   counter and `propose` copies P of the next step from the script, indexed by that device
   counter. No host synchronisation, static shapes: it runs inside the captured CUDA-graph step,
   off the critical path like any history-only predictor's next-step P. With
   StaticPlan.learn_layers_at_once (the default) every sparse layer's counter add and P gather
   run once, after the step's last sparse layer (`update_layers` / `propose_layers`), as ema's
   learning does, instead of a few copy launches after each layer. The run's tokens are
   therefore the recorded serial pass's by construction: a bench_hit_rate run times PRR, it does
   not test that PRR decodes serial DSA's tokens (the one-engine tests do).

Hit rate, by construction: with |P| = size per (row, KV head) and |A| selected blocks, P holds
round(hit_rate·min(|A|, size)) blocks of A (a uniformly random subset) and fills up to `size` with
blocks of the step's context outside A (as many as there are), the definition of
`prr.blocks.controlled_predictions` (the stage map's and the profiled budget's). So the run's
measured hit rate |P ∩ A| / |A| equals the requested fraction per (row, KV head) up to that
rounding when |P| >= |A|, as long as the run selects the recorded sets (the engine's counters
measure the rate it had).

Why teacher forcing (measured): without it, on an H200 in bf16 at the Llama-3.1-8B shape,
exact-mode PRR merges the same blocks' attention in another grouping than serial DSA (per-block
states of P ∩ A ⊕ the repair's splits), so its bf16 outputs differ in the last bits, greedy tokens
flip, and the run left the recorded trajectory after 1-23 of 32 steps: measured hit rates
0.12-0.28 for requested 0.5-0.9, 0.76 for 1.0 (experiments/results/h200/kernels_issue33.md). With
the recorded tokens as inputs the contexts are the recorded ones; the queries and the decoded
tokens' keys can still differ in the last bits, which may flip a near-tied selection: the engine's
counters measure the rate the run had, and bench_engine_runs prints it with its interval.

Refused where it cannot replay: the eager research runtime (no recorded pass; config_check).
`budget=profiled` times its stage check at `budget.hit_rate`, which must then equal this
predictor's `hit_rate` (config_check says so).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from prr.blocks import BlockSet
from prr.predictors.base import NEVER, Predictor, stacked_blocks
from prr.predictors.options import BenchHitRatePredictorOptions
from prr.selectors.base import Selection

log = logging.getLogger("prr")


class ReplayScript:
    """The trajectory a bench_hit_rate run replays. A plain object, not a tensor container, so an
    engine's checkpoint / restore and `start_at` leave it alone: it is the run's script, written
    once before decoding, not state a step changes.
    selected: [L, S, B, Hkv, C + 1] int32, A of each step (ascending ids, then its count in the last
    column); predicted: [L, S + 1, B, Hkv, |P| + 1] int32, P of each step likewise (row S: empty)."""

    def __init__(self) -> None:
        self.recording = False
        self.selected: Tensor | None = None
        self.predicted: Tensor | None = None
        self.info: dict[str, Any] = {}


@dataclass
class BenchHitRateState:
    step: Tensor  # [L] int64: decode steps each layer has learned from since the recording began
    script: ReplayScript = field(default_factory=ReplayScript)


class BenchHitRatePredictor(BenchHitRatePredictorOptions, Predictor):
    # the constructor (replays_selections, declared_hit_rate too) is BenchHitRatePredictorOptions' (prr.predictors.options: no torch, checked before torch is imported)
    history_only = True  # P of step t + 1 is copied from the script after step t's update

    def init_state(self, num_layers: int, batch: int, num_kv_heads: int, max_blocks: int, device: Any) -> BenchHitRateState:
        return BenchHitRateState(step=torch.zeros(num_layers, dtype=torch.int64, device=device))

    def calibrate(self, history: list[list[Selection] | None]) -> dict[str, Any]:
        """Nothing to fit. Returns the predictor's record for the run (its summary's
        budget_setup.calibration), which `finish_recording` completes in place with the script's
        counts once the serial pass is recorded."""
        self.record = {"benchmark_tool": "P = the recorded A with a share swapped out", "hit_rate": self.hit_rate,
                       "seed": self.seed}
        return self.record

    # --- the step: static shapes, device tensors only ------------------------------------------
    def update(self, state: BenchHitRateState, layer: int, selection: Selection) -> None:
        script = state.script
        at = state.step[layer : layer + 1]  # [1]
        if script.recording:
            if script.selected is None:
                raise RuntimeError("bench_hit_rate: start_recording() sizes the table before the recorded pass")
            idx, cnt = selection.blocks.indices, selection.blocks.count  # [B, Hkv, C], [B, Hkv]
            width = script.selected.shape[-1] - 1
            if idx.shape[-1] != width:
                raise ValueError(f"bench_hit_rate records selections of capacity {width}; got {idx.shape[-1]}")
            row = torch.cat([idx.to(torch.int32), cnt.to(torch.int32).unsqueeze(-1)], -1)  # [B, Hkv, C + 1]
            script.selected[layer].index_copy_(0, at.clamp(max=script.selected.shape[1] - 1), row.unsqueeze(0))
        state.step[layer : layer + 1].add_(1)

    def propose(
        self, state: BenchHitRateState, layer: int, num_blocks: int | Tensor, budget_blocks: int,
        current: Selection | None = None, query: Tensor | None = None,
    ) -> BlockSet:
        """P of the step the layer's counter points at, copied from the script (empty while the
        serial pass is recorded, and past the recorded steps)."""
        script = state.script
        if script.predicted is None:  # the recorded pass runs serial DSA: its P is never read
            if script.selected is None:
                raise RuntimeError("bench_hit_rate proposes from its script: the engine records a serial pass first "
                                   "(GraphDecoder.prime_predictions, prr/runtime/replay.py)")
            batch, heads = script.selected.shape[2:4]
            dev = state.step.device
            return BlockSet(torch.zeros(batch, heads, max(budget_blocks, 0), dtype=torch.int32, device=dev),
                            torch.zeros(batch, heads, dtype=torch.int32, device=dev))
        width = script.predicted.shape[-1] - 1
        if budget_blocks != width:
            raise ValueError(f"bench_hit_rate's script holds P of {width} blocks; the engine asks for {budget_blocks}")
        at = state.step[layer : layer + 1].clamp(max=script.predicted.shape[1] - 1)  # [1]
        row = script.predicted[layer].index_select(0, at)[0]  # [B, Hkv, |P| + 1]
        return BlockSet(row[..., :width], row[..., width])

    # --- a range of layers at once (StaticPlan.learn_layers_at_once): one copy each, not one per layer
    def learns_layers_at_once(self) -> bool:
        return True  # table copies on either backend: nothing per layer needs a kernel

    def update_layers(self, state: BenchHitRateState, first: int, selections: list[Selection],
                      blocks: BlockSet | None = None) -> None:
        """`update` of layers first, first + 1, ... (every layer of the range is at the same step)."""
        layers = len(selections)
        script = state.script
        if script.recording:
            if script.selected is None:
                raise RuntimeError("bench_hit_rate: start_recording() sizes the table before the recorded pass")
            a = stacked_blocks(selections, blocks)  # [L, B, Hkv, C]
            width = script.selected.shape[-1] - 1
            if a.indices.shape[-1] != width:
                raise ValueError(f"bench_hit_rate records selections of capacity {width}; got {a.indices.shape[-1]}")
            rows = torch.cat([a.indices.to(torch.int32), a.count.to(torch.int32).unsqueeze(-1)], -1)  # [L, B, Hkv, C + 1]
            at = state.step[first : first + 1].clamp(max=script.selected.shape[1] - 1)  # [1]
            script.selected[first : first + layers].index_copy_(1, at, rows.unsqueeze(1))
        state.step[first : first + layers].add_(1)

    def propose_layers(self, state: BenchHitRateState, first: int, layers: int, num_blocks: int | Tensor,
                       budget_blocks: int) -> tuple[Tensor, Tensor]:
        """P of layers first, first + 1, ... at the step their counters point at -> (indices
        [L, B, Hkv, |P|] int32, counts [L, B, Hkv] int32): one gather from the script."""
        script = state.script
        if script.predicted is None:  # the recorded pass (serial DSA): P is never read
            p = self.propose(state, first, num_blocks, budget_blocks)
            return (p.indices.unsqueeze(0).expand(layers, *p.indices.shape).contiguous(),
                    p.count.unsqueeze(0).expand(layers, *p.count.shape).contiguous())
        width = script.predicted.shape[-1] - 1
        if budget_blocks != width:
            raise ValueError(f"bench_hit_rate's script holds P of {width} blocks; the engine asks for {budget_blocks}")
        at = state.step[first : first + 1].clamp(max=script.predicted.shape[1] - 1)  # [1]
        rows = script.predicted[first : first + layers].index_select(1, at)[:, 0]  # [L, B, Hkv, |P| + 1]
        return rows[..., :width], rows[..., width]

    def rank(self, state: BenchHitRateState, layer: int, num_blocks: int | Tensor) -> Tensor:
        """P of the current step as a rank (1 in P, NEVER elsewhere); [B, Hkv, max_blocks]."""
        script = state.script
        if script.predicted is None:
            raise RuntimeError("bench_hit_rate ranks from its script, built after the recorded serial pass")
        width = script.predicted.shape[-1] - 1
        p = self.propose(state, layer, num_blocks, width)
        max_blocks = script.info["max_blocks"]
        member = p.mask(max_blocks)
        return torch.where(member, torch.ones((), device=member.device), torch.full((), NEVER, device=member.device))

    # --- between passes (host) --------------------------------------------------------------
    def start_recording(self, state: BenchHitRateState, steps: int, batch: int, num_kv_heads: int, capacity: int,
                        max_blocks: int) -> None:
        """Before the serial pass of `steps` decode steps: the table of A (selections of `capacity`
        blocks) allocated, the step counters at 0, recording on."""
        if steps < 1:
            raise ValueError(f"bench_hit_rate records >= 1 decode step, got {steps}")
        script, layers = state.script, state.step.shape[0]
        script.selected = torch.zeros(layers, steps, batch, num_kv_heads, capacity + 1, dtype=torch.int32,
                                      device=state.step.device)
        script.predicted, script.recording = None, True
        script.info = {"max_blocks": max_blocks}
        state.step.zero_()

    def finish_recording(self, state: BenchHitRateState, num_blocks: Tensor, size: int,
                         sparse_layers: list[int]) -> dict[str, Any]:
        """After the serial pass (the engine rewound, step counters back at 0): P of every step from
        the recorded A. num_blocks: [S, B] blocks of each step's context per row; size: |P|.
        -> what the script holds, for the run record (the hit rate it makes, exactly)."""
        script = state.script
        if script.selected is None or not script.recording:
            raise RuntimeError("bench_hit_rate: finish_recording() follows start_recording() and the recorded pass")
        layers, steps, batch, heads, width = script.selected.shape
        if tuple(num_blocks.shape) != (steps, batch):
            raise ValueError(f"num_blocks must be [S, B] = {[steps, batch]}; got {list(num_blocks.shape)}")
        gen = torch.Generator().manual_seed(self.seed)
        selected = script.selected.cpu()
        nb = num_blocks.cpu().to(torch.int64).view(steps, batch, 1).expand(steps, batch, heads).reshape(-1)
        predicted = torch.zeros(layers, steps + 1, batch, heads, size + 1, dtype=torch.int32)
        kept = torch.zeros(steps, dtype=torch.int64)  # per step, over layers, rows and KV heads
        chosen = torch.zeros(steps, dtype=torch.int64)
        for layer in sparse_layers:
            a = selected[layer].view(-1, width)  # [S·B·Hkv, C + 1]
            idx, cnt, keep = swapped_predictions(a[:, :-1], a[:, -1], nb, self.hit_rate, size,
                                                 script.info["max_blocks"], gen)
            predicted[layer, :steps] = torch.cat([idx, cnt.unsqueeze(-1)], -1).view(steps, batch, heads, size + 1)
            kept += keep.view(steps, -1).sum(1)
            chosen += a[:, -1].to(torch.int64).view(steps, -1).sum(1)
        script.predicted = predicted.to(state.step.device)
        script.recording = False
        hits, total = int(kept.sum()), int(chosen.sum())
        script.info.update(steps=steps, predicted_blocks=size, hits=hits, selected=total,
                           expected_hit_rate=hits / total if total else None,
                           hits_per_step=kept.tolist(), selected_per_step=chosen.tolist())
        self.record.update({k: v for k, v in script.info.items() if k != "max_blocks"})
        log.info("predictor=bench_hit_rate (a benchmark tool): P of %d steps from a recorded serial pass, hit rate "
                 "%.4f by construction (%d of %d selected blocks; requested %.4f)", steps,
                 hits / total if total else float("nan"), hits, total, self.hit_rate)
        return dict(script.info)


def swapped_predictions(indices: Tensor, counts: Tensor, num_blocks: Tensor, hit_rate: float, size: int,
                        max_blocks: int, gen: torch.Generator) -> tuple[Tensor, Tensor, Tensor]:
    """`prr.blocks.controlled_predictions`'s definition, vectorised over rows: per row, P holds
    keep = round(hit_rate·min(|A|, size)) blocks of A (a uniformly random subset) and
    min(size - keep, num_blocks - |A|) blocks of [0, num_blocks) outside A (uniformly random).
    indices [N, C] (A's ids, padding past counts), counts [N], num_blocks [N] (every block of A lies
    below it) -> (P [N, size] int32 ascending, padding 0; counts [N] int32; keep [N] int64)."""
    rows, cap = indices.shape
    cnt = counts.to(torch.int64)
    keep = torch.round(hit_rate * torch.clamp(cnt, max=size).to(torch.float64)).to(torch.int64)  # half to even
    positions = torch.arange(cap)
    valid_a = positions < cnt.unsqueeze(1)  # [N, C]
    # a uniformly random subset of A of `keep` blocks: the first keep of a random order of its members
    order = torch.rand(rows, cap, generator=gen).masked_fill(~valid_a, 2.0).argsort(dim=1)
    kept = indices.to(torch.int64).gather(1, order)  # [N, C]
    kept_valid = positions < keep.unsqueeze(1)
    # blocks outside A within the context, in a uniformly random order; -1 keys never come first
    member = torch.zeros(rows, max_blocks + 1, dtype=torch.bool)
    member.scatter_(1, torch.where(valid_a, indices.to(torch.int64), max_blocks), True)
    outside = (~member[:, :max_blocks]) & (torch.arange(max_blocks) < num_blocks.unsqueeze(1))
    width = min(size, max_blocks)
    others = torch.rand(rows, max_blocks, generator=gen).masked_fill(~outside, -1.0).topk(width, dim=1).indices
    need = torch.minimum(size - keep, outside.sum(1))
    others_valid = torch.arange(width) < need.unsqueeze(1)
    ids = torch.cat([kept, others], 1)
    valid = torch.cat([kept_valid, others_valid], 1)
    big = max_blocks + 1
    ordered = ids.masked_fill(~valid, big).sort(dim=1).values[:, :size]  # valid ids first, ascending
    count = valid.sum(1)
    if ordered.shape[1] < size:
        ordered = torch.cat([ordered, torch.full((rows, size - ordered.shape[1]), big)], 1)
    ordered = ordered.masked_fill(torch.arange(size) >= count.unsqueeze(1), 0)
    return ordered.to(torch.int32), count.to(torch.int32), keep
