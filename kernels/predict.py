"""Launchers (checks, allocation, grid) of the predictor kernels in `prr.kernels.predict_jit`;
torch references in `prr.kernels.reference_predict`. One program per (batch row, KV head).

Propose = one rank launch (or none: last_step and ema_membership rank with their state as it
is) + `prr.kernels.topk.topk_select` over the rank with no forced blocks: P is the set of
`reference_selection.top_k_blocks(rank, k)` (higher rank first, ties to the lower block id,
-inf never taken), written in ascending block order (the torch path writes it best first:
the same set). Update = one launch per layer.

Static shapes, no host synchronisation: per-layer parameters (α, β, γ, SPIN's step counter)
are read from device tensors, so every launcher is capturable in a CUDA graph.
Shapes: B rows, Hkv KV heads, N blocks (the cache's max_blocks), C a selection's capacity.
"""

from __future__ import annotations

import torch
import triton
from torch import Tensor

from .pdl import launch_kwargs
from .predict_jit import (
    _ema_rank_kernel,
    _ema_update_kernel,
    _qsim_counters_kernel,
    _qsim_fill_kernel,
    _qsim_propose_kernel,
    _qsim_rank_kernel,
    _qsim_similarity_kernel,
    _qsim_update_kernel,
    _scatter_selected_kernel,
    _spin_rank_kernel,
    _spin_update_kernel,
)
from .topk import MAX_ROW_BLOCK, PAD_BLOCK, topk_select

MAX_TILE = 4096  # blocks of a row per loop iteration
IDX_TILE = 128  # selected ids per loop iteration


def _tile(n: int) -> int:
    return max(16, min(triton.next_power_of_2(max(n, 1)), MAX_TILE))


def _warps(tile: int) -> int:
    return max(1, min(8, tile // 256))


# --- checks ---------------------------------------------------------------------------


def _check_row_tensor(name: str, t: Tensor, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
    if t.shape != shape or t.dtype != dtype:
        raise ValueError(f"{name} must be {dtype} of shape {list(shape)}; got {t.dtype} {list(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device}: put every input on one device")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (a layer of the predictor's [L, B, Hkv, N] state)")


def _check_param(name: str, t: Tensor, device: torch.device) -> None:
    if t.numel() != 1 or t.dtype != torch.float32 or t.device != device:
        raise ValueError(f"{name} must be one fp32 value on {device} (a [1] slice of the per-layer tensor); got "
                         f"{t.dtype} {list(t.shape)} on {t.device}")


def _check_selection(scores: Tensor | None, indices: Tensor, count: Tensor, batch: int, heads: int, n: int,
                     device: torch.device) -> None:
    if scores is not None and (scores.shape != (batch, heads, n) or scores.dtype != torch.float32):
        raise ValueError(f"selection scores must be fp32 [B, Hkv, N] = {[batch, heads, n]}; got {scores.dtype} "
                         f"{list(scores.shape)}")
    if indices.dim() != 3 or indices.shape[:2] != (batch, heads) or indices.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"selection indices must be int32/int64 [B, Hkv, C] with [B, Hkv] = {[batch, heads]}; got "
                         f"{indices.dtype} {list(indices.shape)}")
    if count.shape != (batch, heads) or count.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"selection count must be int32/int64 [B, Hkv] = {[batch, heads]}; got {count.dtype} "
                         f"{list(count.shape)}")
    for name, t in (("scores", scores), ("indices", indices), ("count", count)):
        if t is not None and t.device != device:
            raise ValueError(f"selection {name} is on {t.device}, the state on {device}")


def row_counts(num_blocks: int | Tensor, batch: int, device: torch.device) -> Tensor:
    """Blocks in each row's context as the kernels read them: [B] int32/int64 contiguous on
    `device` (a host int is filled on the device; a 0-dim tensor broadcast; a [B] tensor used as is)."""
    if not isinstance(num_blocks, Tensor):
        return torch.full((batch,), int(num_blocks), dtype=torch.int32, device=device)
    if num_blocks.dtype not in (torch.int32, torch.int64) or num_blocks.device != device:
        raise ValueError(f"num_blocks must be an int32/int64 tensor on {device}; got {num_blocks.dtype} on "
                         f"{num_blocks.device}")
    if num_blocks.dim() == 0:
        return num_blocks.expand(batch).contiguous()
    if num_blocks.shape != (batch,):
        raise ValueError(f"num_blocks must be [B] = [{batch}]; got {list(num_blocks.shape)}")
    return num_blocks.contiguous()


def _selection_args(scores: Tensor | None, indices: Tensor, count: Tensor) -> tuple:
    s = scores.stride() if scores is not None else (0, 0, 0)
    return (*s, *indices.stride(), *count.stride())


def _layer_rows(scores: Tensor, indices: Tensor, count: Tensor, layers: int, batch: int,
                heads: int) -> tuple[Tensor, Tensor, Tensor]:
    """A layer range's selections (scores [L, B, Hkv, N], indices [L, B, Hkv, C], count
    [L, B, Hkv], contiguous: stacked by the caller) as L·B rows of one batch (views)."""
    for name, t in (("scores", scores), ("indices", indices), ("count", count)):
        if not t.is_contiguous() or t.shape[:3] != (layers, batch, heads):
            raise ValueError(f"{name} must be contiguous [L, B, Hkv, ...] = [{layers}, {batch}, {heads}, ...]; got "
                             f"{list(t.shape)}")
    rows = layers * batch
    return scores.view(rows, heads, -1), indices.view(rows, heads, -1), count.view(rows, heads)


# --- propose ------------------------------------------------------------------------------


def propose_top(rank: Tensor, k: int, num_blocks: Tensor) -> tuple[Tensor, Tensor]:
    """rank [B, Hkv, N] fp32 (-inf: never), num_blocks [B] -> P (indices [B, Hkv, min(k, N)]
    int32 ascending then padding 0, counts [B, Hkv] int32): the set of top_k_blocks(rank, k)."""
    return topk_select(rank, k, num_blocks, sink_blocks=0, recent_blocks=0)


def _rank_launch(batch: int, heads: int, n: int, device: torch.device, nb: Tensor, mix: int,
                 ema: Tensor | None, last_selected: Tensor | None, stickiness: Tensor | None, recency: Tensor | None,
                 recent_blocks: int, z_source: Tensor | None, selected_source: Tensor | None,
                 source_stickiness: float, temporal_weight: float, rows_per_param: int | None = None) -> Tensor:
    """rows_per_param: rows sharing one β / γ (and num_blocks [rows_per_param]): B when batch holds
    one layer (default), the rows of a layer when it holds several (`ema_rank_layers`)."""
    rank = torch.empty(batch, heads, n, dtype=torch.float32, device=device)
    if batch == 0 or heads == 0 or n == 0:
        return rank
    dummy_f = rank  # never read: the constexpr MIX leaves those loads out
    dummy_u8 = torch.empty(1, dtype=torch.uint8, device=device)
    one = torch.ones(1, dtype=torch.float32, device=device) if stickiness is None else None
    tile = _tile(n)
    _ema_rank_kernel[(heads, batch)](
        ema if ema is not None else dummy_f,
        last_selected.view(torch.uint8) if last_selected is not None else dummy_u8,
        stickiness if stickiness is not None else one,
        recency if recency is not None else one,
        nb,
        z_source if z_source is not None else dummy_f,
        selected_source.view(torch.uint8) if selected_source is not None else dummy_u8,
        rank,
        n, heads, recent_blocks, rows_per_param or batch,
        float(source_stickiness), float(temporal_weight), float(1 - temporal_weight),
        MIX=mix, TILE=tile, num_warps=_warps(tile), enable_fp_fusion=False, **launch_kwargs(device),
    )
    return rank


def ema_rank(ema: Tensor, last_selected: Tensor, stickiness: Tensor, recency: Tensor, num_blocks: int | Tensor,
             recent_blocks: int) -> Tensor:
    """ema [B, Hkv, N] fp32, last_selected [B, Hkv, N] bool, stickiness / recency one fp32 each
    (device), num_blocks (host int or [B]) -> rank [B, Hkv, N] fp32: ema + β·1[last selected] +
    γ·1[among the recent_blocks newest], -inf at or past num_blocks (bit-equal to the reference:
    no fused multiply-add)."""
    batch, heads, n = ema.shape
    dev = ema.device
    _check_row_tensor("ema", ema, (batch, heads, n), torch.float32, dev)
    _check_row_tensor("last_selected", last_selected, (batch, heads, n), torch.bool, dev)
    _check_param("stickiness", stickiness, dev)
    _check_param("recency", recency, dev)
    if isinstance(recent_blocks, bool) or not isinstance(recent_blocks, int) or recent_blocks < 0:
        raise ValueError(f"recent_blocks={recent_blocks!r} must be an int >= 0")
    nb = row_counts(num_blocks, batch, dev)
    return _rank_launch(batch, heads, n, dev, nb, 0, ema, last_selected, stickiness, recency, min(recent_blocks, n + 1),
                        None, None, 0.0, 1.0)


def ema_propose(ema: Tensor, last_selected: Tensor, stickiness: Tensor, recency: Tensor, num_blocks: int | Tensor,
                recent_blocks: int, k: int) -> tuple[Tensor, Tensor]:
    """ema's P: the top-k blocks of `ema_rank` (two launches) -> (indices [B, Hkv, min(k, N)]
    int32 ascending, counts [B, Hkv] int32)."""
    rank = ema_rank(ema, last_selected, stickiness, recency, num_blocks, recent_blocks)
    return propose_top(rank, k, row_counts(num_blocks, ema.shape[0], ema.device))


def cross_layer_rank(z_source: Tensor, selected_source: Tensor, source_stickiness: float, temporal_weight: float,
                     num_blocks: int | Tensor, ema: Tensor | None = None, last_selected: Tensor | None = None,
                     stickiness: Tensor | None = None, recency: Tensor | None = None, recent_blocks: int = 0) -> Tensor:
    """cross_layer's rank: (1 - w)·(z_source + s·1[selected_source]) + w·ema_rank(...) for
    0 < w < 1, the cross part alone for w = 0 (then the ema arguments are not needed), -inf at or
    past num_blocks. z_source [B, Hkv, N] fp32, selected_source [B, Hkv, N] bool."""
    batch, heads, n = z_source.shape
    dev = z_source.device
    _check_row_tensor("z_source", z_source, (batch, heads, n), torch.float32, dev)
    _check_row_tensor("selected_source", selected_source, (batch, heads, n), torch.bool, dev)
    if not 0.0 <= temporal_weight < 1.0:
        raise ValueError(f"temporal_weight={temporal_weight} must lie in [0, 1) here (1: use ema_rank)")
    nb = row_counts(num_blocks, batch, dev)
    if temporal_weight == 0.0:
        return _rank_launch(batch, heads, n, dev, nb, 1, None, None, None, None, 0, z_source, selected_source,
                            source_stickiness, 0.0)
    if ema is None or last_selected is None or stickiness is None or recency is None:
        raise ValueError(f"temporal_weight={temporal_weight} > 0 mixes in ema's rank: pass ema, last_selected, "
                         "stickiness and recency")
    _check_row_tensor("ema", ema, (batch, heads, n), torch.float32, dev)
    _check_row_tensor("last_selected", last_selected, (batch, heads, n), torch.bool, dev)
    _check_param("stickiness", stickiness, dev)
    _check_param("recency", recency, dev)
    return _rank_launch(batch, heads, n, dev, nb, 2, ema, last_selected, stickiness, recency, min(recent_blocks, n + 1),
                        z_source, selected_source, source_stickiness, temporal_weight)


def spin_rank(vertical: Tensor, diagonal: Tensor, num_blocks: int | Tensor, updates: Tensor | None = None,
              key: int = 0, draw: bool = False) -> tuple[Tensor, Tensor | None]:
    """vertical, diagonal [B, Hkv, N] fp32 -> (rank [B, Hkv, N]: max(vertical(b), diagonal(nb-1-b)),
    -inf outside; with draw, the exploration draw [B, Hkv, N] in [0, 1) inside the context (-inf
    outside) of step key `updates` ([1] int64 device counter) and host key `key` < 2^32)."""
    nb = row_counts(num_blocks, vertical.shape[0], vertical.device)
    return _spin_rank_rows(vertical, diagonal, nb, updates, key, draw, layers=1, first_layer=None)


def _spin_rank_rows(vertical: Tensor, diagonal: Tensor, nb: Tensor, updates: Tensor | None, key: int, draw: bool,
                    layers: int, first_layer: int | None) -> tuple[Tensor, Tensor | None]:
    """spin_rank over rows [R, Hkv, N] of `layers` layers (R = layers·B, layer by layer), nb [R];
    updates [layers]; first_layer None: key is the layer's draw key, else the seed's
    (spin.seed_key), mixed in the kernel with each row's layer first_layer + r // B."""
    rows, heads, n = vertical.shape
    dev = vertical.device
    _check_row_tensor("vertical", vertical, (rows, heads, n), torch.float32, dev)
    _check_row_tensor("diagonal", diagonal, (rows, heads, n), torch.float32, dev)
    if draw and (updates is None or updates.shape != (layers,) or updates.dtype != torch.int64 or updates.device != dev):
        raise ValueError(f"the exploration draw needs updates: [{layers}] int64 on {dev} (each layer's selection counter)")
    if not 0 <= key < 2**32:
        raise ValueError(f"key={key} must lie in [0, 2^32)")
    rank = torch.empty(rows, heads, n, dtype=torch.float32, device=dev)
    drawn = torch.empty_like(rank) if draw else None
    if rows == 0 or heads == 0 or n == 0:
        return rank, drawn
    tile = _tile(n)
    _spin_rank_kernel[(heads, rows)](
        vertical, diagonal, nb, updates if draw else nb, rank, drawn if draw else rank,
        n, heads, key - 2**32 if key >= 2**31 else key, first_layer or 0, rows // layers,
        DRAW=draw, KEY_PER_LAYER=first_layer is not None, TILE=tile, num_warps=_warps(tile), **launch_kwargs(dev),
    )
    return rank, drawn


def spin_propose(vertical: Tensor, diagonal: Tensor, num_blocks: int | Tensor, updates: Tensor, key: int,
                 budget_blocks: int, explored: int) -> tuple[Tensor, Tensor]:
    """SPIN's P: the best budget - explored blocks by `spin_rank`, then the `explored` other
    in-context blocks of highest draw (ties to the lower id) -> (indices [B, Hkv, min(budget, N)]
    int32 ascending, counts [B, Hkv] int32). One launch + one top-k without exploration; rank
    and draw, top-k, a mark, top-k with it."""
    nb = row_counts(num_blocks, vertical.shape[0], vertical.device)
    return _spin_propose_rows(vertical, diagonal, nb, updates, key, budget_blocks, explored, 1, None)


def spin_propose_layers(vertical: Tensor, diagonal: Tensor, num_blocks: int | Tensor, updates: Tensor, seed_key: int,
                        first_layer: int, budget_blocks: int, explored: int) -> tuple[Tensor, Tensor]:
    """`spin_propose` of L layers at once, their rows as one batch (the same launches as one
    layer's): vertical, diagonal [L, B, Hkv, N] fp32 contiguous, updates [L] int64, seed_key
    (spin.seed_key) and first_layer (the draw keys of layers first_layer ...), num_blocks the
    same for every layer -> (indices [L, B, Hkv, min(budget, N)] int32 ascending, counts [L, B,
    Hkv] int32), equal layer by layer to `spin_propose`."""
    layers, batch, heads, n = vertical.shape
    nb = row_counts(num_blocks, batch, vertical.device).repeat(layers)  # [L·B]
    flat = (layers * batch, heads, n)
    idx, cnt = _spin_propose_rows(vertical.view(flat), diagonal.view(flat), nb, updates, seed_key, budget_blocks,
                                  explored, layers, first_layer)
    return idx.view(layers, batch, heads, -1), cnt.view(layers, batch, heads)


def _spin_propose_rows(vertical: Tensor, diagonal: Tensor, nb: Tensor, updates: Tensor, key: int, budget_blocks: int,
                       explored: int, layers: int, first_layer: int | None) -> tuple[Tensor, Tensor]:
    if not 0 <= explored < max(budget_blocks, 1):
        raise ValueError(f"explored={explored} must lie in [0, budget_blocks={budget_blocks})")
    rank, drawn = _spin_rank_rows(vertical, diagonal, nb, updates, key, explored > 0, layers, first_layer)
    if explored == 0:
        return propose_top(rank, budget_blocks, nb)
    best, best_count = propose_top(rank, budget_blocks - explored, nb)
    mark_blocks(drawn, best, best_count, 2.0)  # exploited blocks above every draw (< 1)
    return propose_top(drawn, budget_blocks, nb)


# --- update -------------------------------------------------------------------------------


def ema_update(scores: Tensor, indices: Tensor, count: Tensor, alpha: Tensor, ema: Tensor, last_selected: Tensor,
               z_out: Tensor | None = None, selected_out: Tensor | None = None) -> None:
    """One launch: z = the selection scores standardised per (row, KV head) over the finite
    entries; ema <- α·ema + (1-α)·z where the score is finite; last_selected <- the selection's
    mask. With z_out / selected_out ([B, Hkv, N] fp32 / bool) also writes z and the mask there
    (cross_layer). scores [B, Hkv, N] fp32, indices [B, Hkv, C], count [B, Hkv], alpha one fp32
    on the device; ema [B, Hkv, N] fp32 and last_selected bool, contiguous, in place."""
    batch, heads, n = ema.shape
    dev = ema.device
    _check_row_tensor("ema", ema, (batch, heads, n), torch.float32, dev)
    _check_row_tensor("last_selected", last_selected, (batch, heads, n), torch.bool, dev)
    _check_param("alpha", alpha, dev)
    _check_selection(scores, indices, count, batch, heads, n, dev)
    write_z = z_out is not None or selected_out is not None
    if write_z:
        if z_out is None or selected_out is None:
            raise ValueError("pass both z_out and selected_out, or neither")
        _check_row_tensor("z_out", z_out, (batch, heads, n), torch.float32, dev)
        _check_row_tensor("selected_out", selected_out, (batch, heads, n), torch.bool, dev)
    if batch == 0 or heads == 0 or n == 0:
        return
    tile = _tile(n)
    sel = last_selected.view(torch.uint8)
    _ema_update_kernel[(heads, batch)](
        scores, indices, count, alpha, ema, sel,
        z_out if write_z else ema, selected_out.view(torch.uint8) if write_z else sel,
        n, heads, indices.shape[-1], batch,
        *_selection_args(scores, indices, count),
        WRITE_Z=write_z, TILE=tile, IDX_TILE=IDX_TILE, num_warps=_warps(tile), **launch_kwargs(dev),
    )


# --- several layers in one launch (the graph engine's end-of-step learning) --------------------


def _check_layer_params(names_params: tuple[tuple[str, Tensor], ...], layers: int, device: torch.device) -> None:
    for name, t in names_params:
        if t.shape != (layers,) or t.dtype != torch.float32 or t.device != device:
            raise ValueError(f"{name} must be [L] = [{layers}] fp32 on {device} (one per layer); got "
                             f"{t.dtype} {list(t.shape)} on {t.device}")


def ema_update_layers(scores: Tensor, indices: Tensor, count: Tensor, alpha: Tensor, ema: Tensor,
                      last_selected: Tensor) -> None:
    """`ema_update` of L layers in one launch (each layer's rows with its own α): scores
    [L, B, Hkv, N] fp32, indices [L, B, Hkv, C], count [L, B, Hkv], alpha [L] fp32; ema
    [L, B, Hkv, N] fp32 and last_selected bool, contiguous (a layer range of the predictor's
    state), in place. Equal, layer by layer, to L `ema_update` launches."""
    layers, batch, heads, n = ema.shape
    dev = ema.device
    _check_row_tensor("ema", ema, (layers, batch, heads, n), torch.float32, dev)
    _check_row_tensor("last_selected", last_selected, (layers, batch, heads, n), torch.bool, dev)
    _check_layer_params((("alpha", alpha),), layers, dev)
    scores, indices, count = _layer_rows(scores, indices, count, layers, batch, heads)
    flat = layers * batch
    _check_selection(scores, indices, count, flat, heads, n, dev)
    if flat == 0 or heads == 0 or n == 0:
        return
    tile = _tile(n)
    sel = last_selected.view(torch.uint8).view(flat, heads, n)
    _ema_update_kernel[(heads, flat)](
        scores, indices, count, alpha, ema.view(flat, heads, n), sel, ema, sel,
        n, heads, indices.shape[-1], batch,
        *_selection_args(scores, indices, count),
        WRITE_Z=False, TILE=tile, IDX_TILE=IDX_TILE, num_warps=_warps(tile), **launch_kwargs(dev),
    )


def ema_propose_layers(ema: Tensor, last_selected: Tensor, stickiness: Tensor, recency: Tensor,
                       num_blocks: int | Tensor, recent_blocks: int, k: int) -> tuple[Tensor, Tensor]:
    """`ema_propose` of L layers in two launches (the rank of every layer, then one top-k over
    their rows): ema [L, B, Hkv, N] fp32, last_selected bool, stickiness / recency [L] fp32,
    num_blocks (host int or [B], the same for every layer) -> (indices [L, B, Hkv, min(k, N)]
    int32 ascending, counts [L, B, Hkv] int32), equal layer by layer to `ema_propose`."""
    layers, batch, heads, n = ema.shape
    dev = ema.device
    _check_row_tensor("ema", ema, (layers, batch, heads, n), torch.float32, dev)
    _check_row_tensor("last_selected", last_selected, (layers, batch, heads, n), torch.bool, dev)
    _check_layer_params((("stickiness", stickiness), ("recency", recency)), layers, dev)
    if isinstance(recent_blocks, bool) or not isinstance(recent_blocks, int) or recent_blocks < 0:
        raise ValueError(f"recent_blocks={recent_blocks!r} must be an int >= 0")
    flat = layers * batch
    nb = row_counts(num_blocks, batch, dev)  # [B]
    rank = _rank_launch(flat, heads, n, dev, nb, 0, ema.view(flat, heads, n),
                        last_selected.view(flat, heads, n), stickiness, recency, min(recent_blocks, n + 1),
                        None, None, 0.0, 1.0, rows_per_param=batch)
    idx, cnt = propose_top(rank, k, nb.repeat(layers))
    return idx.view(layers, batch, heads, -1), cnt.view(layers, batch, heads)


def _scatter(mode: int, row: Tensor, scores: Tensor | None, indices: Tensor, count: Tensor, scale: float,
             bonus: float) -> None:
    batch, heads, n = row.shape
    dev = row.device
    _check_row_tensor("state", row, (batch, heads, n), torch.float32, dev)
    _check_selection(scores, indices, count, batch, heads, n, dev)
    if batch == 0 or heads == 0 or n == 0:
        return
    tile = _tile(n)
    _scatter_selected_kernel[(heads, batch)](
        row, scores if scores is not None else row, indices, count,
        n, heads, indices.shape[-1], float(scale), float(bonus),
        *_selection_args(scores, indices, count),
        MODE=mode, TILE=tile, IDX_TILE=IDX_TILE, num_warps=_warps(tile), **launch_kwargs(dev),
    )


def last_step_update(scores: Tensor, indices: Tensor, count: Tensor, rank: Tensor) -> None:
    """One launch: rank [B, Hkv, N] fp32 <- the selected blocks' scores (NaN -> 0, ±inf -> ±1e30),
    -inf elsewhere."""
    _scatter(0, rank, scores, indices, count, 1.0, 0.0)


def membership_ema_update(state: Tensor, indices: Tensor, count: Tensor, alpha: float) -> None:
    """One launch: state [B, Hkv, N] fp32 <- α·state + (1 - α)·1[b selected]."""
    if not 0.0 <= alpha < 1.0:
        raise ValueError(f"alpha={alpha} must lie in [0, 1)")
    _scatter(1, state, None, indices, count, alpha, 1.0 - alpha)


def mark_blocks(row: Tensor, indices: Tensor, count: Tensor, value: float) -> None:
    """One launch: row [B, Hkv, N] fp32 <- value at the listed blocks (the others unchanged)."""
    _scatter(2, row, None, indices, count, 1.0, value)


def spin_update(scores: Tensor, indices: Tensor, count: Tensor, vertical: Tensor, diagonal: Tensor, updates: Tensor,
                alpha_vertical: float, alpha_diagonal: float, selection_bonus: float) -> None:
    """One launch: x = z + bonus·1[b ∈ A] (z: scores standardised over the finite entries);
    vertical <- α_v·vertical + (1-α_v)·x where the score is finite; diagonal(δ) <- α_d·diagonal(δ)
    + (1-α_d)·x(n-1-δ) for δ < n (n: the row's finite scores); updates ([1] int64) += 1."""
    _spin_update_rows(scores, indices, count, vertical, diagonal, updates, alpha_vertical, alpha_diagonal,
                      selection_bonus, 1)


def spin_update_layers(scores: Tensor, indices: Tensor, count: Tensor, vertical: Tensor, diagonal: Tensor,
                       updates: Tensor, alpha_vertical: float, alpha_diagonal: float, selection_bonus: float) -> None:
    """`spin_update` of L layers in one launch: scores, vertical, diagonal [L, B, Hkv, N] fp32
    (contiguous; vertical, diagonal a layer range of the state), indices [L, B, Hkv, C], count
    [L, B, Hkv] contiguous, updates [L] int64 (each += 1). Equal, layer by layer, to L `spin_update` launches."""
    layers, batch, heads, n = vertical.shape
    flat = layers * batch
    _spin_update_rows(*_layer_rows(scores, indices, count, layers, batch, heads),
                      vertical.view(flat, heads, n), diagonal.view(flat, heads, n), updates, alpha_vertical,
                      alpha_diagonal, selection_bonus, layers)


def _spin_update_rows(scores: Tensor, indices: Tensor, count: Tensor, vertical: Tensor, diagonal: Tensor,
                      updates: Tensor, alpha_vertical: float, alpha_diagonal: float, selection_bonus: float,
                      layers: int) -> None:
    """spin_update over rows [R, Hkv, N] of `layers` layers (R = layers·B, layer by layer), updates [layers]."""
    rows, heads, n = vertical.shape
    dev = vertical.device
    _check_row_tensor("vertical", vertical, (rows, heads, n), torch.float32, dev)
    _check_row_tensor("diagonal", diagonal, (rows, heads, n), torch.float32, dev)
    _check_selection(scores, indices, count, rows, heads, n, dev)
    if updates.shape != (layers,) or updates.dtype != torch.int64 or updates.device != dev:
        raise ValueError(f"updates must be [{layers}] int64 on {dev} (each layer's selection counter)")
    member = torch.empty(rows, heads, n, dtype=torch.uint8, device=dev)  # scratch: the selection's mask
    if rows == 0 or heads == 0 or n == 0:
        updates.add_(1)
        return
    tile = _tile(n)
    _spin_update_kernel[(heads, rows)](
        scores, indices, count, vertical, diagonal, member, updates,
        n, heads, indices.shape[-1], rows // layers, float(alpha_vertical), float(alpha_diagonal),
        float(selection_bonus), *_selection_args(scores, indices, count),
        TILE=tile, IDX_TILE=IDX_TILE, num_warps=_warps(tile), **launch_kwargs(dev),
    )


# --- query_similarity ---------------------------------------------------------------------

MAX_LANES = 1024  # merged-list lanes (M_ROWS · K_BLOCK) of the lists' propose; more: rank + top-k
SIMILARITY_VALUES = 2048  # fp32 keys one program of the cosines' launch reads (SLOTS · Q_CHUNK: 4 slots of G·D = 512)


def _qsim_check(query: Tensor, keys: Tensor, set_ids: Tensor, set_count: Tensor, last_selected: Tensor,
                last_z: Tensor, filled: Tensor, pending: Tensor, has_pending: Tensor, neighbours: int) -> None:
    """The checks of query_similarity_rank and _propose (shapes, dtypes, devices)."""
    batch, heads, cache_size, query_size = keys.shape
    n, width = last_z.shape[-1], set_ids.shape[-1]
    dev = keys.device
    if query.shape[:2] != (batch, heads) or query[0, 0].numel() != query_size or query.device != dev:
        raise ValueError(f"query must be [B, Hkv, G, D] with [B, Hkv] = {[batch, heads]} and G·D = {query_size} on "
                         f"{dev}; got {list(query.shape)} on {query.device}")
    _check_row_tensor("keys", keys, (batch, heads, cache_size, query_size), torch.float32, dev)
    _check_row_tensor("set_ids", set_ids, (batch, heads, cache_size + 1, width), torch.int32, dev)
    _check_row_tensor("set_count", set_count, (batch, heads, cache_size + 1), torch.int32, dev)
    _check_row_tensor("last_selected", last_selected, (batch, heads, n), torch.bool, dev)
    _check_row_tensor("last_z", last_z, (batch, heads, n), torch.float32, dev)
    _check_row_tensor("pending", pending, (batch, heads, query_size), torch.float32, dev)
    for name, t, dtype in (("filled", filled, torch.int64), ("has_pending", has_pending, torch.bool)):
        if t.numel() != 1 or t.dtype != dtype or t.device != dev:
            raise ValueError(f"{name} must be one {dtype} on {dev} (the layer's counter)")
    if not 1 <= neighbours <= cache_size:
        raise ValueError(f"neighbours={neighbours} must lie in [1, cache_size={cache_size}]")
    if width > n:
        raise ValueError(f"set_ids holds lists of W = {width} ids, more than the N = {n} blocks")


def query_similarity_rank(query: Tensor, keys: Tensor, set_ids: Tensor, set_count: Tensor, last_selected: Tensor,
                          last_z: Tensor, filled: Tensor, num_blocks: int | Tensor, pending: Tensor, has_pending: Tensor,
                          neighbours: int, recent_blocks: int, tie: float) -> Tensor:
    """One launch: pending <- query / max(‖query‖, 1e-12) (per row and KV head), has_pending <- True,
    -> rank [B, Hkv, N] fp32 = Σ over the `neighbours` cached queries most similar to it (cosine;
    unfilled slots never vote) of (1.5 + s/2)·1[b in their selection] (A_{t-1} instead while no
    pair is cached) + (2·neighbours + 1)·1[among the recent_blocks newest] + tie·last_z, -inf at
    or past num_blocks. query [B, Hkv, G, D] (any float dtype), keys [B, Hkv, C, G·D] fp32,
    set_ids [B, Hkv, C + 1, W] int32 (slot j < C: the selection cached with query j, its distinct
    ids ascending, then padding; slot C: A_{t-1}) with set_count [B, Hkv, C + 1] int32,
    last_selected [B, Hkv, N] bool, last_z [B, Hkv, N] fp32, filled [1] int64, pending
    [B, Hkv, G·D] fp32, has_pending [1] bool."""
    _qsim_check(query, keys, set_ids, set_count, last_selected, last_z, filled, pending, has_pending, neighbours)
    batch, heads, cache_size, query_size = keys.shape
    n, width = last_z.shape[-1], set_ids.shape[-1]
    dev = keys.device
    nb = row_counts(num_blocks, batch, dev)
    rank = torch.empty(batch, heads, n, dtype=torch.float32, device=dev)
    if batch == 0 or heads == 0 or n == 0:
        return rank
    tile = _tile(n)
    _qsim_rank_kernel[(heads, batch)](
        query.contiguous(), keys, set_ids, set_count, last_selected.view(torch.uint8), last_z, filled, nb, pending,
        has_pending.view(torch.uint8), rank,
        n, heads, query_size, cache_size, width, min(recent_blocks, n + 1), float(2 * neighbours + 1), float(tie),
        NEIGHBOURS=neighbours, C_BLOCK=max(16, triton.next_power_of_2(cache_size)),
        M_ROWS=triton.next_power_of_2(neighbours), Q_TILE=max(16, min(triton.next_power_of_2(query_size), 128)),
        TILE=tile, IDX_TILE=IDX_TILE, num_warps=_warps(tile), enable_fp_fusion=False, **launch_kwargs(dev),
    )
    return rank


def query_similarity_propose(query: Tensor, keys: Tensor, set_ids: Tensor, set_count: Tensor, last_selected: Tensor,
                             last_z: Tensor, filled: Tensor, num_blocks: int | Tensor, pending: Tensor,
                             has_pending: Tensor, neighbours: int, recent_blocks: int, tie: float, k: int,
                             fill: Tensor | None = None, fill_valid: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """query_similarity's P: the top-k blocks of `query_similarity_rank` (which it writes to
    pending / has_pending alike) -> (indices [B, Hkv, min(k, N)] int32 ascending, counts [B, Hkv]
    int32). Two launches: the cosines (`_qsim_similarity_kernel`, C / SLOTS programs a KV head),
    then `_qsim_propose_kernel`, which works on the neighbours' id lists, the recent window and the
    fill list in registers (no pass over the N blocks; the lanes' memberships from one sort of
    their (id, row) keys and two scans, O(LANES·log LANES), not a compare of each lane against
    each list) where they hold P: rows of up to MAX_ROW_BLOCK blocks, LANES = (neighbours + 1
    rounded up to a power of two) × max(W, recent_blocks, W_fill / that, 16) (rounded likewise)
    <= MAX_LANES, and tie < 0.5 / sqrt(N - 1) (the voted blocks then outrank the others); where
    they do not (fewer than k candidates and no valid, long enough fill) the same launch takes
    the whole row's top-k. Else rank + topk_select.
    fill: [B, Hkv, W_fill] int32, the W_fill best blocks of tie·last_z best first
    (`fill_reference`), with fill_valid [1] bool (False: not written for this last_z yet); None:
    no fill."""
    _qsim_check(query, keys, set_ids, set_count, last_selected, last_z, filled, pending, has_pending, neighbours)
    batch, heads, cache_size, query_size = keys.shape
    n, width = last_z.shape[-1], set_ids.shape[-1]
    dev = keys.device
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise ValueError(f"k={k!r} must be an int >= 0 (blocks to propose)")
    recent = min(recent_blocks, n + 1)
    m_rows = triton.next_power_of_2(neighbours + 1)
    fill_lanes = triton.next_power_of_2(fill.shape[-1]) if fill is not None and fill.shape[-1] > 0 else 0
    # one list per row of lanes (tiles of 16 at least, as the others here), and lanes enough for the fill list
    k_block = max(16, triton.next_power_of_2(max(width, recent)), fill_lanes // m_rows)
    from_lists = (triton.next_power_of_2(max(n, 1)) <= MAX_ROW_BLOCK and abs(tie) * max(n - 1, 0) ** 0.5 < 0.5
                  and m_rows * k_block <= MAX_LANES)
    if not from_lists or k == 0 or batch == 0 or heads == 0 or n == 0:
        rank = query_similarity_rank(query, keys, set_ids, set_count, last_selected, last_z, filled, num_blocks,
                                     pending, has_pending, neighbours, recent_blocks, tie)
        return propose_top(rank, k, row_counts(num_blocks, batch, dev))
    has_fill = fill is not None and fill.shape[-1] > 0
    if has_fill:
        if fill_valid is None or fill_valid.numel() != 1 or fill_valid.dtype != torch.bool or fill_valid.device != dev:
            raise ValueError(f"fill_valid must be one bool on {dev} (the layer's flag) beside fill")
        if fill.dim() != 3 or fill.shape[:2] != (batch, heads) or fill.shape[-1] > n:
            raise ValueError(f"fill must be [B, Hkv, W] with [B, Hkv] = {[batch, heads]} and W <= N = {n}; got "
                             f"{list(fill.shape)}")
        _check_row_tensor("fill", fill, tuple(fill.shape), torch.int32, dev)
    nb = row_counts(num_blocks, batch, dev)
    k = min(k, n)
    block = triton.next_power_of_2(n)
    fill_width = fill.shape[-1] if has_fill else 0
    indices = torch.empty(batch, heads, k, dtype=torch.int32, device=dev)
    counts = torch.empty(batch, heads, dtype=torch.int32, device=dev)
    similarity = torch.empty(batch, heads, cache_size, dtype=torch.float32, device=dev)
    scratch_row = torch.empty(batch * heads, n, dtype=torch.int32, device=dev)
    q_chunk = min(triton.next_power_of_2(max(query_size, 1)), SIMILARITY_VALUES)
    slots = max(1, min(SIMILARITY_VALUES // q_chunk, triton.next_power_of_2(cache_size)))
    _qsim_similarity_kernel[(heads, batch, triton.cdiv(cache_size, slots))](
        query.contiguous(), keys, pending, has_pending.view(torch.uint8), similarity, heads, query_size, cache_size,
        SLOTS=slots, Q_CHUNK=q_chunk, num_warps=4,
    )
    _qsim_propose_kernel[(heads, batch)](
        similarity, set_ids, set_count, last_z, filled, nb,
        fill if has_fill else indices, fill_valid.view(torch.uint8) if has_fill else counts,
        indices, counts, scratch_row,
        n, heads, cache_size, width, recent, k, k, fill_width, float(2 * neighbours + 1), float(tie),
        NEIGHBOURS=neighbours, C_BLOCK=max(16, triton.next_power_of_2(cache_size)), M_ROWS=m_rows, K_BLOCK=k_block,
        BLOCK=block, HAS_FILL=has_fill, RADIX_BITS=2, PAD_BLOCK=PAD_BLOCK, enable_fp_fusion=False,
        **launch_kwargs(dev),
        # 4 warps for the lists' small tiles; where P must come from the whole row (more than the
        # candidates can hold, no fill list) the row's width, as the row kernels take it
        num_warps=max(4, min(8, block // 256)) if k > neighbours * width + recent and not has_fill else 4,
    )
    return indices, counts


def query_similarity_update(scores: Tensor, indices: Tensor, count: Tensor, keys: Tensor, set_ids: Tensor,
                            set_count: Tensor, pending: Tensor, has_pending: Tensor, cursor: Tensor, filled: Tensor,
                            last_selected: Tensor, last_z: Tensor) -> None:
    """Two launches: last_z <- the scores standardised over the finite entries, last_selected <-
    the selection's mask, slot C of set_ids / set_count <- its list (distinct in-range ids
    ascending, padding 0), and where a propose left a query (has_pending) the ring-buffer slot
    `cursor` <- (pending, the list); then cursor <- (cursor + 1) mod C, filled <- min(filled + 1,
    C), has_pending <- False where it was set. keys [B, Hkv, C, G·D] (G·D = 0: no query yet, no
    pairing), set_ids [B, Hkv, C + 1, W] with W >= min(the selection's capacity, N), the rest as
    query_similarity_rank's; cursor, filled [1] int64, has_pending [1] bool (the layer's)."""
    _qsim_update_rows(scores, indices, count, keys, set_ids, set_count, pending, has_pending, cursor, filled,
                      last_selected, last_z, layers=1)


def query_similarity_update_layers(scores: Tensor, indices: Tensor, count: Tensor, keys: Tensor, set_ids: Tensor,
                                   set_count: Tensor, pending: Tensor, has_pending: Tensor, cursor: Tensor,
                                   filled: Tensor, last_selected: Tensor, last_z: Tensor) -> None:
    """`query_similarity_update` of L layers in the same two launches: every tensor of the state as
    a layer range ([L, B, Hkv, ...], contiguous; cursor, filled [L] int64, has_pending [L] bool),
    scores [L, B, Hkv, N], indices [L, B, Hkv, C_A], count [L, B, Hkv], contiguous. Equal, layer by
    layer, to L `query_similarity_update` calls."""
    layers, batch, heads, n = last_z.shape
    rows = layers * batch

    def state(t: Tensor) -> Tensor:  # [L, B, ...] -> [L·B, ...]: a view, so the writes land in the state
        if t.shape[:2] != (layers, batch):
            raise ValueError(f"the state's tensors must be [L, B, ...] = [{layers}, {batch}, ...]; got {list(t.shape)}")
        return t.view(rows, *t.shape[2:])
    _qsim_update_rows(*_layer_rows(scores, indices, count, layers, batch, heads), state(keys), state(set_ids),
                      state(set_count), state(pending), has_pending, cursor, filled, state(last_selected),
                      state(last_z), layers)


def _qsim_update_rows(scores: Tensor, indices: Tensor, count: Tensor, keys: Tensor, set_ids: Tensor,
                      set_count: Tensor, pending: Tensor, has_pending: Tensor, cursor: Tensor, filled: Tensor,
                      last_selected: Tensor, last_z: Tensor, layers: int) -> None:
    """query_similarity's update over rows [R, Hkv, ...] of `layers` layers (R = layers·B, layer by
    layer), with each layer's counters cursor, filled [layers] int64 and has_pending [layers] bool."""
    rows, heads, cache_size, query_size = keys.shape
    n, width = last_z.shape[-1], set_ids.shape[-1]
    dev = last_z.device
    _check_row_tensor("last_selected", last_selected, (rows, heads, n), torch.bool, dev)
    _check_row_tensor("last_z", last_z, (rows, heads, n), torch.float32, dev)
    _check_row_tensor("set_ids", set_ids, (rows, heads, cache_size + 1, width), torch.int32, dev)
    _check_row_tensor("set_count", set_count, (rows, heads, cache_size + 1), torch.int32, dev)
    _check_selection(scores, indices, count, rows, heads, n, dev)
    if min(indices.shape[-1], n) > width:
        raise ValueError(f"a selection of capacity {indices.shape[-1]} may hold more ids than the W = {width} of "
                         "set_ids (size the lists for the selector's capacity)")
    pair = query_size > 0
    if pair:
        _check_row_tensor("keys", keys, (rows, heads, cache_size, query_size), torch.float32, dev)
        _check_row_tensor("pending", pending, (rows, heads, query_size), torch.float32, dev)
    for name, t, dtype in (("cursor", cursor, torch.int64), ("filled", filled, torch.int64),
                           ("has_pending", has_pending, torch.bool)):
        if t.shape != (layers,) or t.dtype != dtype or t.device != dev or not t.is_contiguous():
            raise ValueError(f"{name} must be [{layers}] {dtype} on {dev}, contiguous (each layer's counter)")
    if rows == 0 or heads == 0 or n == 0:
        return
    tile = _tile(n)
    pdl = launch_kwargs(dev)
    flag = has_pending.view(torch.uint8)
    _qsim_update_kernel[(heads, rows)](
        scores, indices, count, keys if pair else last_z, set_ids, set_count, pending if pair else last_z, flag,
        cursor, last_selected.view(torch.uint8), last_z,
        n, heads, indices.shape[-1], query_size, cache_size, width, rows // layers,
        *_selection_args(scores, indices, count),
        PAIR=pair, TILE=tile, IDX_TILE=IDX_TILE, Q_TILE=max(16, min(triton.next_power_of_2(max(query_size, 1)), 128)),
        num_warps=_warps(tile), **pdl,
    )
    if pair:
        _qsim_counters_kernel[(layers,)](flag, cursor, filled, cache_size, num_warps=1)


def fill_in_one_launch(n: int) -> bool:
    """Whether `query_similarity_fill` takes rows of n blocks (it holds a row in registers)."""
    return triton.next_power_of_2(max(n, 1)) <= MAX_ROW_BLOCK


def query_similarity_fill(last_z: Tensor, tie: float, fill: Tensor, fill_valid: Tensor) -> None:
    """One launch: fill [B, Hkv, W] int32 <- the W blocks of largest tie·last_z (fp32, as the rank
    adds it), best first, ties to the lower id (reference_predict.fill_reference; fewer valid
    blocks: those, then padding 0), fill_valid [1] bool <- True. last_z [B, Hkv, N] fp32, W <= N."""
    batch, heads, n = last_z.shape
    dev = last_z.device
    _check_row_tensor("last_z", last_z, (batch, heads, n), torch.float32, dev)
    if fill.dim() != 3 or fill.shape[:2] != (batch, heads) or fill.shape[-1] > n:
        raise ValueError(f"fill must be [B, Hkv, W] with [B, Hkv] = {[batch, heads]} and W <= N = {n}; got "
                         f"{list(fill.shape)}")
    _check_row_tensor("fill", fill, tuple(fill.shape), torch.int32, dev)
    if fill_valid.numel() != 1 or fill_valid.dtype != torch.bool or fill_valid.device != dev:
        raise ValueError(f"fill_valid must be one bool on {dev} (the layer's flag)")
    width = fill.shape[-1]
    if batch == 0 or heads == 0 or width == 0:
        fill_valid.fill_(True)
        return
    block = triton.next_power_of_2(n)
    if not fill_in_one_launch(n):
        raise ValueError(f"query_similarity_fill holds a row in registers: N = {n} blocks is over {MAX_ROW_BLOCK} "
                         "(fill_in_one_launch); rank with topk_select instead")
    counts = torch.empty(batch * heads, dtype=torch.int32, device=dev)
    _qsim_fill_kernel[(heads, batch)](
        last_z, fill, counts, fill_valid.view(torch.uint8), n, heads, width, float(tie),
        BLOCK=block, FILL_BLOCK=max(16, triton.next_power_of_2(width)), RADIX_BITS=2, PAD_BLOCK=PAD_BLOCK,
        num_warps=max(4, min(8, block // 256)), enable_fp_fusion=False, **launch_kwargs(dev),
    )
