"""Torch references of InfLLM-v2's selection kernels (`prr.kernels.infllm_v2`): the compressed keys
and the block scores, as the paper defines them (arXiv 2509.24663, sec. 3.3, Eqs. 4-7). Static
shapes, no host syncs: `InfLLMV2Selector` runs them as its torch ops (the CPU path, and inside the
graph engine's captured step), and the kernel tests compare the Triton kernels against them.

Layout: compressed keys [B, Hkv, W, D] (W windows; prr keeps W = 4 * NB_max, window w at index w),
window w the mean of the keys of tokens [w * STRIDE, w * STRIDE + WINDOW), written once complete.
Selection block k (BLOCK tokens) is scored from the windows that overlap it: w in
[k * BLOCK / STRIDE - 1, (k + 1) * BLOCK / STRIDE - 1] (5 at 64 / 16: the reference code's max-pooling
of kernel 5, stride 4, padding 1).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

BLOCK, WINDOW, STRIDE = 64, 32, 16  # InfLLM-v2's (prr.selectors.options.INFLLM_V2_*)
WINDOWS_PER_BLOCK = BLOCK // STRIDE  # 4: the max-pooling's stride
POOLED_WINDOWS = WINDOWS_PER_BLOCK + 1  # 5: the max-pooling's kernel (window k*4 - 1 .. k*4 + 3)


def complete_windows(lengths: Tensor) -> Tensor:
    """lengths [B] tokens -> [B] windows wholly inside them (the keys a query at length - 1 sees)."""
    return torch.clamp((lengths - WINDOW) // STRIDE + 1, min=0)


def window_means(keys: Tensor, first: int, count: int) -> Tensor:
    """keys [B, Hkv, T, D] -> the means of windows first + [0, count) [B, Hkv, count, D] fp32 (the
    windows' tokens must lie below T)."""
    start = first * STRIDE
    span = keys[:, :, start : start + (count - 1) * STRIDE + WINDOW].float()  # [B, Hkv, n, D]
    return span.unfold(2, WINDOW, STRIDE).mean(-1)  # [B, Hkv, count, D]


def compress_range_reference(compressed: Tensor, keys: Tensor, start: int, end: int) -> None:
    """Tokens [start, end) were appended (host range: the prefill): the windows they complete get
    their mean key, in place. compressed [B, Hkv, W, D] (any float dtype), keys [B, Hkv, T, D]."""
    first = max(0, -(-(start - WINDOW + 1) // STRIDE))  # windows whose last token (w*S + WINDOW - 1) >= start
    last = min((end - WINDOW) // STRIDE + 1, compressed.shape[2])  # ... and < end
    if last > first:
        compressed[:, :, first:last] = window_means(keys, first, last - first).to(compressed.dtype)


def compress_append_reference(compressed: Tensor, keys: Tensor, positions: Tensor) -> None:
    """One token per row was appended at positions [B] (device ints): a window it completes gets
    its mean key, in place (the others are rewritten unchanged). compressed [B, Hkv, W, D], keys
    [B, Hkv, T, D] holding the token. Static shapes."""
    b, h, w_max, d = compressed.shape
    pos = positions.long()
    window = (pos + 1 - WINDOW) // STRIDE  # [B] the window ending at pos, if one does
    done = ((pos + 1) % STRIDE == 0) & (window >= 0) & (window < w_max)
    window = window.clamp(0, w_max - 1)
    tokens = (window * STRIDE).view(b, 1) + torch.arange(WINDOW, device=keys.device)  # [B, WINDOW]
    tokens = tokens.clamp(max=keys.shape[2] - 1).view(b, 1, WINDOW, 1).expand(b, h, WINDOW, d)
    mean = torch.gather(keys, 2, tokens).float().mean(2, keepdim=True).to(compressed.dtype)  # [B, Hkv, 1, D]
    index = window.view(b, 1, 1, 1).expand(b, h, 1, d)
    old = torch.gather(compressed, 2, index)
    compressed.scatter_(2, index, torch.where(done.view(b, 1, 1, 1), mean, old))


def window_logits(q: Tensor, compressed: Tensor, scale: float | None = None) -> Tensor:
    """q·k_w·scale (scale 1/sqrt(D), the reference kernel's default) of each query head and window:
    q [B, Hq, D], compressed [B, Hkv, W, D] -> [B, Hkv, G, W] fp32 (every window, complete or not)."""
    b, h, w_max, d = compressed.shape
    g = q.shape[1] // h
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    return torch.einsum("bhgd,bhwd->bhgw", q.float().view(b, h, g, d), compressed.float()) * scale


def window_probabilities(q: Tensor | None, compressed: Tensor | None, lengths: Tensor, scale: float | None = None,
                         logits: Tensor | None = None) -> Tensor:
    """S_shared (Eqs. 5-6): each query head's softmax over the complete windows of its row
    (`window_logits`), summed over the GQA group. q [B, Hq, D], compressed [B, Hkv, W, D], lengths
    [B] -> [B, Hkv, W] fp32, 0 past the complete windows. logits: `window_logits` when the caller has
    them (a prefill tail folds its positions into the batch after each one's own q·K product)."""
    logits = window_logits(q, compressed, scale) if logits is None else logits  # [B, Hkv, G, W]
    b, _, _, w_max = logits.shape
    seen = torch.arange(w_max, device=logits.device).view(1, w_max) < complete_windows(lengths).view(b, 1)  # [B, W]
    logits = logits.masked_fill(~seen.view(b, 1, 1, w_max), float("-inf"))
    probs = torch.softmax(logits, dim=-1).nan_to_num(0.0)  # a row with no complete window: all 0
    return probs.sum(2)


def infllm_v2_score_reference(q: Tensor | None, compressed: Tensor | None, lengths: Tensor, max_blocks: int,
                              scale: float | None = None, logits: Tensor | None = None) -> Tensor:
    """InfLLM-v2's block scores S_cmp (Eq. 7): per selection block the max of S_shared over the
    complete windows that overlap it; 0 for a block of the context with none complete (the newest,
    forced anyway), -inf past the context. q [B, Hq, D] (post-RoPE), compressed [B, Hkv, W, D],
    lengths [B] tokens -> [B, Hkv, max_blocks] fp32. logits: as `window_probabilities`' (then q and
    compressed may be None)."""
    shared = window_probabilities(q, compressed, lengths, scale, logits)  # [B, Hkv, W]
    b, _, w_max = shared.shape
    seen = complete_windows(lengths).view(b, 1, 1, 1)
    blocks = torch.arange(max_blocks, device=shared.device)
    windows = (blocks * WINDOWS_PER_BLOCK - 1).view(max_blocks, 1) + torch.arange(POOLED_WINDOWS, device=shared.device)
    inside = (windows >= 0) & (windows < w_max)  # [NB, 5]
    pooled = shared[:, :, windows.clamp(0, w_max - 1)]  # [B, Hkv, NB, 5]
    pooled = pooled.masked_fill(~inside | (windows >= seen), float("-inf")).amax(-1)
    pooled = pooled.masked_fill(pooled == float("-inf"), 0.0)
    num_blocks = (lengths.view(b, 1, 1) + BLOCK - 1) // BLOCK
    return pooled.masked_fill(blocks.view(1, 1, max_blocks) >= num_blocks, float("-inf"))
