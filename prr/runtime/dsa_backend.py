"""The DSA/PRR attention backend of the research runtime: owns the paged KV cache, the
selector's metadata and the predictor's state, and runs each layer's decode attention
through `PRRStep` — the graph engine's own step, run eagerly: one stage after the
other, each timed (`StageTimer`: events on CUDA, resolved at end_step), with the budget's |P|
for this layer and step. Beside the step (untimed) it measures what the records need: the
predictor's top-|A| ranking, the dense reference and the serial-DSA check.

Run modes: `sparse` returns the PRR output (the selection decides what is attended);
`shadow` returns dense attention while selector, predictor and budget run beside it on the
dense trajectory, so methods compare on identical inputs. Both produce the same records.
"""

from __future__ import annotations

import math
import time
from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from prr.attention_state import AttentionState, merge
from prr.block_attention import attend_blocks, attend_dense, relative_error
from prr.blocks import BlockSet
from prr.budget.base import SpeculationBudget
from prr.cache import PagedKVCache
from prr.predictors.base import Predictor
from prr.reuse import SelectionReuse
from prr.runtime.engine_ops import BACKENDS
from prr.runtime.prr_step import PRRStep
from prr.runtime.settings import REPAIR_MODES, RUN_MODES
from prr.runtime.timing import StageTimer
from prr.selectors.base import Selection, Selector
from prr.step_record import LayerStepRecord


class DSABackend:
    """AttentionBackend for the decoder (prefill dense, decode through PRR)."""

    def __init__(
        self,
        cache: PagedKVCache,
        num_heads: int,
        selector: Selector,
        predictor: Predictor,
        budget: SpeculationBudget,
        mode: str = "sparse",
        repair_mode: str = "exact",
        calibration_tokens: int = 32,
        dense_metrics_every: int = 1,
        check_serial: bool = False,
        backend: str = "torch",
        reuse: SelectionReuse | None = None,
    ) -> None:
        """backend: the op backend of the step (prr/runtime/engine_ops.py): "torch" (any
        device) or "triton" (CUDA, or the CPU under TRITON_INTERPRET=1).
        reuse: selection reuse (prr.reuse, an approximation; default none: every layer selects)."""
        if mode not in RUN_MODES:
            raise ValueError(f"runtime.mode={mode!r} is not one of {list(RUN_MODES)}")
        if repair_mode not in REPAIR_MODES:
            raise ValueError(f"runtime.repair_mode={repair_mode!r} is not one of {list(REPAIR_MODES)}")
        if num_heads % cache.num_kv_heads:
            raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={cache.num_kv_heads}")
        if backend not in BACKENDS:
            raise ValueError(f"backend={backend!r} is not one of {list(BACKENDS)}")
        self.cache = cache
        self.group = num_heads // cache.num_kv_heads
        self.scale = 1.0 / math.sqrt(cache.head_dim)
        self.selector, self.predictor, self.budget = selector, predictor, budget
        self.mode, self.repair_mode = mode, repair_mode
        self.calibration_tokens = calibration_tokens
        self.dense_metrics_every = dense_metrics_every
        self.check_serial = check_serial
        self.backend = backend
        self.timer = StageTimer(cache.device)
        self.engine = PRRStep.eager(cache, num_heads, selector, predictor, backend, repair_mode, self.timer, reuse)
        self.step = 0
        self.history: list[list[Selection] | None] = [None] * cache.num_layers  # prefill-tail selections
        self.previous: list[Tensor | None] = [None] * cache.num_layers
        self.predictor_state: Any = None
        self.records: list[LayerStepRecord] = []
        self._marks: list[list] = []  # stage-timer marks of each record, resolved at end_step
        self.measure_s = 0.0  # wall time of untimed measurement work this step (dense reference, serial check)
        self._finite: dict[int, Tensor] = {}  # layer -> 0-dim bool: last attention output finite

    def _grouped(self, q: Tensor) -> Tensor:
        """q: [B, Hq, ...D] -> [B, Hkv, G, ...D]."""
        return q.view(q.shape[0], self.cache.num_kv_heads, self.group, *q.shape[2:])

    def hidden_hook(self, prefill: bool):
        """The decoder's callback for each layer's normed hidden state, where the selector reads it
        (`Selector.needs_hidden`: the lightning indexer); else None."""
        if not self.selector.needs_hidden:
            return None
        return lambda layer, x: self.selector.take_hidden(self.cache, layer, x, prefill)

    # --- prefill ------------------------------------------------------------------------
    def prefill(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """q: [B, Hq, T, D], k, v: [B, Hkv, T, D] -> [B, Hq, T, D] (dense, causal)."""
        self.absorb_prefill(layer, q, k, v)
        if q.is_cuda and q.dtype == torch.float32 and self.group > 1:
            # fp32 GQA has no fused SDPA kernel (torch 2.11): its math fallback holds [B, Hq, T, T]
            # scores (122 GiB at 32K on the 8B shape); K/V repeated per query head take the
            # memory-efficient kernel, which does fp32
            k, v = k.repeat_interleave(self.group, 1), v.repeat_interleave(self.group, 1)
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale, enable_gqa=True)

    def absorb_prefill(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> None:
        """`prefill` without its output: k, v into the cache, the selector's metadata and the
        prefill tail's selections. A kept prefill replayed into another config needs only this
        (its output is known): the causal attention over T prompt tokens, O(T²) per layer, was
        most of a 32K replay (issue 34's campaign: about 0.1 s per row and config on the H200)."""
        start, end = self.cache.append(layer, k, v)
        if start != 0:
            raise ValueError(f"prefill of layer {layer} must start an empty cache (it holds {start} tokens)")
        if self.selector.is_dense_layer(layer):
            self.selector.update_metadata(self.cache, layer, start, end)
        else:
            # Selections at the last prompt positions (predictor calibration and warm-up), each
            # made as decode would have: position t sees no key after t (`Selector.select_tail`).
            tail_start = max(1, end - self.calibration_tokens)
            self.selector.update_metadata(self.cache, layer, start, tail_start)
            qg = self._grouped(q)  # [B, Hkv, G, T, D]
            self.history[layer] = self.selector.select_tail(qg[:, :, :, tail_start:end], self.cache, layer,
                                                            tail_start, queries=qg)

    def finish_prefill(self, history: list[list[Selection] | None] | None = None,
                       calibrate_on: list[list[Selection] | None] | None = None) -> dict[str, Any]:
        """Calibrate the predictor on the prefill tail, then warm its state by replaying it.
        history: the tail's selections per layer (None for dense layers), [B, ...] each
        (default: this backend's own prefill's; a ragged batch prefills its rows one by one and
        passes theirs, stacked: `prr.selectors.base.stack_rows`).
        calibrate_on: what calibration fits instead (default: history) — a tensor-parallel rank
        passes every rank's KV heads, so each fits what one process would."""
        info = self.calibrate_predictor(history, calibrate_on)
        self.warm_predictor()
        return info

    def calibrate_predictor(self, history: list[list[Selection] | None] | None = None,
                            calibrate_on: list[list[Selection] | None] | None = None) -> dict[str, Any]:
        """`finish_prefill`'s first half (the predictor's `calibrate`, timed apart by
        experiments/request_cost.py) -> what calibration chose."""
        if history is not None:
            if len(history) != self.cache.num_layers:
                raise ValueError(f"history has {len(history)} layers, the cache {self.cache.num_layers}")
            self.history = history
        return self.predictor.calibrate(self.history if calibrate_on is None else calibrate_on)

    def warm_predictor(self) -> None:
        """`finish_prefill`'s second half: the predictor's state made and warmed by replaying the
        prefill tail (after `calibrate_predictor`)."""
        c = self.cache
        self.predictor_state = self.predictor.init_state(c.num_layers, c.batch, c.num_kv_heads, c.max_blocks, c.device)
        self.engine.schedule.adopt_state(self.predictor_state)
        for first, layers in self._warm_runs():  # layers' states are independent: a step of a run at once
            for t in range(len(self.history[first])):
                self.predictor.update_layers(self.predictor_state, first, [self.history[i][t] for i in layers])
        if not self.predictor.learns_layers_at_once():
            self.predictor.learn_tail(self.predictor_state, self.history)
        for layer, selections in enumerate(self.history):
            if selections:
                self.previous[layer] = selections[-1].blocks.mask(c.max_blocks)

    def _warm_runs(self) -> list[tuple[int, range]]:
        """Where the predictor learns layers at once (`learns_layers_at_once`: one launch, equal
        layer by layer to `update`), the runs of consecutive layers whose tails have one length ->
        (first, layers) each; else none (every layer `update`s step by step: L·T calls,
        704 at 32K on Qwen-0.5B, down to T per run here)."""
        if not self.predictor.learns_layers_at_once():
            return []
        runs: list[tuple[int, range]] = []
        for layer, selections in enumerate(self.history):
            if not selections:
                continue
            first, layers = runs[-1] if runs else (-1, range(0))
            if runs and layers.stop == layer and len(self.history[first]) == len(selections):
                runs[-1] = (first, range(first, layer + 1))
            else:
                runs.append((layer, range(layer, layer + 1)))
        return runs

    # --- decode -------------------------------------------------------------------------
    def decode(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """q: [B, Hq, D], k, v: [B, Hkv, D] -> [B, Hq, D]."""
        if self.predictor_state is None:
            raise RuntimeError("call finish_prefill() after the prefill and before decoding")
        start, end = self.cache.append(layer, k.unsqueeze(2), v.unsqueeze(2))
        if not self.selector.is_dense_layer(layer):  # the decode step's own metadata update (static shapes)
            self.selector.append_metadata(self.cache, layer, torch.full((self.cache.batch,), start, device=q.device))
        qg = self._grouped(q)  # [B, Hkv, G, D]
        batch, dev = self.cache.batch, q.device
        num_blocks = self.cache.num_blocks(layer)
        lengths = torch.full((batch,), end, dtype=torch.int32, device=dev)
        block_counts = torch.full((batch,), num_blocks, dtype=torch.int32, device=dev)
        if self.selector.is_dense_layer(layer):
            return self._finished(layer, self.engine.dense_attention(layer, q, lengths, block_counts).to(q.dtype))
        budget_blocks = self.budget.predicted_blocks(layer, num_blocks, self.selector.selected_blocks(num_blocks))
        # Untimed measurement before the step: the predictor's ranking (best first), to judge its
        # top-|A_t| whatever |P| the budget chose (the oracle ranks by this step's A).
        measure_start = time.perf_counter()
        current = self.selector.select(qg, self.cache, layer) if self.predictor.needs_current_selection else None
        capacity = self.selector.capacity(self.group, self.cache.max_blocks)  # |A| at most
        query = {"query": qg} if getattr(self.predictor, "needs_query", False) else {}  # query_similarity
        ranking = self.predictor.propose_best_first(self.predictor_state, layer, num_blocks, capacity, current, **query)
        self.measure_s += time.perf_counter() - measure_start
        out, selection = self.engine.sparse_attention(layer, q, lengths, block_counts, predicted_blocks=budget_blocks,
                                                      fp32=True, step=self.step)  # [B, Hq, D] fp32
        predicted = self.engine.schedule.prediction(layer) if budget_blocks else None
        result_out = out.view_as(qg)  # [B, Hkv, G, D]
        marks = self.timer.take()  # resolved in end_step: no synchronisation inside the step

        # Measurements beside the step (untimed): dense reference, serial-DSA equivalence.
        measure_start = time.perf_counter()
        dense: AttentionState | None = None
        block_mass = output_relerr = serial_relerr = None
        if self.mode == "shadow" or self.step % self.dense_metrics_every == 0:
            dense, mass = attend_dense(qg, self.cache, layer, end, self.scale)
            block_mass = mass.mean(2)  # [B, Hkv, max_blocks]
            output_relerr = relative_error(result_out, dense.out)
        if self.check_serial:
            serial = attend_blocks(qg, self.cache, layer, selection.blocks, end, self.scale)
            if self.selector.compensates:  # serial DSA gets the same compensation as the PRR step
                serial = merge(serial, self.selector.compensation(qg, self.cache, layer, selection))
            serial_relerr = relative_error(result_out, serial.out)
        if self.mode == "sparse":  # in shadow mode the dense attention is the step's real output
            self.measure_s += time.perf_counter() - measure_start
        selected = selection.blocks.mask(self.cache.max_blocks)
        predicted_mask = predicted.mask(self.cache.max_blocks) if predicted is not None else torch.zeros_like(selected)
        # The predictor's top-|A_t| blocks: ranking entries before position |A_t|.
        top_of_ranking = BlockSet(ranking.indices, torch.minimum(ranking.count, selection.blocks.count))
        self.records.append(LayerStepRecord(
            step=self.step, layer=layer, context_tokens=end, selected=selected,
            predicted=predicted_mask, previous=self.previous[layer],
            ranked_at_k=top_of_ranking.mask(self.cache.max_blocks),
            budget_blocks=budget_blocks, timings={}, block_mass=block_mass,
            output_relerr=output_relerr, serial_relerr=serial_relerr,
        ))
        self._marks.append(marks)
        self.previous[layer] = selected
        if self.mode == "shadow":
            if dense is None:
                dense, _ = attend_dense(qg, self.cache, layer, end, self.scale)
            return self._finished(layer, dense.out.to(q.dtype).view_as(q))
        return self._finished(layer, out.to(q.dtype))

    def _finished(self, layer: int, out: Tensor) -> Tensor:
        """Note whether a layer's attention output is finite (a device flag: no sync here)."""
        self._finite[layer] = torch.isfinite(out).all()
        return out

    def nonfinite_layers(self) -> list[int]:
        """Layers whose last attention output held NaN/Inf (synchronises; for error reports)."""
        return [layer for layer, ok in sorted(self._finite.items()) if not bool(ok)]

    def end_step(self) -> tuple[list[LayerStepRecord], float]:
        """Close a decode step (all layers done): hand over its records and the seconds spent
        on measurement work (CPU wall clock; on CUDA this excludes queued GPU time)."""
        records = [replace(r, timings=self.timer.resolve(m)) for r, m in zip(self.records, self._marks, strict=True)]
        self.records, self._marks = [], []
        self.budget.observe(records)  # adaptive budgets learn from what speculation did
        measure_s, self.measure_s = self.measure_s, 0.0
        self.step += 1
        return records, measure_s


def check_finite(logits: torch.Tensor, step: int, backend: DSABackend) -> None:
    """NaN/Inf in a step's logits stop the run with the step and the first bad layer."""
    if bool(torch.isfinite(logits).all()):
        return
    bad = backend.nonfinite_layers()
    where = f"first in the attention output of layer {bad[0]}" if bad else "not in any attention output (MLP/norm?)"
    raise FloatingPointError(f"non-finite logits at decode step {step}, {where}; non-finite attention layers: {bad}")
