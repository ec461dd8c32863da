"""`infllm_v2` (arXiv 2509.24663, InfLLM-v2; OpenBMB/infllmv2_cuda_impl, MiniCPM4's `sparse_config`):
InfLLM-v2's block selection on a dense model, training-free.

The rule, as the paper and its reference kernels define it (read as facts, no code carried over):
- compressed keys (Eq. 4): per KV head, the mean of the keys of each window of 32 tokens at a
  stride of 16 (l_C1 = B/2, s_C1 = B/4); a window is scored once all its tokens exist (the
  reference's causal mask: a query at t sees windows ending at or before t);
- S_C1 (Eq. 5): each query head's softmax over the row's complete windows of q·k_w / sqrt(D) (the
  stage-1 kernel's default scale); S_shared (Eq. 6): those probabilities summed over the GQA group
  (the query heads of one KV head), so a group shares one selection;
- S_cmp (Eq. 7): per selection block of B = 64 tokens, the max of S_shared over the windows that
  overlap it (the reference's max-pooling: kernel 5, stride 4, padding 1 = windows 4k-1 .. 4k+3);
- A = the initial blocks (`sink_blocks`, MiniCPM4's init_blocks) ∪ the local blocks (the query's
  own block and `local_blocks` before it: `force_newest` + `local_blocks`) ∪ the top blocks by
  S_cmp, `topk_blocks` in all (the reference sets the forced blocks' scores to +inf before its
  top-k, so its k counts them too, as prr's does);
- dense below a length: while a row's context has at most `topk_blocks` blocks, A is all of them.
Attention over A is prr's (the same kernel as every selector's).

Departures of this training-free version from the trained model (docs/design.md's table, with what
is measured of them):
1. the model is dense-trained: its keys were never fine-tuned so that pooled keys stand for their
   blocks (InfLLM-v2's 5B-token long-context fine-tuning), and the group size is the model's
   (InfLLM-v2 trains with G = 16);
2. the lse of S_C1 is exact (the paper's "w/o LSE Approx" row): the trained kernels approximate it
   from coarser windows (128 at stride 64), within 0.5 points of RULER in the paper (Table 1);
3. the dense threshold is the budget: MiniCPM4 attends densely below dense_len = 8,192 tokens, more
   than its 64 selected blocks (4,096 tokens) hold, which prr's fixed |A| <= topk_blocks cannot
   express; here A is dense while the context fits the budget;
4. sizes are prr's defaults (8 blocks = 512 tokens, 1 sink, 1 local + the newest block, no dense
   layers) where the paper's model uses 96 blocks (1 initial, 32 local, 63 top-k: 6,144 tokens)
   and MiniCPM4 64 blocks with a 2,048-token window: set them with topk_blocks / local_blocks;
5. the compressed keys are kept in the cache's dtype (bf16 in the GPU runs, as the trained
   kernels'), the means computed in fp32; the trained model's kernels (FlashAttention-based
   stage 1 with a fused group sum, CUDA max-pooling and top-k) are replaced by prr's Triton kernels
   (`prr.kernels.infllm_v2`) and top-K.
The blocks are the cache's: `runtime.block_size` must be 64 (refused otherwise before the model
loads, naming the fix: `SelectorOptions.block_size_problems`).

Metadata: the slot `infllm_v2_compressed` [B, Hkv, NB_max, 4, D] in the cache's dtype, read as
[B, Hkv, 4 * NB_max, D] windows (window w at index w). `update_metadata` (the prefill's host range)
writes the windows the range completes; `append_metadata` writes the window one decode token
completes (every 16th token), static shapes. Both give the same windows (a window is written once,
from its complete keys): `bulk_metadata_equals_stepwise`.

One definition, two op backends, tested equal (tests/test_kernels_infllm_v2.py): torch ops
(`prr.kernels.reference_infllm_v2`: the CPU path and the reference) and under runtime backend triton
`prr.kernels.infllm_v2` (the window update, the lse pass and the pooled scores) + the shared top-K.
"""

from __future__ import annotations

import torch
from torch import Tensor

from prr.blocks import BlockSet
from prr.cache import PagedKVCache
from prr.kernels.reference_infllm_v2 import (
    WINDOWS_PER_BLOCK,
    compress_append_reference,
    compress_range_reference,
    infllm_v2_score_reference,
    window_logits,
)
from prr.selectors.base import Selection, Selector, tail_rows
from prr.selectors.options import INFLLM_V2_BLOCK_TOKENS, InfLLMV2SelectorOptions

COMPRESSED = "infllm_v2_compressed"


class InfLLMV2Selector(InfLLMV2SelectorOptions, Selector):
    # the constructor is InfLLMV2SelectorOptions' (no torch: run.py checks it before importing torch)
    bulk_metadata_equals_stepwise = True  # a window's mean is written once, from its complete keys

    def compressed(self, cache: PagedKVCache, layer: int) -> Tensor:
        """The layer's compressed keys [B, Hkv, 4 * NB_max, D] in the cache's dtype (a view of its slot)."""
        if cache.block_size != INFLLM_V2_BLOCK_TOKENS:
            raise ValueError(self.block_size_problems(cache.block_size)[0])
        slot = cache.metadata_slot(layer, COMPRESSED, (WINDOWS_PER_BLOCK, cache.head_dim), cache.dtype)
        b, h, nb, _, d = slot.shape
        return slot.view(b, h, nb * WINDOWS_PER_BLOCK, d)

    def triton_problems(self) -> list[str]:
        return []

    def update_metadata(self, cache: PagedKVCache, layer: int, start: int, end: int) -> None:
        self.topk_hint(cache, layer)  # (hinted_topk) every slot a decode step writes exists after the prefill
        compress_range_reference(self.compressed(cache, layer), cache.keys[layer], start, end)

    def append_metadata(self, cache: PagedKVCache, layer: int, positions: Tensor) -> None:
        compressed = self.compressed(cache, layer)
        if self.backend == "triton":
            from prr.kernels.infllm_v2 import infllm_v2_compress_append

            infllm_v2_compress_append(compressed, cache.keys[layer], positions)
            return
        compress_append_reference(compressed, cache.keys[layer], positions)

    def head_scores(self, q: Tensor, cache: PagedKVCache, layer: int, lengths: Tensor) -> Tensor:
        # q: [B, Hkv, G, D] -> S_cmp [B, Hkv, 1, max_blocks]: the group is summed inside (Eq. 6, before
        # the pooling), so the base class's reduction (gqa_reduce = sum) runs over one entry
        b, h, g, d = q.shape
        scores = infllm_v2_score_reference(q.reshape(b, h * g, d), self.compressed(cache, layer), lengths,
                                           cache.max_blocks)
        return scores.unsqueeze(2)

    def select_tail(self, q_tail: Tensor, cache: PagedKVCache, layer: int, start: int,
                    queries: Tensor | None = None) -> list[Selection]:
        """The base loop's selections from one metadata update: a window is written once, from its
        complete keys, and position t reads only the windows complete by t (`complete_windows`), so
        the final windows score every position as its own step's did. Each position's q·K product
        is its own call, as `head_scores` makes it (CPU matmuls are not batch-invariant); the
        softmax, pooling, reduce / force / top-K one call each over the T positions folded into the
        batch (rows (t, b)). Backend triton: the base loop (the kernels' selection)."""
        if self.backend == "triton":
            return super().select_tail(q_tail, cache, layer, start, queries=queries)
        b, h, g, num, d = q_tail.shape
        self.topk_hint(cache, layer)  # allocated in the prefill (hinted_topk)
        self.update_metadata(cache, layer, start, start + num)
        lengths = torch.arange(start + 1, start + num + 1, device=q_tail.device).repeat_interleave(b)  # [T * B]
        compressed = self.compressed(cache, layer)
        logits = torch.cat([window_logits(q_tail[:, :, :, i].reshape(b, h * g, d), compressed)
                            for i in range(num)])  # [T * B, Hkv, G, W]
        scores = infllm_v2_score_reference(None, None, lengths, cache.max_blocks, logits=logits)  # [T * B, Hkv, NB]
        per_head = scores.unsqueeze(2)  # as head_scores: the group summed inside
        num_blocks = (lengths + cache.block_size - 1) // cache.block_size
        return tail_rows(self.selection_from(per_head, num_blocks, cache.max_blocks), num)

    def select_triton(self, q: Tensor, cache: PagedKVCache, layer: int, lengths: Tensor,
                      num_blocks: Tensor) -> Selection:
        from prr.kernels.infllm_v2 import infllm_v2_score

        b, h, g, d = q.shape
        rows = num_blocks.to(torch.int32)
        scores = infllm_v2_score(q.reshape(b, h * g, d), self.compressed(cache, layer), lengths.to(torch.int32),
                                 cache.max_blocks)  # [B, Hkv, NB]
        indices, counts = self.top_k_triton(scores, rows, self.topk_hint(cache, layer))
        return Selection(blocks=BlockSet(indices, counts), scores=scores)
