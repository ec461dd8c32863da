"""`infllm` (arXiv 2402.04617) in prr's block framework: InfLLM's published retrieval, and
prr's variant of it as named options.

InfLLM keeps the initial tokens (attention sinks) and a local window always attended, and
retrieves older context in memory units (blocks), each summarised by r representative keys;
the top-k units by ⟨query, representatives⟩ are attended. The rule below is the one of the
paper's public repository (thunlp/InfLLM, `inf_llm/attention/context_manager.py`), read as
facts, no code carried over:

- representatives (`representatives_from=window_attention`, the default): every query adds
  the softmax attention probability it gives each token of its local window into that
  token's score, per query head; when a block leaves the window, each query head keeps the
  `representatives` (r) tokens of the block with the largest summed probability, and the
  block's key for that head is the mean of their keys (a GQA group's heads read their KV
  head's keys). (The paper's text defines the representative score from the window queries'
  dot products q·k; the repository sums softmax probabilities; we follow the repository.)
- position-agnostic scoring (`scoring=position_agnostic`, the default): the representative
  keys are kept *before* RoPE and the query is rotated to one fixed angle, the local window's
  length less one (InfLLM: `n_local - 1`), so a block's score does not depend on how far back
  it lies. The cache holds post-RoPE keys; their rotation is undone exactly (up to float) from
  their positions and the model's RoPE frequencies (`bind_model`), and the query's from its
  position: ⟨R(c)·R(−p)·q_p, mean_r R(−j)·k_j⟩ with c = window tokens − 1.
- block score = Σ over every query head of the layer (`per_head=false`, as InfLLM: one
  selection shared by every KV head); `per_head=true` scores per query head and reduces each
  GQA group by `gqa_reduce` (a prr extension).
Attention over the selected blocks keeps the tokens' true positions: what prr's DSA framing
needs (InfLLM itself attends memory units at the fixed distance too).

Where prr departs from the repository, and why (docs/design.md's paper-vs-prr table has the
measured effects):
1. blocks are the cache's pages (`runtime.block_size`, default 16) and the initial tokens and
   local window are whole blocks: `sink_blocks`, and `local_blocks` + the newest block
   (`force_newest`), forced by the base class (InfLLM: units of 128, 128 initial tokens, a
   4,096-token sliding window, 16 units retrieved);
2. the softmax whose probabilities are summed is normalised over the forced blocks (sinks +
   local window) only: InfLLM's normaliser also holds the units retrieved at that step,
   which are not known before this step's selection;
3. the prefill is dense (prr's DSA framing): the prompt's queries add their window
   probabilities as decode queries do (`catch_up(queries=...)`), where InfLLM's chunked
   prefill attends retrieved units and scores each 512-query chunk with its mean query;
4. a block becomes a memory unit at the first selection after it left the window, all at
   once for the prompt's backlog (`catch_up`); the same moment as InfLLM's;
5. `topk_blocks` counts the forced blocks too (InfLLM retrieves its top-k units on top of the
   initial tokens and the window); the graph engine's `start_at`, which has no prompt
   queries, lets one query stand for every prompt position's (timing runs, not studies).

prr's variant (conf/selector/infllm_prr.yaml: `scoring=rope`, `representatives_from=
one_query`): the r tokens of a block with the largest q·k under **the one query of the step
at which the block left the window** (the first replayed prompt-tail query for the prompt's
blocks; summed over all query heads with `per_head=false`, so every KV head keeps the same
positions), their mean post-RoPE key per KV head, scored against the query at its true
position. It keeps more attention mass than the published rule on SmolLM2 (docs/results).

Metadata (static shapes: the same code runs eagerly and in the captured CUDA-graph step):
- `infllm_repr` [B, Hkv, max_blocks, G, D] fp32: each final block's representative key per
  query head (pre-RoPE with position_agnostic, post-RoPE with rope);
- `infllm_live` [B, Hkv, max_blocks, D] fp32: mean key of a block not final yet (inside the
  window, or the newest); such blocks are forced, but predictors rank by the scores;
- `infllm_finalised` [B] int64: blocks [0, n) are final (they finalise in order);
- window_attention only: `infllm_window` [B, Hkv, max_blocks, G, S] fp32, the summed window
  probabilities per token and query head (memory: Hq floats per token, G/D of the K/V
  cache's), and `infllm_scored` [B] int64: queries at positions < n have been added, so a
  second selection at the same step (the oracle's look) adds nothing: idempotent.
- `infllm_arrivals` [B] int32: the Triton step kernel's arrival counter (zero between launches;
  allocated by `update_metadata` whatever the backend, so a decode step adds no slot).
Per step: one softmax over the forced blocks' (sinks + window) tokens per query head, an add
into the window blocks' scores, at most one block finalised.

One definition, two op backends, tested equal (tests/test_kernels_infllm.py: the same sets, slots
and scores within 1e-5): torch ops (`head_scores` = `_add_window_attention` + `_finalise` +
`block_scores`, then the base class's reduce / force / top-K; the reference and the CPU path), and
under runtime backend triton prr.kernels.infllm: `append_metadata` is one launch (the token's
block mean), `select` three: the step kernel (the window softmax and its add, the finalising of at
most one block, the row's counters), the score kernel (the query turned to the fixed angle; final
blocks against their representatives, the others against their live mean; Σ over the layer's
heads, or reduced per group) and the shared `topk_select`. Representatives stay fp32, as the
torch path keeps them (bf16 would round the scores differently, and then the selections would not
be the torch path's); one_query's are equal over a group, so the score kernel reads one per block
(a quarter of the bytes at G = 4). `gqa_reduce=union` and head dims other than powers of two in
[16, 256] have no kernels (`triton_problems` says so before a run). The prefill's backlog
(`catch_up`) runs in torch ops (eager, once, in a few large chunks). Measured on the H200:
experiments/results/h200/kernels_issue33.md. The prefill tail's selections (`select_tail`) are the
base class's loop batched, bitwise: the final metadata only changes where a block leaves the
window, so the positions are scored as rows of one batch (under triton the step kernel still runs
per position, one_query's only where a block leaves).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from prr.blocks import BlockSet, block_counts
from prr.cache import PagedKVCache
from prr.model.rope import rope_inv_freq
from prr.selectors.base import Selection, Selector, tail_rows
from prr.selectors.options import InfLLMSelectorOptions

REPR_SLOT = "infllm_repr"
LIVE_SLOT = "infllm_live"
FINALISED = "infllm_finalised"
WINDOW_SLOT = "infllm_window"
SCORED = "infllm_scored"
ARRIVALS = "infllm_arrivals"  # the Triton step kernel's arrival counter per row (zero between launches)
PROMPT_KEYS_BYTES = 1 << 29  # catch_up: fp32 keys gathered per chunk of prompt queries (bounds its memory)
# fp32 elements per chunk of select_tail's positions (each one's copy of the live means): cache-sized
# on a CPU, large on a GPU (launch-bound: few chunks).
TAIL_CHUNK_ELEMENTS = {"cpu": 1 << 19, "cuda": 1 << 25}


def block_means(keys: Tensor, positions: Tensor, end: Tensor) -> Tensor:
    """keys [B, Hkv, n, S, D] fp32 at positions [B, 1, n, S] -> the mean of each one's keys at
    positions < end (broadcast against positions) [B, Hkv, n, D]: a live block's key (one definition
    for `update_metadata` and `select_tail`: the same ops, so the same fp32 sums)."""
    live = (positions < end).unsqueeze(-1)  # [B, 1, n, S, 1]
    return (keys * live).sum(3) / live.sum(3).clamp(min=1)


def by_rows(product, count: int, rows: int) -> Tensor:
    """product(i) of rows [i, i + rows) for i = 0, rows, ... < count, concatenated along dim 0."""
    parts = [product(i) for i in range(0, count, rows)]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def rotate(x: Tensor, positions: Tensor, inv_freq: Tensor, sign: float = 1.0) -> Tensor:
    """RoPE (HF rotate_half layout, prr.model.rope.apply_rope) of x [..., D] by `sign` ×
    positions [...] (broadcast against x's leading dims): sign −1 undoes the model's rotation."""
    angles = positions.to(torch.float32).unsqueeze(-1) * inv_freq  # [..., D/2]
    angles = torch.cat((angles, angles), dim=-1)
    half = x.shape[-1] // 2
    turned = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * angles.cos() + turned * (sign * angles.sin())


class InfLLMSelector(InfLLMSelectorOptions, Selector):
    # the constructor is InfLLMSelectorOptions' (no torch: run.py checks it before importing torch)

    @property
    def bulk_metadata_equals_stepwise(self) -> bool:
        """The published rule's representatives come from every window query (catch_up has them
        all); prr's one_query variant takes the query of the step a block leaves the window at."""
        return self.representatives_from == "window_attention"

    def bind_model(self, config: Any) -> None:
        """Keep the model's RoPE frequencies (config: head_dim, rope_theta, rope_scaling), which
        position-agnostic scoring needs to undo the cache keys' rotation."""
        self.inv_freq = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)

    def _freqs(self, cache: PagedKVCache) -> Tensor:
        if self.inv_freq is None:
            raise ValueError("selector.scoring=position_agnostic needs the model's RoPE: call "
                             "selector.bind_model(model.config) before prefill (run.py does), or use scoring=rope")
        if 2 * self.inv_freq.numel() != cache.head_dim:
            raise ValueError(f"the bound RoPE has {self.inv_freq.numel()} frequencies but the cache's head_dim is "
                             f"{cache.head_dim}: bind the model whose keys the cache holds")
        # Kept on the cache's device: the first (eager) call moves it, so a captured step never
        # copies from the host (a host-to-device copy cannot be captured in a CUDA graph).
        self.inv_freq = self.inv_freq.to(cache.device)
        return self.inv_freq

    # --- metadata slots ----------------------------------------------------------------------
    def _repr(self, cache: PagedKVCache, layer: int, group: int) -> Tensor:
        return cache.metadata_slot(layer, REPR_SLOT, (group, cache.head_dim), torch.float32)  # [B, Hkv, NB, G, D]

    def _live(self, cache: PagedKVCache, layer: int) -> Tensor:
        return cache.metadata_slot(layer, LIVE_SLOT, (cache.head_dim,), torch.float32)  # [B, Hkv, NB, D]

    def _finalised(self, cache: PagedKVCache, layer: int) -> Tensor:
        """[B] int64 on the cache's device: blocks [0, n) of each row are final."""
        return cache.state_slot(layer, FINALISED, (cache.batch,), torch.int64)

    def _window(self, cache: PagedKVCache, layer: int, group: int) -> Tensor:
        return cache.metadata_slot(layer, WINDOW_SLOT, (group, cache.block_size), torch.float32)  # [B, Hkv, NB, G, S]

    def _arrivals(self, cache: PagedKVCache, layer: int) -> Tensor:
        """[B] int32 zeros: the Triton step kernel's per-row arrival counter (left zeroed)."""
        return cache.state_slot(layer, ARRIVALS, (cache.batch,), torch.int32)

    def _scored(self, cache: PagedKVCache, layer: int) -> Tensor:
        """[B] int64: the queries of positions < n have added their window probabilities."""
        return cache.state_slot(layer, SCORED, (cache.batch,), torch.int64)

    def _post_rope_keys(self, cache: PagedKVCache, layer: int, blocks: Tensor) -> tuple[Tensor, Tensor]:
        """blocks [B, n] (valid ids) -> the cache's keys of those blocks as stored (post-RoPE)
        [B, Hkv, n, S, D] fp32 and their positions [B, 1, n, S]."""
        s, b, h, d = cache.block_size, cache.batch, cache.num_kv_heads, cache.head_dim
        n = blocks.shape[1]
        positions = blocks.unsqueeze(-1) * s + torch.arange(s, device=cache.device)  # [B, n, S]
        keys = torch.gather(cache.keys[layer], 2, positions.view(b, 1, n * s, 1).expand(b, h, n * s, d)).float()
        return keys.view(b, h, n, s, d), positions.view(b, 1, n, s)

    def _block_keys(self, cache: PagedKVCache, layer: int, blocks: Tensor) -> tuple[Tensor, Tensor]:
        """blocks [B, n] -> keys [B, Hkv, n, S, D] fp32 as scored (pre-RoPE with
        position_agnostic: the model's rotation undone) and their positions [B, 1, n, S]."""
        keys, positions = self._post_rope_keys(cache, layer, blocks)
        if self.scoring == "position_agnostic":
            keys = rotate(keys, positions, self._freqs(cache), sign=-1.0)
        return keys, positions

    # --- metadata upkeep ---------------------------------------------------------------------
    def _provisional(self, cache: PagedKVCache, layer: int, first: Tensor, count: int, end: Tensor) -> None:
        """Blocks first + [0, count) of each row (first: [B] int64) get the mean of their live
        keys (positions < end [B]). Static shapes."""
        b, h, d = cache.batch, cache.num_kv_heads, cache.head_dim
        blocks = (first.view(b, 1) + torch.arange(count, device=cache.device)).clamp(max=cache.max_blocks - 1)  # [B, n]
        keys, positions = self._block_keys(cache, layer, blocks)  # [B, Hkv, n, S, D], [B, 1, n, S]
        mean = block_means(keys, positions, end.view(b, 1, 1, 1))  # [B, Hkv, n, D]
        self._live(cache, layer).scatter_(2, blocks.view(b, 1, count, 1).expand(b, h, count, d), mean)

    def update_metadata(self, cache: PagedKVCache, layer: int, start: int, end: int) -> None:
        self.topk_hint(cache, layer)  # (hinted_topk) every slot a decode step writes exists after the prefill
        if self.is_dense_layer(layer) or end <= start:
            return
        s = cache.block_size
        # Every slot a decode step writes exists after the prefill, whichever backend the prefill
        # ran: the graph engine checkpoints and restores the slots as a list (GraphDecoder._mutable).
        self._arrivals(cache, layer)
        first, last = start // s, -(-end // s)
        rows = torch.full((cache.batch,), first, dtype=torch.int64, device=cache.device)
        self._provisional(cache, layer, rows, last - first, torch.full_like(rows, end))

    def append_metadata(self, cache: PagedKVCache, layer: int, positions: Tensor) -> None:
        if self.is_dense_layer(layer):
            return
        if self.backend == "triton":  # one launch: the token's block mean (prr.kernels.infllm)
            from prr.kernels.infllm import infllm_live_update

            freqs = self._freqs(cache) if self.scoring == "position_agnostic" else None
            infllm_live_update(self._live(cache, layer), cache.keys[layer], positions, cache.block_size, freqs)
            return
        positions = positions.long()
        self._provisional(cache, layer, positions // cache.block_size, 1, positions + 1)

    def _add_window_attention(self, queries: Tensor, positions: Tensor, cache: PagedKVCache, layer: int) -> None:
        """The queries at `positions` [B, C] (queries: [B, Hkv, G, C, D] post-RoPE) add the softmax
        probability each gives the tokens of its local window (normalised over its forced blocks:
        sinks + window) into those tokens' scores; queries already added (positions below
        `infllm_scored`) add nothing. Static shapes."""
        s, b, h, d = cache.block_size, cache.batch, cache.num_kv_heads, cache.head_dim
        g, c = queries.shape[2], queries.shape[3]
        w, sinks = self.window_blocks, self.sink_blocks
        nb = positions // s + 1  # [B, C] blocks of each query's context
        window = nb.unsqueeze(-1) - w + torch.arange(w, device=cache.device)  # [B, C, W] window blocks (may be < 0)
        sink = torch.arange(sinks, device=cache.device).expand(b, c, sinks)  # [B, C, Ks]
        blocks = torch.cat((sink, window), -1)  # [B, C, Ks + W]
        tokens = blocks.unsqueeze(-1) * s + torch.arange(s, device=cache.device)  # [B, C, Ks + W, S]
        valid = (blocks >= 0).unsqueeze(-1) & (tokens <= positions.view(b, c, 1, 1))
        valid[:, :, :sinks] &= (blocks[:, :, :sinks] < nb.unsqueeze(-1) - w).unsqueeze(-1)  # a sink in the window: once
        m = (sinks + w) * s
        idx = tokens.clamp(min=0).view(b, 1, c * m, 1).expand(b, h, c * m, d)
        keys = torch.gather(cache.keys[layer], 2, idx).float().view(b, h, c, m, d)  # [B, Hkv, C, M, D]
        logits = torch.einsum("bhgcd,bhcmd->bhgcm", queries.float(), keys) / math.sqrt(d)
        logits = logits.masked_fill(~valid.view(b, 1, 1, c, m), float("-inf"))
        probs = torch.softmax(logits, dim=-1)[..., sinks * s:]  # [B, Hkv, G, C, W*S] the window's part
        scored = self._scored(cache, layer)
        fresh = (positions >= scored.view(b, 1)).view(b, 1, 1, c, 1)
        probs = torch.where(fresh & valid[:, :, sinks:].reshape(b, 1, 1, c, w * s), probs, 0.0)
        add = probs.view(b, h, g, c * w, s).permute(0, 1, 3, 2, 4)  # [B, Hkv, C*W, G, S]
        index = window.clamp(min=0).view(b, 1, c * w, 1, 1).expand(b, h, c * w, g, s)
        self._window(cache, layer, g).scatter_add_(2, index, add)
        scored.copy_(torch.maximum(scored, positions.amax(1) + 1))

    def _add_window_queries(self, queries: Tensor, first: int, cache: PagedKVCache, layer: int) -> None:
        """`_add_window_attention` of queries [B, Hkv, G, C, D] (post-RoPE) at positions first + [0, C),
        in position order, in chunks as large as the memory budget allows (10,922 queries at B 1,
        Hkv 2, D 64 and 6 forced blocks of 16), not 256 queries: a 32K prompt's 128 chunks a layer
        were ~8,000 small ops, launch-bound on a GPU (now 4 chunks, ~320 ops). The same per-query
        products, added by scatter_add_ in query order as with any chunking: on the CPU the window
        scores are bitwise the 256-query chunks' and the one-query calls' of the decode step (a GPU's
        scatter_add_ adds in no fixed order anyway)."""
        forced = (self.sink_blocks + self.window_blocks) * cache.block_size
        per_query = 4 * cache.batch * cache.num_kv_heads * forced * cache.head_dim  # bytes of gathered keys
        chunk = max(PROMPT_KEYS_BYTES // per_query, 1)
        count = queries.shape[3]
        for lo in range(0, count, chunk):
            hi = min(lo + chunk, count)
            positions = torch.arange(first + lo, first + hi, device=cache.device).repeat(cache.batch, 1)  # [B, C]
            self._add_window_attention(queries[:, :, :, lo:hi].to(cache.device), positions, cache, layer)

    def _out_of_window(self, lengths: int | Tensor, block_size: int) -> int | Tensor:
        """Full blocks that have left the local window at `lengths` tokens (a host int or a tensor):
        the blocks [0, n) that `_finalise` makes final by then."""
        num_blocks = (lengths + block_size - 1) // block_size
        if isinstance(lengths, Tensor):
            return torch.minimum(lengths // block_size, num_blocks - self.window_blocks)
        return min(lengths // block_size, num_blocks - self.window_blocks)

    def _finalise(self, q: Tensor, cache: PagedKVCache, layer: int, lengths: Tensor, first: Tensor, count: int) -> None:
        """Blocks first + [0, count) (first: [B] int64) of each row that have left the local
        window by `lengths` [B] and are not final yet get their representatives: from the summed
        window probabilities, or (one_query) from q [B, Hkv, G, D]. Static shapes: a selection
        looks at one block, the oldest not final (the window moves by at most one block per
        token); `catch_up` passes the prefill's backlog (all blocks from 0)."""
        s, b, h, d = cache.block_size, cache.batch, cache.num_kv_heads, cache.head_dim
        g = q.shape[2]
        target = self._out_of_window(block_counts(lengths, b, cache.device), s)  # [B]
        done = self._finalised(cache, layer)
        blocks = first.view(b, 1) + torch.arange(count, device=cache.device)  # [B, n] candidates, distinct
        todo = (blocks >= done.view(b, 1)) & (blocks < target.view(b, 1))
        blocks = blocks.clamp(max=cache.max_blocks - 1)
        keys, _ = self._block_keys(cache, layer, blocks)  # [B, Hkv, n, S, D]
        r = min(self.representatives, s)
        if self.representatives_from == "window_attention":
            index = blocks.view(b, 1, count, 1, 1).expand(b, h, count, g, s)
            token_scores = torch.gather(self._window(cache, layer, g), 2, index)  # [B, Hkv, n, G, S]
            top = token_scores.topk(r, dim=-1).indices  # [B, Hkv, n, G, r] per query head
            chosen = torch.gather(keys.unsqueeze(3).expand(b, h, count, g, s, d), 4,
                                  top.unsqueeze(-1).expand(b, h, count, g, r, d)).mean(4)  # [B, Hkv, n, G, D]
        else:  # one_query: the r tokens of largest q·k (post-RoPE, true positions) under this step's query
            post = keys if self.scoring == "rope" else self._post_rope_keys(cache, layer, blocks)[0]
            token_scores = torch.einsum("bhgd,bhnsd->bhns", q.float(), post)  # Σ over the group: [B, Hkv, n, S]
            if not self.per_head:
                token_scores = token_scores.sum(1, keepdim=True).expand(b, h, count, s)  # one set per layer
            top = token_scores.topk(r, dim=-1).indices  # [B, Hkv, n, r]
            chosen = torch.gather(keys, 3, top.unsqueeze(-1).expand(b, h, count, r, d)).mean(3)  # [B, Hkv, n, D]
            chosen = chosen.unsqueeze(3).expand(b, h, count, g, d)
        repr_keys = self._repr(cache, layer, g)
        index = blocks.view(b, 1, count, 1, 1).expand(b, h, count, g, d)
        write = todo.view(b, 1, count, 1, 1)
        repr_keys.scatter_(2, index, torch.where(write, chosen, torch.gather(repr_keys, 2, index)))
        done.copy_(torch.maximum(done, torch.minimum(first + count, target)))

    def catch_up(self, q: Tensor, cache: PagedKVCache, layer: int, length: int, queries: Tensor | None = None) -> None:
        """The prefill's backlog at `length`: with window_attention, the queries of positions
        [0, length) (queries: [B, Hkv, G, >= length, D] post-RoPE, the prefill's) add their window
        probabilities; then every block older than the window is finalised (one_query: with q
        [B, Hkv, G, D], the first replayed prompt-tail query)."""
        if self.is_dense_layer(layer):
            return
        if self.representatives_from == "window_attention":
            if queries is None:
                raise ValueError("selector.representatives_from=window_attention needs the prefill's queries: pass "
                                 "catch_up(..., queries=[B, Hkv, G, T, D]), or use representatives_from=one_query")
            if queries.shape[3] < length:
                raise ValueError(f"catch_up got the queries of {queries.shape[3]} positions for a prefill of {length} "
                                 "tokens: pass one query per prompt position")
            self._add_window_queries(queries[:, :, :, :length], 0, cache, layer)
        backlog = cache.num_blocks(layer, length)
        if backlog:
            rows = torch.full((cache.batch,), length, device=cache.device)
            self._finalise(q, cache, layer, rows, torch.zeros_like(rows), backlog)

    # --- the prefill tail --------------------------------------------------------------------
    def select_tail(self, q_tail: Tensor, cache: PagedKVCache, layer: int, start: int,
                    queries: Tensor | None = None) -> list[Selection]:
        """The base class's loop batched: its selections and the metadata it leaves, bitwise on the
        CPU (tests/test_selectors_tail_infllm.py) and, measured, on the H200 under both backends but
        for the window sums (a GPU's scatter_add_ adds in no fixed order: two loops differ there too;
        their selections did not). Position `start` is the loop's own step (its update,
        catch_up's backlog, its selection); after it, a row's final blocks at position t are
        max(finalised then, `_out_of_window(t + 1)`): the loop finalises one block per step from
        there. For the other positions t in (start, start + T):
        - live means: each position's block from its keys <= t in one pass (`_tail_live`);
        - window work (window_attention): every query's probabilities added in one pass, in position
          order (`_add_window_queries`). A block that has left the window is in no later query's
          window, so its sums are complete before it is finalised, whatever comes after;
        - finalising: the loop's `_finalise` at each position where a block leaves the window
          (about T / S of them; one_query takes that position's query);
        - scores: every position as a row of one batch (`_scores`: its products still one per
          position), against the representatives as the tail leaves them (a block's are written
          once, when it becomes final, and read only by positions it is final at) and its own live
          means (`_live_at`). Backend triton: the step kernel runs per position as in the loop (its window adds are its
        own sums in the loop's order; one_query's step only finalises: only where a block leaves),
        then the scores and the top-K of every position at once."""
        num = q_tail.shape[3]
        self.topk_hint(cache, layer)  # allocated in the prefill (hinted_topk)
        if num <= 1 or self.is_dense_layer(layer):  # (a dense layer skips catch_up, which the schedule assumes)
            return Selector.select_tail(self, q_tail, cache, layer, start, queries=queries)
        selections = Selector.select_tail(self, q_tail[:, :, :, :1], cache, layer, start, queries=queries)
        begin, end, s = start + 1, start + num, cache.block_size
        q_rest = q_tail[:, :, :, 1:]  # [B, Hkv, G, T - 1, D]
        lengths = torch.arange(begin + 1, end + 1, device=cache.device)  # [T - 1] tokens at each position
        finalised = torch.maximum(self._finalised(cache, layer).view(1, -1),
                                  self._out_of_window(lengths, s).view(-1, 1))  # [T - 1, B], before it moves
        leaving = [t for t in range(begin, end) if self._out_of_window(t + 1, s) > self._out_of_window(t, s)]
        means, own = self._tail_live(cache, layer, begin, end)
        if self.backend == "triton":
            return selections + self._tail_triton(q_rest, cache, layer, begin, finalised, means, own, leaving)
        if self.representatives_from == "window_attention":
            self._add_window_queries(q_rest, begin, cache, layer)
        for t in leaving:
            self._finalise(q_rest[:, :, :, t - begin], cache, layer, t + 1, self._finalised(cache, layer), 1)
        b, h, g, n, d = q_rest.shape
        repr_keys, live = self._repr(cache, layer, g), self._live(cache, layer)
        rows = lengths.repeat_interleave(b)  # [(T - 1) * B] tokens, rows (t, b)
        per_head = []
        for lo, hi in self._tail_chunks(n, b * h * cache.max_blocks * d, cache.device):
            query = q_rest[:, :, :, lo:hi].permute(3, 0, 1, 2, 4).flatten(0, 1)  # [c * B, Hkv, G, D]
            lives = self._live_at(live, means[:, :, lo:hi], own[lo:hi]).flatten(0, 1)  # [c * B, Hkv, NB, D]
            per_head.append(self._scores(query, cache, rows[lo * b : hi * b], repr_keys, lives,
                                         finalised[lo:hi].flatten()))
        per_head = torch.cat(per_head)  # [(T - 1) * B, Hkv, G, NB]
        return selections + tail_rows(self.selection_from(per_head, (rows + s - 1) // s, cache.max_blocks), n)

    def _tail_live(self, cache: PagedKVCache, layer: int, begin: int, end: int) -> tuple[Tensor, Tensor]:
        """Positions [begin, end): each one's block's live mean over its keys <= it, as that
        position's `update_metadata` leaves it -> (means [B, Hkv, T, D], those blocks [T]). The slot
        gets each block's mean at its last position: what the loop's updates leave."""
        s, b = cache.block_size, cache.batch
        positions = torch.arange(begin, end, device=cache.device)
        own = positions // s  # [T]
        blocks = torch.arange(begin // s, (end - 1) // s + 1, device=cache.device)  # [n] the tail's blocks
        keys, token_positions = self._block_keys(cache, layer, blocks.expand(b, -1))  # [B, Hkv, n, S, D], [B, 1, n, S]
        at = own - begin // s  # [T] each position's block among them
        means = block_means(keys[:, :, at], token_positions[:, :, at], (positions + 1).view(1, 1, -1, 1))
        ends = [i for i, t in enumerate(range(begin, end)) if (t + 1) % s == 0 or t == end - 1]  # a block's last
        ends = torch.tensor(ends, device=cache.device)
        self._live(cache, layer).index_copy_(2, own[ends], means[:, :, ends])
        return means, own

    @staticmethod
    def _live_at(live: Tensor, means: Tensor, own: Tensor) -> Tensor:
        """The live means positions score against: the slot live [B, Hkv, NB, D] as the tail leaves
        it, with each position's own block (own [c]) its mean so far (means [B, Hkv, c, D]) ->
        [c, B, Hkv, NB, D]. Later blocks' columns hold the tail's means: outside the position's
        context, their scores are masked."""
        column = torch.arange(live.shape[2], device=live.device).view(-1, 1) == own.view(-1, 1, 1, 1, 1)  # [c, 1, 1, NB, 1]
        return torch.where(column, means.permute(2, 0, 1, 3).unsqueeze(3), live)

    @staticmethod
    def _tail_chunks(count: int, per_position: int, device: torch.device) -> list[tuple[int, int]]:
        """[lo, hi) chunks of `count` positions, each with at most TAIL_CHUNK_ELEMENTS of the
        device's (per_position elements a position) and at least one position."""
        limit = TAIL_CHUNK_ELEMENTS.get(device.type, TAIL_CHUNK_ELEMENTS["cpu"])
        chunk = max(1, limit // max(1, per_position))
        return [(lo, min(count, lo + chunk)) for lo in range(0, count, chunk)]

    def _tail_triton(self, q_rest: Tensor, cache: PagedKVCache, layer: int, begin: int, finalised: Tensor,
                     means: Tensor, own: Tensor, leaving: list[int]) -> list[Selection]:
        """`select_tail` under backend triton after its first position: q_rest [B, Hkv, G, T, D] at
        positions begin + [0, T), finalised [T, B] and (means, own) of `_tail_live`."""
        b, h, g, n, d = q_rest.shape
        s = cache.block_size
        per_row = torch.arange(begin + 1, begin + n + 1, device=cache.device).view(-1, 1).expand(n, b).contiguous()
        # per_row: [T, B] int64 tokens, as `select` passes them to the kernels
        steps = range(begin, begin + n) if self.representatives_from == "window_attention" else leaving
        for t in steps:
            self._step_triton(q_rest[:, :, :, t - begin].reshape(b, h * g, d), cache, layer, per_row[t - begin])
        blocks = ((per_row + s - 1) // s).to(torch.int32)  # [T, B]
        repr_keys, live = self._repr(cache, layer, g), self._live(cache, layer)
        scores = torch.empty(n, b, h, cache.max_blocks, device=cache.device)
        for lo, hi in self._tail_chunks(n, h * cache.max_blocks * d, cache.device):
            for row in range(b):  # the kernel takes one slot row per query row: a stride-0 view per cache row
                q3 = q_rest[row, :, :, lo:hi].permute(2, 0, 1, 3).reshape(hi - lo, h * g, d)  # [c, Hq, D]
                lives = self._live_at(live[row : row + 1], means[row : row + 1, :, lo:hi], own[lo:hi])[:, 0]
                scores[lo:hi, row] = self._scores_triton(
                    q3, cache, per_row[lo:hi, row].contiguous(), blocks[lo:hi, row].contiguous(),
                    finalised[lo:hi, row].contiguous(), repr_keys[row : row + 1].expand(hi - lo, *repr_keys.shape[1:]),
                    lives)
        return tail_rows(self._top_triton(scores.flatten(0, 1), blocks.flatten()), n)

    # --- backends ----------------------------------------------------------------------------
    def triton_problems(self) -> list[str]:
        problems = []
        if self.gqa_reduce == "union":
            problems.append("selector.gqa_reduce=union has no Triton InfLLM kernel (it reduces inside the kernel); "
                            "use gqa_reduce=max or sum, or runtime.backend=torch")
        if self.inv_freq is not None:  # (bound: the head_dim is known)
            d = 2 * self.inv_freq.numel()
            if d < 16 or d > 256 or d & (d - 1):
                problems.append(f"head_dim={d}: the Triton InfLLM kernels take a power of two in [16, 256]; "
                                "use runtime.backend=torch")
        return problems

    def select_triton(self, q: Tensor, cache: PagedKVCache, layer: int, lengths: Tensor,
                      num_blocks: Tensor) -> Selection:
        """`head_scores` + the base class's reduce / force / top-K in three launches (the token's
        live mean is `append_metadata`'s): prr.kernels.infllm's step (window work + finalising)
        and scores, then topk_select. Static shapes, no host synchronisation."""
        if cache.block_size & (cache.block_size - 1):
            raise ValueError(f"block_size={cache.block_size}: the Triton InfLLM kernels take a power of two")
        b, h, g, d = q.shape
        q3 = q.reshape(b, h * g, d)
        self._step_triton(q3, cache, layer, lengths)
        rows = num_blocks.to(torch.int32)
        scores = self._scores_triton(q3, cache, lengths, rows, self._finalised(cache, layer),
                                     self._repr(cache, layer, g), self._live(cache, layer))
        return self._top_triton(scores, rows, self.topk_hint(cache, layer))

    def _step_triton(self, q3: Tensor, cache: PagedKVCache, layer: int, lengths: Tensor) -> None:
        """prr.kernels.infllm's step kernel (the window work and the finalising of at most one
        block, in place) for the queries q3 [B, Hq, D] at positions lengths - 1 ([B])."""
        from prr.kernels.infllm import infllm_step

        g = q3.shape[1] // cache.num_kv_heads
        from_window = self.representatives_from == "window_attention"
        infllm_step(q3, cache.keys[layer], lengths, self._repr(cache, layer, g), self._finalised(cache, layer),
                    self._arrivals(cache, layer), cache.block_size, self.sink_blocks, self.window_blocks,
                    self.representatives,
                    window=self._window(cache, layer, g) if from_window else None,
                    scored=self._scored(cache, layer) if from_window else None,
                    inv_freq=self._freqs(cache) if self.scoring == "position_agnostic" else None,
                    layer_sum=not from_window and not self.per_head)

    def _scores_triton(self, q3: Tensor, cache: PagedKVCache, lengths: Tensor, rows: Tensor, finalised: Tensor,
                       repr_keys: Tensor, live: Tensor) -> Tensor:
        """prr.kernels.infllm's score kernel on rows that need not be the cache's (`select_tail`
        folds positions into them): q3 [N, Hq, D] at positions lengths - 1, rows [N] int32 blocks,
        finalised [N] int64, repr_keys [N, Hkv, NB, G, D], live [N, Hkv, NB, D] -> [N, Hkv, NB]."""
        from prr.kernels.infllm import infllm_scores

        return infllm_scores(q3, lengths, rows, finalised, repr_keys, live,
                             inv_freq=self._freqs(cache) if self.scoring == "position_agnostic" else None,
                             fixed_position=max(self.window_blocks * cache.block_size - 1, 0),
                             layer_sum=not self.per_head, gqa_reduce=self.gqa_reduce,
                             shared_repr=self.representatives_from != "window_attention")

    def _top_triton(self, scores: Tensor, rows: Tensor, hint: Tensor | None = None) -> Selection:
        """scores [N, Hkv, NB], rows [N] int32 blocks -> the forced, top-K Selection (`top_k_triton`;
        hint [N, Hkv]: `topk_hint`, decode steps only)."""
        indices, counts = self.top_k_triton(scores, rows, hint)
        return Selection(blocks=BlockSet(indices, counts), scores=scores)

    # --- scores ------------------------------------------------------------------------------
    def head_scores(self, q: Tensor, cache: PagedKVCache, layer: int, lengths: Tensor) -> Tensor:
        # q: [B, Hkv, G, D] post-RoPE at position lengths - 1 -> [B, Hkv, G, max_blocks]
        b = q.shape[0]
        lengths = block_counts(lengths, b, cache.device)
        if self.representatives_from == "window_attention":
            self._add_window_attention(q.unsqueeze(3), (lengths - 1).view(b, 1), cache, layer)
        self._finalise(q, cache, layer, lengths, self._finalised(cache, layer), 1)
        return self.block_scores(q, cache, layer, lengths)

    def block_scores(self, q: Tensor, cache: PagedKVCache, layer: int, lengths: Tensor) -> Tensor:
        """`head_scores` without its metadata work (the metadata as it is): q [B, Hkv, G, D],
        lengths [B] -> [B, Hkv, G, max_blocks], final blocks against their representatives, the
        others against their live mean (what prr.kernels.infllm.infllm_scores computes, reduced)."""
        b, g = q.shape[0], q.shape[2]
        return self._scores(q, cache, block_counts(lengths, b, cache.device), self._repr(cache, layer, g),
                            self._live(cache, layer), self._finalised(cache, layer))

    def _scores(self, q: Tensor, cache: PagedKVCache, lengths: Tensor, repr_keys: Tensor, live: Tensor,
                finalised: Tensor) -> Tensor:
        """`block_scores` of rows that need not be the cache's (`select_tail` folds positions into
        them, rows (t, b)): q [N, Hkv, G, D] at positions lengths - 1 ([N] int64), N a multiple of
        the cache's B, against the slot's repr_keys [B, Hkv, NB, G, D] and live [N, Hkv, NB, D] of
        their own, blocks below finalised [N] final -> [N, Hkv, G, NB]. The products are made B rows
        at a time, contiguous, as `select` makes them: matmuls are not batch-invariant (the CPU's
        round a [G·T, D] product or a strided operand differently, cuBLAS a larger batch: measured
        on the H200), so each keeps the loop's own shape and layout."""
        n, b = q.shape[0], repr_keys.shape[0]
        query = q.float()
        if self.scoring == "position_agnostic":  # InfLLM's fixed angle: the window's length less one
            freqs = self._freqs(cache)
            fixed = max(self.window_blocks * cache.block_size - 1, 0)
            query = rotate(rotate(query, (lengths - 1).view(n, 1, 1), freqs, sign=-1.0),
                           torch.full((n, 1, 1), fixed, device=cache.device), freqs)
        query, live_keys = query.contiguous(), live.contiguous()
        final = by_rows(lambda i: torch.einsum("bhgd,bhngd->bhgn", query[i : i + b], repr_keys), n, b)  # [N, Hkv, G, NB]
        live = by_rows(lambda i: query[i : i + b] @ live_keys[i : i + b].transpose(-1, -2), n, b)  # [N, Hkv, G, NB]
        is_final = torch.arange(cache.max_blocks, device=cache.device) < finalised.view(n, 1, 1, 1)
        scores = torch.where(is_final, final, live)
        if not self.per_head:
            scores = scores.sum((1, 2), keepdim=True).expand_as(scores)  # Σ over every head of the layer
        return scores
