"""Scored requests on the CUDA-graph engine (`runtime.engine=graph`): the request strategy of
`prr.evaluation.Engine` beside the eager one (`EagerRequests`), behind the same interface.

One `GraphDecoder` per Engine, built (and on CUDA its step captured) on the first request at
the Engine's capacity (its longest request), over one paged KV cache that every request reuses:
captured graphs keep their pointers, so each request resets that state in place.

A request:
1. prefill as `GraphDecode.prefill` does: the research runtime's dense prefill into the engine's
   cache (`EagerRuntime(cache=)`), `finish_prefill` calibrating and warming the predictor on
   the prompt tail; its state is copied into the engine's, then `begin`, `prime_predictions`
   and `set_previous_selections`;
2. steps of the captured step. Each writes, at the position of the token it chose, that token,
   its log-probability, whether it is the argmax and the top-1 minus top-2 logit into small
   device buffers the host reads once per window (generation: greedy, EOS and stop strings
   checked per window of steps) or once per request (scoring: the continuation is fed by
   teacher forcing, `GraphDecoder.forced_tokens`).

Batches: runtime.batch_size requests decode together, one per row of the cache, each of its
own length (ragged rows: prefilled row by row, `EagerRuntime.prefill_rows`); the predictor is
calibrated on every row's prefill tail at once, as a ragged decode run's is.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import Tensor

from prr.runtime.graph_decode import GraphDecoder
from prr.runtime.graph_run import engine_backend, graph_plan, resolved_plan, scoring_problems
from prr.runtime.run_strategy import Steps, topk_label
from prr.runtime.timing import timed_steps


class GraphRequests:
    """Engine's request strategy on the graph engine (see the module docstring)."""

    label = "graph"

    def __init__(self, owner: Any) -> None:
        """owner: the prr.evaluation.Engine (its cfg, settings, model, budget, ops, max_tokens, dtype)."""
        from hydra.utils import instantiate

        from prr.runtime.eager_run import kv_cache
        from prr.runtime.probe import device_name

        self.owner = owner
        settings, cfg, decoder = owner.settings, owner.cfg, owner.model.decoder
        self.selector = selector = instantiate(cfg.selector)
        selector.bind_model(owner.model.config)
        self.predictor = predictor = instantiate(cfg.predictor)
        problems = scoring_problems(settings, predictor, owner.budget)
        if problems:
            raise ValueError("; ".join(problems))
        self.device = owner.device
        self.rows = settings.batch_size  # requests decoded together, one per row of the cache
        self.backend = engine_backend(settings.device, owner.ops.name, owner.ops.graph_on_gpu)
        # The engine's cache, its capacity the longest request: every request prefills into it.
        self.cache = kv_cache(decoder, self.rows, settings.block_size, owner.max_tokens, owner.dtype, self.device)
        max_blocks = self.cache.max_blocks
        plan = graph_plan(settings, selector, predictor, owner.budget, max_blocks)
        self.budget_info: dict[str, Any] = {"policy": type(owner.budget).__name__,
                                            "predicted_blocks": plan.predicted_blocks}
        # |P| is static for the captured step: decided once, at the longest request's context
        plan, info = resolved_plan(plan, owner.budget, predictor, decoder, self.rows, self.cache.max_tokens, selector,
                                   self.backend, max_blocks)
        self.budget_info.update(info)
        self.plan = plan
        self.speculating = plan.variant == "prr"
        self.selection_backend = selector.set_backend(self.backend)
        self.topk_blocks = topk_label(selector)
        self.device_name = device_name(self.device)
        # Steps between host looks while generating (EOS, stop strings); scoring looks once per request.
        self.window = 16
        self.engine: GraphDecoder | None = None
        self.positions = [0] * self.rows  # per row: the position of the token the next step reads
        # pooled device counters over requests (|A|, |P|, |P ∩ A|, |A_t ∩ A_t-1| per layer)
        self.totals: Tensor | None = None
        self.request_counts: dict[str, float] = {}  # the last batch's, pooled over sparse layers and rows (_pooled)
        # the last batch's per row (padding rows too), pooled over sparse layers and KV heads; a row's
        # steps past its own end (while the batch's other rows decode on) are counted
        self.row_counts: list[dict[str, float]] = []

    # --- a request ----------------------------------------------------------------------
    def open(self, total_tokens: int) -> Any:
        """The research runtime that prefills a request into the engine's cache (emptied in place)."""
        from prr.runtime.eager_run import EagerRuntime

        o = self.owner
        with torch.inference_mode():  # (slots the prefill allocated are inference tensors)
            for layer in range(self.cache.num_layers):
                self.cache.set_length(layer, 0)
                self.cache.reset_metadata(layer)
        # Serial DSA learns nothing from the prefill tail but its last selection (the last-step
        # overlap's A_t-1); where a bulk metadata update equals the stepwise one, a one-token
        # tail leaves the same metadata and A_t-1 (tests/test_runtime.py) at 1/32 of the selections.
        one_token = not self.speculating and self.selector.bulk_metadata_equals_stepwise
        tail = {"calibration_tokens": 1} if one_token else {}
        return EagerRuntime(o.model.decoder, o.settings, self.selector, self.predictor, o.budget, o.ops.name,
                            self.cache.max_tokens, o.dtype, cache=self.cache, mode="sparse", dense_metrics_every=1,
                            check_serial=False, **tail)

    def begin(self, eager: Any, lengths: list[int]) -> None:
        """After the prefill of lengths[b] tokens into row b of the cache: the engine takes over
        (built and captured on the first batch), its state set for this batch in place."""
        # the prefill ran the selector and predictor on the prefill's ops: back to the engine's
        self.selector.set_backend(self.backend)
        self.predictor.set_backend(self.backend)
        first = self.engine is None
        if first:
            self._build()
        engine = self.engine
        engine.take_over(lengths, torch.zeros(self.rows, dtype=torch.long),
                         eager.backend.predictor_state if self.speculating else None, eager.backend.previous)
        self.forced.fill_(-1)
        self.positions = list(lengths)
        if first:  # (CUDA: one capture, rewound)
            self.replay = engine.capture_all({"step": self.replay})["step"]

    def _build(self) -> None:
        """The engine, its step view, the output buffers and the forced-token table, once."""
        o = self.owner
        self.plan = dataclasses.replace(self.plan, projections=o.settings.graph_projections())  # (fused GEMVs: GPU, batch 1)
        engine = self.engine = GraphDecoder(
            o.model.decoder, self.plan, self.rows, self.cache.max_tokens, compile=self.device.type == "cuda",
            selector=self.selector, predictor=self.predictor if self.speculating else None, cache=self.cache,
            backend=self.backend)
        cap = engine.max_tokens + 1
        # Per row, indexed by the position of the token a step chose ([B, capacity + 1]): the same
        # captured step serves every request, whatever its prompt length.
        B = self.rows
        self.tokens = torch.zeros(B, cap, dtype=torch.long, device=self.device)
        self.logprobs = torch.zeros(B, cap, dtype=torch.float32, device=self.device)
        self.greedy = torch.zeros(B, cap, dtype=torch.bool, device=self.device)
        self.margins = torch.zeros(B, cap, dtype=torch.float32, device=self.device)
        # [B, max_tokens]: the token that follows each position (-1: the step's greedy token)
        self.forced = engine.forced_tokens = torch.full((B, engine.max_tokens), -1, dtype=torch.long,
                                                         device=self.device)
        view = engine.with_plan(count_hits=True, measure_dense=False)

        def step() -> None:
            logits = view.step(advance=True).float()  # [B, V]; view.token: the chosen tokens [B, 1]
            at = view.pos.long().view(-1, 1)  # [B, 1]: each row's chosen token's position
            top2 = logits.topk(2, -1).values  # [B, 2]
            self.tokens.scatter_(1, at, view.token)
            self.logprobs.scatter_(1, at, logits.log_softmax(-1).gather(1, view.token))
            self.greedy.scatter_(1, at, logits.argmax(-1, keepdim=True) == view.token)
            self.margins.scatter_(1, at, top2[:, :1] - top2[:, 1:])

        self.replay = step

    def steps(self, first: list[int], n: int, forced: list[list[int]] | None, step: int = 0) -> list[Steps]:
        """n steps of the batch from each row's position: step 0 reads first[b], step i > 0 the
        token step i - 1 chose: forced[b][i - 1] (teacher forcing; -1: greedy) or the greedy
        token. Rows past len(first) (a short batch's padding) repeat the last row's.
        -> one Steps per row given."""
        engine, given = self.engine, len(first)
        pad = self.rows - given
        first = first + first[-1:] * pad
        p0 = self.positions
        if max(p0) + n > engine.max_tokens:  # (step i writes row b's K/V at p0[b] + i)
            raise ValueError(f"{n} steps from positions {p0} exceed the engine's {engine.max_tokens} tokens")
        with torch.inference_mode():  # (the engine was built, and its tensors made, under the prefill's)
            engine.token.copy_(torch.tensor(first, dtype=torch.long).view(-1, 1))
            if forced is not None:
                for b, row in enumerate(forced + forced[-1:] * pad):
                    self.forced[b, p0[b] : p0[b] + n] = torch.tensor(row, dtype=torch.long)
            wall = timed_steps([self.replay] * n, self.device)  # device time per step on CUDA
            # each row's n chosen tokens sit at p0[b] + 1 ... p0[b] + n: one gather and one read each
            at = (torch.tensor(p0)[:, None] + 1 + torch.arange(n)).to(self.device)  # [B, n]
            chosen, logprobs, greedy, margins = (t.gather(1, at).tolist() for t in (self.tokens, self.logprobs,
                                                                                       self.greedy, self.margins))
        self.positions = [p + n for p in p0]
        return [Steps(read=[first[b], *chosen[b][:-1]], chosen=chosen[b], logprobs=logprobs[b], greedy=greedy[b],
                      margins=margins[b], wall_s=wall, measure_s=[0.0] * n) for b in range(given)]

    def end(self) -> None:
        """A request done: its device counters pooled (read once per request)."""
        if self.engine is None:
            return
        read = self.engine.counters()  # one host read (it was one per counter name)
        counts = torch.tensor([read[c] for c in self.engine.COUNTERS], dtype=torch.float64)
        self.totals = counts if self.totals is None else self.totals + counts
        self.request_counts = self._pooled(counts)
        sparse = torch.tensor(self.engine.sparse, dtype=torch.bool)
        rows = self.engine.study_counters(per_row=True)  # name -> [L, B, Hkv]
        per_row = {c: rows[c][sparse].sum((0, 2)).tolist() for c in ("selected", "predicted", "hits", "overlap")}
        self.row_counts = [{c: per_row[c][b] for c in per_row} for b in range(self.rows)]

    def _pooled(self, counts: Tensor) -> dict[str, float]:
        """|A|, |P|, |P ∩ A| and |A_t ∩ A_t-1| summed over sparse layers, from counters [7, L]."""
        names, sparse = self.engine.COUNTERS, [i for i, s in enumerate(self.engine.sparse) if s]
        return {c: float(counts[names.index(c)][sparse].sum()) for c in ("selected", "predicted", "hits", "overlap")}

    def results(self) -> dict[str, Any]:
        """The summary's engine numbers: hit rate and precision (PRR), last-step overlap, pooled
        over every request's decode steps and sparse layers."""
        out: dict[str, Any] = {"engine": "graph", "predicted_blocks": self.plan.predicted_blocks}
        if self.totals is None:
            return out
        total = self._pooled(self.totals)
        if self.speculating:
            out["hit_rate"] = total["hits"] / total["selected"] if total["selected"] else None
            out["precision"] = total["hits"] / total["predicted"] if total["predicted"] else None
        out["last_step_overlap"] = total["overlap"] / total["selected"] if total["selected"] else None
        return out
