"""The selector interface: which KV blocks a decode step attends (set A).

A selector scores every block per query head from cheap per-block metadata; the shared
`select` then reduces the GQA group, forces the always-kept blocks (sinks, local window,
the newest block) and takes the top-K. Dense layers skip selection entirely (the runtime
asks `is_dense_layer`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch
from torch import Tensor

from prr.attention_state import AttentionState, merge, merge_many
from prr.blocks import BlockSet, Selection, block_counts, inside_context, top_blocks, top_blocks_ascending
from prr.cache import PagedKVCache
from prr.kernels.reference_hinted_topk import hinted_top_k_blocks
from prr.selectors.options import SelectorOptions

TOPK_HINT = "topk_hint"  # the cache slot of selector.hinted_topk's threshold guesses


def stack_rows(selections: list[Selection]) -> Selection:
    """Selections of single rows ([1, Hkv, ...] each, one capacity and max_blocks) -> one
    Selection of those rows in order ([B, Hkv, ...])."""
    return Selection(BlockSet(torch.cat([s.blocks.indices for s in selections]),
                              torch.cat([s.blocks.count for s in selections])),
                     torch.cat([s.scores for s in selections]))


class Selector(SelectorOptions, ABC):
    """Subclasses implement `head_scores`, and metadata upkeep if they keep any. The constructor
    (options and their checks) is SelectorOptions' (prr.selectors.options: no torch)."""

    # --- what subclasses provide -------------------------------------------------------
    def update_metadata(self, cache: PagedKVCache, layer: int, start: int, end: int) -> None:
        """Tokens [start, end) of `layer` were appended to the cache (host range: the prefill,
        eager); refresh their blocks. (Here: the hint slot of selector.hinted_topk, so that every
        slot a decode step writes exists after the prefill; subclasses call `topk_hint` too.)"""
        self.topk_hint(cache, layer)

    def append_metadata(self, cache: PagedKVCache, layer: int, positions: Tensor) -> None:  # noqa: B027 - optional hook
        """One decode token per row was written at positions [B] (device ints): refresh its
        block. Static shapes, no host synchronisation (runs inside the captured step); the
        same metadata `update_metadata` builds."""

    def summaries_apart(self) -> bool:
        """Whether the decode token's metadata splits into Quest's key max / min (`metadata`, all
        that selection reads: the engine's append kernels update it) and summaries that only the
        compensation reads (`append_summaries`: LESS's). The graph engine then updates the summaries
        on its side stream beside selection and attention, joined before the compensation
        (StaticPlan.side_summaries)."""
        return False

    def append_summaries(self, cache: PagedKVCache, layer: int, positions: Tensor) -> None:
        """`append_metadata` less Quest's key max / min (selectors whose `summaries_apart`)."""
        raise NotImplementedError(f"{type(self).__name__} keeps no summaries apart (summaries_apart() is False)")

    @abstractmethod
    def head_scores(self, q: Tensor, cache: PagedKVCache, layer: int, lengths: Tensor) -> Tensor:
        """q: [B, Hkv, G, D], lengths [B] int64 tokens per row -> block scores per query head
        [B, Hkv, G, max_blocks] (entries past each row's context are ignored). Static shapes."""

    # Selectors that score from the layer's normed hidden state, not from q and the cache (the lightning
    # indexer) set `needs_hidden` and say their `hidden_size`; the decoder then hands it each layer's
    # through `take_hidden` (and the graph engine's random contexts random ones: graph_context).
    needs_hidden = False

    def take_hidden(self, cache: PagedKVCache, layer: int, x: Tensor, prefill: bool) -> None:
        """x: [B, T, hidden] the normed input of `layer`'s attention (the prompt's, or T = 1 at decode),
        before its K/V reach the cache."""
        raise NotImplementedError(f"{type(self).__name__} reads no hidden state (needs_hidden is False)")

    def hidden_projection(self, cache: PagedKVCache, layer: int) -> tuple[Tensor, Tensor] | None:
        """A selector whose decode step reads only a projection x Wᵀ of the normed hidden state x may
        return (W [N, hidden], slot [B, N]): an engine with fused GEMVs then writes the projection into
        slot itself, the RMSNorm inside its GEMV, instead of calling take_hidden (the same values up to
        rounding). None: hand it x through take_hidden."""
        return None

    # Selectors that change the attention output beyond choosing blocks (LESS's low-rank
    # compensation of the unselected blocks) set `compensates` and implement `compensation`;
    # the runtime merges its state after repair, in the timed merge stage.
    compensates = False

    def compensation(self, q: Tensor, cache: PagedKVCache, layer: int, selection: Selection,
                     length: int | Tensor | None = None) -> AttentionState:
        """q: [B, Hkv, G, D] -> a partial state (out [B, Hkv, G, D], lse [B, Hkv, G], prr's LSE
        convention) for the tokens of the cache's blocks outside `selection`, within each row's
        first `length` tokens (host int or [B] tensor; default: the cache's length)."""
        raise NotImplementedError(f"{type(self).__name__} has no compensation (compensates=False)")

    def compensated(self, q: Tensor, cache: PagedKVCache, layer: int, selection: Selection, lengths: Tensor,
                    out: Tensor, lse: Tensor, out_dtype: torch.dtype) -> Tensor:
        """The layer's output: the attention over A ⊕ `compensation`. q: [B, Hkv, G, D]; out, lse:
        the attention over A, fp32 [B, Hq, D], [B, Hq] or its split partials [B, Hq, S, D],
        [B, Hq, S]; lengths [B] -> [B, Hq, D] in out_dtype. Torch ops (selectors with a kernel
        override it: LESS's merges in its compensation launch)."""
        b, h, g, d = q.shape
        attended = merge_many(out, lse) if out.dim() == 4 else AttentionState(out, lse)
        state = AttentionState(attended.out.float().view(b, h, g, d), attended.lse.view(b, h, g))
        state = merge(state, self.compensation(q, cache, layer, selection, lengths))
        return state.out.to(out_dtype).view(b, h * g, d)

    # Metadata kept only in the cache's slots, per-row slots leading with the batch dim: a
    # `PagedKVCache.row` view rebuilds one row of it (ragged batches in the graph engine).
    # Selectors with other per-batch state set False; the engine then refuses ragged rows.
    per_row_metadata = True

    # Selectors whose whole per-block metadata is Quest's key max / min (`metadata(cache, layer)`)
    # let the engine's append kernels update it (prr.kernels.cache_append, qkv_append); the
    # others get `append_metadata` after the append.
    metadata_in_append_kernel = False

    # True when the prefill's bulk metadata update leaves what token-by-token updates would
    # (and the last prefill-tail selection with it): a serial request then keeps a one-token
    # tail (prr/runtime/graph_pipeline.py). Tested for every selector in tests/test_runtime.py.
    bulk_metadata_equals_stepwise = False
    # --- backends ---------------------------------------------------------------------------
    # Selectors with Triton kernels override `triton_problems` and `select_triton`; the others
    # score with torch ops under every runtime.backend (the run summary says which ran).
    backend = "torch"

    def triton_problems(self) -> list[str] | None:
        """None: no Triton path (torch selection); []: Triton selection works; else why not."""
        return None

    def set_backend(self, backend: str) -> str:
        """Use runtime.backend where this selector has kernels; returns the selection backend."""
        # both ways: a selector reused by an engine of the other backend must not keep the old one
        self.backend = "triton" if backend == "triton" and self.triton_problems() == [] else "torch"
        return self.backend

    # --- shared ---------------------------------------------------------------------------
    def is_dense_layer(self, layer: int) -> bool:
        return layer in self.dense_layers

    def selected_blocks(self, num_blocks: int) -> int:
        """Blocks a selection keeps in a context of num_blocks (per query head for `union`,
        whose per-KV-head set can reach group × this): what budgets scale |P| by."""
        return min(self.topk_blocks, num_blocks)

    def capacity(self, group_size: int, max_blocks: int) -> int:
        """Static size of a selection's index tensor."""
        per_head = self.topk_blocks * (group_size if self.gqa_reduce == "union" else 1)
        return min(per_head, max_blocks)

    def forced_mask(self, num_blocks: int | Tensor, max_blocks: int, device: torch.device) -> Tensor:
        """[B or 1, 1, max_blocks] bool: sinks, local window and newest block of each row's
        context of num_blocks (host int or [B] tensor) blocks."""
        nb = block_counts(num_blocks, 1 if not isinstance(num_blocks, Tensor) else num_blocks.numel(), device)
        ids = torch.arange(max_blocks, device=device)
        nb = nb.view(-1, 1, 1)
        recent = self.local_blocks + int(self.force_newest)
        return ((ids < torch.clamp(nb, max=self.sink_blocks)) | (ids >= nb - recent)) & (ids < nb)

    def catch_up(self, q: Tensor, cache: PagedKVCache, layer: int, length: int,  # noqa: B027 - optional hook
                 queries: Tensor | None = None) -> None:
        """Called once, eagerly, before the first selection after a bulk metadata update (the
        prefill), with that selection's query q [B, Hkv, G, D] and the prefill's queries of
        positions [0, length) (queries: [B, Hkv, G, >= length, D] post-RoPE): selectors whose
        per-step metadata work is bounded (InfLLM finalises at most one block per selection)
        do the backlog here; InfLLM's representatives need the past queries. Never inside a
        decode step."""

    def bind_model(self, config: Any) -> None:  # noqa: B027 - optional hook
        """The model's facts a selector needs beside the cache (config: prr.model.config.ModelConfig);
        called once before the prefill. InfLLM keeps the RoPE frequencies its position-agnostic
        scoring undoes; the others need nothing."""

    def select(self, q: Tensor, cache: PagedKVCache, layer: int, length: int | Tensor | None = None,
               num_blocks: Tensor | None = None) -> Selection:
        """q: [B, Hkv, G, D] -> Selection A over the first `length` tokens of each row (a host
        int, or [B] int tensor: the graph engine's device positions; default: the cache's
        length). Static shapes, no host synchronisation: capturable in a CUDA graph.
        A's indices are int32 in ascending block order, padded with 0, whatever the backend.
        num_blocks: [B] int32 blocks of each row at `length` (a tensor `length`), when the caller
        has them: the graph engine derives them once per step; derived here, they would be four
        small launches per layer before the Triton kernels (4.4–6.9 µs a layer at batch 1 on the H200)."""
        if self.backend == "triton" and num_blocks is not None and isinstance(length, Tensor):
            return self.select_triton(q, cache, layer, length, num_blocks)
        lengths = token_counts(cache, layer, length, q.shape[0], q.device)  # [B] int64
        num_blocks = (lengths + cache.block_size - 1) // cache.block_size  # [B]
        if self.backend == "triton":
            return self.select_triton(q, cache, layer, lengths, num_blocks)
        return self.selection_from(self.head_scores(q, cache, layer, lengths), num_blocks, cache.max_blocks,
                                   hint=self.topk_hint(cache, layer))

    def topk_hint(self, cache: PagedKVCache, layer: int) -> Tensor | None:
        """selector.hinted_topk: the layer's [B, Hkv] fp32 slot holding the previous decode step's k-th
        score per (row, KV head) (-inf on a fresh request: `reset_metadata`'s fill), the top-k's
        threshold guess, which the top-k overwrites with this step's (in place: capturable). None
        without the option. `select_tail` touches it, so it exists after the prefill (an engine
        checkpoint made then covers it)."""
        if not self.hinted_topk:
            return None
        return cache.state_slot(layer, TOPK_HINT, (cache.batch, cache.num_kv_heads), torch.float32, float("-inf"))

    def top_k_triton(self, scores: Tensor, rows: Tensor, hint: Tensor | None) -> tuple[Tensor, Tensor]:
        """The Triton selections' top-K: scores [N, Hkv, NB] fp32, rows [N] int32 blocks -> (indices
        [N, Hkv, C] int32 ascending then 0, counts [N, Hkv] int32), forced blocks as `forced_mask`;
        with hint ([N, Hkv], `topk_hint`) by prr.kernels.hinted_topk: the same set."""
        recent = self.local_blocks + int(self.force_newest)
        if hint is None:
            from prr.kernels.topk import topk_select

            return topk_select(scores, self.topk_blocks, rows, sink_blocks=self.sink_blocks, recent_blocks=recent)
        from prr.kernels.hinted_topk import hinted_topk_select

        return hinted_topk_select(scores, self.topk_blocks, rows, hint, sink_blocks=self.sink_blocks,
                                  recent_blocks=recent)

    def selection_from(self, per_head: Tensor, num_blocks: Tensor, max_blocks: int,
                       hint: Tensor | None = None) -> Selection:
        """The torch `select` after scoring: per_head [B, Hkv, G, NB] scores, num_blocks [B] ->
        GQA-reduced, forced, top-K Selection (shared by `select` and the batched `select_tail`).
        hint: [B, Hkv] `topk_hint` (selector.hinted_topk): the top-K from it, the same set."""
        per_head = per_head.float()
        outside = ~inside_context(num_blocks, max_blocks)  # [B, 1, NB]
        per_head = per_head.masked_fill(outside.unsqueeze(2), float("-inf"))
        reduced = per_head.sum(2) if self.gqa_reduce == "sum" else per_head.amax(2)  # [B, Hkv, NB]
        reduced = reduced.masked_fill(outside, float("-inf"))
        forced = self.forced_mask(num_blocks, max_blocks, per_head.device)  # [B, 1, NB]
        if self.gqa_reduce == "union":
            forced_scores = per_head.masked_fill(forced.unsqueeze(2), float("inf"))
            b, h, g, n = forced_scores.shape
            per_head_sets = top_blocks(forced_scores.reshape(b, h * g, n), self.topk_blocks)
            union = per_head_sets.mask(n).view(b, h, g, n).any(2)
            blocks = BlockSet.from_mask(union, self.capacity(g, max_blocks))
        elif hint is not None:
            blocks = BlockSet(*hinted_top_k_blocks(reduced.masked_fill(forced, float("inf")), self.topk_blocks, hint))
        else:  # the set of `top_blocks`, ascending already (without its full sort)
            return Selection(top_blocks_ascending(reduced.masked_fill(forced, float("inf")), self.topk_blocks), reduced)
        return Selection(blocks=ascending(blocks), scores=reduced)

    def select_tail(self, q_tail: Tensor, cache: PagedKVCache, layer: int, start: int,
                    queries: Tensor | None = None) -> list[Selection]:
        """The prefill tail's selections: q_tail [B, Hkv, G, T, D] are the queries of positions
        [start, start + T), whose keys are in the cache; the metadata covers [0, start) on entry
        and [0, start + T) on return. -> T Selections, the one of position t over tokens <= t, as
        decode would have made it (metadata grown one token at a time: no future key leaks).
        queries: the prefill's queries [B, Hkv, G, >= start + 1, D] for `catch_up`.
        Default: one metadata update and `select` per position; selectors that can fold the T
        queries into the batch exactly (quest, exact) override it (2T launches -> a few)."""
        self.topk_hint(cache, layer)  # allocated in the prefill (hinted_topk)
        selections = []
        for i in range(q_tail.shape[3]):
            t = start + i
            self.update_metadata(cache, layer, t, t + 1)
            if i == 0:  # the backlog of bounded per-step metadata work (InfLLM's finalising)
                self.catch_up(q_tail[:, :, :, 0], cache, layer, t + 1, queries=queries)
            selections.append(self.select(q_tail[:, :, :, i], cache, layer, length=t + 1))
        return selections

    def select_triton(self, q: Tensor, cache: PagedKVCache, layer: int, lengths: Tensor,
                      num_blocks: Tensor) -> Selection:
        """The Triton fast path of `select` (same set; tested equal): lengths [B] tokens, num_blocks
        [B] blocks (int32 or int64). Selectors with kernels override it."""
        raise NotImplementedError(f"{type(self).__name__} has no Triton selection (triton_problems() is None)")

    def speculates_in_selection(self) -> bool:
        """Whether the engine calls `select_speculating` instead of speculating on its side stream:
        this selector's kernels compute PRR's per-block states over P inside selection's own launch
        (exact: its q·K pass fills the GPU, so a speculation on a second stream beside it only slows
        it down)."""
        return False

    def select_speculating(self, q: Tensor, cache: PagedKVCache, layer: int, lengths: Tensor, num_blocks: Tensor,
                           pred_idx: Tensor, pred_cnt: Tensor, scale: float,
                           tokens_per_program: int | None) -> tuple[Selection, tuple[Tensor, Tensor]]:
        """`select_triton` and the attention over P in the same launch: q [B, Hkv, G, D], P =
        pred_idx [B, Hkv, C] with counts pred_cnt [B, Hkv] -> (A, (out [B, Hq, C, D], lse [B, Hq, C])
        fp32 per-block states, what sparse_decode(per_block=True, tokens_per_split=tokens_per_program)
        gives). Here the definition, two launches one after the other on the current stream (the
        Triton kernels: backend triton); selectors whose `speculates_in_selection` is True override
        it with one launch that gives the same A and the same states bit for bit."""
        from prr.kernels.sparse_decode import sparse_decode

        b, h, g, d = q.shape
        selection = self.select(q, cache, layer, lengths, num_blocks=num_blocks)
        states = sparse_decode(q.reshape(b, h * g, d), cache.keys[layer], cache.values[layer], pred_idx, pred_cnt,
                               lengths, cache.block_size, scale, per_block=True, tokens_per_split=tokens_per_program)
        return selection, states


def token_counts(cache: PagedKVCache, layer: int, length: int | Tensor | None, batch: int,
                 device: torch.device) -> Tensor:
    """Tokens in each row's context: [B] int64 on `device` (default: the cache's host length)."""
    return block_counts(cache.length(layer) if length is None else length, batch, device)


def ascending(blocks: BlockSet) -> BlockSet:
    """The same set with its valid ids in ascending order, padding 0, int32 (the kernels' layout)."""
    n = torch.iinfo(torch.int32).max
    ordered = torch.where(blocks.valid(), blocks.indices, n).sort(-1).values
    ordered = torch.where(ordered == n, 0, ordered)
    return BlockSet(ordered.to(torch.int32), blocks.count.to(torch.int32))


def tail_rows(rows: Selection, positions: int) -> list[Selection]:
    """Selections of a tail folded into the batch, rows ordered (t, b): [T * B, Hkv, ...] ->
    the T Selections of its positions, [B, Hkv, ...] each (contiguous views: no copies)."""
    indices, count, scores = (x.unflatten(0, (positions, -1)).unbind(0)
                              for x in (rows.blocks.indices, rows.blocks.count, rows.scores))
    return [Selection(BlockSet(*row[:2]), row[2]) for row in zip(indices, count, scores, strict=True)]
