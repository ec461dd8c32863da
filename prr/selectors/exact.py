"""`exact`: the true top-K blocks by attention mass (from dense scores). The selector
oracle: no cheaper selector can carry more attention mass with the same K.

One definition, two op backends: torch ops (`head_scores`, the softmax of scale·q·k over the
whole context summed per block, + the base class's reduce / force / top-K) and the Triton
kernels (`prr.kernels.exact.exact_scores`: a q·K pass storing every block's lse and a pass
turning them into masses, GQA-reduced; then `topk_select`), tested equal. Ties: both take the
higher mass, then the lower block id. The two compute a block's mass in a different order (the
kernel as exp(lse_block − lse_row)), so masses within a few fp32 ulps of each other may rank
differently, and blocks whose mass underflows fp32 (below ~1e-38: the kernel's exp2 may flush
subnormals to 0 on a GPU) tie at 0 there, lowest id first.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from prr.block_attention import attend_dense
from prr.blocks import BlockSet
from prr.cache import PagedKVCache
from prr.selectors.base import Selection, Selector, tail_rows


class ExactSelector(Selector):
    bulk_metadata_equals_stepwise = True  # no metadata: every key scored at each step

    def head_scores(self, q: Tensor, cache: PagedKVCache, layer: int, lengths: Tensor) -> Tensor:
        # q: [B, Hkv, G, D] -> attention mass per block [B, Hkv, G, max_blocks]
        _, block_mass = attend_dense(q, cache, layer, lengths, 1.0 / math.sqrt(q.shape[-1]))
        return block_mass

    def triton_problems(self) -> list[str]:
        if self.gqa_reduce == "union":
            return ["selector.gqa_reduce=union has no Triton exact kernel (it reduces inside the kernel); "
                    "use gqa_reduce=max or sum, or runtime.backend=torch"]
        return []

    def select_triton(self, q: Tensor, cache: PagedKVCache, layer: int, lengths: Tensor,
                      num_blocks: Tensor, speculation=None) -> Selection:
        """speculation: a sparse_decode(per_block=True, plan_only=True) launch over q (as [B, Hq, D]),
        run in the q·K pass's launch (`select_speculating`)."""
        from prr.kernels.exact import exact_scores

        b, h, g, d = q.shape
        rows = num_blocks.to(torch.int32)  # [B]
        scores = exact_scores(q.reshape(b, h * g, d), cache.keys[layer], lengths, rows, cache.block_size,
                              1.0 / math.sqrt(d), self.gqa_reduce, speculation=speculation)  # [B, Hkv, NB]
        indices, counts = self.top_k_triton(scores, rows, self.topk_hint(cache, layer))
        return Selection(blocks=BlockSet(indices, counts), scores=scores)

    def speculates_in_selection(self) -> bool:
        return self.backend == "triton"

    def select_speculating(self, q: Tensor, cache: PagedKVCache, layer: int, lengths: Tensor, num_blocks: Tensor,
                           pred_idx: Tensor, pred_cnt: Tensor, scale: float,
                           tokens_per_program: int | None) -> tuple[Selection, tuple[Tensor, Tensor]]:
        from prr.kernels.sparse_decode import sparse_decode

        b, h, g, d = q.shape
        flat = q.reshape(b, h * g, d)  # [B, Hq, D]: the view the q·K pass reads
        launch = sparse_decode(flat, cache.keys[layer], cache.values[layer], pred_idx, pred_cnt, lengths,
                               cache.block_size, scale, per_block=True, tokens_per_split=tokens_per_program,
                               plan_only=True)
        return self.select_triton(q, cache, layer, lengths, num_blocks, speculation=launch), (launch.out, launch.lse)

    def select_tail(self, q_tail: Tensor, cache: PagedKVCache, layer: int, start: int,
                    queries: Tensor | None = None) -> list[Selection]:
        """The base loop's selections with the T positions folded into the batch (rows (t, b)):
        no metadata, so position t is the full cache's scores masked to tokens <= t."""
        b, h, g, num, d = q_tail.shape
        self.topk_hint(cache, layer)  # allocated in the prefill (hinted_topk)
        positions = torch.arange(start, start + num, device=q_tail.device)
        lengths = (positions + 1).repeat_interleave(b)  # [T * B], rows (t, b)
        num_blocks = (lengths + cache.block_size - 1) // cache.block_size
        scale = 1.0 / math.sqrt(d)
        if self.backend == "triton":
            from prr.kernels.exact import exact_scores

            rows = num_blocks.to(torch.int32)
            per_position = (positions + 1, (positions // cache.block_size + 1).to(torch.int32))  # [T] lengths, blocks
            scores = []
            for row in range(b):  # the kernels take one key row per query row: a stride-0 view per cache row
                q_rows = q_tail[row].permute(2, 0, 1, 3).reshape(num, h * g, d)  # [T, Hq, D]
                keys = cache.keys[layer][row : row + 1].expand(num, *cache.keys[layer].shape[1:])
                scores.append(exact_scores(q_rows, keys, *per_position, cache.block_size, scale,
                                           self.gqa_reduce))  # [T, Hkv, NB]
            scores = torch.stack(scores, 1).flatten(0, 1)  # [T * B, Hkv, NB]
            indices, counts = self.top_k_triton(scores, rows, None)  # (one hint per row, not per position)
            return tail_rows(Selection(BlockSet(indices, counts), scores), num)
        # attend_dense's block mass, batched after the q·K products: those stay one matmul per
        # position, as `select` makes them (CPU matmuls are not batch-invariant: measured, a
        # [B, Hkv, G·T, D] product differs in the last bits).
        k = cache.keys[layer].float().transpose(-1, -2)  # [B, Hkv, D, T_max]
        logits = torch.stack([q_tail[:, :, :, i].float() @ k for i in range(num)], 3) * scale  # [B, Hkv, G, T, T_max]
        live = torch.arange(cache.max_tokens, device=q_tail.device) <= positions.unsqueeze(1)  # [T, T_max]
        logits = logits.masked_fill(~live, float("-inf"))
        probs = torch.exp(logits - torch.logsumexp(logits, dim=-1, keepdim=True))
        mass = probs.unflatten(-1, (cache.max_blocks, cache.block_size)).sum(-1)  # [B, Hkv, G, T, NB]
        per_head = mass.permute(3, 0, 1, 2, 4).flatten(0, 1)  # [T * B, Hkv, G, NB]
        return tail_rows(self.selection_from(per_head, num_blocks, cache.max_blocks), num)
