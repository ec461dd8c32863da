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

from prr.runtime.graph_run import engine_backend, scoring_problems
from prr.runtime.graph_session import GraphSession, session_plan
from prr.runtime.run_strategy import Steps, topk_label


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
        # |P| is static for the captured step: decided once, at the longest request's context
        self.plan, self.budget_info = session_plan(settings, selector, predictor, owner.budget, decoder, self.rows,
                                                   self.cache.max_tokens, self.backend, self.cache.max_blocks)
        self.speculating = self.plan.variant == "prr"
        self.selection_backend = selector.set_backend(self.backend)
        self.topk_blocks = topk_label(selector)
        self.device_name = device_name(self.device)
        # Steps between host looks while generating (EOS, stop strings); scoring looks once per request.
        self.window = 16
        self.session: GraphSession | None = None
        # pooled device counters over requests (|A|, |P|, |P ∩ A|, |A_t ∩ A_t-1| per layer)
        self.totals: Tensor | None = None
        self.request_counts: dict[str, float] = {}  # the last batch's, pooled over sparse layers and rows (_pooled)
        # the last batch's per row (padding rows too), pooled over sparse layers and KV heads; a row's
        # steps past its own end (while the batch's other rows decode on) are counted
        self.row_counts: list[dict[str, float]] = []

    @property
    def engine(self) -> Any:
        """The session's GraphDecoder (None before the first request)."""
        return None if self.session is None else self.session.engine

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
        (the session built and its step captured on the first batch), its state set for this batch
        in place."""
        # the prefill ran the selector and predictor on the prefill's ops: back to the engine's
        self.selector.set_backend(self.backend)
        self.predictor.set_backend(self.backend)
        first = self.session is None
        if first:
            o = self.owner
            plan = dataclasses.replace(self.plan, projections=o.settings.graph_projections())  # (fused GEMVs: GPU, batch 1)
            self.session = GraphSession(o.model.decoder, plan, self.rows, self.cache, selector=self.selector,
                                        predictor=self.predictor, backend=self.backend,
                                        compile=self.device.type == "cuda", scores=True)
            self.session.forcing()  # (before the capture: the step reads the table it was captured with)
        self.session.take_over(eager.backend, lengths, torch.zeros(self.rows, dtype=torch.long))
        if first:  # (CUDA: one capture, rewound)
            self.session.capture({"step": {"count_hits": True, "measure_dense": False}})

    def steps(self, first: list[int], n: int, forced: list[list[int]] | None, step: int = 0) -> list[Steps]:
        """n steps of the batch from each row's position: step 0 reads first[b], step i > 0 the
        token step i - 1 chose: forced[b][i - 1] (teacher forcing; -1: greedy) or the greedy
        token. Rows past len(first) (a short batch's padding) repeat the last row's.
        -> one Steps per row given."""
        session, given = self.session, len(first)
        pad = self.rows - given
        first = first + first[-1:] * pad
        with torch.inference_mode():  # (the engine was built, and its tensors made, under the prefill's)
            session.engine.token.copy_(torch.tensor(first, dtype=torch.long).view(-1, 1))
        if forced is not None:
            session.force(forced + forced[-1:] * pad, n)
        wall = session.run(["step"] * n)  # device time per step on CUDA
        out = session.read()  # each row's n chosen tokens, at its positions + 1 ... + n
        return [Steps(read=[first[b], *out["tokens"][b][:-1]], chosen=out["tokens"][b], logprobs=out["logprobs"][b],
                      greedy=out["greedy"][b], margins=out["margins"][b], wall_s=wall, measure_s=[0.0] * n)
                for b in range(given)]

    def end(self) -> None:
        """A request done: its device counters pooled (read once per request)."""
        if self.session is None:
            return
        engine = self.session.engine
        read = engine.counters()  # one host read (it was one per counter name)
        counts = torch.tensor([read[c] for c in engine.COUNTERS], dtype=torch.float64)
        self.totals = counts if self.totals is None else self.totals + counts
        self.request_counts = self._pooled(counts)
        sparse = torch.tensor(engine.sparse, dtype=torch.bool)
        rows = engine.study_counters(per_row=True)  # name -> [L, B, Hkv]
        per_row = {c: rows[c][sparse].sum((0, 2)).tolist() for c in ("selected", "predicted", "hits", "overlap")}
        self.row_counts = [{c: per_row[c][b] for c in per_row} for b in range(self.rows)]
    def _pooled(self, counts: Tensor) -> dict[str, float]:
        """|A|, |P|, |P ∩ A| and |A_t ∩ A_t-1| summed over sparse layers, from counters [7, L]."""
        engine = self.session.engine
        names, sparse = engine.COUNTERS, [i for i, s in enumerate(engine.sparse) if s]
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
