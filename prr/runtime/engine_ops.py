"""The graph engine's operations, on one of two backends with one set of signatures:

- `triton`: the prr.kernels launches (a CUDA device, or the CPU under TRITON_INTERPRET=1 for
  tests);
- `torch`: static-shape torch ops on any device, built from the eager runtime's own
  attention and merge (prr.block_attention.partials_over, prr.attention_state) and block-set
  algebra (prr.blocks), so the engine runs on a plain CPU and its step can be captured.

`engine_ops(backend)` returns the name -> namespace dict the engine calls through
(`AttentionEngine._k`); each torch namespace has the functions of the kernel module of the same
name that the engine uses, with the same arguments and results. Launch-tuning arguments
(fuse_merge, arrivals, tokens_per_split) change how a kernel runs, not what it computes, and
are ignored by torch. The Triton-only projection kernels (dense_gemv, qkv_append) have no
torch namespace: `StaticPlan.projections="fused"` needs backend triton.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
from prr.kernels.reference_merge import lse_merge, lse_merge_many
from torch import Tensor

from prr.attention_state import merge_many
from prr.block_attention import partials_over
from prr.blocks import BlockSet

BACKENDS = ("triton", "torch")


@dataclass(frozen=True)
class OpsBackend:
    """The `backend` config group (conf/backend): `name`, the op backend of every engine in the
    run; `graph_on_gpu`, the CUDA-graph engine's on a GPU where it differs (backend=auto, the
    default: torch ops for the eager runtime and the prefill, the Triton kernels for the engine)."""

    name: str
    graph_on_gpu: str | None = None

    def __post_init__(self) -> None:
        if self.name not in BACKENDS:
            raise ValueError(f"backend={self.name!r} is not one of {list(BACKENDS)}")
        if self.graph_on_gpu is not None and self.graph_on_gpu not in BACKENDS:
            raise ValueError(f"backend.graph_on_gpu={self.graph_on_gpu!r} is not one of {list(BACKENDS)} or null")


def triton_shape_problems(head_dim: int, block_size: int) -> list[str]:
    """What the Triton kernels cannot take, from their own limits (prr.kernels.sparse_decode's
    SUPPORTED_HEAD_DIMS and MIN_BLOCK_SIZE: the attention kernels every engine step runs).
    Needs the triton package."""
    from prr.kernels.sparse_decode import MIN_BLOCK_SIZE, SUPPORTED_HEAD_DIMS

    out = []
    if head_dim not in SUPPORTED_HEAD_DIMS:
        out.append(f"head_dim={head_dim} is not one of the Triton kernels' {list(SUPPORTED_HEAD_DIMS)}")
    if block_size < MIN_BLOCK_SIZE:
        out.append(f"the Triton kernels need runtime.block_size >= {MIN_BLOCK_SIZE}, got {block_size}")
    return out


def triton_problems(device: str, head_dim: int, block_size: int) -> list[str]:
    """Reasons backend=triton cannot run this configuration (empty when it can)."""
    out = []
    try:
        import triton  # noqa: F401
    except ImportError:
        return ["backend=triton needs the triton package (pip install triton), or use backend=torch"]
    if not device.startswith("cuda") and os.environ.get("TRITON_INTERPRET") != "1":
        out.append(f"backend=triton runs on a CUDA device (runtime.device={device!r}); on a CPU only under "
                   "TRITON_INTERPRET=1, for tests. Use backend=torch on the CPU")
    return out + [f"backend=triton: {p}; use backend=torch" for p in triton_shape_problems(head_dim, block_size)]


def _blocked(cache: Tensor, block_size: int) -> Tensor:
    """[B, Hkv, T_max, D] -> [B, Hkv, NB, S, D] (a view: the cache is block-aligned)."""
    b, h, t, d = cache.shape
    return cache.view(b, h, t // block_size, block_size, d)


def sparse_decode(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_ids: Tensor, block_counts: Tensor,
                  lengths: Tensor, block_size: int, scale: float, per_block: bool = False, *,
                  merge_splits: bool = True, out_dtype: torch.dtype = torch.float32, fuse_merge: bool = False,
                  arrivals: Tensor | None = None, tokens_per_split: int | None = None) -> tuple[Tensor, Tensor]:
    """q [B, Hq, D] over the listed blocks -> (out [B, Hq, D] out_dtype, lse [B, Hq] fp32); per_block:
    ([B, Hq, C, D], [B, Hq, C]); merge_splits=False: one "split" ([B, Hq, 1, D], [B, Hq, 1])."""
    b, hq, d = q.shape
    hkv = k_cache.shape[1]
    state = partials_over(q.view(b, hkv, hq // hkv, d), _blocked(k_cache, block_size), _blocked(v_cache, block_size),
                          BlockSet(block_ids, block_counts), lengths, scale)  # [B, Hkv, G, C, (D)]
    c = block_ids.shape[-1]
    if per_block:
        return state.out.reshape(b, hq, c, d), state.lse.reshape(b, hq, c)
    merged = merge_many(state.out, state.lse)
    out, lse = merged.out.reshape(b, hq, d), merged.lse.reshape(b, hq)
    if not merge_splits:
        return out.unsqueeze(2), lse.unsqueeze(2)
    return out.to(out_dtype), lse


def append_token(k_cache: Tensor, v_cache: Tensor, k_new: Tensor, v_new: Tensor, positions: Tensor,
                 key_max: Tensor | None = None, key_min: Tensor | None = None, block_size: int = 16,
                 rope: tuple[Tensor, Tensor, Tensor] | None = None) -> Tensor | None:
    """This step's K/V [B, Hkv, D] at positions [B] (rope = (cos, sin, q): k and q rotated first,
    in fp32, rounded once) -> the rotated q or None. The metadata is the selector's own update
    (`Selector.append_metadata`): key_max / key_min must be None."""
    if key_max is not None or key_min is not None:
        raise ValueError("the torch backend leaves metadata to the selector's append_metadata: pass key_max = key_min = None")
    rows, pos = torch.arange(k_cache.shape[0], device=k_cache.device), positions.long()
    q_rot = None
    if rope is not None:
        cos, sin, q = rope
        c, s = cos[pos].float().unsqueeze(1), sin[pos].float().unsqueeze(1)  # [B, 1, D]

        def rotate(x: Tensor) -> Tensor:
            half = x.shape[-1] // 2
            x = x.float()
            return x * c + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * s
        q_rot, k_new = rotate(q).to(q.dtype), rotate(k_new)
    k_cache[rows, :, pos] = k_new.to(k_cache.dtype)
    v_cache[rows, :, pos] = v_new.to(v_cache.dtype)
    return q_rot


def repair_scratch(batch: int, num_kv_heads: int, max_blocks: int, device: torch.device | str) -> Tensor:
    """The membership scratch the kernel needs; here it only carries NB (its last dim)."""
    return torch.zeros(batch, num_kv_heads, max_blocks, dtype=torch.int8, device=device)


def repair_plan(sel_idx: Tensor, sel_cnt: Tensor, pred_idx: Tensor, pred_cnt: Tensor,
                scratch: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """A, P -> (A \\ P [B, Hkv, K] int32 ascending (A's order), its counts, keep [B, Hkv, C]:
    P entry valid and in A)."""
    max_blocks = scratch.shape[-1]
    selection, prediction = BlockSet(sel_idx, sel_cnt), BlockSet(pred_idx, pred_cnt)
    selected = selection.mask(max_blocks)
    missed = BlockSet.from_mask(selected & ~prediction.mask(max_blocks), sel_idx.shape[-1])
    valid = prediction.valid()  # padding entries may hold any id: never index with them
    keep = torch.gather(selected, -1, torch.where(valid, pred_idx.long(), 0)) & valid
    return missed.indices.to(torch.int32), missed.count.to(torch.int32), keep


def merge_speculation(part_out: Tensor, part_lse: Tensor, keep: Tensor, rep_out: Tensor, rep_lse: Tensor,
                      out_dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
    """⊕ of the kept per-block states of P [B, Hq, C, (D)] (keep [B, Hkv, C]) ⊕ the repair
    ([B, Hq, (D)] or its splits [B, Hq, S, (D)]) -> (out [B, Hq, D] out_dtype, lse [B, Hq])."""
    group = part_out.shape[1] // keep.shape[1]
    spec = lse_merge_many(part_out, part_lse, keep.repeat_interleave(group, dim=1))
    repair = lse_merge_many(rep_out, rep_lse) if rep_out.dim() == 4 else (rep_out, rep_lse)
    out, lse = lse_merge(*spec, *repair)
    return out.to(out_dtype), lse


def repair_and_merge(q: Tensor, k_cache: Tensor, v_cache: Tensor, sel_idx: Tensor, sel_cnt: Tensor,
                     pred_idx: Tensor, pred_cnt: Tensor, lengths: Tensor, part_out: Tensor, part_lse: Tensor,
                     block_size: int, scale: float, *, out_dtype: torch.dtype = torch.float32,
                     arrivals: Tensor | None = None, tokens_per_split: int | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """The fused tail's result from the three steps: repair_plan, attention over A \\ P, merge."""
    scratch = repair_scratch(0, 0, k_cache.shape[2] // block_size, q.device)
    miss_idx, miss_cnt, keep = repair_plan(sel_idx, sel_cnt, pred_idx, pred_cnt, scratch)
    rep_out, rep_lse = sparse_decode(q, k_cache, v_cache, miss_idx, miss_cnt, lengths, block_size, scale)
    out, lse = merge_speculation(part_out, part_lse, keep, rep_out, rep_lse, out_dtype)
    return out, lse, keep


def counter_scratch(batch: int, num_kv_heads: int, max_blocks: int, device: torch.device | str) -> Tensor:
    """As the kernel's; here it only carries NB (its last dim)."""
    return torch.zeros(2, batch * num_kv_heads, max_blocks, dtype=torch.int8, device=device)


def step_counters(sel_idx: Tensor, sel_cnt: Tensor, pred_idx: Tensor | None, pred_cnt: Tensor | None,
                  prev_idx: Tensor, prev_cnt: Tensor, scratch: Tensor, out: Tensor) -> None:
    """out [4, B * Hkv] += (|A|, |P|, |P ∩ A|, |A ∩ A_{t-1}|); A_{t-1} (prev) <- A, in place."""
    max_blocks = scratch.shape[-1]
    selected = BlockSet(sel_idx, sel_cnt).mask(max_blocks)
    predicted = BlockSet(pred_idx, pred_cnt).mask(max_blocks) if pred_idx is not None else torch.zeros_like(selected)
    previous = BlockSet(prev_idx, prev_cnt).mask(max_blocks)
    counts = torch.stack([selected.sum(-1), predicted.sum(-1), (selected & predicted).sum(-1),
                          (selected & previous).sum(-1)])  # [4, B, Hkv]
    out += counts.flatten(1)
    prev_idx.copy_(sel_idx)
    prev_cnt.copy_(sel_cnt)


def layer_counter_scratch(layers: int, batch: int, num_kv_heads: int, max_blocks: int,
                          device: torch.device | str) -> Tensor:
    """As the kernel's ([L, 2, B * Hkv, NB]); here it only carries NB (its last dim)."""
    return torch.zeros(layers, 2, batch * num_kv_heads, max_blocks, dtype=torch.int8, device=device)


def step_counters_layers(sel_idx: Tensor, sel_cnt: Tensor, pred_idx: Tensor | None, pred_cnt: Tensor | None,
                         prev_idx: Tensor, prev_cnt: Tensor, scratch: Tensor, out: Tensor) -> None:
    """`step_counters` of each layer of the [L, ...] arguments (out [L, 4, B * Hkv])."""
    for i in range(sel_idx.shape[0]):
        step_counters(sel_idx[i], sel_cnt[i], None if pred_idx is None else pred_idx[i],
                      None if pred_cnt is None else pred_cnt[i], prev_idx[i], prev_cnt[i], scratch[i], out[i])


def _never(*args: Any, **kwargs: Any) -> bool:
    return False


TORCH = {
    "sparse_decode": SimpleNamespace(sparse_decode=sparse_decode, sparse_decode_one_wave=_never),
    "cache_append": SimpleNamespace(append_token=append_token),
    "prr_merge": SimpleNamespace(repair_scratch=repair_scratch, repair_plan=repair_plan,
                                 merge_speculation=merge_speculation),
    "prr_repair": SimpleNamespace(repair_and_merge=repair_and_merge, fused_tail_pays=_never),
    "step_counters": SimpleNamespace(counter_scratch=counter_scratch, step_counters=step_counters,
                                     layer_counter_scratch=layer_counter_scratch,
                                     step_counters_layers=step_counters_layers),
}


def engine_ops(backend: str) -> dict[str, Any]:
    """The engine's operations by kernel-module name, for `backend`."""
    if backend == "torch":
        return dict(TORCH)
    if backend == "triton":
        from prr.kernels import (
            cache_append,
            dense_gemv,
            prr_merge,
            prr_repair,
            qkv_append,
            sparse_decode,
            step_counters,
        )

        return dict(cache_append=cache_append, dense_gemv=dense_gemv, prr_merge=prr_merge, prr_repair=prr_repair,
                    step_counters=step_counters, qkv_append=qkv_append, sparse_decode=sparse_decode)
    raise ValueError(f"engine backend {backend!r} is not one of {list(BACKENDS)}")
