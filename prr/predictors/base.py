"""The predictor interface: from history only (steps < t), rank the blocks that decode
step t will probably select; the speculation budget then decides how many of the
top-ranked blocks form the predicted set P.

State lives in an explicit object made by `init_state` and handed back on every call,
so one predictor instance can serve several runs and the runtime owns all state.

One definition runs eagerly on the CPU and captured in a CUDA graph on the GPU, so
`rank`, `propose` and `update` use static shapes and device tensors only: no host syncs
(`.item()`, `.tolist()`, Python branches on tensor values) and no host-side state that
changes from step to step (a captured graph replays device work only). Host values fixed
for the run (the constructor's options, what `calibrate` fitted before decoding) are fine.
`num_blocks` is a host int or a device tensor [B] (rows may differ); implementations read
it through `prr.blocks.block_counts`.

Backends, as selectors have them (`Selector.set_backend`): the torch ops below are the
definition, the CPU path and the kernels' reference; predictors with kernels
(prr.kernels.predict) override `triton_problems` and run `propose` / `update` as one or two
launches when the engine's backend is triton (`set_backend`, called by PRRStep). The
kernels give the same P as a set (tested): torch writes P best first, the kernels in ascending
block order. Callers that take a prefix of P as "the best blocks" use `propose_best_first`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch
from torch import Tensor

from prr.blocks import BlockSet, top_blocks
from prr.predictors.options import PredictorOptions
from prr.selectors.base import Selection

NEVER = float("-inf")  # a rank that keeps a block out of P whatever the budget


class Predictor(PredictorOptions, ABC):
    # uses_budget, replays_selections, declared_hit_rate: PredictorOptions' (prr.predictors.options)
    # Capabilities engines dispatch on (never on class names):
    speculates: bool = True  # False: P is always empty (serial DSA)
    # What `propose` reads besides the state, so an engine knows when it may run:
    # - history_only: only state written by past steps' `update`s, so the next step's P
    #   may be computed right after `update`, off the critical path (False for
    #   query_similarity, oracle and cross_layer, which read the current step);
    # - needs_query: this step's query (query_similarity): propose(..., query=q);
    # - needs_current_selection: this step's selection, computed untimed (the oracle
    #   alone may see it): propose(..., current=A_t).
    history_only: bool = True
    needs_query: bool = False
    needs_current_selection: bool = False
    # "torch" (the definition) or "triton" (prr.kernels.predict), chosen by `set_backend`.
    backend: str = "torch"

    def triton_problems(self) -> list[str] | None:
        """None: no Triton path (torch ops under every backend); []: the kernels run this
        configuration; else why not."""
        return None

    def set_backend(self, backend: str) -> str:
        """Run on the kernels when `backend` is "triton" and this predictor has them, on torch
        ops otherwise; returns the predictor's backend."""
        self.backend = "triton" if backend == "triton" and self.triton_problems() == [] else "torch"
        return self.backend

    @abstractmethod
    def init_state(self, num_layers: int, batch: int, num_kv_heads: int, max_blocks: int, device: Any) -> Any:
        """A fresh state for one run, every buffer allocated."""

    @abstractmethod
    def rank(self, state: Any, layer: int, num_blocks: int | Tensor) -> Tensor:
        """num_blocks: host int or [B] blocks in each row's context at the step predicted.
        -> [B, Hkv, max_blocks] fp32 ranking for the next step; NEVER for blocks not to propose."""

    @abstractmethod
    def update(self, state: Any, layer: int, selection: Selection) -> None:
        """Learn from this step's selection A_t of `layer` (in place; indices int32 or int64)."""

    def proposals_after_update(self, state: Any, layer: int) -> list[tuple[int, bool]]:
        """The P that `update(state, layer, ·)` completes, which an engine may write right after it
        (on the side stream, off the critical path), exactly as a propose at the layer's step
        would: (target layer, next_step): next_step True: the target's P for the next decode step;
        False: for this step (a layer above, not yet run). Default: history-only predictors the
        layer's own next P."""
        return [(layer, True)] if self.history_only else []

    layer_range_kernels = False  # has update_layers / propose_layers on the kernels (learns_layers_at_once)

    def learns_layers_at_once(self) -> bool:
        """Whether this predictor also offers `update_layers(state, first, selections, blocks=None)`
        (the `update` of layers first, first + 1, ... from their selections, one per layer;
        blocks: their A stacked [L, B, Hkv, C] when the caller has that copy already) and
        `propose_layers(state, first, layers, num_blocks, budget_blocks) -> (indices [L, B, Hkv, C],
        counts [L, B, Hkv])` (their next step's P), one launch each, equal layer by layer to
        `update` then `propose`: the graph engine then learns once after a step's last sparse layer
        instead of after each one (StaticPlan.learn_layers_at_once). History-only predictors,
        and predictors whose update writes no P (`proposals_after_update` empty:
        query_similarity on the kernels, which offers `update_layers` alone and proposes in the
        step); the engine calls those methods only where this returns True (ema, spin and
        the StateRankPredictors, last_step and ema_membership, on the kernels: layer_range_kernels;
        the torch definition learns layer by layer; the benchmark tool bench_hit_rate, whose
        learning is a table lookup, on either backend)."""
        return self.layer_range_kernels and self.backend == "triton"

    def proposed_ahead(self, state: Any, layer: int) -> bool:
        """Whether `layer`'s P is written by `proposals_after_update` of an earlier update (this
        layer's at the previous step, or a layer below's at this step), so an engine that writes
        those need not propose before the layer's speculation."""
        return self.history_only

    def size_for_query(self, state: Any, query_size: int) -> None:  # noqa: B027 - optional hook
        """Predictors that keep past queries (needs_query) size their buffers for queries of
        query_size = G·D values here, before an engine captures its step."""

    def size_for_selection(self, state: Any, capacity: int) -> None:  # noqa: B027 - optional hook
        """Predictors that keep past selections as id lists size them for selections of
        `capacity` ids here, before an engine captures its step (a checkpoint taken then holds
        every buffer the captured step writes)."""

    def learn_tail(self, state: Any, history: list[list[Selection] | None]) -> None:
        """Learn the prefill tail's selections (history[layer]: A over its steps, None for dense
        layers) after calibration, where `learns_layers_at_once` is False. Default: `update`
        layer by layer, step by step (L·T calls); a predictor may batch them, equal to that."""
        for layer, selections in enumerate(history):
            for selection in selections or []:
                self.update(state, layer, selection)

    def calibrate(self, history: list[list[Selection] | None]) -> dict[str, Any]:
        """Fit parameters to selections of the prefill tail (history[layer] = A over steps,
        None for dense layers), on the host before decoding. Returns what was chosen, for
        the run record."""
        return {}

    def propose(
        self, state: Any, layer: int, num_blocks: int | Tensor, budget_blocks: int,
        current: Selection | None = None, query: Tensor | None = None,
    ) -> BlockSet:
        """P: the `budget_blocks` best-ranked blocks (a host int, static per captured graph).
        -> BlockSet [B, Hkv, budget_blocks] (best first on torch, ascending on triton: one set)."""
        return top_blocks(self.rank(state, layer, num_blocks), budget_blocks)

    def propose_best_first(
        self, state: Any, layer: int, num_blocks: int | Tensor, budget_blocks: int,
        current: Selection | None = None, query: Tensor | None = None,
    ) -> BlockSet:
        """`propose` by the torch definition whatever the backend: P best first, for measurements
        that take its first entries as the best-ranked blocks (untimed; same set as `propose`)."""
        backend, self.backend = self.backend, "torch"
        try:
            return self.propose(state, layer, num_blocks, budget_blocks, current, query=query)
        finally:
            self.backend = backend


def stacked_blocks(selections: list[Selection], blocks: BlockSet | None = None) -> BlockSet:
    """The selections' A stacked layer by layer -> BlockSet [L, B, Hkv, C] (`blocks` where the
    engine passes its stacked copy already)."""
    if blocks is not None:
        return blocks
    return BlockSet(torch.stack([s.blocks.indices for s in selections]), torch.stack([s.blocks.count for s in selections]))


class StateRankPredictor(Predictor):
    """Predictors whose per-layer state [L, B, Hkv, max_blocks] is already the rank (last_step,
    ema_membership): on backend triton P is the top-k kernel over the state row as it is (it masks
    blocks past each row's context itself), and a range of L layers learns and proposes at once as
    L·B rows of one update and one top-k launch; on torch, `rank` + `top_blocks`, layer by layer."""

    update_reads_scores = True  # whether `update_rows` reads the selection's scores
    layer_range_kernels = True

    def triton_problems(self) -> list[str]:
        return []

    @abstractmethod
    def update_rows(self, rows: Tensor, selection: Selection) -> None:
        """The kernels' update of state rows [R, Hkv, N] from `selection` ([R, Hkv, ...]; scores
        None where `update_reads_scores` is False): one layer's B rows, or a layer range's L·B."""

    def update_layers(self, state: Tensor, first: int, selections: list[Selection],
                      blocks: BlockSet | None = None) -> None:
        span = state[first : first + len(selections)]  # [L, B, Hkv, N], contiguous
        layers, batch, heads, n = span.shape
        rows = layers * batch
        blocks = stacked_blocks(selections, blocks)
        scores = torch.stack([s.scores for s in selections]).view(rows, heads, n) if self.update_reads_scores else None
        self.update_rows(span.view(rows, heads, n), Selection(
            BlockSet(blocks.indices.reshape(rows, heads, -1), blocks.count.reshape(rows, heads)), scores))

    def propose_layers(self, state: Tensor, first: int, layers: int, num_blocks: int | Tensor,
                       budget_blocks: int) -> tuple[Tensor, Tensor]:
        from prr.kernels.predict import propose_top, row_counts

        span = state[first : first + layers]  # [L, B, Hkv, N]
        _, batch, heads, n = span.shape
        nb = row_counts(num_blocks, batch, state.device).repeat(layers)  # [L·B]: the same context every layer
        idx, cnt = propose_top(span.reshape(layers * batch, heads, n), budget_blocks, nb)
        return idx.view(layers, batch, heads, -1), cnt.view(layers, batch, heads)

    def propose(self, state: Tensor, layer: int, num_blocks: int | Tensor, budget_blocks: int,
                current: Selection | None = None, query: Tensor | None = None) -> BlockSet:
        if self.backend != "triton" or budget_blocks <= 0:
            return super().propose(state, layer, num_blocks, budget_blocks)
        from prr.kernels.predict import propose_top, row_counts

        return BlockSet(*propose_top(state[layer], budget_blocks, row_counts(num_blocks, state.shape[1], state.device)))
