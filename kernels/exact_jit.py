"""Triton kernels for `exact` selection: every block's share of the dense attention mass.
Launchers with checks live in `prr.kernels.exact`, the torch reference in
`prr.kernels.reference_exact`.

A block's mass for query head g is Σ_{t∈b} exp(s_t − lse_g), s_t = scale · q_g·k_t, lse_g the
log-sum-exp over the row's whole context: exp(lse_{g,b} − lse_g) with lse_{g,b} the block's own
log-sum-exp. Two launches:
1. `_exact_block_lse_kernel`, the q·K pass: each program reads a run of the row's keys once for
   the whole GQA group (one tl.dot per tile), and stores per head every block's lse_{g,b} and the
   lse of its whole run (a partial of lse_g);
2. `_exact_block_mass_kernel`: per tile of blocks, lse_g from the run partials, each block's
   mass, reduced over the group (max or sum) -> the scores the top-k takes.
With a PRR speculation (`_exact_lse_speculate_kernel`), launch 1 also runs sparse_decode's
`per_block_program` over P as its first programs (one launch instead of a second kernel beside it).
Inside, scores are in log2 units (scaled by log2 e) so the softmax uses exp2; stored lse values
are natural logs (prr's convention). Heads g < GROUP of KV head h are query heads h·GROUP + g.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .pdl import pdl_prologue
from .sparse_decode_jit import per_block_program


@triton.jit
def _exact_block_lse_kernel(
    q_ptr,  # [B, Hq, D] fp16/bf16/fp32 (Hq = Hkv * GROUP)
    k_ptr,  # [B, Hkv, T_max, D] the layer's key cache (T_max = NB_max * BLOCK_SIZE)
    lengths_ptr,  # [B] int32/int64 tokens of each row's context
    num_blocks_ptr,  # [B] int32/int64 blocks of each row's context (cdiv(length, BLOCK_SIZE))
    block_lse_ptr,  # [B, Hkv, GROUP, NB_max] fp32 out: lse of each block's live tokens (natural log)
    part_lse_ptr,  # [B, Hkv, GROUP, P] fp32 out: lse of each program's run of blocks
    qk_scale,  # scale * log2(e)
    max_blocks,  # NB_max
    stride_qb, stride_qh, stride_qd,
    stride_kb, stride_kh, stride_kt, stride_kd,
    stride_lb, stride_lh, stride_lg, stride_ln,
    stride_pb, stride_ph, stride_pg, stride_pp,
    GROUP: tl.constexpr,  # query heads per KV head
    GROUP_PAD: tl.constexpr,  # rows of the dot's q tile: a power of two >= GROUP (>= 16 on a GPU)
    HEAD_DIM: tl.constexpr,  # D, a power of two
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block, a power of two
    TILE_BLOCKS: tl.constexpr,  # blocks per tile (one tl.dot of TILE_BLOCKS * BLOCK_SIZE keys)
    TILES: tl.constexpr,  # tiles per program: a program's run is TILES * TILE_BLOCKS blocks
    NATIVE_DOT: tl.constexpr,  # q and K in their 16-bit type for tl.dot; else fp32 operands
    INPUT_PRECISION: tl.constexpr,  # of the fp32 dot: "ieee" (fp32 data) or "tf32" (16-bit data: exact)
    PDL: tl.constexpr,
):
    pdl_prologue(PDL)
    # grid: (P = cdiv(NB_max, TILES * TILE_BLOCKS), Hkv, B)
    _exact_lse_program(tl.program_id(0), tl.program_id(1), tl.program_id(2),
                       q_ptr, k_ptr, lengths_ptr, num_blocks_ptr, block_lse_ptr, part_lse_ptr, qk_scale, max_blocks,
                       stride_qb, stride_qh, stride_qd, stride_kb, stride_kh, stride_kt, stride_kd,
                       stride_lb, stride_lh, stride_lg, stride_ln, stride_pb, stride_ph, stride_pg, stride_pp,
                       GROUP, GROUP_PAD, HEAD_DIM, BLOCK_SIZE, TILE_BLOCKS, TILES, NATIVE_DOT, INPUT_PRECISION)


@triton.jit
def _exact_lse_speculate_kernel(
    q_ptr,  # [B, Hq, D] fp16/bf16/fp32 (Hq = Hkv * GROUP)
    k_ptr,  # [B, Hkv, T_max, D] the layer's key cache (T_max = NB_max * BLOCK_SIZE)
    lengths_ptr,  # [B] int32/int64 tokens of each row's context
    num_blocks_ptr,  # [B] int32/int64 blocks of each row's context (cdiv(length, BLOCK_SIZE))
    block_lse_ptr,  # [B, Hkv, GROUP, NB_max] fp32 out: lse of each block's live tokens (natural log)
    part_lse_ptr,  # [B, Hkv, GROUP, P] fp32 out: lse of each program's run of blocks
    qk_scale,  # scale * log2(e)
    max_blocks,  # NB_max
    stride_qb, stride_qh, stride_qd,
    stride_kb, stride_kh, stride_kt, stride_kd,
    stride_lb, stride_lh, stride_lg, stride_ln,
    stride_pb, stride_ph, stride_pg, stride_pp,
    spec_chunks,  # programs per (row, KV head) of P's speculation: grid dim 0 = spec_chunks + P runs
    v_ptr, ids_ptr, counts_ptr, spec_out_ptr, spec_lse_ptr, spec_capacity, spec_entries,
    stride_vb, stride_vh, stride_vt, stride_vd,
    stride_ib, stride_ih, stride_ic,
    stride_cb, stride_ch,
    stride_len,
    stride_ob, stride_oh, stride_oc, stride_od,
    stride_sb, stride_sh, stride_sc,
    GROUP: tl.constexpr,  # query heads per KV head
    GROUP_PAD: tl.constexpr,  # rows of the dot's q tile: a power of two >= GROUP (>= 16 on a GPU)
    HEAD_DIM: tl.constexpr,  # D, a power of two
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block, a power of two
    TILE_BLOCKS: tl.constexpr,  # blocks per tile (one tl.dot of TILE_BLOCKS * BLOCK_SIZE keys)
    TILES: tl.constexpr,  # tiles per program: a program's run is TILES * TILE_BLOCKS blocks
    NATIVE_DOT: tl.constexpr,  # q and K in their 16-bit type for tl.dot; else fp32 operands
    INPUT_PRECISION: tl.constexpr,  # of the fp32 dot: "ieee" (fp32 data) or "tf32" (16-bit data: exact)
    SUB_TILE: tl.constexpr,  # per_block_program's sub-tile of a block
    PRECISE_PV: tl.constexpr,
    PDL: tl.constexpr,
):
    """The q·K pass and PRR's speculation over P in one launch: programs [0, spec_chunks) of each
    (KV head, row) run sparse_decode's `per_block_program` (P's per-block states, written as
    sparse_decode(per_block=True) writes them), the rest the q·K pass's runs. One launch, so
    the speculation does not contend from a second stream with a pass that fills the GPU."""
    pdl_prologue(PDL)
    # grid: (spec_chunks + P, Hkv, B)
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    batch = tl.program_id(2)
    if pid < spec_chunks:
        per_block_program(pid, batch * tl.num_programs(1) + kv_head,
                          q_ptr, k_ptr, v_ptr, ids_ptr, counts_ptr, lengths_ptr, spec_out_ptr, spec_lse_ptr,
                          qk_scale, tl.num_programs(1), spec_capacity, spec_entries,
                          stride_qb, stride_qh, stride_qd, stride_kb, stride_kh, stride_kt, stride_kd,
                          stride_vb, stride_vh, stride_vt, stride_vd, stride_ib, stride_ih, stride_ic,
                          stride_cb, stride_ch, stride_len, stride_ob, stride_oh, stride_oc, stride_od,
                          stride_sb, stride_sh, stride_sc,
                          GROUP, GROUP_PAD, HEAD_DIM, BLOCK_SIZE, SUB_TILE, NATIVE_DOT, INPUT_PRECISION, PRECISE_PV)
    else:
        _exact_lse_program(pid - spec_chunks, kv_head, batch,
                           q_ptr, k_ptr, lengths_ptr, num_blocks_ptr, block_lse_ptr, part_lse_ptr, qk_scale, max_blocks,
                           stride_qb, stride_qh, stride_qd, stride_kb, stride_kh, stride_kt, stride_kd,
                           stride_lb, stride_lh, stride_lg, stride_ln, stride_pb, stride_ph, stride_pg, stride_pp,
                           GROUP, GROUP_PAD, HEAD_DIM, BLOCK_SIZE, TILE_BLOCKS, TILES, NATIVE_DOT, INPUT_PRECISION)


@triton.jit
def _exact_lse_program(
    part, kv_head, batch,  # this program's run of blocks, KV head and batch row
    q_ptr,  # [B, Hq, D] fp16/bf16/fp32 (Hq = Hkv * GROUP)
    k_ptr,  # [B, Hkv, T_max, D] the layer's key cache (T_max = NB_max * BLOCK_SIZE)
    lengths_ptr,  # [B] int32/int64 tokens of each row's context
    num_blocks_ptr,  # [B] int32/int64 blocks of each row's context (cdiv(length, BLOCK_SIZE))
    block_lse_ptr,  # [B, Hkv, GROUP, NB_max] fp32 out: lse of each block's live tokens (natural log)
    part_lse_ptr,  # [B, Hkv, GROUP, P] fp32 out: lse of each program's run of blocks
    qk_scale,  # scale * log2(e)
    max_blocks,  # NB_max
    stride_qb, stride_qh, stride_qd,
    stride_kb, stride_kh, stride_kt, stride_kd,
    stride_lb, stride_lh, stride_lg, stride_ln,
    stride_pb, stride_ph, stride_pg, stride_pp,
    GROUP: tl.constexpr,  # query heads per KV head
    GROUP_PAD: tl.constexpr,  # rows of the dot's q tile: a power of two >= GROUP (>= 16 on a GPU)
    HEAD_DIM: tl.constexpr,  # D, a power of two
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block, a power of two
    TILE_BLOCKS: tl.constexpr,  # blocks per tile (one tl.dot of TILE_BLOCKS * BLOCK_SIZE keys)
    TILES: tl.constexpr,  # tiles per program: a program's run is TILES * TILE_BLOCKS blocks
    NATIVE_DOT: tl.constexpr,  # q and K in their 16-bit type for tl.dot; else fp32 operands
    INPUT_PRECISION: tl.constexpr,  # of the fp32 dot: "ieee" (fp32 data) or "tf32" (16-bit data: exact)
):
    """One run of TILES * TILE_BLOCKS blocks of the q·K pass (see the module docstring)."""
    TILE_TOKENS: tl.constexpr = TILE_BLOCKS * BLOCK_SIZE
    num_blocks = tl.minimum(tl.load(num_blocks_ptr + batch).to(tl.int32), max_blocks)
    # Tokens counted: below the row's length and inside its num_blocks blocks (the caller's counts rule).
    length = tl.minimum(tl.load(lengths_ptr + batch).to(tl.int64), num_blocks.to(tl.int64) * BLOCK_SIZE)
    first_block = part * (TILES * TILE_BLOCKS)
    # Runs past the row's context write nothing: the mass kernel masks them by num_blocks.
    if first_block < num_blocks:
        offs_g = tl.arange(0, GROUP_PAD)
        offs_d = tl.arange(0, HEAD_DIM)
        real_head = offs_g < GROUP
        q_rows = q_ptr + batch.to(tl.int64) * stride_qb + (kv_head * GROUP + offs_g).to(tl.int64) * stride_qh
        q = tl.load(q_rows[:, None] + offs_d[None, :] * stride_qd, mask=real_head[:, None], other=0.0)
        if not NATIVE_DOT:
            q = q.to(tl.float32)  # (the interpreter's bf16 arithmetic is wrong)
        k_row = k_ptr + batch.to(tl.int64) * stride_kb + kv_head.to(tl.int64) * stride_kh
        out_row = block_lse_ptr + batch.to(tl.int64) * stride_lb + kv_head.to(tl.int64) * stride_lh
        out_row += offs_g[:, None].to(tl.int64) * stride_lg  # [GROUP_PAD, 1]
        run_max = tl.full([GROUP_PAD], float("-inf"), tl.float32)  # log2 units
        run_sum = tl.zeros([GROUP_PAD], tl.float32)
        tiles = tl.minimum(TILES, tl.cdiv(num_blocks - first_block, TILE_BLOCKS))
        for t in range(0, tiles):
            tile_block = first_block + t * TILE_BLOCKS
            tokens = tile_block.to(tl.int64) * BLOCK_SIZE + tl.arange(0, TILE_TOKENS)  # [TILE_TOKENS]
            live = tokens < length
            k = tl.load(k_row + tokens[:, None] * stride_kt + offs_d[None, :] * stride_kd, mask=live[:, None],
                        other=0.0)  # [TILE_TOKENS, D]; lanes past the context read nothing
            if NATIVE_DOT:
                s = tl.dot(q, tl.trans(k))
            else:
                s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision=INPUT_PRECISION)
            s = tl.where(live[None, :], s * qk_scale, float("-inf"))  # [GROUP_PAD, TILE_TOKENS] log2 units
            s = tl.reshape(s, [GROUP_PAD, TILE_BLOCKS, BLOCK_SIZE])  # a block's tokens are contiguous
            block_max = tl.max(s, axis=2)  # [GROUP_PAD, TILE_BLOCKS]
            block_safe = tl.where(block_max == float("-inf"), 0.0, block_max)
            block_sum = tl.sum(tl.exp2(s - block_safe[:, :, None]), axis=2)  # 0 for blocks without live tokens
            block_lse = tl.where(block_sum > 0.0, block_safe + tl.log2(tl.maximum(block_sum, 1e-30)), float("-inf"))
            blocks = tile_block + tl.arange(0, TILE_BLOCKS)
            store = real_head[:, None] & (blocks < num_blocks)[None, :]
            tl.store(out_row + blocks[None, :].to(tl.int64) * stride_ln, block_lse * 0.6931471805599453, mask=store)
            # The run's partial of lse_g, from its blocks' lse (online).
            new_max = tl.maximum(run_max, tl.max(block_lse, axis=1))
            new_safe = tl.where(new_max == float("-inf"), 0.0, new_max)
            run_sum = run_sum * tl.exp2(run_max - new_safe) + tl.sum(tl.exp2(block_lse - new_safe[:, None]), axis=1)
            run_max = new_max
        run_safe = tl.where(run_max == float("-inf"), 0.0, run_max)
        run_lse = tl.where(run_sum > 0.0, (run_safe + tl.log2(tl.maximum(run_sum, 1e-30))) * 0.6931471805599453,
                           float("-inf"))
        part_out = part_lse_ptr + batch.to(tl.int64) * stride_pb + kv_head.to(tl.int64) * stride_ph
        tl.store(part_out + offs_g.to(tl.int64) * stride_pg + part * stride_pp, run_lse, mask=real_head)


@triton.jit
def _exact_block_mass_kernel(
    block_lse_ptr,  # [B, Hkv, GROUP, NB_max] fp32 from _exact_block_lse_kernel
    part_lse_ptr,  # [B, Hkv, GROUP, P] fp32 from _exact_block_lse_kernel
    num_blocks_ptr,  # [B] int32/int64
    out_ptr,  # [B, Hkv, NB_max] fp32: GQA-reduced block mass, -inf from num_blocks[b] on
    max_blocks,  # NB_max
    stride_lb, stride_lh, stride_lg, stride_ln,
    stride_pb, stride_ph, stride_pg, stride_pp,
    stride_ob, stride_oh, stride_on,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,  # a power of two >= GROUP
    BLOCKS_PER_PART: tl.constexpr,  # blocks of one run of the lse kernel (TILES * TILE_BLOCKS)
    PART_CHUNK: tl.constexpr,  # run partials read at a time (a power of two)
    BLOCK_N: tl.constexpr,  # blocks per program (a power of two)
    SUM_GROUP: tl.constexpr,  # True: sum the group's masses; False: max
    PDL: tl.constexpr,
):
    pdl_prologue(PDL)
    # grid: (cdiv(NB_max, BLOCK_N), Hkv, B)
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    batch = tl.program_id(2)
    LOG2E: tl.constexpr = 1.4426950408889634
    num_blocks = tl.minimum(tl.load(num_blocks_ptr + batch).to(tl.int32), max_blocks)
    offs_g = tl.arange(0, GROUP_PAD)
    real_head = offs_g < GROUP
    # lse_g over the whole context: log-sum-exp of the live runs' partials (log2 units here).
    parts = tl.cdiv(num_blocks, BLOCKS_PER_PART)
    part_row = part_lse_ptr + batch.to(tl.int64) * stride_pb + kv_head.to(tl.int64) * stride_ph
    part_row += offs_g[:, None].to(tl.int64) * stride_pg  # [GROUP_PAD, 1]
    row_max = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    row_sum = tl.zeros([GROUP_PAD], tl.float32)
    for p0 in range(0, parts, PART_CHUNK):
        offs_p = p0 + tl.arange(0, PART_CHUNK)
        lse = tl.load(part_row + offs_p[None, :] * stride_pp, mask=real_head[:, None] & (offs_p < parts)[None, :],
                      other=float("-inf")) * LOG2E  # [GROUP_PAD, PART_CHUNK]
        new_max = tl.maximum(row_max, tl.max(lse, axis=1))
        new_safe = tl.where(new_max == float("-inf"), 0.0, new_max)
        row_sum = row_sum * tl.exp2(row_max - new_safe) + tl.sum(tl.exp2(lse - new_safe[:, None]), axis=1)
        row_max = new_max
    row_safe = tl.where(row_max == float("-inf"), 0.0, row_max)
    row_lse = tl.where(row_sum > 0.0, row_safe + tl.log2(tl.maximum(row_sum, 1e-30)), 0.0)  # (0: an empty row has no live block)

    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    live_n = offs_n < num_blocks
    lse_row = block_lse_ptr + batch.to(tl.int64) * stride_lb + kv_head.to(tl.int64) * stride_lh
    block_lse = tl.load(lse_row + offs_g[:, None].to(tl.int64) * stride_lg + offs_n[None, :].to(tl.int64) * stride_ln,
                        mask=real_head[:, None] & live_n[None, :], other=float("-inf")) * LOG2E
    mass = tl.exp2(block_lse - row_lse[:, None])  # [GROUP_PAD, BLOCK_N]; 0 where -inf
    if SUM_GROUP:
        reduced = tl.sum(tl.where(real_head[:, None], mass, 0.0), axis=0)
    else:
        reduced = tl.max(tl.where(real_head[:, None], mass, float("-inf")), axis=0)
    reduced = tl.where(live_n, reduced, float("-inf"))
    out = out_ptr + batch.to(tl.int64) * stride_ob + kv_head.to(tl.int64) * stride_oh + offs_n.to(tl.int64) * stride_on
    tl.store(out, reduced, mask=offs_n < max_blocks)
