"""Triton kernels for LESS (prr.selectors.less): the compensation (the unselected blocks'
estimated attention state from the feature summaries) and, at the end, the decode token's
update of those summaries (`_less_append_kernel`). Launchers with checks live in
`prr.kernels.less`, the torch reference in `prr.kernels.reference_less`.

Per (row, KV head), with φ's log-features of the query ℓ_gj (random features:
ℓ_gj = x_g·w_j − ‖x_g‖²/2 − ½ log m, x_g = √scale · q_g; or given: a trained map), totals
S_tot [m, D], s_tot [m] at offsets c_tot [m], block summaries S_b, s_b at offsets c_b, and the
selected blocks A:

    r_j = exp(c_bj − c_tot_j)                          (each summary at the totals' offset, ≤ 1)
    rest_s_j = max(s_tot_j − Σ_{b∈A} r_bj s_bj, 0),    rest_S_j = S_tot_j − Σ_{b∈A} r_bj S_bj
    u_gj = exp(ℓ_gj + c_tot_j − top_g),                top_g = max_j (ℓ_gj + c_tot_j)
    mass_g = Σ_j u_gj rest_s_j,  total_g = Σ_j u_gj s_tot_j,  num_g = Σ_j u_gj rest_S_j

Two launches: `_less_partial_kernel` sums over the selected blocks and over one chunk of
features for one chunk of D (features are independent until the last sum, and every program
knows top_g, so the chunks' partial sums share one unit and merely add up); then
`_less_finish_kernel` adds the chunks in a fixed order, and writes out = num/mass and
lse = top + log mass + scale·q·centre where the compensation is used (some block of the
context unselected, mass > MIN_RELATIVE_MASS · total), else out = 0, lse = −inf.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .pdl import pdl_prologue


@triton.jit
def _query_log_features(
    q,  # [GROUP_PAD, HEAD_DIM] fp32, rows >= GROUP zero
    w_ptr, stride_wm, stride_wd, qlog_row, stride_qlg, stride_qlm, offs_g, feature0, num_features, sqrt_scale,
    half_log_m,
    GROUP: tl.constexpr, M_BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, LOGITS_GIVEN: tl.constexpr,
):
    """-> ℓ [GROUP_PAD, M_BLOCK] fp32 of features feature0 + [0, M_BLOCK) (−inf past m and for
    padding heads): random features from q and w, or loaded from the given logits."""
    offs_m = feature0 + tl.arange(0, M_BLOCK)
    live_m = offs_m < num_features
    live = (offs_g < GROUP)[:, None] & live_m[None, :]
    if LOGITS_GIVEN:
        logits = tl.load(qlog_row + offs_g[:, None] * stride_qlg + offs_m[None, :] * stride_qlm, mask=live,
                         other=float("-inf"))
    else:
        offs_d = tl.arange(0, HEAD_DIM)
        w = tl.load(w_ptr + offs_m[:, None] * stride_wm + offs_d[None, :] * stride_wd, mask=live_m[:, None],
                    other=0.0)  # [M_BLOCK, HEAD_DIM] fp32
        x = q * sqrt_scale
        dots = tl.sum(x[:, None, :] * w[None, :, :], axis=2)  # [GROUP_PAD, M_BLOCK]
        logits = dots - 0.5 * tl.sum(x * x, axis=1)[:, None] - half_log_m
        logits = tl.where(live, logits, float("-inf"))
    return logits


@triton.jit
def _less_partial_kernel(
    q_ptr,  # [B, Hkv, G, D] fp16/bf16/fp32 query (post-RoPE)
    qlog_ptr,  # [B, Hkv, G, m] fp32 given log-features (LOGITS_GIVEN), else unused
    w_ptr,  # [Hkv, m, D] fp32 random-feature directions (unused with LOGITS_GIVEN)
    ids_ptr,  # [B, Hkv, C] int32 selected block ids (entries >= count are padding)
    counts_ptr,  # [B, Hkv] int32
    big_ptr,  # [B, Hkv, NB_max, m, D] S_b (fp32 or bf16)
    small_ptr,  # [B, Hkv, NB_max, m] s_b (fp32 or bf16)
    offset_ptr,  # [B, Hkv, NB_max, m] fp32 c_b
    big_tot_ptr,  # [B, Hkv, m, D] fp32 S_tot
    small_tot_ptr,  # [B, Hkv, m] fp32 s_tot
    offset_tot_ptr,  # [B, Hkv, m] fp32 c_tot
    num_part_ptr,  # [B, Hkv, MC, G, D] fp32 out: Σ over this feature chunk of u · rest_S
    mass_part_ptr,  # [B, Hkv, MC, G] fp32 out (D chunk 0 writes it): Σ u · rest_s
    total_part_ptr,  # [B, Hkv, MC, G] fp32 out (D chunk 0): Σ u · s_tot
    top_ptr,  # [B, Hkv, G] fp32 out (program (0, 0) of each row writes it): top_g
    num_kv_heads, num_features, capacity, sqrt_scale, half_log_m,
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
    stride_nb, stride_nh, stride_nc, stride_ng, stride_nd,
    stride_mb, stride_mh, stride_mc, stride_mg,
    stride_pb, stride_ph, stride_pg,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    M_BLOCK: tl.constexpr,  # features per program (a power of two)
    D_BLOCK: tl.constexpr,  # columns of S per program (a power of two dividing HEAD_DIM)
    C_BLOCK: tl.constexpr,  # selected blocks gathered at a time
    LOGITS_GIVEN: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_prologue(PDL)
    # grid: (cdiv(m, M_BLOCK), HEAD_DIM // D_BLOCK, B * Hkv)
    chunk = tl.program_id(0)
    d_chunk = tl.program_id(1)
    row = tl.program_id(2)
    batch = (row // num_kv_heads).to(tl.int64)
    kv_head = (row % num_kv_heads).to(tl.int64)
    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    real_head = offs_g < GROUP
    q = tl.load(q_ptr + batch * stride_qb + kv_head * stride_qh + offs_g[:, None] * stride_qg
                + offs_d[None, :] * stride_qd, mask=real_head[:, None], other=0.0).to(tl.float32)
    qlog_row = qlog_ptr + batch * stride_qlb + kv_head * stride_qlh
    w_head = w_ptr + kv_head * stride_wh
    tot_row = offset_tot_ptr + batch * stride_ub + kv_head * stride_uh

    # top_g over every feature: each program derives it, so all chunks share exp(top_g) as unit.
    top = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    for f0 in range(0, num_features, M_BLOCK):
        logits = _query_log_features(q, w_head, stride_wm, stride_wd, qlog_row, stride_qlg, stride_qlm, offs_g, f0,
                                     num_features, sqrt_scale, half_log_m, GROUP, M_BLOCK, HEAD_DIM, LOGITS_GIVEN)
        offs_f = f0 + tl.arange(0, M_BLOCK)
        c_tot = tl.load(tot_row + offs_f * stride_um, mask=offs_f < num_features, other=float("-inf"))
        top = tl.maximum(top, tl.max(logits + c_tot[None, :], axis=1))
    top_safe = tl.where(top == float("-inf"), 0.0, top)

    feature0 = chunk * M_BLOCK
    offs_m = feature0 + tl.arange(0, M_BLOCK)
    live_m = offs_m < num_features
    logits = _query_log_features(q, w_head, stride_wm, stride_wd, qlog_row, stride_qlg, stride_qlm, offs_g,
                                 feature0, num_features, sqrt_scale, half_log_m, GROUP, M_BLOCK, HEAD_DIM,
                                 LOGITS_GIVEN)
    c_tot = tl.load(tot_row + offs_m * stride_um, mask=live_m, other=float("-inf"))  # [M_BLOCK]
    weights = tl.exp(logits + c_tot[None, :] - top_safe[:, None])  # [GROUP_PAD, M_BLOCK]; 0 past m
    c_tot_safe = tl.where(c_tot == float("-inf"), 0.0, c_tot)  # (empty totals: every summary is 0 too)

    # Σ over the selected blocks of the summaries at the totals' offsets.
    offs_dc = d_chunk * D_BLOCK + tl.arange(0, D_BLOCK)
    count = tl.load(counts_ptr + batch * stride_cb + kv_head * stride_ch)
    id_row = ids_ptr + batch * stride_ib + kv_head * stride_ih
    big_row = big_ptr + batch * stride_Sb + kv_head * stride_Sh
    small_row = small_ptr + batch * stride_sb + kv_head * stride_sh
    off_row = offset_ptr + batch * stride_ob + kv_head * stride_oh
    sel_small = tl.zeros([M_BLOCK], tl.float32)
    sel_big = tl.zeros([M_BLOCK, D_BLOCK], tl.float32)
    for c0 in range(0, tl.minimum(count, capacity), C_BLOCK):
        offs_c = c0 + tl.arange(0, C_BLOCK)
        live_c = offs_c < count
        blocks = tl.load(id_row + offs_c * stride_ic, mask=live_c, other=0).to(tl.int64)  # [C_BLOCK]
        live = live_c[:, None] & live_m[None, :]
        at = blocks[:, None] * stride_on + offs_m[None, :] * stride_om
        c_b = tl.load(off_row + at, mask=live, other=float("-inf"))  # [C_BLOCK, M_BLOCK]
        rescale = tl.where(live, tl.exp(c_b - c_tot_safe[None, :]), 0.0)
        s_b = tl.load(small_row + blocks[:, None] * stride_sn + offs_m[None, :] * stride_sm, mask=live,
                      other=0.0).to(tl.float32)
        sel_small += tl.sum(s_b * rescale, axis=0)
        big_at = blocks[:, None, None] * stride_Sn + offs_m[None, :, None] * stride_Sm + offs_dc[None, None, :] * stride_Sd
        big_b = tl.load(big_row + big_at, mask=live[:, :, None], other=0.0).to(tl.float32)  # [C_BLOCK, M_BLOCK, D_BLOCK]
        sel_big += tl.sum(big_b * rescale[:, :, None], axis=0)

    small_tot = tl.load(small_tot_ptr + batch * stride_tb + kv_head * stride_th + offs_m * stride_tm, mask=live_m,
                        other=0.0)
    big_tot = tl.load(big_tot_ptr + batch * stride_Tb + kv_head * stride_Th + offs_m[:, None] * stride_Tm
                      + offs_dc[None, :] * stride_Td, mask=live_m[:, None], other=0.0)  # [M_BLOCK, D_BLOCK]
    rest_small = tl.maximum(small_tot - sel_small, 0.0)
    rest_big = big_tot - sel_big
    num = tl.sum(weights[:, :, None] * rest_big[None, :, :], axis=1)  # [GROUP_PAD, D_BLOCK]
    num_out = num_part_ptr + batch * stride_nb + kv_head * stride_nh + chunk * stride_nc
    tl.store(num_out + offs_g[:, None] * stride_ng + offs_dc[None, :] * stride_nd, num, mask=real_head[:, None])
    if d_chunk == 0:
        mass = tl.sum(weights * rest_small[None, :], axis=1)  # [GROUP_PAD]
        total = tl.sum(weights * small_tot[None, :], axis=1)
        part = batch * stride_mb + kv_head * stride_mh + chunk * stride_mc + offs_g * stride_mg
        tl.store(mass_part_ptr + part, mass, mask=real_head)
        tl.store(total_part_ptr + part, total, mask=real_head)
        if chunk == 0:
            tl.store(top_ptr + batch * stride_pb + kv_head * stride_ph + offs_g * stride_pg, top, mask=real_head)


@triton.jit
def _less_finish_kernel(
    q_ptr,  # [B, Hkv, G, D] the query
    center_ptr,  # [B, Hkv, D] fp32 key centre c (scale·q·c is exact, added to lse)
    counts_ptr,  # [B, Hkv] int32 selected blocks
    lengths_ptr,  # [B] int32/int64 tokens of each row's context
    num_part_ptr, mass_part_ptr, total_part_ptr, top_ptr,  # from _less_partial_kernel
    out_ptr,  # [B, Hkv, G, D] fp32 out
    lse_ptr,  # [B, Hkv, G] fp32 out
    num_chunks, block_size, scale, min_relative_mass,
    stride_qb, stride_qh, stride_qg, stride_qd,
    stride_eb, stride_eh, stride_ed,
    stride_cb, stride_ch,
    stride_nb, stride_nh, stride_nc, stride_ng, stride_nd,
    stride_mb, stride_mh, stride_mc, stride_mg,
    stride_pb, stride_ph, stride_pg,
    stride_ob, stride_oh, stride_og, stride_od,
    stride_lb, stride_lh, stride_lg,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_prologue(PDL)
    # grid: (Hkv, B)
    kv_head = tl.program_id(0).to(tl.int64)
    batch = tl.program_id(1).to(tl.int64)
    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    real_head = offs_g < GROUP
    num = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    mass = tl.zeros([GROUP_PAD], tl.float32)
    total = tl.zeros([GROUP_PAD], tl.float32)
    num_row = num_part_ptr + batch * stride_nb + kv_head * stride_nh + offs_g[:, None] * stride_ng + offs_d[None, :] * stride_nd
    part_row = batch * stride_mb + kv_head * stride_mh + offs_g * stride_mg
    for c in range(0, num_chunks):  # a fixed order: the same sums every step
        num += tl.load(num_row + c * stride_nc, mask=real_head[:, None], other=0.0)
        mass += tl.load(mass_part_ptr + part_row + c * stride_mc, mask=real_head, other=0.0)
        total += tl.load(total_part_ptr + part_row + c * stride_mc, mask=real_head, other=0.0)
    top = tl.load(top_ptr + batch * stride_pb + kv_head * stride_ph + offs_g * stride_pg, mask=real_head, other=0.0)
    q = tl.load(q_ptr + batch * stride_qb + kv_head * stride_qh + offs_g[:, None] * stride_qg
                + offs_d[None, :] * stride_qd, mask=real_head[:, None], other=0.0).to(tl.float32)
    center = tl.load(center_ptr + batch * stride_eb + kv_head * stride_eh + offs_d * stride_ed)
    exact = scale * tl.sum(q * center[None, :], axis=1)  # [GROUP_PAD]
    # Some block of the context is unselected iff A (distinct ids inside the context) is smaller.
    num_blocks = tl.cdiv(tl.load(lengths_ptr + batch).to(tl.int32), block_size)
    count = tl.load(counts_ptr + batch * stride_cb + kv_head * stride_ch)
    use = (count < num_blocks) & (mass > min_relative_mass * total)  # [GROUP_PAD]
    safe_mass = tl.where(use, mass, 1.0)
    out = tl.where(use[:, None], num / safe_mass[:, None], 0.0)
    lse = tl.where(use, top + tl.log(safe_mass) + exact, float("-inf"))
    tl.store(out_ptr + batch * stride_ob + kv_head * stride_oh + offs_g[:, None] * stride_og + offs_d[None, :] * stride_od,
             out, mask=real_head[:, None])
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
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    M_BLOCK: tl.constexpr,  # features per program (>= 16 on a GPU: a tl.dot's M)
    PDL: tl.constexpr,
):
    """One decode token per row: the running totals take it (at a running-max offset) and its
    block's summaries are recomputed from the block's live tokens, for M_BLOCK features."""
    pdl_prologue(PDL)
    # grid: (cdiv(m, M_BLOCK), Hkv, B)
    chunk = tl.program_id(0)
    kv_head = tl.program_id(1).to(tl.int64)
    batch = tl.program_id(2).to(tl.int64)
    position = tl.load(positions_ptr + batch).to(tl.int64)
    block = position // BLOCK_SIZE
    if block < max_blocks:  # positions outside the cache write nothing
        offs_d = tl.arange(0, HEAD_DIM)
        offs_t = tl.arange(0, BLOCK_SIZE)
        offs_m = chunk * M_BLOCK + tl.arange(0, M_BLOCK)
        live_m = offs_m < num_features
        tokens = block * BLOCK_SIZE + offs_t  # [BLOCK_SIZE]
        live_t = tokens <= position
        keys = tl.load(k_ptr + batch * stride_kb + kv_head * stride_kh + tokens[:, None] * stride_kt
                       + offs_d[None, :] * stride_kd, mask=live_t[:, None], other=0.0).to(tl.float32)
        values = tl.load(v_ptr + batch * stride_vb + kv_head * stride_vh + tokens[:, None] * stride_vt
                         + offs_d[None, :] * stride_vd, mask=live_t[:, None], other=0.0).to(tl.float32)
        center = tl.load(center_ptr + batch * stride_eb + kv_head * stride_eh + offs_d * stride_ed)
        w = tl.load(w_ptr + kv_head * stride_wh + offs_m[:, None] * stride_wm + offs_d[None, :] * stride_wd,
                    mask=live_m[:, None], other=0.0)  # [M_BLOCK, D]
        x = (keys - center[None, :]) * sqrt_scale  # [BLOCK_SIZE, D]
        logits = tl.dot(x, tl.trans(w), input_precision="ieee")  # [BLOCK_SIZE, M_BLOCK]
        logits = logits - 0.5 * tl.sum(x * x, axis=1)[:, None] - half_log_m
        logits = tl.where(live_t[:, None], logits, float("-inf"))
        # The block's summaries from its live tokens, at their max (finite: the new token is live).
        c_block = tl.max(logits, axis=0)  # [M_BLOCK]
        weights = tl.exp(logits - c_block[None, :])  # [BLOCK_SIZE, M_BLOCK]; 0 for later tokens
        big = tl.dot(tl.trans(weights), values, input_precision="ieee")  # [M_BLOCK, D]
        small = tl.sum(weights, axis=0)
        at = batch * stride_ob + kv_head * stride_oh + block * stride_on + offs_m * stride_om
        tl.store(offset_ptr + at, c_block, mask=live_m)
        tl.store(small_ptr + batch * stride_sb + kv_head * stride_sh + block * stride_sn + offs_m * stride_sm,
                 small.to(small_ptr.dtype.element_ty), mask=live_m)
        tl.store(big_ptr + batch * stride_Sb + kv_head * stride_Sh + block * stride_Sn + offs_m[:, None] * stride_Sm
                 + offs_d[None, :] * stride_Sd, big.to(big_ptr.dtype.element_ty), mask=live_m[:, None])
        # The totals take the new token: rescale to the new running max, then add it.
        is_new = (tokens == position)[:, None]
        new_logit = tl.max(tl.where(is_new, logits, float("-inf")), axis=0)  # [M_BLOCK]
        new_value = tl.sum(tl.where(is_new, values, 0.0), axis=0)  # [D]
        tot = batch * stride_ub + kv_head * stride_uh + offs_m * stride_um
        c_old = tl.load(offset_tot_ptr + tot, mask=live_m, other=0.0)
        c_new = tl.maximum(c_old, new_logit)
        keep = tl.exp(c_old - c_new)  # 0 while the totals are empty (c_old = -inf)
        add = tl.exp(new_logit - c_new)
        small_at = small_tot_ptr + batch * stride_tb + kv_head * stride_th + offs_m * stride_tm
        tl.store(small_at, tl.load(small_at, mask=live_m, other=0.0) * keep + add, mask=live_m)
        big_at = big_tot_ptr + batch * stride_Tb + kv_head * stride_Th + offs_m[:, None] * stride_Tm + offs_d[None, :] * stride_Td
        big_tot = tl.load(big_at, mask=live_m[:, None], other=0.0)
        tl.store(big_at, big_tot * keep[:, None] + add[:, None] * new_value[None, :], mask=live_m[:, None])
        tl.store(offset_tot_ptr + tot, c_new, mask=live_m)
