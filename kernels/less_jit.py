"""Triton kernels for LESS (prr.selectors.less): the compensation (the unselected blocks'
estimated attention state from the feature summaries), optionally merged with the attention
over A in the same launch (`_less_compensate_kernel`), and the decode token's update of those
summaries and of Quest's key max / min (`_less_append_kernel`). Launchers with checks live in
`prr.kernels.less`, the torch reference in `prr.kernels.reference_less`.

Per (row, KV head), with φ's log-features of the query ℓ_gj (random features:
ℓ_gj = x_g·w_j − ‖x_g‖²/2 − ½ log m, x_g = √scale · q_g; or given: a trained map), totals
S_tot [m, D], s_tot [m] at offsets c_tot [m], block summaries S_b, s_b at offsets c_b, and the
selected blocks A:

    r_j = exp(c_bj − c_tot_j)                          (each summary at the totals' offset, ≤ 1)
    rest_s_j = max(s_tot_j − Σ_{b∈A} r_bj s_bj, 0),    rest_S_j = S_tot_j − Σ_{b∈A} r_bj S_bj
    u_gj = exp(ℓ_gj + c_tot_j − top_g),                top_g = max_j (ℓ_gj + c_tot_j)
    mass_g = Σ_j u_gj rest_s_j,  total_g = Σ_j u_gj s_tot_j,  num_g = Σ_j u_gj rest_S_j

One launch, one program per (D chunk, KV head, row): every program walks all m features in
chunks (top_g as a running max: the chunks' sums are rescaled when it grows, as in online
softmax), gathers A's summaries for its D columns only, and so holds mass_g, total_g and its
columns of num_g with no cross-program reduction. The state is out = num/mass and
lse = top + log mass + scale·q·centre where the compensation is used (some block of the context
unselected, mass > MIN_RELATIVE_MASS · total), else out = 0, lse = −inf. With MERGE the program
then merges it with the sparse attention's split partials over A (log-sum-exp, the definition of
prr.attention_state.merge_many then merge) and writes the layer's output in its dtype: no merge
launch, no fp32 round trip, no cast.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .pdl import pdl_prologue
from .quest_jit import _quest_update_one


@triton.jit
def _less_compensate_kernel(
    q_ptr,  # [B, Hkv, G, D] fp16/bf16/fp32 query (post-RoPE)
    qlog_ptr,  # [B, Hkv, G, m] fp32 given log-features (LOGITS_GIVEN), else unused
    w_ptr,  # [Hkv, m, D] fp32 random-feature directions (unused with LOGITS_GIVEN)
    ids_ptr,  # [B, Hkv, C] int32 selected block ids (entries >= count are padding)
    counts_ptr,  # [B, Hkv] int32
    lengths_ptr,  # [B] int32/int64 tokens of each row's context
    big_ptr,  # [B, Hkv, NB_max, m, D] S_b (fp32 or bf16)
    small_ptr,  # [B, Hkv, NB_max, m] s_b (fp32 or bf16)
    offset_ptr,  # [B, Hkv, NB_max, m] fp32 c_b
    big_tot_ptr,  # [B, Hkv, m, D] fp32 S_tot
    small_tot_ptr,  # [B, Hkv, m] fp32 s_tot
    offset_tot_ptr,  # [B, Hkv, m] fp32 c_tot
    center_ptr,  # [B, Hkv, D] fp32 key centre c (scale·q·c is exact, added to lse)
    part_out_ptr,  # MERGE: [B, Hkv, G, S, D] fp32 the attention over A, S split partials
    part_lse_ptr,  # MERGE: [B, Hkv, G, S] fp32 their lse
    out_ptr,  # [B, Hkv, G, D] out: the state (fp32), with MERGE the merged output (any float dtype)
    lse_ptr,  # [B, Hkv, G] fp32 out: its lse (D chunk 0 writes it)
    capacity, num_splits, block_size, scale, sqrt_scale, half_log_m, min_relative_mass,
    stride_qb, stride_qh, stride_qg, stride_qd,
    stride_qlb, stride_qlh, stride_qlg, stride_qlm,
    stride_wh, stride_wm, stride_wd,
    stride_ib, stride_ih, stride_ic,
    stride_cb, stride_ch,
    stride_Sb, stride_Sh, stride_Sn, stride_Sm, stride_Sd,
    stride_sb, stride_sh, stride_sn, stride_sm,
    stride_ob, stride_oh, stride_on, stride_om,
    stride_Tb, stride_Th, stride_Tm, stride_Td,
    stride_tb, stride_th, stride_tm,
    stride_ub, stride_uh, stride_um,
    stride_eb, stride_eh, stride_ed,
    stride_pob, stride_poh, stride_pog, stride_pos, stride_pod,
    stride_plb, stride_plh, stride_plg, stride_pls,
    stride_rb, stride_rh, stride_rg, stride_rd,
    stride_lb, stride_lh, stride_lg,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,  # query heads per KV head; padded to >= 16 (tl.dot's M)
    HEAD_DIM: tl.constexpr,
    NUM_FEATURES: tl.constexpr,  # m
    M_BLOCK: tl.constexpr,  # features per chunk (a power of two, >= 16 on a GPU: tl.dot's N)
    D_BLOCK: tl.constexpr,  # columns of S per program (a power of two dividing HEAD_DIM)
    C_BLOCK: tl.constexpr,  # selected blocks gathered at once
    LOGITS_GIVEN: tl.constexpr,
    MERGE: tl.constexpr,
    SPLITS_PAD: tl.constexpr,  # MERGE: S rounded up to a power of two
    PDL: tl.constexpr,
):
    pdl_prologue(PDL)
    # grid: (HEAD_DIM // D_BLOCK, Hkv, B)
    d_chunk = tl.program_id(0)
    kv_head = tl.program_id(1).to(tl.int64)
    batch = tl.program_id(2).to(tl.int64)
    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    real_head = offs_g < GROUP
    q = tl.load(q_ptr + batch * stride_qb + kv_head * stride_qh + offs_g[:, None] * stride_qg
                + offs_d[None, :] * stride_qd, mask=real_head[:, None], other=0.0).to(tl.float32)
    x = q * sqrt_scale  # [GROUP_PAD, D]
    half_sq = 0.5 * tl.sum(x * x, axis=1)  # [GROUP_PAD]
    offs_dc = d_chunk * D_BLOCK + tl.arange(0, D_BLOCK)
    count = tl.load(counts_ptr + batch * stride_cb + kv_head * stride_ch)
    n_selected = tl.minimum(count, capacity)
    id_row = ids_ptr + batch * stride_ib + kv_head * stride_ih
    big_row = big_ptr + batch * stride_Sb + kv_head * stride_Sh
    small_row = small_ptr + batch * stride_sb + kv_head * stride_sh
    off_row = offset_ptr + batch * stride_ob + kv_head * stride_oh
    tot_at = batch * stride_ub + kv_head * stride_uh

    top = tl.full([GROUP_PAD], float("-inf"), tl.float32)  # running max of ℓ + c_tot
    mass = tl.zeros([GROUP_PAD], tl.float32)  # in units of exp(top)
    total = tl.zeros([GROUP_PAD], tl.float32)
    num = tl.zeros([GROUP_PAD, D_BLOCK], tl.float32)
    for f0 in tl.static_range(0, NUM_FEATURES, M_BLOCK):
        offs_m = f0 + tl.arange(0, M_BLOCK)
        live_m = offs_m < NUM_FEATURES
        if LOGITS_GIVEN:
            logits = tl.load(qlog_ptr + batch * stride_qlb + kv_head * stride_qlh + offs_g[:, None] * stride_qlg
                             + offs_m[None, :] * stride_qlm, mask=real_head[:, None] & live_m[None, :],
                             other=float("-inf"))
        else:
            w = tl.load(w_ptr + kv_head * stride_wh + offs_m[:, None] * stride_wm + offs_d[None, :] * stride_wd,
                        mask=live_m[:, None], other=0.0)  # [M_BLOCK, D] fp32
            logits = tl.dot(x, tl.trans(w), input_precision="ieee") - half_sq[:, None] - half_log_m
        c_tot = tl.load(offset_tot_ptr + tot_at + offs_m * stride_um, mask=live_m, other=float("-inf"))
        log_w = tl.where(real_head[:, None] & live_m[None, :], logits + c_tot[None, :], float("-inf"))
        c_tot_safe = tl.where(c_tot == float("-inf"), 0.0, c_tot)  # (empty totals: every summary is 0 too)
        # Σ over A of this chunk's summaries (this program's columns) at the totals' offsets.
        sel_small = tl.zeros([M_BLOCK], tl.float32)
        sel_big = tl.zeros([M_BLOCK, D_BLOCK], tl.float32)
        for c0 in range(0, n_selected, C_BLOCK):
            offs_c = c0 + tl.arange(0, C_BLOCK)
            live_c = offs_c < n_selected
            blocks = tl.load(id_row + offs_c * stride_ic, mask=live_c, other=0).to(tl.int64)  # [C_BLOCK]
            live = live_c[:, None] & live_m[None, :]
            at = blocks[:, None] * stride_on + offs_m[None, :] * stride_om
            c_b = tl.load(off_row + at, mask=live, other=float("-inf"))  # [C_BLOCK, M_BLOCK]
            rescale = tl.where(live, tl.exp(c_b - c_tot_safe[None, :]), 0.0)
            s_b = tl.load(small_row + blocks[:, None] * stride_sn + offs_m[None, :] * stride_sm, mask=live,
                          other=0.0).to(tl.float32)
            sel_small += tl.sum(s_b * rescale, axis=0)
            big_at = (blocks[:, None, None] * stride_Sn + offs_m[None, :, None] * stride_Sm
                      + offs_dc[None, None, :] * stride_Sd)
            big_b = tl.load(big_row + big_at, mask=live[:, :, None], other=0.0).to(tl.float32)
            sel_big += tl.sum(big_b * rescale[:, :, None], axis=0)  # [M_BLOCK, D_BLOCK]
        small_tot = tl.load(small_tot_ptr + batch * stride_tb + kv_head * stride_th + offs_m * stride_tm,
                            mask=live_m, other=0.0)
        big_tot = tl.load(big_tot_ptr + batch * stride_Tb + kv_head * stride_Th + offs_m[:, None] * stride_Tm
                          + offs_dc[None, :] * stride_Td, mask=live_m[:, None], other=0.0)  # [M_BLOCK, D_BLOCK]
        rest_small = tl.maximum(small_tot - sel_small, 0.0)
        rest_big = big_tot - sel_big
        new_top = tl.maximum(top, tl.max(log_w, axis=1))
        unit = tl.where(new_top == float("-inf"), 0.0, new_top)
        keep = tl.exp(top - unit)  # the sums so far, brought to the new unit (0 while empty)
        u = tl.exp(log_w - unit[:, None])  # [GROUP_PAD, M_BLOCK]; 0 past m and for padding heads
        mass = mass * keep + tl.sum(u * rest_small[None, :], axis=1)
        total = total * keep + tl.sum(u * small_tot[None, :], axis=1)
        num = num * keep[:, None] + tl.sum(u[:, :, None] * rest_big[None, :, :], axis=1)
        top = new_top

    center = tl.load(center_ptr + batch * stride_eb + kv_head * stride_eh + offs_d * stride_ed)
    exact = scale * tl.sum(q * center[None, :], axis=1)  # [GROUP_PAD]
    # Some block of the context is unselected iff A (distinct ids inside the context) is smaller.
    num_blocks = tl.cdiv(tl.load(lengths_ptr + batch).to(tl.int32), block_size)
    use = (count < num_blocks) & (mass > min_relative_mass * total)  # [GROUP_PAD]
    safe_mass = tl.where(use, mass, 1.0)
    out = tl.where(use[:, None], num / safe_mass[:, None], 0.0)  # [GROUP_PAD, D_BLOCK]
    lse = tl.where(use, top + tl.log(safe_mass) + exact, float("-inf"))
    if MERGE:  # ⊕ the split partials of the attention over A
        offs_s = tl.arange(0, SPLITS_PAD)
        live_s = real_head[:, None] & (offs_s < num_splits)[None, :]
        part_lse = tl.load(part_lse_ptr + batch * stride_plb + kv_head * stride_plh + offs_g[:, None] * stride_plg
                           + offs_s[None, :] * stride_pls, mask=live_s, other=float("-inf"))  # [GROUP_PAD, S]
        part_out = tl.load(part_out_ptr + batch * stride_pob + kv_head * stride_poh
                           + offs_g[:, None, None] * stride_pog + offs_s[None, :, None] * stride_pos
                           + offs_dc[None, None, :] * stride_pod, mask=live_s[:, :, None], other=0.0)
        high = tl.maximum(tl.max(part_lse, axis=1), lse)
        high = tl.where(high == float("-inf"), 0.0, high)  # nothing at all: weights 0, lse -inf
        w_parts = tl.exp(part_lse - high[:, None])  # [GROUP_PAD, S]
        w_comp = tl.exp(lse - high)
        weight = tl.sum(w_parts, axis=1) + w_comp
        merged = tl.sum(w_parts[:, :, None] * part_out, axis=1) + w_comp[:, None] * out
        out = merged / tl.where(weight > 0, weight, 1.0)[:, None]
        lse = high + tl.log(weight)
    tl.store(out_ptr + batch * stride_rb + kv_head * stride_rh + offs_g[:, None] * stride_rg
             + offs_dc[None, :] * stride_rd, out.to(out_ptr.dtype.element_ty), mask=real_head[:, None])
    if d_chunk == 0:
        tl.store(lse_ptr + batch * stride_lb + kv_head * stride_lh + offs_g * stride_lg, lse, mask=real_head)


@triton.jit
def _less_append_kernel(
    k_ptr,  # [B, Hkv, T_max, D] the layer's key cache (the token at positions[b] already written)
    v_ptr,  # [B, Hkv, T_max, D] value cache
    positions_ptr,  # [B] int32/int64: the appended token of each row
    w_ptr,  # [Hkv, m, D] fp32 random-feature directions
    center_ptr,  # [B, Hkv, D] fp32 key centre
    big_ptr,  # [B, Hkv, NB_max, m, D] S_b (fp32 or bf16), block positions[b] // BLOCK_SIZE rewritten
    small_ptr,  # [B, Hkv, NB_max, m] s_b, rewritten likewise
    offset_ptr,  # [B, Hkv, NB_max, m] fp32 c_b, rewritten likewise
    big_tot_ptr,  # [B, Hkv, m, D] fp32 S_tot, updated in place
    small_tot_ptr,  # [B, Hkv, m] fp32 s_tot
    offset_tot_ptr,  # [B, Hkv, m] fp32 c_tot
    key_max_ptr, key_min_ptr,  # QUEST: [B, Hkv, NB_max, D] Quest's metadata, updated in place
    num_features, max_blocks, sqrt_scale, half_log_m,
    stride_kb, stride_kh, stride_kt, stride_kd,
    stride_vb, stride_vh, stride_vt, stride_vd,
    stride_wh, stride_wm, stride_wd,
    stride_eb, stride_eh, stride_ed,
    stride_Sb, stride_Sh, stride_Sn, stride_Sm, stride_Sd,
    stride_sb, stride_sh, stride_sn, stride_sm,
    stride_ob, stride_oh, stride_on, stride_om,
    stride_Tb, stride_Th, stride_Tm, stride_Td,
    stride_tb, stride_th, stride_tm,
    stride_ub, stride_uh, stride_um,
    stride_xb, stride_xh, stride_xn, stride_xd,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    M_BLOCK: tl.constexpr,  # features per program (>= 16 on a GPU: a tl.dot's N and M)
    D_BLOCK: tl.constexpr,  # columns of K / V per step (>= 16 on a GPU: a tl.dot's K and N)
    QUEST: tl.constexpr,  # also Quest's key max / min of the block (feature chunk 0's programs)
    PDL: tl.constexpr,
):
    """One decode token per row: the running totals take it (at a running-max offset) and its
    block's summaries are recomputed from the block's live tokens, for M_BLOCK features, reading
    K and V D_BLOCK columns at a time (registers stay small at any block size)."""
    pdl_prologue(PDL)
    # grid: (cdiv(m, M_BLOCK), Hkv, B)
    chunk = tl.program_id(0)
    kv_head = tl.program_id(1).to(tl.int64)
    batch = tl.program_id(2).to(tl.int64)
    position = tl.load(positions_ptr + batch).to(tl.int64)
    block = position // BLOCK_SIZE
    if QUEST:
        if chunk == 0:
            offs_k = tl.arange(0, HEAD_DIM)
            # (a scalar condition as a lane limit: the CPU interpreter mishandles scalar & tensor masks)
            limit = tl.where(position >= 0, tl.where(block < max_blocks, HEAD_DIM, 0), 0)
            k_new = tl.load(k_ptr + batch * stride_kb + kv_head * stride_kh + position * stride_kt
                            + offs_k * stride_kd, mask=offs_k < limit, other=0.0).to(tl.float32)
            _quest_update_one(key_max_ptr, key_min_ptr, k_new, position, batch * stride_xb + kv_head * stride_xh,
                              max_blocks, HEAD_DIM, stride_xn, stride_xd, BLOCK_SIZE, HEAD_DIM)
    if block < max_blocks:  # positions outside the cache write nothing
        offs_t = tl.arange(0, BLOCK_SIZE)
        offs_m = chunk * M_BLOCK + tl.arange(0, M_BLOCK)
        live_m = offs_m < num_features
        tokens = block * BLOCK_SIZE + offs_t  # [BLOCK_SIZE]
        live_t = tokens <= position
        k_row = k_ptr + batch * stride_kb + kv_head * stride_kh
        v_row = v_ptr + batch * stride_vb + kv_head * stride_vh
        center_row = center_ptr + batch * stride_eb + kv_head * stride_eh
        w_row = w_ptr + kv_head * stride_wh
        logits = tl.zeros([BLOCK_SIZE, M_BLOCK], tl.float32)
        half_sq = tl.zeros([BLOCK_SIZE], tl.float32)
        for d0 in tl.static_range(0, HEAD_DIM, D_BLOCK):
            offs_d = d0 + tl.arange(0, D_BLOCK)
            keys = tl.load(k_row + tokens[:, None] * stride_kt + offs_d[None, :] * stride_kd, mask=live_t[:, None],
                           other=0.0).to(tl.float32)
            center = tl.load(center_row + offs_d * stride_ed)
            x = (keys - center[None, :]) * sqrt_scale  # [BLOCK_SIZE, D_BLOCK]
            w = tl.load(w_row + offs_m[:, None] * stride_wm + offs_d[None, :] * stride_wd, mask=live_m[:, None],
                        other=0.0)  # [M_BLOCK, D_BLOCK]
            logits += tl.dot(x, tl.trans(w), input_precision="ieee")
            half_sq += 0.5 * tl.sum(x * x, axis=1)
        logits = logits - half_sq[:, None] - half_log_m
        logits = tl.where(live_t[:, None], logits, float("-inf"))
        # The block's summaries from its live tokens, at their max (finite: the new token is live).
        c_block = tl.max(logits, axis=0)  # [M_BLOCK]
        weights = tl.exp(logits - c_block[None, :])  # [BLOCK_SIZE, M_BLOCK]; 0 for later tokens
        tl.store(offset_ptr + batch * stride_ob + kv_head * stride_oh + block * stride_on + offs_m * stride_om,
                 c_block, mask=live_m)
        tl.store(small_ptr + batch * stride_sb + kv_head * stride_sh + block * stride_sn + offs_m * stride_sm,
                 tl.sum(weights, axis=0).to(small_ptr.dtype.element_ty), mask=live_m)
        # The totals take the new token: rescale to the new running max, then add it.
        is_new = (tokens == position)[:, None]
        new_logit = tl.max(tl.where(is_new, logits, float("-inf")), axis=0)  # [M_BLOCK]
        tot = batch * stride_ub + kv_head * stride_uh + offs_m * stride_um
        c_old = tl.load(offset_tot_ptr + tot, mask=live_m, other=0.0)
        c_new = tl.maximum(c_old, new_logit)
        keep = tl.exp(c_old - c_new)  # 0 while the totals are empty (c_old = -inf)
        add = tl.exp(new_logit - c_new)
        small_at = small_tot_ptr + batch * stride_tb + kv_head * stride_th + offs_m * stride_tm
        tl.store(small_at, tl.load(small_at, mask=live_m, other=0.0) * keep + add, mask=live_m)
        tl.store(offset_tot_ptr + tot, c_new, mask=live_m)
        big_row = big_ptr + batch * stride_Sb + kv_head * stride_Sh + block * stride_Sn + offs_m[:, None] * stride_Sm
        tot_row = big_tot_ptr + batch * stride_Tb + kv_head * stride_Th + offs_m[:, None] * stride_Tm
        for d0 in tl.static_range(0, HEAD_DIM, D_BLOCK):
            offs_d = d0 + tl.arange(0, D_BLOCK)
            values = tl.load(v_row + tokens[:, None] * stride_vt + offs_d[None, :] * stride_vd, mask=live_t[:, None],
                             other=0.0).to(tl.float32)  # [BLOCK_SIZE, D_BLOCK]
            big = tl.dot(tl.trans(weights), values, input_precision="ieee")  # [M_BLOCK, D_BLOCK]
            tl.store(big_row + offs_d[None, :] * stride_Sd, big.to(big_ptr.dtype.element_ty), mask=live_m[:, None])
            new_value = tl.load(v_row + position * stride_vt + offs_d * stride_vd).to(tl.float32)  # [D_BLOCK]
            big_tot = tl.load(tot_row + offs_d[None, :] * stride_Td, mask=live_m[:, None], other=0.0)
            tl.store(tot_row + offs_d[None, :] * stride_Td, big_tot * keep[:, None] + add[:, None] * new_value[None, :],
                     mask=live_m[:, None])


@triton.jit
def _less_append_incremental_kernel(
    k_ptr,  # [B, Hkv, T_max, D] the layer's key cache (the token at positions[b] already written)
    v_ptr,  # [B, Hkv, T_max, D] value cache
    positions_ptr,  # [B] int32/int64: the appended token of each row
    w_ptr,  # [Hkv, m, D] fp32 random-feature directions
    center_ptr,  # [B, Hkv, D] fp32 key centre
    big_ptr,  # [B, Hkv, NB_max, m, D] S_b (fp32 or bf16), block positions[b] // BLOCK_SIZE written
    small_ptr,  # [B, Hkv, NB_max, m] s_b, written likewise
    offset_ptr,  # [B, Hkv, NB_max, m] fp32 c_b, read and written (the open block's running max)
    big_open_ptr,  # [B, Hkv, m, D] fp32: the open block's S_b unrounded, read and written
    small_open_ptr,  # [B, Hkv, m] fp32: its s_b unrounded
    big_tot_ptr,  # [B, Hkv, m, D] fp32 S_tot, updated in place
    small_tot_ptr,  # [B, Hkv, m] fp32 s_tot
    offset_tot_ptr,  # [B, Hkv, m] fp32 c_tot
    key_max_ptr, key_min_ptr,  # QUEST: [B, Hkv, NB_max, D] Quest's metadata, updated in place
    num_features, max_blocks, sqrt_scale, half_log_m,
    stride_kb, stride_kh, stride_kt, stride_kd,
    stride_vb, stride_vh, stride_vt, stride_vd,
    stride_wh, stride_wm, stride_wd,
    stride_eb, stride_eh, stride_ed,
    stride_Sb, stride_Sh, stride_Sn, stride_Sm, stride_Sd,
    stride_sb, stride_sh, stride_sn, stride_sm,
    stride_ob, stride_oh, stride_on, stride_om,
    stride_Pb, stride_Ph, stride_Pm, stride_Pd,
    stride_pb, stride_ph, stride_pm,
    stride_Tb, stride_Th, stride_Tm, stride_Td,
    stride_tb, stride_th, stride_tm,
    stride_ub, stride_uh, stride_um,
    stride_xb, stride_xh, stride_xn, stride_xd,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    M_BLOCK: tl.constexpr,  # features per program
    D_BLOCK: tl.constexpr,  # columns of w / V per step
    QUEST: tl.constexpr,  # also Quest's key max / min of the block (feature chunk 0's programs)
    PDL: tl.constexpr,
):
    """One decode token per row, O(m·D) whatever the block size: its block's summaries take the
    token as the totals do (rescaled to the running max c_b, then the token added; the first token
    of a block starts them afresh), accumulated in fp32 in the open-block slots and stored rounded
    to the summary dtype, so bf16 summaries round once, as the re-read (`_less_append_kernel`) does.
    Needs the open-block slots to hold the block's tokens before this one (update_metadata writes
    them; every decode append goes through here or the torch path, which writes them too)."""
    pdl_prologue(PDL)
    # grid: (cdiv(m, M_BLOCK), Hkv, B)
    chunk = tl.program_id(0)
    kv_head = tl.program_id(1).to(tl.int64)
    batch = tl.program_id(2).to(tl.int64)
    position = tl.load(positions_ptr + batch).to(tl.int64)
    block = position // BLOCK_SIZE
    k_row = k_ptr + batch * stride_kb + kv_head * stride_kh + position * stride_kt
    if QUEST:
        if chunk == 0:
            offs_k = tl.arange(0, HEAD_DIM)
            # (a scalar condition as a lane limit: the CPU interpreter mishandles scalar & tensor masks)
            limit = tl.where(position >= 0, tl.where(block < max_blocks, HEAD_DIM, 0), 0)
            k_new = tl.load(k_row + offs_k * stride_kd, mask=offs_k < limit, other=0.0).to(tl.float32)
            _quest_update_one(key_max_ptr, key_min_ptr, k_new, position, batch * stride_xb + kv_head * stride_xh,
                              max_blocks, HEAD_DIM, stride_xn, stride_xd, BLOCK_SIZE, HEAD_DIM)
    if block < max_blocks:  # positions outside the cache write nothing
        offs_m = chunk * M_BLOCK + tl.arange(0, M_BLOCK)
        live_m = offs_m < num_features
        center_row = center_ptr + batch * stride_eb + kv_head * stride_eh
        w_row = w_ptr + kv_head * stride_wh
        logits = tl.zeros([M_BLOCK], tl.float32)
        half_sq = tl.zeros([D_BLOCK], tl.float32)
        for d0 in tl.static_range(0, HEAD_DIM, D_BLOCK):
            offs_d = d0 + tl.arange(0, D_BLOCK)
            key = tl.load(k_row + offs_d * stride_kd).to(tl.float32)
            x = (key - tl.load(center_row + offs_d * stride_ed)) * sqrt_scale  # [D_BLOCK]
            w = tl.load(w_row + offs_m[:, None] * stride_wm + offs_d[None, :] * stride_wd, mask=live_m[:, None],
                        other=0.0)  # [M_BLOCK, D_BLOCK]
            logits += tl.sum(w * x[None, :], axis=1)
            half_sq += 0.5 * x * x
        new = logits - tl.sum(half_sq, axis=0) - half_log_m  # [M_BLOCK]: log φ of the token
        first = (position % BLOCK_SIZE) == 0  # a block starts from its first token: stale contents ignored
        at = batch * stride_ob + kv_head * stride_oh + block * stride_on + offs_m * stride_om
        c_old = tl.load(offset_ptr + at, mask=live_m, other=0.0)
        c_new = tl.where(first, new, tl.maximum(c_old, new))
        keep = tl.where(first, 0.0, tl.exp(c_old - c_new))
        add = tl.exp(new - c_new)
        open_at = small_open_ptr + batch * stride_pb + kv_head * stride_ph + offs_m * stride_pm
        s_old = tl.load(open_at, mask=live_m, other=0.0)
        s_new = tl.where(first, add, s_old * keep + add)
        # The totals take it too, at their own running max.
        tot = batch * stride_ub + kv_head * stride_uh + offs_m * stride_um
        t_old = tl.load(offset_tot_ptr + tot, mask=live_m, other=0.0)
        t_new = tl.maximum(t_old, new)
        t_keep = tl.exp(t_old - t_new)  # 0 while the totals are empty (t_old = -inf)
        t_add = tl.exp(new - t_new)
        small_tot_at = small_tot_ptr + batch * stride_tb + kv_head * stride_th + offs_m * stride_tm
        s_tot_old = tl.load(small_tot_at, mask=live_m, other=0.0)
        # [M_BLOCK] vectors are replicated across the program's threads (16 features, 128 threads) and
        # keep / add / t_keep / t_add feed every thread's [M_BLOCK, D_BLOCK] stores below: every
        # replica reads the old c_b, s_b, c_tot, s_tot before any thread overwrites them.
        tl.debug_barrier()
        tl.store(open_at, s_new, mask=live_m)
        tl.store(offset_ptr + at, c_new, mask=live_m)
        tl.store(small_ptr + batch * stride_sb + kv_head * stride_sh + block * stride_sn + offs_m * stride_sm,
                 s_new.to(small_ptr.dtype.element_ty), mask=live_m)
        tl.store(small_tot_at, s_tot_old * t_keep + t_add, mask=live_m)
        tl.store(offset_tot_ptr + tot, t_new, mask=live_m)
        v_row = v_ptr + batch * stride_vb + kv_head * stride_vh + position * stride_vt
        big_row = big_ptr + batch * stride_Sb + kv_head * stride_Sh + block * stride_Sn + offs_m[:, None] * stride_Sm
        open_row = big_open_ptr + batch * stride_Pb + kv_head * stride_Ph + offs_m[:, None] * stride_Pm
        tot_row = big_tot_ptr + batch * stride_Tb + kv_head * stride_Th + offs_m[:, None] * stride_Tm
        for d0 in tl.static_range(0, HEAD_DIM, D_BLOCK):
            offs_d = d0 + tl.arange(0, D_BLOCK)
            value = tl.load(v_row + offs_d * stride_vd).to(tl.float32)[None, :]  # [1, D_BLOCK]
            big_old = tl.load(open_row + offs_d[None, :] * stride_Pd, mask=live_m[:, None], other=0.0)
            big_new = tl.where(first, 0.0, big_old * keep[:, None]) + add[:, None] * value  # [M_BLOCK, D_BLOCK]
            tl.store(open_row + offs_d[None, :] * stride_Pd, big_new, mask=live_m[:, None])
            tl.store(big_row + offs_d[None, :] * stride_Sd, big_new.to(big_ptr.dtype.element_ty), mask=live_m[:, None])
            big_tot = tl.load(tot_row + offs_d[None, :] * stride_Td, mask=live_m[:, None], other=0.0)
            tl.store(tot_row + offs_d[None, :] * stride_Td, big_tot * t_keep[:, None] + t_add[:, None] * value,
                     mask=live_m[:, None])
