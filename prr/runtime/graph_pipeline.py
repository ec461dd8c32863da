"""The graph engine's pipeline (`runtime.engine=graph`): prefill -> hand-off -> steps, one class
for run.py's decode (`GraphDecode`, graph_run.py, `purpose="decode"`) and scored requests
(`prr.evaluation.Engine`, `purpose="scoring"`). The eager one: prr/runtime/eager_pipeline.py.

One `GraphSession` (graph_session.py: the plan with the budget's |P|, the engine, its captured
views, one timing window) per pipeline, built on the first prefill over one paged KV cache that
every request reuses: captured graphs keep their pointers, so each request resets that state in
place.

A prefill: the research runtime's dense prefill into the engine's cache (`EagerRuntime(cache=)`;
a ragged batch row by row, `prefill_rows`), `finish_prefill` calibrating and warming the
predictor on every row's prompt tail at once, then the session's `take_over`.

Steps: each writes, at the position of the token it chose, that token (scoring: also its
log-probability, whether it is the argmax and the top-1 minus top-2 logit) into device buffers
the host reads once per window. A decode runs the view of the variant its budget chooses per
window (adaptive: serial or PRR), measuring against dense attention every
`dense_metrics_every`-th step, and counts each window on the device for the budget's rule; a
scored request runs one view and its counters are read once per request (`end`).
"""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from prr.runtime.graph_session import GraphSession, engine_backend, session_plan
from prr.runtime.run_strategy import Steps, topk_label

PURPOSES = ("decode", "scoring")


@dataclass
class DecodeLog:
    """A decode's steps: seconds and variant of each; the device counters summed per variant
    (serial steps count |A|, no hits), name -> [counters, L] fp64."""

    latencies: list[float] = field(default_factory=list)
    ran: list[str] = field(default_factory=list)
    totals: dict[str, Tensor] = field(default_factory=dict)


@dataclass
class RequestCounts:
    """Scored requests' device counters: `totals` [counters, L] over every request; the last
    batch's pooled over sparse layers and rows (`last`), and per row (`rows`, padding rows too;
    a row's steps past its own end, while the batch's other rows decode on, are counted)."""

    totals: Tensor | None = None
    last: dict[str, float] = field(default_factory=dict)
    rows: list[dict[str, float]] = field(default_factory=list)


class GraphPipeline:
    """The graph engine's pipeline (see the module docstring)."""

    label = "graph"

    def __init__(self, settings: Any, decoder: Any, selector: Any, predictor: Any, budget: Any, ops: Any, *,
                 rows: int, capacity: int, dtype: torch.dtype, purpose: str, context: int | None = None,
                 tp: Any = None, reuse: Any = None) -> None:
        """settings: the runtime group; decoder: the model's (or a tensor-parallel rank's shard);
        ops: the backend group (the prefill's ops; the engine's `engine_backend`); rows: requests
        (or a decode's batch) decoded together; capacity: tokens a row holds; purpose: "decode"
        (run.py: the budget's variants per window, dense-measured steps) or "scoring" (one view,
        each step's scores); context: blocks at which the budget decides |P| (default: the cache's);
        reuse: the engine's selection reuse (prr.reuse; default none)."""
        from prr.runtime.eager_run import kv_cache
        from prr.runtime.probe import device_name

        if purpose not in PURPOSES:
            raise ValueError(f"purpose={purpose!r} is not one of {list(PURPOSES)}")
        self.settings, self.decoder, self.selector, self.predictor, self.budget = settings, decoder, selector, predictor, budget
        self.ops, self.dtype, self.purpose, self.tp, self.rows, self.reuse = ops.name, dtype, purpose, tp, rows, reuse
        device = torch.device(settings.device)
        self.backend = engine_backend(settings.device, ops.name, ops.graph_on_gpu)
        # The engine's cache, its capacity the longest request: every request prefills into it.
        self.cache = kv_cache(decoder, rows, settings.block_size, capacity, dtype, device)
        # |P| is static for the captured step: decided once, before any prefill
        self.plan, self.budget_info = session_plan(settings, selector, predictor, budget, decoder, rows, capacity,
                                                   self.backend, self.cache.max_blocks if context is None else context)
        self.variants = budget.engine_variants(self.plan.variant)  # the views captured (one per variant)
        self.every = (1 if self.plan.mode == "shadow" else settings.dense_metrics_every) if purpose == "decode" else 0
        # Steps between host looks (EOS, stop strings): a decode's budget may set them; scoring looks once per request.
        self.window = budget.window_steps_or(16 if device.type == "cuda" else 1) if purpose == "decode" else 16
        self.selection_backend = selector.set_backend(self.backend)
        self.topk_blocks = topk_label(selector)
        self.device_name = device_name(device)
        self.session: GraphSession | None = None
        self.done = 0  # steps since the last prefill
        self.log, self.counts = DecodeLog(), RequestCounts()

    @property
    def speculating(self) -> bool:
        return self.plan.variant == "prr"

    @property
    def calibration(self) -> dict[str, Any]:
        """What the last prefill's predictor calibration chose (empty: none ran)."""
        return self.budget_info.get("calibration", {})

    @property
    def row_counts(self) -> list[dict[str, float]]:
        """The last scored batch's |A|, |P|, |P ∩ A| and |A_t ∩ A_t-1| per row (`RequestCounts.rows`)."""
        return self.counts.rows

    @property
    def engine(self) -> Any:
        """The session's GraphDecoder (None before the first prefill)."""
        return None if self.session is None else self.session.engine

    # --- prefill and hand-off ---------------------------------------------------------------
    def prefill(self, prompts: Tensor | list[Tensor], kept: list[Any] | None = None,
                new_tokens: int = 0, phase: Any = None) -> Tensor | list[Tensor | None]:
        """The prompts prefilled into the engine's cache (emptied in place), the predictor
        calibrated and warmed on their tails, then the engine takes over (built and captured on
        the first prefill). prompts: [B, T] (every row the same length, prefilled at once) or one
        [1, T_b] per row (rows, ragged; kept[b]: a kept dense prefill's q/k/v to replay instead,
        `EagerRuntime.prefill_rows`); new_tokens: the steps to follow (checked against the
        capacity); phase(name): called after each of "replay" (the prefill), "calibrate", "warm" and
        "begin" (the hand-off; experiments/request_cost.py times them). -> logits [B, V] at each row's last position, or where a
        kept prefill was replayed a list of [1, V] per row with None there (the caller has those)."""
        from prr.runtime.eager_run import EagerRuntime

        longest = prompts.shape[1] if isinstance(prompts, Tensor) else max(p.shape[1] for p in prompts)
        if longest + new_tokens > self.cache.max_tokens:
            raise ValueError(f"{longest} prompt tokens + {new_tokens} new ones exceed the pipeline's "
                             f"{self.cache.max_tokens} tokens")
        s, phase = self.settings, phase or (lambda name: None)
        with torch.inference_mode():  # (slots the prefill allocated are inference tensors)
            for layer in range(self.cache.num_layers):
                self.cache.set_length(layer, 0)
                self.cache.reset_metadata(layer)
        # Serial DSA learns nothing from the prefill tail but its last selection (the last-step
        # overlap's A_t-1); where a bulk metadata update equals the stepwise one, a one-token
        # tail leaves the same metadata and A_t-1 (tests/test_runtime.py) at 1/32 of the selections.
        one_token = self.purpose == "scoring" and not self.speculating and self.selector.bulk_metadata_equals_stepwise
        self.selector.set_backend(self.ops)
        eager = EagerRuntime(self.decoder, s, self.selector, self.predictor, self.budget, self.ops,
                             self.cache.max_tokens, self.dtype, cache=self.cache, mode="sparse", dense_metrics_every=1,
                             check_serial=False, **({"calibration_tokens": 1} if one_token else {}))
        with torch.inference_mode():
            history = None
            if isinstance(prompts, Tensor):
                logits, lengths = eager.prefill(prompts), [prompts.shape[1]] * prompts.shape[0]
            elif self.rows == 1:
                lengths = [prompts[0].shape[1]]
                if kept is None or kept[0] is None:
                    logits = eager.prefill(prompts[0], last_logits_only=True)  # [1, V]
                else:
                    eager.replay_prefill(kept[0])  # same q/k/v: selector metadata and tail rebuilt
                    logits = [None]
            else:  # a ragged batch, row by row
                rows, history = eager.prefill_rows(prompts, kept)
                logits = rows if any(r is None for r in rows) else torch.cat(rows)
                lengths = [p.shape[1] for p in prompts]
            phase("replay")
            calibrate_on = None
            if self.tp is not None:  # calibration fits every rank's heads (all ranks choose alike, as one process would)
                own = history if history is not None else eager.backend.history
                calibrate_on = [None if h is None else [self.tp.gather_heads(x) for x in h] for h in own]
            calibration = eager.finish_prefill(history, calibrate_on, phase)  # calibrates and warms the predictor
            if calibration:
                self.budget_info["calibration"] = calibration
            else:
                self.budget_info.pop("calibration", None)
            # the prefill ran the selector and predictor on the prefill's ops: back to the engine's
            self.selector.set_backend(self.backend)
            self.predictor.set_backend(self.backend)
            first = self.session is None
            if first:
                self._build()
            greedy = logits.argmax(-1) if isinstance(logits, Tensor) else torch.zeros(self.rows, dtype=torch.long)
            self.session.take_over(eager.backend, lengths, greedy)
            if first:  # (CUDA: one graph per view, rewound to the prompt's end)
                self._capture()
        phase("begin")
        self.done = 0
        return logits

    def _build(self) -> None:
        self.plan = dataclasses.replace(self.plan, projections=self.settings.graph_projections())  # (fused GEMVs: GPU, batch 1)
        self.session = GraphSession(self.decoder, self.plan, self.rows, self.cache, selector=self.selector,
                                    predictor=self.predictor, backend=self.backend,
                                    compile=self.cache.device.type == "cuda" and self.tp is None,
                                    scores=self.purpose == "scoring", reuse=self.reuse)
        if self.purpose == "scoring":
            self.session.forcing()  # (before the capture: the step reads the table it was captured with)

    def _capture(self) -> None:
        """The views: scoring one (counts, no dense measurement); a decode one per variant its
        budget can take, and of each a second that measures against dense attention (every
        `dense_metrics_every`-th step; shadow mode: every step)."""
        if self.purpose == "scoring":
            self.session.capture({("step", False): {"count_hits": True, "measure_dense": False}})
            return
        measures = (True,) if self.every == 1 else (True, False)
        # (serial windows between PRR ones keep the predictor learning, as the eager runtime's serial steps do)
        switches = len(self.variants) > 1
        self.session.capture({(variant, m): {"variant": variant, "measure_dense": m, "count_hits": True,
                                             "learn_in_serial": switches}
                              for variant in self.variants for m in measures})
        names = self.session.engine.COUNTERS
        self.log.totals = {v: torch.zeros(len(names), self.cache.num_layers, dtype=torch.float64)
                           for v in ("serial", "prr")}

    # --- steps ------------------------------------------------------------------------------
    def steps(self, first: list[int] | None, n: int, forced: list[list[int]] | None = None,
              step: int = 0) -> list[Steps]:
        """n steps of the batch from each row's position: step 0 reads first[b] (None: the token
        the engine holds, a decode's), step i > 0 the token step i - 1 chose: forced[b][i - 1]
        (teacher forcing; -1: greedy) or the greedy token. Rows past len(first) (a short batch's
        padding) repeat the last row's. -> one Steps per row given (every row for first=None)."""
        session = self.session
        given = self.rows if first is None else len(first)
        if first is not None:
            first = first + first[-1:] * (self.rows - given)
            with torch.inference_mode():  # (the engine's tensors are the prefill's kind)
                session.engine.token.copy_(torch.tensor(first, dtype=torch.long).view(-1, 1))
        else:
            first = session.engine.token.view(-1).tolist()
        if forced is not None:
            session.force(forced + forced[-1:] * (self.rows - len(forced)), n)
        if self.purpose == "scoring":
            wall = session.run([("step", False)] * n)  # device time per step on CUDA
        else:
            wall = self._decode_window(n)
        out = session.read()  # each row's n chosen tokens, at its positions + 1 ... + n
        self.done += n
        zeros = [[0.0] * n] * self.rows
        return [Steps(read=[first[b], *out["tokens"][b][:-1]], chosen=out["tokens"][b],
                      logprobs=out.get("logprobs", zeros)[b], greedy=out.get("greedy", [[True] * n] * self.rows)[b],
                      margins=out.get("margins", zeros)[b], wall_s=wall, measure_s=[0.0] * n) for b in range(given)]

    def _decode_window(self, n: int) -> list[float]:
        """n steps of the variant the budget chooses for this window, then the window's counters;
        the budget learns from its median step time and hit rate (`end_window`)."""
        engine, budget = self.session.engine, self.budget
        names = engine.COUNTERS
        variant = budget.window_variant(self.plan.variant)
        # copies: on the CPU .cpu() would alias the counters the steps add to in place
        before = torch.tensor([engine.counters()[c] for c in names], dtype=torch.float64)
        wall = self.session.run([(variant, (self.done + i) % self.every == 0) for i in range(n)])
        window = torch.tensor([engine.counters()[c] for c in names], dtype=torch.float64) - before
        self.log.totals[variant] += window
        self.log.latencies += wall
        self.log.ran += [variant] * n
        window_hit = None
        if variant == "prr":
            sparse = [i for i, s in enumerate(engine.sparse) if s]
            hits, selected = window[names.index("hits"), sparse].sum(), window[names.index("selected"), sparse].sum()
            window_hit = float(hits / selected) if selected > 0 else None
        budget.end_window(variant, statistics.median(wall), window_hit)
        return wall

    def end(self) -> None:
        """A scored batch done: its device counters pooled (read once per request)."""
        if self.session is None or self.purpose != "scoring":
            return
        engine = self.session.engine
        read = engine.counters()  # one host read (it was one per counter name)
        counts = torch.tensor([read[c] for c in engine.COUNTERS], dtype=torch.float64)
        kept = self.counts
        kept.totals = counts if kept.totals is None else kept.totals + counts
        kept.last = self._pooled(counts)
        sparse = torch.tensor(engine.sparse, dtype=torch.bool)
        rows = engine.study_counters(per_row=True)  # name -> [L, B, Hkv]
        per_row = {c: rows[c][sparse].sum((0, 2)).tolist() for c in ("selected", "predicted", "hits", "overlap")}
        kept.rows = [{name: per_row[name][b] for name in per_row} for b in range(self.rows)]

    def _pooled(self, counts: Tensor) -> dict[str, float]:
        """|A|, |P|, |P ∩ A| and |A_t ∩ A_t-1| summed over sparse layers, from counters [7, L]."""
        engine = self.session.engine
        names, sparse = engine.COUNTERS, [i for i, s in enumerate(engine.sparse) if s]
        return {c: float(counts[names.index(c)][sparse].sum()) for c in ("selected", "predicted", "hits", "overlap")}

    def results(self) -> dict[str, Any]:
        """Scoring's engine numbers for the summary: hit rate and precision (PRR), last-step
        overlap, pooled over every request's decode steps and sparse layers."""
        out: dict[str, Any] = {"engine": "graph", "predicted_blocks": self.plan.predicted_blocks}
        if self.counts.totals is None:
            return out
        total = self._pooled(self.counts.totals)
        if self.speculating:
            out["hit_rate"] = total["hits"] / total["selected"] if total["selected"] else None
            out["precision"] = total["hits"] / total["predicted"] if total["predicted"] else None
        out["last_step_overlap"] = total["overlap"] / total["selected"] if total["selected"] else None
        return out
