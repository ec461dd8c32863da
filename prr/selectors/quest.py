"""`quest` (arXiv 2406.10774): per block, the elementwise max M and min m of its keys;
score U_b(q) = Σ_i max(q_i M_{b,i}, q_i m_{b,i}), an upper bound of q·k for every key of b.
The metadata is refreshed incrementally: only the block that received the token.

As the paper, per head: the bound, its incremental upkeep, top-K pages. Departures (docs/design.md's
paper-vs-prr table): pages are `runtime.block_size` tokens (the paper's default 16 too); a GQA
group's query heads share their KV head's selection, their bounds reduced by `gqa_reduce`
(max | sum, or the union of per-head top-K; Quest's kernels assume one query head per KV head);
the sink blocks and the newest block are forced (`sink_blocks`, `force_newest`; the paper's rule as
written is top-K over every page); dense layers are configured (`dense_layers`, [0, 1] by
default, as the paper's).

One definition, two op backends: torch ops (`head_scores` + the base class's reduce / force /
top-K) and the Triton kernels (`quest_score` + `topk_select`, `quest_update`), tested equal.
M and m are stored in the cache's dtype: a max or min of keys is exact in it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from prr.blocks import BlockSet
from prr.cache import PagedKVCache
from prr.selectors.base import Selection, Selector, tail_rows

KEY_MAX, KEY_MIN = "quest_key_max", "quest_key_min"
# fp32 elements of one torch `select_tail` chunk's [.., T, NB, D] products: cache-sized on a CPU
# (memory-bound there: one 58 MB product of 32 positions ran 4.7x slower than the loop), large
# on a GPU (launch-bound: few chunks).
TAIL_CHUNK_ELEMENTS = {"cpu": 1 << 19, "cuda": 1 << 25}


class QuestSelector(Selector):
    metadata_in_append_kernel = True
    bulk_metadata_equals_stepwise = True  # a block's key max / min: the same however it grew
    def metadata(self, cache: PagedKVCache, layer: int) -> tuple[Tensor, Tensor]:
        """(key_max, key_min) [B, Hkv, max_blocks, D] in the cache dtype; ±inf in blocks never
        written. Public: fused kernels that append a token (prr.kernels.qkv_append) update them."""
        d = (cache.head_dim,)
        key_max = cache.metadata_slot(layer, KEY_MAX, d, cache.dtype, float("-inf"))
        key_min = cache.metadata_slot(layer, KEY_MIN, d, cache.dtype, float("inf"))
        return key_max, key_min

    def triton_problems(self) -> list[str]:
        if self.gqa_reduce == "union":
            return ["selector.gqa_reduce=union has no Triton Quest kernel (it reduces inside the kernel); "
                    "use gqa_reduce=max or sum, or runtime.backend=torch"]
        return []

    def update_metadata(self, cache: PagedKVCache, layer: int, start: int, end: int) -> None:
        self.topk_hint(cache, layer)  # (hinted_topk) every slot a decode step writes exists after the prefill
        key_max, key_min = self.metadata(cache, layer)
        s = cache.block_size
        first, last = start // s, -(-end // s)  # blocks touched by [start, end)
        keys = cache.keys[layer][:, :, first * s : last * s]  # [B, Hkv, n*S, D]
        b, h, _, d = keys.shape
        keys = keys.view(b, h, last - first, s, d)
        live = (torch.arange(first * s, last * s, device=keys.device) < end).view(1, 1, last - first, s, 1)
        # Recompute touched blocks from all their live tokens.
        key_max[:, :, first:last] = keys.masked_fill(~live, float("-inf")).amax(3)
        key_min[:, :, first:last] = keys.masked_fill(~live, float("inf")).amin(3)

    def append_metadata(self, cache: PagedKVCache, layer: int, positions: Tensor) -> None:
        key_max, key_min = self.metadata(cache, layer)
        b, h, d = cache.batch, cache.num_kv_heads, cache.head_dim
        pos = positions.view(b, 1, 1, 1).long().expand(b, h, 1, d)
        k_new = torch.gather(cache.keys[layer], 2, pos).squeeze(2)  # [B, Hkv, D] as the cache stores it
        if self.backend == "triton":  # the running max / min kernel
            from prr.kernels.quest import quest_update

            quest_update(key_max, key_min, k_new, positions.to(torch.int32), cache.block_size)
            return
        block = (pos // cache.block_size)  # [B, Hkv, 1, D]
        first = (positions.view(b, 1, 1, 1).long() % cache.block_size) == 0  # a new block starts from the token
        old_max, old_min = torch.gather(key_max, 2, block), torch.gather(key_min, 2, block)
        k_new = k_new.unsqueeze(2)
        key_max.scatter_(2, block, torch.where(first, k_new, torch.maximum(old_max, k_new)))
        key_min.scatter_(2, block, torch.where(first, k_new, torch.minimum(old_min, k_new)))

    def select_triton(self, q: Tensor, cache: PagedKVCache, layer: int, lengths: Tensor,
                      num_blocks: Tensor) -> Selection:
        from prr.kernels.quest import quest_score

        b, h, g, d = q.shape
        key_max, key_min = self.metadata(cache, layer)
        rows = num_blocks.to(torch.int32)
        scores = quest_score(q.reshape(b, h * g, d), key_max, key_min, rows, gqa_reduce=self.gqa_reduce)  # [B, Hkv, NB]
        indices, counts = self.top_k_triton(scores, rows, self.topk_hint(cache, layer))
        return Selection(blocks=BlockSet(indices, counts), scores=scores)

    def head_scores(self, q: Tensor, cache: PagedKVCache, layer: int, lengths: Tensor) -> Tensor:
        # q: [B, Hkv, G, D] -> upper bounds [B, Hkv, G, max_blocks] (unscaled q·k units)
        key_max, key_min = self.metadata(cache, layer)
        return _bounds(q.float().unsqueeze(3), key_max.float().unsqueeze(2), key_min.float().unsqueeze(2))

    def select_tail(self, q_tail: Tensor, cache: PagedKVCache, layer: int, start: int,
                    queries: Tensor | None = None) -> list[Selection]:
        """The base loop's selections with the T positions folded into the batch (rows (t, b)).
        Position t sees the final metadata of the blocks before its own (complete by then) and,
        for its own block p = t // S, the max / min of that block's keys <= t: a running max /
        min over the block (exact in the cache dtype, as the stepwise update). Scored with all
        blocks' final metadata, then column p replaced by the bound over that partial block."""
        b, h, g, num, d = q_tail.shape
        self.topk_hint(cache, layer)  # allocated in the prefill (hinted_topk)
        end, s = start + num, cache.block_size
        self.update_metadata(cache, layer, start, end)  # the final metadata (= stepwise, see the class)
        key_max, key_min = self.metadata(cache, layer)
        first, last = start // s, -(-end // s)  # blocks holding tail positions
        keys = cache.keys[layer][:, :, first * s : last * s].unflatten(2, (last - first, s))  # [B, Hkv, n, S, D]
        window = slice(start - first * s, end - first * s)
        run_max = keys.cummax(3).values.flatten(2, 3)[:, :, window]  # [B, Hkv, T, D]: block's max up to t
        run_min = keys.cummin(3).values.flatten(2, 3)[:, :, window]
        positions = torch.arange(start, end, device=q_tail.device)
        own = positions // s  # [T] each position's block
        num_blocks = (own + 1).repeat_interleave(b)  # [T * B], rows (t, b)
        if self.backend == "triton":
            from prr.kernels.quest import quest_score

            rows = num_blocks.to(torch.int32)
            ones = torch.ones(num, dtype=torch.int32, device=q_tail.device)
            scores = []
            for row in range(b):  # the kernels take one metadata row per query row: a stride-0 view per cache row
                q_rows = q_tail[row].permute(2, 0, 1, 3).reshape(num, h * g, d)  # [T, Hq, D]
                meta = [m[row : row + 1].expand(num, *m.shape[1:]) for m in (key_max, key_min)]
                full = quest_score(q_rows, *meta, (own + 1).to(torch.int32), gqa_reduce=self.gqa_reduce)  # [T, Hkv, NB]
                partial = quest_score(q_rows, run_max[row].transpose(0, 1).unsqueeze(2),
                                      run_min[row].transpose(0, 1).unsqueeze(2), ones,
                                      gqa_reduce=self.gqa_reduce)  # [T, Hkv, 1]: own block from keys <= t
                scores.append(full.scatter_(2, own.view(num, 1, 1).expand(num, h, 1), partial))
            scores = torch.stack(scores, 1).flatten(0, 1)  # [T * B, Hkv, NB]
            indices, counts = self.top_k_triton(scores, rows, None)  # (one hint per row, not per position)
            return tail_rows(Selection(BlockSet(indices, counts), scores), num)
        nb = key_max.shape[2]
        limit = TAIL_CHUNK_ELEMENTS.get(q_tail.device.type, TAIL_CHUNK_ELEMENTS["cpu"])
        chunk = max(1, limit // max(1, b * h * g * nb * d))  # positions per chunk
        qf = q_tail.float()
        full_max, full_min = key_max.float()[:, :, None, None], key_min.float()[:, :, None, None]  # [B, Hkv, 1, 1, NB, D]
        per_head = torch.empty(b, h, g, num, nb, device=q_tail.device)  # [B, Hkv, G, T, NB]
        for lo in range(0, num, chunk):
            part = slice(lo, min(num, lo + chunk))
            per_head[:, :, :, part] = _bounds(qf[:, :, :, part].unsqueeze(4), full_max, full_min)
        partial = _bounds(qf, run_max.float().unsqueeze(2), run_min.float().unsqueeze(2))  # [B, Hkv, G, T]
        for block in range(first, last):  # column `block` of its positions (slices: no index_put)
            rows = slice(max(start, block * s) - start, min(end, (block + 1) * s) - start)
            per_head[:, :, :, rows, block] = partial[:, :, :, rows]
        per_head = per_head.permute(3, 0, 1, 2, 4).flatten(0, 1)  # [T * B, Hkv, G, NB]
        return tail_rows(self.selection_from(per_head, num_blocks, cache.max_blocks), num)


def _bounds(q: Tensor, key_max: Tensor, key_min: Tensor) -> Tensor:
    """Quest's bound Σ_i max(q_i M_i, q_i m_i) over the last dim of broadcast fp32 operands (one
    definition for `select` and `select_tail`: the same ops, so the same fp32 sums)."""
    upper = q * key_max
    # in place: one product-sized temporary fewer, the same values (memory-bound on a CPU: 1.7x
    # faster on the tail's [B, Hkv, G, t, NB, D] products, SmolLM2's shapes)
    upper = torch.maximum(upper, q * key_min, out=upper).sum(-1)
    # Blocks never written hold ±inf metadata; the base class masks them out by length.
    return torch.nan_to_num(upper, nan=float("-inf"))
