"""The graph engine's one pipeline from a prefilled cache to decoded steps, for every caller:
run.py's decode and scored requests (`GraphPipeline`, graph_pipeline.py) and the studies
(`graph_study_decode`, study_decode.py).

- `session_plan`: the run's plan (`graph_plan`) with the budget's |P| resolved (`resolved_plan`)
  and what the budget decided;
- `GraphSession`: the engine built over the prefilled cache; `take_over` (the one hand-off from the
  research runtime's prefill: lengths, first token, the warmed predictor state, A_{t-1}); `capture`
  (the views a caller runs, each a `with_plan` of the engine, captured once on CUDA and rewound);
  `force` (teacher forcing); `run` (steps back to back, one timing window: `timed_steps`); `read`
  (what the steps wrote, one host read). Under reuse=steps each view is captured as a selecting
  step and a step between selections, and `run` replays the one of each step's number
  (`StepViews`, step_views.py).

Each step writes, at the position of the token it chose, that token, and with `scores` its
log-probability, whether it is the argmax and the top-1 minus top-2 logit, into device buffers
[B, capacity + 1] the host reads once per window: one captured step serves every request,
whatever its prompt length.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable
from typing import Any

import torch
from torch import Tensor

from prr.runtime.graph_decode import GraphDecoder
from prr.runtime.static_plan import StaticPlan
from prr.runtime.step_views import StepViews
from prr.runtime.timing import timed_steps


def engine_backend(device: str, backend: str, graph_on_gpu: str | None = None) -> str:
    """The engine's ops: `backend` (backend.name: backend=torch runs torch ops on a GPU too), or
    on a GPU `graph_on_gpu` where the backend group names one (backend=auto: triton)."""
    return graph_on_gpu if graph_on_gpu is not None and str(device).startswith("cuda") else backend


def graph_topk(selector: Any, max_blocks: int) -> int:
    """The run's top-K on the engine, in blocks: the selector's, at most the cache's `max_blocks`
    (what the budgets size |P| from and the summary records)."""
    return min(selector.topk_blocks, max_blocks)


def graph_plan(settings: Any, selector: Any, predictor: Any, budget: Any, max_blocks: int) -> StaticPlan:
    """The engine's plan for this run's objects: serial DSA for a predictor that never
    speculates, else PRR with a static |P| (every block for `dense`; the budget's size before
    anything is measured, `engine_blocks`; the oracle's P is sized by the engine).
    The objects themselves go to the engine (GraphDecoder's selector= / predictor=)."""
    k = graph_topk(selector, max_blocks)
    if not predictor.speculates:
        size = 0
    elif selector.selects_every_block:
        size = max_blocks
    elif not predictor.uses_budget:
        size = k
    else:
        size = budget.engine_blocks(k, max_blocks)
    return StaticPlan(variant="prr" if predictor.speculates else "serial", predicted_blocks=size,
                      repair_mode=settings.repair_mode, mode=settings.mode, block_size=settings.block_size)


def resolved_plan(plan: StaticPlan, budget: Any, predictor: Any, decoder: Any, batch: int, capacity: int,
                  selector: Any, backend: str, context: int) -> tuple[StaticPlan, dict[str, Any]]:
    """The budget's |P| for the decode (`resolve_engine_blocks`, at `context` blocks; a budget that
    measures times the engine's own stages, GraphProbe) -> (the plan with it, serial DSA for
    |P| = 0; what the budget decided). A plan that does not speculate, or a predictor that sizes
    its own P, is kept as it is."""
    if plan.variant != "prr" or not predictor.uses_budget:
        return plan, {}
    from prr.runtime.graph_budget import GraphProbe

    max_blocks = -(-capacity // plan.block_size)
    k = graph_topk(selector, max_blocks)

    def make_probe() -> GraphProbe:
        return GraphProbe(lambda n: GraphDecoder(decoder, dataclasses.replace(plan, predicted_blocks=n), batch,
                                                 capacity, selector=selector, predictor=None, backend=backend),
                          first_size=k)

    size, info = budget.resolve_engine_blocks(make_probe, plan.predicted_blocks, k, max_blocks, context)
    if size == plan.predicted_blocks:
        return plan, info
    plan = dataclasses.replace(plan, variant="prr" if size else "serial", predicted_blocks=size)
    return plan, {**info, "choice": plan.variant, "predicted_blocks": size}


def session_plan(settings: Any, selector: Any, predictor: Any, budget: Any, decoder: Any, rows: int,
                 capacity: int, backend: str, context: int) -> tuple[StaticPlan, dict[str, Any]]:
    """The plan a session runs for `rows` rows of `capacity` tokens, its |P| decided by the budget
    at `context` blocks (before any prefill: a profile's engines and the run's are never in memory
    at once) -> (plan, the summary's budget_setup: the policy, |P| and what the budget decided)."""
    plan = graph_plan(settings, selector, predictor, budget, -(-capacity // settings.block_size))
    info: dict[str, Any] = {"policy": type(budget).__name__, "predicted_blocks": plan.predicted_blocks}
    plan, decided = resolved_plan(plan, budget, predictor, decoder, rows, capacity, selector, backend, context)
    return plan, {**info, **decided}


class GraphSession:
    """The graph engine over a prefilled paged cache (see the module docstring)."""

    def __init__(self, decoder: Any, plan: StaticPlan, rows: int, cache: Any, *, selector: Any, predictor: Any,
                 backend: str, compile: bool = False, scores: bool = False, reuse: Any = None) -> None:
        """plan: the session's (serial or PRR, |P|); the predictor is the engine's only for PRR.
        scores: each step also writes its chosen token's log-probability, whether it is the argmax
        and the top-1 minus top-2 logit (scored requests, studies); else the token only (run.py).
        reuse: the engine's selection reuse (prr.reuse; default none)."""
        self.plan, self.speculating, self.scores = plan, plan.variant == "prr", scores
        self.engine = engine = GraphDecoder(decoder, plan, rows, cache.max_tokens, compile=compile, selector=selector,
                                            predictor=predictor if self.speculating else None, cache=cache,
                                            backend=backend, reuse=reuse)
        self.device, self.rows = engine.device, rows
        cap = engine.max_tokens + 1  # indexed by the position of the token a step chose
        self.tokens = torch.zeros(rows, cap, dtype=torch.long, device=self.device)
        if scores:
            self.logprobs = torch.zeros(rows, cap, dtype=torch.float32, device=self.device)
            self.greedy = torch.zeros(rows, cap, dtype=torch.bool, device=self.device)
            self.margins = torch.zeros(rows, cap, dtype=torch.float32, device=self.device)
        self.forced: Tensor | None = None  # [B, max_tokens]: the token after each position (-1: greedy)
        self.replays: dict[Hashable, Any] = {}
        self.step_views = StepViews(reuse)  # (reuse=steps: a selecting and a reusing view of each)
        self.positions = [0] * rows  # per row: the position of the token the next unread step read
        self.pending = 0  # steps run since the last read

    # --- the hand-off and the views ---------------------------------------------------------
    def take_over(self, backend: Any, lengths: list[int], first: Tensor) -> None:
        """The engine takes over from the research runtime's prefill (`backend`: its DSABackend)
        of lengths[b] tokens into row b: first [B] the tokens step 0 reads, the predictor state it
        warmed (PRR) and the last prompt-tail selections (A_{t-1})."""
        self.engine.take_over(lengths, first, backend.predictor_state if self.speculating else None,
                              backend.previous)
        self.positions, self.pending = list(lengths), 0
        self.step_views.restart()
        if self.forced is not None:
            with torch.inference_mode():
                self.forced.fill_(-1)

    def capture(self, views: dict[Hashable, dict[str, Any]]) -> None:
        """The steps this session runs: key -> the engine's plan changes of that view
        (`GraphDecoder.with_plan`); on CUDA each captured once, the state rewound to the hand-off."""
        steppers = {key: self._stepper(self.engine.with_plan(**changes))
                    for key, changes in self.step_views.views(views).items()}
        with torch.inference_mode():  # (the prefill's tensors are inference tensors)
            self.replays = self.engine.capture_all(steppers)

    def _stepper(self, view: GraphDecoder):
        def run() -> None:  # one step of this view; its outputs land at the chosen token's position
            logits = view.step(advance=True)  # [B, V]; view.token: the chosen tokens [B, 1]; pos advanced
            at = view.pos.long().view(-1, 1)  # [B, 1]
            self.tokens.scatter_(1, at, view.token)
            if self.scores:
                logits = logits.float()
                top2 = logits.topk(2, -1).values  # [B, 2]
                self.logprobs.scatter_(1, at, logits.log_softmax(-1).gather(1, view.token))
                self.greedy.scatter_(1, at, logits.argmax(-1, keepdim=True) == view.token)
                self.margins.scatter_(1, at, top2[:, :1] - top2[:, 1:])
        return run

    def force(self, rows: list[list[int]], steps: int) -> None:
        """Teacher forcing for the next `steps` steps from each row's position: step i of row b
        chooses rows[b][i] (-1: its greedy token)."""
        engine = self.engine
        self._check(steps)
        with torch.inference_mode():  # (the engine's tensors are the prefill's kind)
            if self.forced is None:  # (kept: a captured step reads the table it was captured with)
                self.forced = engine.forced_tokens = torch.full((self.rows, engine.max_tokens), -1, dtype=torch.long,
                                                                 device=self.device)
            for b, row in enumerate(rows):
                p = self.positions[b] + self.pending
                self.forced[b, p : p + steps] = torch.tensor(row[:steps], dtype=torch.long)

    def forcing(self) -> None:
        """Make the forced-token table before `capture` (a captured step reads the table it saw)."""
        self.force([[] for _ in range(self.rows)], 0)

    # --- steps ------------------------------------------------------------------------------
    def run(self, keys: list[Hashable]) -> list[float]:
        """One step of each view in `keys`, back to back -> each step's seconds (CUDA: device time
        of its replay, no host sync until the last; elsewhere wall time)."""
        self._check(len(keys))
        with torch.inference_mode():
            wall = timed_steps([self.replays[k] for k in self.step_views.keys(keys)], self.device)
        self.pending += len(keys)
        return wall

    def _check(self, n: int) -> None:
        start = [p + self.pending for p in self.positions]
        if max(start) + n > self.engine.max_tokens:  # (step i writes row b's K/V at start[b] + i)
            raise ValueError(f"{n} steps from positions {start} exceed the engine's {self.engine.max_tokens} tokens")

    def read(self) -> dict[str, list[list[Any]]]:
        """What the steps run since the last read wrote, per row (one gather and one host read
        each): tokens, and with scores logprobs, greedy and margins, each [rows][steps]."""
        p0, n = self.positions, self.pending
        at = (torch.tensor(p0)[:, None] + 1 + torch.arange(n)).to(self.device)  # [B, n]
        names = ("tokens", "logprobs", "greedy", "margins") if self.scores else ("tokens",)
        with torch.inference_mode():
            out = {name: getattr(self, name).gather(1, at).tolist() for name in names}
        self.positions, self.pending = [p + n for p in p0], 0
        return out
