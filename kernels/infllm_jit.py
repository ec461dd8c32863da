"""Triton kernels for InfLLM's selection (arXiv 2402.04617; prr.selectors.infllm): the decode
token's live block mean, the per-step window work + finalising, and the block scores. Launchers
with checks live in `prr.kernels.infllm`; the torch definition is `InfLLMSelector`'s own ops
(`_provisional`, `_add_window_attention`, `_finalise`, `head_scores` + `Selector.select`'s
reduce), which the tests compare against.

RoPE here is prr's (HF rotate_half layout): rotating x [D] by angle θ_j = p · inv_freq[j mod D/2]
is x·cos θ + turned(x)·sin θ with turned(x) = (−x[D/2:], x[:D/2]); undoing it uses −sin. A
[*, D] tile's turned copy is a second load of the same rows at (d + D/2) mod D (an L1 hit), so
every rotation is elementwise, in the order of `prr.selectors.infllm.rotate`.
Heads g < GROUP of KV head h are query heads h·GROUP + g.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .pdl import pdl_prologue


@triton.jit
def _turned(x, x_swapped, offs_d, HALF: tl.constexpr):
    """turned(x) = (−x[D/2:], x[:D/2]) from x's rows read at (d + D/2) mod D: [..., D]."""
    return tl.where(offs_d < HALF, -x_swapped, x_swapped)


@triton.jit
def _unrotated_halves(row_ptr, tokens, live, offs_h, stride_kt, stride_kd, inv_freq_ptr,
                      HALF: tl.constexpr, UNROTATE: tl.constexpr):
    """Keys of `tokens` [T] (lanes not `live` read nothing: 0) -> their two halves ([T, D/2] fp32
    each: d < D/2, d >= D/2), with the model's rotation at each token's position undone when
    UNROTATE (position_agnostic scoring). The angles repeat over the halves: one cos and one sin
    per (token, frequency)."""
    rows = row_ptr + tokens[:, None].to(tl.int64) * stride_kt
    x1 = tl.load(rows + offs_h[None, :] * stride_kd, mask=live[:, None], other=0.0).to(tl.float32)
    x2 = tl.load(rows + (offs_h + HALF)[None, :] * stride_kd, mask=live[:, None], other=0.0).to(tl.float32)
    if UNROTATE:
        angles = tokens.to(tl.float32)[:, None] * tl.load(inv_freq_ptr + offs_h)[None, :]  # [T, D/2]
        cos, minus_sin = tl.cos(angles), -tl.sin(angles)
        # x·cos + turned(x)·(−sin), turned(x) = (−x2, x1): the order of prr.selectors.infllm.rotate
        x1, x2 = x1 * cos + (-x2) * minus_sin, x2 * cos + x1 * minus_sin
    return x1, x2


@triton.jit
def _infllm_live_kernel(
    k_ptr,  # [B, Hkv, T_max, D] the layer's key cache (post-RoPE)
    positions_ptr,  # [B] int32/int64: the decode token's position in each row
    inv_freq_ptr,  # [D/2] fp32 RoPE frequencies (read when UNROTATE)
    live_ptr,  # [B, Hkv, NB_max, D] fp32 `infllm_live`, updated in place
    max_blocks,  # NB_max
    stride_kb, stride_kh, stride_kt, stride_kd,
    stride_lb, stride_lh, stride_ln, stride_ld,
    HEAD_DIM: tl.constexpr,  # D, a power of two
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block, a power of two
    UNROTATE: tl.constexpr,  # position_agnostic: the mean of the keys before RoPE
    PDL: tl.constexpr,
):
    """The block of positions[b] gets the mean of its live keys (positions <= positions[b]):
    `InfLLMSelector.append_metadata`. grid: (Hkv, B)."""
    pdl_prologue(PDL)
    kv_head = tl.program_id(0)
    batch = tl.program_id(1)
    HALF: tl.constexpr = HEAD_DIM // 2
    position = tl.load(positions_ptr + batch).to(tl.int64)
    block = position // BLOCK_SIZE
    # Out-of-range positions are the caller's error; they write nothing.
    d_limit = tl.where(position >= 0, tl.where(block < max_blocks, HEAD_DIM, 0), 0)
    tokens = block * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    # (Scalar conditions become lane limits: the CPU interpreter mishandles scalar & tensor masks.)
    live = tokens <= tl.where(d_limit > 0, position, -1)
    offs_h = tl.arange(0, HALF)
    row = k_ptr + batch.to(tl.int64) * stride_kb + kv_head.to(tl.int64) * stride_kh
    x1, x2 = _unrotated_halves(row, tokens, live, offs_h, stride_kt, stride_kd, inv_freq_ptr, HALF, UNROTATE)
    count = tl.maximum(position - block * BLOCK_SIZE + 1, 1).to(tl.float32)
    out = live_ptr + batch.to(tl.int64) * stride_lb + kv_head.to(tl.int64) * stride_lh + block * stride_ln
    tl.store(out + offs_h * stride_ld, tl.sum(x1, axis=0) / count, mask=offs_h < d_limit)  # [D/2] each
    tl.store(out + (offs_h + HALF) * stride_ld, tl.sum(x2, axis=0) / count, mask=offs_h < d_limit)


@triton.jit
def _top_tokens(scores, offs_s, R: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """scores [S] fp32 -> bool [S]: the R largest (ties towards the lower token index)."""
    chosen = offs_s < 0
    for _ in tl.static_range(R):
        left = tl.where(chosen, float("-inf"), scores)
        best = tl.max(left, axis=0)
        first = tl.min(tl.where((left == best) & ~chosen, offs_s, BLOCK_SIZE), axis=0)
        chosen = chosen | (offs_s == first)
    return chosen


@triton.jit
def _window_logits(q, k_row, chunk, position, num_blocks, sqrt_d, offs_d, stride_kt, stride_kd,
                   BLOCK_SIZE: tl.constexpr, SINK_BLOCKS: tl.constexpr, WINDOW_BLOCKS: tl.constexpr,
                   FORCED_CHUNK: tl.constexpr, NATIVE_DOT: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    """Chunk `chunk` of a query's forced tokens (sinks, then the window: slots of S tokens)
    -> (logits [DOT_PAD, FORCED_CHUNK] q·k / sqrt(D), -inf where not attended; window [FORCED_CHUNK]
    bool: attended window tokens (their probabilities are added); their block ids and offsets)."""
    j = chunk * FORCED_CHUNK + tl.arange(0, FORCED_CHUNK)
    slot = j // BLOCK_SIZE
    within = j % BLOCK_SIZE
    block = tl.where(slot < SINK_BLOCKS, slot.to(tl.int64), num_blocks - WINDOW_BLOCKS + (slot - SINK_BLOCKS))
    token = block * BLOCK_SIZE + within
    valid = (slot < SINK_BLOCKS + WINDOW_BLOCKS) & (block >= 0) & (token <= position)
    valid = valid & ((slot >= SINK_BLOCKS) | (block < num_blocks - WINDOW_BLOCKS))  # a sink in the window: once
    k = tl.load(k_row + token[:, None] * stride_kt + offs_d[None, :] * stride_kd, mask=valid[:, None],
                other=0.0)  # [FORCED_CHUNK, D]
    if NATIVE_DOT:
        logits = tl.dot(q, tl.trans(k))
    else:
        logits = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision=INPUT_PRECISION)
    logits = tl.where(valid[None, :], logits / sqrt_d, float("-inf"))
    return logits, valid & (slot >= SINK_BLOCKS), tl.maximum(block, 0), within


@triton.jit
def _infllm_step_kernel(
    q_ptr,  # [B, Hq, D] post-RoPE query at position lengths[b] - 1 (Hq = Hkv * GROUP)
    k_ptr,  # [B, Hkv, T_max, D] the layer's key cache (post-RoPE)
    lengths_ptr,  # [B] int32/int64 tokens of each row's context (this token included)
    inv_freq_ptr,  # [D/2] fp32 (read when UNROTATE)
    window_ptr,  # [B, Hkv, NB_max, GROUP, S] fp32 `infllm_window` (WINDOW_ATTENTION), updated in place
    repr_ptr,  # [B, Hkv, NB_max, GROUP, D] fp32 `infllm_repr`, the finalised block written
    finalised_ptr,  # [B] int64 `infllm_finalised`: blocks [0, n) are final; advanced by the last program
    scored_ptr,  # [B] int64 `infllm_scored` (WINDOW_ATTENTION): queries below it were added
    arrivals_ptr,  # [B] int32 zero on entry, re-armed to zero on exit
    num_kv_heads,  # Hkv
    sqrt_d,  # sqrt(D): the window logits are q·k / sqrt(D), as the torch path divides
    stride_qb, stride_qh, stride_qd,
    stride_kb, stride_kh, stride_kt, stride_kd,
    stride_wb, stride_wh, stride_wn, stride_wg, stride_ws,
    stride_rb, stride_rh, stride_rn, stride_rg, stride_rd,
    GROUP: tl.constexpr,  # G = Hq / Hkv
    DOT_PAD: tl.constexpr,  # rows of the window dot's q tile: a power of two >= G (>= 16 on a GPU)
    HEAD_DIM: tl.constexpr,  # D, a power of two
    BLOCK_SIZE: tl.constexpr,  # S, a power of two
    SINK_BLOCKS: tl.constexpr,  # Ks
    WINDOW_BLOCKS: tl.constexpr,  # W = local_blocks + force_newest (>= 1 with WINDOW_ATTENTION)
    FORCED_CHUNK: tl.constexpr,  # forced tokens per window dot (a power of two >= 16)
    FORCED_CHUNKS: tl.constexpr,  # cdiv((Ks + W) * S, FORCED_CHUNK)
    R: tl.constexpr,  # representatives per block: min(r, S)
    WINDOW_ATTENTION: tl.constexpr,  # representatives_from=window_attention; else one_query
    UNROTATE: tl.constexpr,  # position_agnostic: representatives are means of pre-RoPE keys
    LAYER_SUM: tl.constexpr,  # one_query with per_head=false: token scores summed over every KV head
    NATIVE_DOT: tl.constexpr,  # q and K in their 16-bit type for the window dot; else fp32 operands
    INPUT_PRECISION: tl.constexpr,  # of the fp32 dot: "ieee" (fp32 data) or "tf32" (16-bit data: exact)
    PDL: tl.constexpr,
):
    """One (row, KV head) of InfLLM's per-step metadata work (`InfLLMSelector.head_scores`'s
    `_add_window_attention` then `_finalise` of one block):
    1. WINDOW_ATTENTION, when the query is fresh (position >= scored[b]): the softmax of
       q·k / sqrt(D) over the forced blocks' tokens (sinks + window, a sink inside the window
       once), per query head, added into the window tokens' summed probabilities;
    2. the oldest block not final, if it has left the window (block < min(length // S, nb − W)):
       per query head, the mean of its R tokens of largest summed probability (one_query: of
       largest Σ_g q_g·k under this query, post-RoPE, summed over every KV head with LAYER_SUM,
       the same for the whole group), pre-RoPE with UNROTATE, written into repr.
    The last program of a row to arrive advances scored[b] and finalised[b] (which every
    program read before arriving). grid: (Hkv, B)."""
    pdl_prologue(PDL)
    kv_head = tl.program_id(0)
    batch = tl.program_id(1)
    HALF: tl.constexpr = HEAD_DIM // 2
    length = tl.load(lengths_ptr + batch).to(tl.int64)
    position = length - 1
    num_blocks = (length + BLOCK_SIZE - 1) // BLOCK_SIZE
    done = tl.load(finalised_ptr + batch)
    target = tl.minimum(length // BLOCK_SIZE, num_blocks - WINDOW_BLOCKS)  # full blocks out of the window
    offs_d = tl.arange(0, HEAD_DIM)
    offs_s = tl.arange(0, BLOCK_SIZE)
    k_row = k_ptr + batch.to(tl.int64) * stride_kb + kv_head.to(tl.int64) * stride_kh
    q_row = q_ptr + batch.to(tl.int64) * stride_qb + (kv_head * GROUP).to(tl.int64) * stride_qh
    scored = 0
    if WINDOW_ATTENTION:
        scored = tl.load(scored_ptr + batch)
        if position >= scored:
            offs_g = tl.arange(0, DOT_PAD)
            real_head = offs_g < GROUP
            q = tl.load(q_row + offs_g[:, None] * stride_qh + offs_d[None, :] * stride_qd, mask=real_head[:, None],
                        other=0.0)  # [DOT_PAD, D]
            if not NATIVE_DOT:
                q = q.to(tl.float32)  # (the interpreter's bf16 arithmetic is wrong)
            w_row = window_ptr + batch.to(tl.int64) * stride_wb + kv_head.to(tl.int64) * stride_wh
            # Two passes over the forced tokens in chunks: the softmax's max and sum, then the adds.
            run_max = tl.full([DOT_PAD], float("-inf"), tl.float32)
            run_sum = tl.zeros([DOT_PAD], tl.float32)
            for c in range(0, FORCED_CHUNKS):
                logits, _, _, _ = _window_logits(q, k_row, c, position, num_blocks, sqrt_d, offs_d, stride_kt, stride_kd,
                                                 BLOCK_SIZE, SINK_BLOCKS, WINDOW_BLOCKS, FORCED_CHUNK, NATIVE_DOT,
                                                 INPUT_PRECISION)
                new_max = tl.maximum(run_max, tl.max(logits, axis=1))
                safe = tl.where(new_max == float("-inf"), 0.0, new_max)
                run_sum = run_sum * tl.exp(run_max - safe) + tl.sum(tl.exp(logits - safe[:, None]), axis=1)
                run_max = new_max
            for c in range(0, FORCED_CHUNKS):
                logits, add, w_block, within = _window_logits(q, k_row, c, position, num_blocks, sqrt_d, offs_d,
                                                              stride_kt, stride_kd, BLOCK_SIZE, SINK_BLOCKS,
                                                              WINDOW_BLOCKS, FORCED_CHUNK, NATIVE_DOT, INPUT_PRECISION)
                probs = tl.exp(logits - run_max[:, None]) / run_sum[:, None]  # [DOT_PAD, FORCED_CHUNK]
                add = real_head[:, None] & add[None, :]
                w = w_row + w_block[None, :] * stride_wn + offs_g[:, None] * stride_wg + within[None, :] * stride_ws
                old = tl.load(w, mask=add, other=0.0)
                tl.store(w, old + probs, mask=add)

    if (done >= 0) & (done < target):  # finalise block `done` (it left the window: this step's add never touches it)
        tokens = done * BLOCK_SIZE + offs_s
        every = offs_s < BLOCK_SIZE
        offs_h = tl.arange(0, HALF)
        x1, x2 = _unrotated_halves(k_row, tokens, every, offs_h, stride_kt, stride_kd, inv_freq_ptr, HALF, UNROTATE)
        r = repr_ptr + batch.to(tl.int64) * stride_rb + kv_head.to(tl.int64) * stride_rh + done * stride_rn
        if WINDOW_ATTENTION:
            w = window_ptr + batch.to(tl.int64) * stride_wb + kv_head.to(tl.int64) * stride_wh + done * stride_wn
            for g in tl.static_range(GROUP):
                token_scores = tl.load(w + g * stride_wg + offs_s * stride_ws)  # [S]
                chosen = _top_tokens(token_scores, offs_s, R, BLOCK_SIZE)
                tl.store(r + g * stride_rg + offs_h * stride_rd, tl.sum(tl.where(chosen[:, None], x1, 0.0), axis=0) / R)
                tl.store(r + g * stride_rg + (offs_h + HALF) * stride_rd,
                         tl.sum(tl.where(chosen[:, None], x2, 0.0), axis=0) / R)
        else:
            # Σ_g q_g·k per token under this query, post-RoPE (this KV head, or every KV head).
            token_scores = tl.zeros([BLOCK_SIZE], tl.float32)
            first = kv_head
            heads = 1
            if LAYER_SUM:
                first = kv_head * 0  # (a tensor: the interpreter's loop counters are Python ints)
                heads = num_kv_heads
            for i in range(0, heads):
                hh = first + i
                rows = k_ptr + batch.to(tl.int64) * stride_kb + hh.to(tl.int64) * stride_kh
                post = tl.load(rows + tokens[:, None] * stride_kt + offs_d[None, :] * stride_kd).to(tl.float32)
                q_rows = q_ptr + batch.to(tl.int64) * stride_qb + (hh * GROUP).to(tl.int64) * stride_qh
                q_sum = tl.zeros([HEAD_DIM], tl.float32)
                for g in tl.static_range(GROUP):
                    q_sum += tl.load(q_rows + g * stride_qh + offs_d * stride_qd).to(tl.float32)
                token_scores += tl.sum(post * q_sum[None, :], axis=1)
            chosen = _top_tokens(token_scores, offs_s, R, BLOCK_SIZE)
            mean1 = tl.sum(tl.where(chosen[:, None], x1, 0.0), axis=0) / R  # [D/2] each
            mean2 = tl.sum(tl.where(chosen[:, None], x2, 0.0), axis=0) / R
            for g in tl.static_range(GROUP):
                tl.store(r + g * stride_rg + offs_h * stride_rd, mean1)
                tl.store(r + g * stride_rg + (offs_h + HALF) * stride_rd, mean2)

    tl.debug_barrier()  # every thread's stores precede the arrival (release covers them)
    arrived = tl.atomic_add(arrivals_ptr + batch, 1, sem="acq_rel", scope="gpu")
    if arrived == num_kv_heads - 1:  # every program of the row has read scored and finalised
        if WINDOW_ATTENTION:
            tl.store(scored_ptr + batch, tl.maximum(scored, length))
        tl.store(finalised_ptr + batch, tl.maximum(done, tl.minimum(done + 1, target)))
        tl.store(arrivals_ptr + batch, 0)  # re-arm for the next launch


@triton.jit
def _infllm_score_kernel(
    q_ptr,  # [B, Hq, D] post-RoPE query at position lengths[b] - 1
    lengths_ptr,  # [B] int32/int64 tokens of each row's context
    num_blocks_ptr,  # [B] int32/int64 blocks of each row's context
    finalised_ptr,  # [B] int64: blocks [0, n) read repr, the others live
    inv_freq_ptr,  # [D/2] fp32 (read when ROTATE)
    repr_ptr,  # [B, Hkv, NB_max, GROUP, D] fp32 representative key per query head
    live_ptr,  # [B, Hkv, NB_max, D] fp32 mean key of a block not final yet
    out_ptr,  # [B, Hkv, NB_max] fp32 GQA-reduced scores, -inf from num_blocks[b] on
    num_kv_heads,  # Hkv
    max_blocks,  # NB_max
    fixed_position,  # fp32: InfLLM's fixed query position (position_agnostic): window tokens − 1
    stride_qb, stride_qh, stride_qd,
    stride_rb, stride_rh, stride_rn, stride_rg, stride_rd,
    stride_lb, stride_lh, stride_ln, stride_ld,
    stride_ob, stride_oh, stride_on,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,  # a power of two >= GROUP
    HEAD_DIM: tl.constexpr,  # D, a power of two
    BLOCK_N: tl.constexpr,  # blocks per program (a power of two)
    ROTATE: tl.constexpr,  # position_agnostic: the query turned from its position to fixed_position
    LAYER_SUM: tl.constexpr,  # per_head=false: Σ over every query head of the layer, for every KV head
    SUM_GROUP: tl.constexpr,  # gqa_reduce: True sum, False max (of the per-head or layer scores)
    SHARED_REPR: tl.constexpr,  # one_query: repr is the same for a group's heads: read head 0's only
    PDL: tl.constexpr,
):
    """Scores of blocks [tile * BLOCK_N, (tile + 1) * BLOCK_N): `InfLLMSelector.head_scores`
    reduced over each GQA group as `Selector.select` does. grid: (cdiv(NB_max, BLOCK_N),
    1 if LAYER_SUM else Hkv, B)."""
    pdl_prologue(PDL)
    tile = tl.program_id(0)
    head_program = tl.program_id(1)
    batch = tl.program_id(2)
    HALF: tl.constexpr = HEAD_DIM // 2
    length = tl.load(lengths_ptr + batch).to(tl.int64)
    num_blocks = tl.minimum(tl.load(num_blocks_ptr + batch).to(tl.int64), max_blocks)
    done = tl.load(finalised_ptr + batch)
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    in_context = offs_n < num_blocks
    final = in_context & (offs_n < done)
    not_final = in_context & (offs_n >= done)
    any_live = (tile * BLOCK_N + BLOCK_N > done) & (tile * BLOCK_N < num_blocks)
    offs_g = tl.arange(0, GROUP_PAD)
    real_head = offs_g < GROUP
    offs_d = tl.arange(0, HEAD_DIM)
    swapped = (offs_d + HALF) % HEAD_DIM
    if ROTATE:  # rotate(rotate(q, position, −1), fixed_position, +1), as the torch path
        freq = tl.load(inv_freq_ptr + offs_d % HALF)
        back = (length - 1).to(tl.float32) * freq
        fixed = fixed_position * freq
        cos_b, sin_b = tl.cos(back), tl.sin(back)
        cos_f, sin_f = tl.cos(fixed), tl.sin(fixed)
    first = head_program
    heads = 1
    if LAYER_SUM:
        first = head_program * 0  # (a tensor: the interpreter's loop counters are Python ints)
        heads = num_kv_heads
    total = tl.zeros([BLOCK_N], tl.float32)
    for i in range(0, heads):
        kv_head = first + i
        q_rows = q_ptr + batch.to(tl.int64) * stride_qb + (kv_head * GROUP + offs_g).to(tl.int64)[:, None] * stride_qh
        q = tl.load(q_rows + offs_d[None, :] * stride_qd, mask=real_head[:, None], other=0.0).to(tl.float32)
        if ROTATE:
            q_sw = tl.load(q_rows + swapped[None, :] * stride_qd, mask=real_head[:, None], other=0.0).to(tl.float32)
            y = q * cos_b[None, :] + _turned(q, q_sw, offs_d[None, :], HALF) * (-sin_b[None, :])
            # y at (d + D/2) mod D: the angles repeat every D/2, turned(q) there is (q[:D/2], −q[D/2:])
            y_sw = q_sw * cos_b[None, :] + tl.where(offs_d[None, :] < HALF, q, -q) * (-sin_b[None, :])
            q = y * cos_f[None, :] + _turned(y, y_sw, offs_d[None, :], HALF) * sin_f[None, :]
        # q: [GROUP_PAD, D] fp32, rows >= GROUP are 0
        r_row = repr_ptr + batch.to(tl.int64) * stride_rb + kv_head.to(tl.int64) * stride_rh
        r_row += offs_n[:, None, None].to(tl.int64) * stride_rn  # [BLOCK_N, 1, 1]
        if SHARED_REPR:
            rep = tl.load(r_row + offs_d[None, None, :] * stride_rd, mask=final[:, None, None], other=0.0)  # [N, 1, D]
        else:
            rep = tl.load(r_row + offs_g[None, :, None] * stride_rg + offs_d[None, None, :] * stride_rd,
                          mask=final[:, None, None] & real_head[None, :, None], other=0.0)  # [N, G, D]
        per_head = tl.sum(rep * q[None, :, :], axis=2)  # [BLOCK_N, GROUP_PAD]
        if any_live:
            l_row = live_ptr + batch.to(tl.int64) * stride_lb + kv_head.to(tl.int64) * stride_lh
            live = tl.load(l_row + offs_n[:, None].to(tl.int64) * stride_ln + offs_d[None, :] * stride_ld,
                           mask=not_final[:, None], other=0.0)  # [BLOCK_N, D]
            per_head = tl.where(final[:, None], per_head, tl.sum(live[:, None, :] * q[None, :, :], axis=2))
        if LAYER_SUM:
            total += tl.sum(tl.where(real_head[None, :], per_head, 0.0), axis=1)
        else:
            if SUM_GROUP:
                reduced = tl.sum(tl.where(real_head[None, :], per_head, 0.0), axis=1)
            else:
                reduced = tl.max(tl.where(real_head[None, :], per_head, float("-inf")), axis=1)
            out = out_ptr + batch.to(tl.int64) * stride_ob + kv_head.to(tl.int64) * stride_oh
            tl.store(out + offs_n * stride_on, tl.where(in_context, reduced, float("-inf")), mask=offs_n < max_blocks)
    if LAYER_SUM:
        # every query head scores `total`; the group's reduction as Selector.select takes it
        reduced = total
        if SUM_GROUP:
            for _ in tl.static_range(GROUP - 1):
                reduced += total
        reduced = tl.where(in_context, reduced, float("-inf"))
        for i in range(0, num_kv_heads):
            out = out_ptr + batch.to(tl.int64) * stride_ob + (first + i).to(tl.int64) * stride_oh
            tl.store(out + offs_n * stride_on, reduced, mask=offs_n < max_blocks)
