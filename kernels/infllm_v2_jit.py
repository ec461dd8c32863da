"""Triton kernels of InfLLM-v2's selection (arXiv 2509.24663): the compressed-key update and the
block scores. Launchers with checks live in `prr.kernels.infllm_v2`, the torch references in
`prr.kernels.reference_infllm_v2` (the definitions: window means, each query head's softmax over
the complete windows summed over its group, max-pooled onto blocks).

The scores take two launches: the softmax's normaliser needs every window of the row before any
probability is known (the paper's two-pass stage 1), so `_lse_kernel` reads every complete window's
key once, stores each head's scaled logit (fp32 [B, Hkv, GROUP, W]: G·4 bytes a window against
the key's D·2, 1/32 of the keys' bytes at D = 128, G = 4) and reduces split ranges of windows to
per-head partial (max, sum of exp); `_pool_kernel` merges those into each head's log-sum-exp and
scores a tile of blocks from the stored logits of the five windows overlapping each (window
4k-1 .. 4k+3 of block k). Recomputing the logits there instead re-read 5/4 of the keys.
Products: by default one tl.dot per tile of windows, the group's G query heads padded with zero rows
to the dot's 16 (tensor cores idle on the padding, but one instruction stream instead of a
broadcast-multiply-sum per D chunk); `DOT=False` keeps the fp32 FMA chunks. 16-bit q and keys
enter the dot as they are (exact products, fp32 sums); fp32 ones as fp32 with ieee precision.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _compress_append_kernel(
    compressed_ptr,  # [B, Hkv, W, D] compressed keys (the cache's dtype), one window written in place
    keys_ptr,  # [B, Hkv, T, D] the cache's keys, holding the appended token
    positions_ptr,  # [B] int32/int64: the token appended per row
    max_windows,  # W
    head_dim,  # D
    stride_cb, stride_ch, stride_cw, stride_cd,
    stride_kb, stride_kh, stride_kt, stride_kd,
    WINDOW: tl.constexpr,  # tokens per window (32)
    STRIDE: tl.constexpr,  # tokens between window starts (16)
    BLOCK_D: tl.constexpr,  # next power of two >= D
):
    """The window that row's token completes (if any) gets the mean of its WINDOW keys."""
    kv_head = tl.program_id(0)
    batch = tl.program_id(1)
    # the position as a [WINDOW] vector: masks built from vectors (a scalar bool broadcast into a mask
    # is an int8 array in the interpreter, which tl.load refuses)
    pos = tl.load(positions_ptr + batch).to(tl.int32) + tl.zeros((WINDOW,), tl.int32)
    ends_window = ((pos + 1) % STRIDE == 0) & (pos + 1 >= WINDOW)
    window = tl.where(ends_window, (pos + 1 - WINDOW) // STRIDE, 0)  # [WINDOW], all equal
    write = ends_window & (window < max_windows)
    offs_t = window * STRIDE + tl.arange(0, WINDOW)  # [WINDOW] the window's tokens
    offs_d = tl.arange(0, BLOCK_D)
    live_d = offs_d < head_dim
    key_row = keys_ptr + batch.to(tl.int64) * stride_kb + kv_head.to(tl.int64) * stride_kh
    keys = tl.load(key_row + offs_t[:, None].to(tl.int64) * stride_kt + offs_d[None, :] * stride_kd,
                   mask=write[:, None] & live_d[None, :], other=0.0).to(tl.float32)  # [WINDOW, BLOCK_D]
    mean = tl.sum(keys, axis=0) / WINDOW  # [BLOCK_D]
    written = tl.max(write.to(tl.int32), axis=0)  # one flag for the row
    out = compressed_ptr + batch.to(tl.int64) * stride_cb + kv_head.to(tl.int64) * stride_ch
    out += tl.max(window, axis=0).to(tl.int64) * stride_cw + offs_d * stride_cd
    tl.store(out, mean.to(compressed_ptr.dtype.element_ty), mask=live_d & (offs_d * 0 + written > 0))


@triton.jit
def _group_logits(q_row, stride_qh, stride_qd, comp_rows, stride_cd, live, head_dim,
                  GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_D: tl.constexpr, D_CHUNK: tl.constexpr):
    """q_row: the group's first query head; comp_rows: [N] pointers to windows (live: [N] mask) ->
    unscaled q·k [GROUP_PAD, N] fp32 (0 where not live or padding)."""
    offs_g = tl.arange(0, GROUP_PAD)
    offs_c = tl.arange(0, D_CHUNK)
    acc = tl.zeros((GROUP_PAD, comp_rows.shape[0]), dtype=tl.float32)
    for d0 in tl.static_range(0, BLOCK_D, D_CHUNK):
        offs_d = d0 + offs_c
        live_d = offs_d < head_dim
        q = tl.load(q_row + offs_g[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                    mask=(offs_g[:, None] < GROUP) & live_d[None, :], other=0.0).to(tl.float32)  # [G_PAD, C]
        k = tl.load(comp_rows[:, None] + offs_d[None, :] * stride_cd, mask=live[:, None] & live_d[None, :],
                    other=0.0).to(tl.float32)  # [N, C]
        acc += tl.sum(q[:, None, :] * k[None, :, :], axis=2)
    return acc


@triton.jit
def _complete_windows(length, WINDOW: tl.constexpr, STRIDE: tl.constexpr):
    """Windows wholly inside a row of `length` tokens (no negative floor division)."""
    return tl.where(length >= WINDOW, (length - WINDOW) // STRIDE + 1, 0)


@triton.jit
def _lse_kernel(
    q_ptr,  # [B, Hq, D] post-RoPE queries, Hq = Hkv * GROUP
    compressed_ptr,  # [B, Hkv, W, D]
    lengths_ptr,  # [B] int32: tokens per row
    max_ptr,  # [B, Hkv, SPLITS, GROUP_PAD] fp32 out: per head the max scaled logit of the split
    sum_ptr,  # [B, Hkv, SPLITS, GROUP_PAD] fp32 out: Σ exp(logit - max) over the split
    logits_ptr,  # [B, Hkv, GROUP, W] fp32 out: each head's scaled logit of each window (-inf if not complete)
    max_windows, head_dim, scale, num_splits,
    stride_qb, stride_qh, stride_qd,
    stride_cb, stride_ch, stride_cw, stride_cd,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    WINDOW: tl.constexpr, STRIDE: tl.constexpr,
    WINDOWS_PER_SPLIT: tl.constexpr,  # a multiple of BLOCK_W
    BLOCK_W: tl.constexpr, BLOCK_D: tl.constexpr, D_CHUNK: tl.constexpr,
    DOT: tl.constexpr,  # q·k by tl.dot over [GROUP_PAD >= 16, BLOCK_D] x [BLOCK_D, BLOCK_W]; else FMA chunks
    NATIVE_DOT: tl.constexpr,  # (DOT) q and keys in their 16-bit type; else fp32 operands, ieee products
):
    split = tl.program_id(0)
    kv_head = tl.program_id(1)
    batch = tl.program_id(2)
    seen = _complete_windows(tl.load(lengths_ptr + batch).to(tl.int32), WINDOW, STRIDE)
    q_row = q_ptr + batch.to(tl.int64) * stride_qb + (kv_head * GROUP).to(tl.int64) * stride_qh
    comp = compressed_ptr + batch.to(tl.int64) * stride_cb + kv_head.to(tl.int64) * stride_ch
    offs_g = tl.arange(0, GROUP_PAD)
    real_head = (offs_g < GROUP)[:, None]  # [GROUP_PAD, 1]
    logit_rows = logits_ptr + ((batch * tl.num_programs(1) + kv_head).to(tl.int64) * GROUP
                               + offs_g[:, None]) * max_windows  # [GROUP_PAD, 1]: rows of the real heads
    offs_d = tl.arange(0, BLOCK_D)
    live_d = offs_d < head_dim
    if DOT:  # the group's queries once, padded to the dot's 16 rows with zeros
        q = tl.load(q_row + offs_g[:, None] * stride_qh + offs_d[None, :] * stride_qd, mask=real_head & live_d[None, :],
                    other=0.0)  # [GROUP_PAD, BLOCK_D]
        if not NATIVE_DOT:
            q = q.to(tl.float32)
    run_max = tl.full((GROUP_PAD,), float("-inf"), tl.float32)
    run_sum = tl.zeros((GROUP_PAD,), tl.float32)
    for w0 in range(split * WINDOWS_PER_SPLIT, (split + 1) * WINDOWS_PER_SPLIT, BLOCK_W):
        offs_w = w0 + tl.arange(0, BLOCK_W)
        live = (offs_w < seen) & (offs_w < max_windows)
        rows = comp + offs_w.to(tl.int64) * stride_cw  # [BLOCK_W] pointers to windows
        if DOT:
            k = tl.load(rows[:, None] + offs_d[None, :] * stride_cd, mask=live[:, None] & live_d[None, :],
                        other=0.0)  # [BLOCK_W, BLOCK_D]
            if NATIVE_DOT:
                logits = tl.dot(q, tl.trans(k)) * scale
            else:
                logits = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee") * scale
        else:
            logits = _group_logits(q_row, stride_qh, stride_qd, rows, stride_cd, live, head_dim, GROUP, GROUP_PAD,
                                   BLOCK_D, D_CHUNK) * scale
        logits = tl.where(live[None, :], logits, float("-inf"))  # [GROUP_PAD, BLOCK_W]
        tl.store(logit_rows + offs_w[None, :], logits, mask=real_head & (offs_w < max_windows)[None, :])
        new_max = tl.maximum(run_max, tl.max(logits, axis=1))
        safe = tl.where(new_max == float("-inf"), 0.0, new_max)  # nothing seen yet: no rescale
        run_sum = run_sum * tl.exp(run_max - safe) + tl.sum(tl.exp(logits - safe[:, None]), axis=1)
        run_max = new_max
    out = ((batch * tl.num_programs(1) + kv_head) * num_splits + split).to(tl.int64) * GROUP_PAD + offs_g
    tl.store(max_ptr + out, run_max)
    tl.store(sum_ptr + out, run_sum)


@triton.jit
def _pool_kernel(
    lengths_ptr,
    max_ptr, sum_ptr,  # the split partials of _lse_kernel
    logits_ptr,  # [B, Hkv, GROUP, W] fp32: _lse_kernel's scaled logits
    out_ptr,  # [B, Hkv, NB_max] fp32 S_cmp: 0 for a block with no complete window, -inf past the context
    max_windows, max_blocks, num_splits,
    stride_ob, stride_oh, stride_on,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    WINDOW: tl.constexpr, STRIDE: tl.constexpr, BLOCK: tl.constexpr,
    SPLITS_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    batch = tl.program_id(2)
    length = tl.load(lengths_ptr + batch).to(tl.int32)
    seen = _complete_windows(length, WINDOW, STRIDE)
    num_blocks = (length + BLOCK - 1) // BLOCK
    # each head's log-sum-exp over its row's complete windows, from the split partials
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_g = tl.arange(0, GROUP_PAD)
    part = ((batch * tl.num_programs(1) + kv_head) * num_splits + offs_s[:, None]).to(tl.int64) * GROUP_PAD
    live_s = (offs_s < num_splits)[:, None]
    part_max = tl.load(max_ptr + part + offs_g[None, :], mask=live_s, other=float("-inf"))  # [SPLITS_PAD, G_PAD]
    part_sum = tl.load(sum_ptr + part + offs_g[None, :], mask=live_s, other=0.0)
    top = tl.max(part_max, axis=0)
    top = tl.where(top == float("-inf"), 0.0, top)
    total = tl.sum(part_sum * tl.exp(part_max - top[None, :]), axis=0)  # [G_PAD]; 0: no complete window
    lse = top + tl.log(tl.maximum(total, 1e-30))  # (a row without windows scores none of them)
    real_head = (offs_g < GROUP)[:, None]

    logit_rows = logits_ptr + ((batch * tl.num_programs(1) + kv_head).to(tl.int64) * GROUP
                               + offs_g[:, None]) * max_windows  # [GROUP_PAD, 1]: rows of the real heads
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    in_context = offs_n < num_blocks
    best = tl.full((BLOCK_N,), float("-inf"), tl.float32)
    for j in tl.static_range(BLOCK // STRIDE + 1):  # windows 4k - 1 .. 4k + 3 overlap block k
        offs_w = offs_n * (BLOCK // STRIDE) - 1 + j
        live = (offs_w >= 0) & (offs_w < seen) & (offs_w < max_windows) & in_context
        logits = tl.load(logit_rows + offs_w[None, :], mask=real_head & live[None, :], other=0.0)  # [G_PAD, BLOCK_N]
        probs = tl.where(real_head & live[None, :], tl.exp(logits - lse[:, None]), 0.0)
        best = tl.maximum(best, tl.where(live, tl.sum(probs, axis=0), float("-inf")))
    best = tl.where(best == float("-inf"), 0.0, best)
    out = out_ptr + batch.to(tl.int64) * stride_ob + kv_head.to(tl.int64) * stride_oh + offs_n * stride_on
    tl.store(out, tl.where(in_context, best, float("-inf")), mask=offs_n < max_blocks)
