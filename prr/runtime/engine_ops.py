"""The graph engine's operations: one protocol (`EngineOps`), two backends.

`EngineOps` is an abstract class whose methods are every op the engine (prr.runtime.prr_step,
prr.runtime.graph_decode) calls, with the prr.kernels launchers' signatures and results:

- `TritonOps`: each method is the prr.kernels launch of the same name, called with the same
  arguments (the same launches as calling the kernel module; a CUDA device, or the CPU under
  TRITON_INTERPRET=1 for tests). The kernel modules are imported when it is built: the
  triton package is needed only then.
- `TorchOps`: the kernels' torch references (kernels/reference_<op>.py: static shapes, no host
  syncs, at fp32), on any device, so the engine runs on a plain CPU and its step can be
  captured. The kernel tests compare the kernels against these same functions. The Triton-only
  projection ops (dense_gemv, qkv_rope_append, rope_pair_permutation:
  `StaticPlan.projections="fused"`) raise a ValueError saying they need backend=triton.

`engine_ops(backend)` returns the backend's instance; the engine keeps it as `self.ops` and
calls `self.ops.sparse_decode(...)`. Launch-tuning arguments (fuse_merge, arrivals,
tokens_per_split) change how a kernel runs, not what it computes: TorchOps ignores them, and
its launch-plan questions (sparse_decode_one_wave, fused_tail_pays) answer False (one path).
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from dataclasses import dataclass
from types import ModuleType

import torch
from prr.kernels.reference_append_newest import append_newest_reference
from prr.kernels.reference_cache_append import append_token_reference
from prr.kernels.reference_keep_selection import keep_selection_reference
from prr.kernels.reference_prr_merge import merge_speculation_reference, repair_plan_reference
from prr.kernels.reference_prr_repair import repair_and_merge_reference
from prr.kernels.reference_sparse_decode import sparse_decode_reference
from prr.kernels.reference_step_counters import step_counters_reference
from torch import Tensor

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
    if block_size != 1 and block_size < MIN_BLOCK_SIZE:
        out.append(f"the Triton kernels need runtime.block_size >= {MIN_BLOCK_SIZE}, or 1 (token lists: "
                   f"prr.kernels.token_sparse_decode), got {block_size}")
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


Rope = tuple[Tensor, Tensor, Tensor]  # (cos [T, D], sin [T, D], q [B, Hq, D])


class EngineOps(ABC):
    """The engine's ops (see the module docstring); `name` is the backend's."""

    name: str

    # --- attention (prr.kernels.sparse_decode) ---------------------------------------------

    @abstractmethod
    def sparse_decode(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, block_ids: Tensor, block_counts: Tensor,
                      lengths: Tensor, block_size: int, scale: float, per_block: bool = False, *,
                      merge_splits: bool = True, out_dtype: torch.dtype = torch.float32, fuse_merge: bool = False,
                      arrivals: Tensor | None = None,
                      tokens_per_split: int | None = None) -> tuple[Tensor | None, Tensor]:
        """q [B, Hq, D] over the blocks block_ids [B, Hkv, C] (first block_counts [B, Hkv] valid) of
        the caches [B, Hkv, T_max, D], lengths [B] tokens -> (out [B, Hq, D] out_dtype, lse [B, Hq]
        fp32); per_block: ([B, Hq, C, D], [B, Hq, C]) fp32, at block_size 1 (None, [B, Hq, C]): a
        token's state is (v_t, scale q·k_t), and its value row stays in the cache, where
        `repair_and_merge` reads it (part_out=None); merge_splits=False: the unmerged split
        states ([B, Hq, S, D], [B, Hq, S]) fp32."""

    @abstractmethod
    def sparse_decode_one_wave(self, capacity: int, batch: int, num_kv_heads: int, block_size: int,
                               device: torch.device | str = "cuda", *, head_dim: int,
                               cache_dtype: torch.dtype) -> bool:
        """Whether sparse_decode's default plan over `capacity` blocks fills at most one wave
        (StaticPlan.fuse_merge="one_wave")."""

    # --- cache append (prr.kernels.cache_append) ---------------------------------------------

    @abstractmethod
    def append_token(self, k_cache: Tensor, v_cache: Tensor, k_new: Tensor, v_new: Tensor, positions: Tensor,
                     key_max: Tensor | None = None, key_min: Tensor | None = None, block_size: int = 16,
                     rope: Rope | None = None) -> Tensor | None:
        """This step's K/V [B, Hkv, D] written at positions [B] into the caches [B, Hkv, T_max, D],
        in place (and the Quest metadata key_max / key_min [B, Hkv, NB_max, D] when given);
        rope = (cos, sin, q): q and k rotated first -> the rotated q [B, Hq, D], else None."""

    # --- PRR's repair and merge (prr.kernels.prr_merge, prr.kernels.prr_repair) -------------

    @abstractmethod
    def repair_scratch(self, batch: int, num_kv_heads: int, max_blocks: int, device: torch.device | str) -> Tensor:
        """The zeroed int8 [B, Hkv, NB_max] scratch `repair_plan` takes (one per stream)."""

    @abstractmethod
    def repair_plan(self, sel_idx: Tensor, sel_cnt: Tensor, pred_idx: Tensor, pred_cnt: Tensor,
                    scratch: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """A: sel_idx [B, Hkv, K] int32 / sel_cnt [B, Hkv]; P: pred_idx [B, Hkv, C] / pred_cnt.
        -> (A \\ P [B, Hkv, K] int32 in A's order, its counts [B, Hkv] int32, keep [B, Hkv, C] bool:
        P entry valid and in A)."""

    @abstractmethod
    def merge_speculation(self, part_out: Tensor, part_lse: Tensor, keep: Tensor, rep_out: Tensor, rep_lse: Tensor,
                          out_dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
        """⊕ of the kept per-block states of P (part_out [B, Hq, C, D], part_lse [B, Hq, C]; keep
        [B, Hkv, C]) ⊕ the repair ([B, Hq, (D)] or its splits [B, Hq, S, (D)])
        -> (out [B, Hq, D] out_dtype, lse [B, Hq] fp32)."""

    @abstractmethod
    def repair_and_merge(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, sel_idx: Tensor, sel_cnt: Tensor,
                         pred_idx: Tensor, pred_cnt: Tensor, lengths: Tensor, part_out: Tensor | None,
                         part_lse: Tensor, block_size: int, scale: float, *, out_dtype: torch.dtype = torch.float32,
                         arrivals: Tensor | None = None,
                         tokens_per_split: int | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """repair_plan, attention over A \\ P and merge_speculation in one -> (out [B, Hq, D]
        out_dtype, lse [B, Hq] fp32, keep [B, Hkv, C_P] bool). part_out=None (block_size 1, P's
        states from sparse_decode per_block): each kept token's value row is read from v_cache."""

    @abstractmethod
    def fused_tail_pays(self, sel_cap: int, pred_cap: int, rows: int, device: torch.device | str) -> bool:
        """Whether `repair_and_merge` beats the three ops at these sizes (StaticPlan.fused_repair="auto")."""

    # --- selection counters (prr.kernels.step_counters) --------------------------------------

    @abstractmethod
    def counter_scratch(self, batch: int, num_kv_heads: int, max_blocks: int, device: torch.device | str) -> Tensor:
        """The zeroed int8 [2, B * Hkv, NB] scratch `step_counters` takes."""

    @abstractmethod
    def step_counters(self, sel_idx: Tensor, sel_cnt: Tensor, pred_idx: Tensor | None, pred_cnt: Tensor | None,
                      prev_idx: Tensor, prev_cnt: Tensor, scratch: Tensor, out: Tensor) -> None:
        """out [4, B * Hkv] int64 += (|A|, |P|, |P ∩ A|, |A ∩ A_{t-1}|); A_{t-1} (prev_idx [B, Hkv, K],
        prev_cnt [B, Hkv]) <- A, in place. P may be None."""

    @abstractmethod
    def layer_counter_scratch(self, layers: int, batch: int, num_kv_heads: int, max_blocks: int,
                              device: torch.device | str) -> Tensor:
        """The zeroed int8 [L, 2, B * Hkv, NB] scratch `step_counters_layers` takes."""

    @abstractmethod
    def step_counters_layers(self, sel_idx: Tensor, sel_cnt: Tensor, pred_idx: Tensor | None,
                             pred_cnt: Tensor | None, prev_idx: Tensor, prev_cnt: Tensor, scratch: Tensor,
                             out: Tensor) -> None:
        """`step_counters` of each layer of the [L, ...] arguments (out [L, 4, B * Hkv])."""

    # --- selection reuse (prr.kernels.append_newest, prr.kernels.keep_selection) ----------------

    @abstractmethod
    def append_newest_block(self, indices: Tensor, count: Tensor, num_blocks: Tensor, width: int,
                            out: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
        """A: indices [B, Hkv, C] (distinct ids, any order; the first count [B, Hkv] valid) with each
        row's newest block (num_blocks [B] - 1) added -> (A ∪ {newest} [B, Hkv, width] int32 ascending,
        zero padded; its size [B, Hkv] int32); width >= C. out: contiguous int32 ([B, Hkv, width],
        [B, Hkv]) written and returned instead, the inputs themselves (in place) or apart from them."""

    @abstractmethod
    def keep_selection(self, indices: Tensor, count: Tensor, scores: Tensor | None, out_indices: Tensor,
                       out_count: Tensor, out_scores: Tensor | None) -> None:
        """A: indices [B, Hkv, C] -> out_indices [B, Hkv, width] int32 (zeros past C), count [B, Hkv]
        -> out_count int32, scores [B, Hkv, NB] -> out_scores fp32 (None: skipped), in place."""

    # --- projections (Triton only: prr.kernels.dense_gemv, prr.kernels.qkv_append) -----------

    @abstractmethod
    def dense_gemv(self, x: Tensor, weight: Tensor, bias: Tensor | None = None, *,
                   norm_weight: Tensor | None = None, eps: float = 1e-6, residual: Tensor | None = None,
                   swiglu: bool = False, out: Tensor | None = None) -> Tensor:
        """x [M, K] @ weight [N_w, K]^T (+ bias), RMSNorm of x first with norm_weight, SwiGLU of
        [gate | up], residual [M, N] += the result in place -> y [M, N] (written into out when given)."""

    @abstractmethod
    def qkv_rope_append(self, x: Tensor, weight_perm: Tensor, bias_perm: Tensor | None, norm_weight: Tensor | None,
                        eps: float, k_cache: Tensor, v_cache: Tensor, positions: Tensor, cos: Tensor, sin: Tensor,
                        key_max: Tensor | None, key_min: Tensor | None, block_size: int, num_q_heads: int,
                        num_kv_heads: int) -> Tensor:
        """One row's q|k|v projection (x [1, H]), RoPE and append -> q_rot [1, Hq, D]."""

    @abstractmethod
    def rope_pair_permutation(self, num_q_heads: int, num_kv_heads: int, head_dim: int) -> Tensor:
        """-> the row permutation [(Hq + 2 Hkv) D] int64 `qkv_rope_append`'s weight takes."""


class TorchOps(EngineOps):
    """The kernels' torch references (kernels/reference_<op>.py) at fp32, on any device."""

    name = "torch"

    def sparse_decode(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, block_ids: Tensor, block_counts: Tensor,
                      lengths: Tensor, block_size: int, scale: float, per_block: bool = False, *,
                      merge_splits: bool = True, out_dtype: torch.dtype = torch.float32, fuse_merge: bool = False,
                      arrivals: Tensor | None = None,
                      tokens_per_split: int | None = None) -> tuple[Tensor | None, Tensor]:
        out, lse = sparse_decode_reference(q, k_cache, v_cache, block_ids, block_counts, lengths, block_size, scale,
                                           per_block, compute_dtype=torch.float32)
        if per_block:
            return (None, lse) if block_size == 1 else (out, lse)  # token states: values stay in the cache
        if not merge_splits:  # one "split": the merged state
            return out.unsqueeze(2), lse.unsqueeze(2)
        return out.to(out_dtype), lse

    def sparse_decode_one_wave(self, capacity: int, batch: int, num_kv_heads: int, block_size: int,
                               device: torch.device | str = "cuda", *, head_dim: int,
                               cache_dtype: torch.dtype) -> bool:
        return False  # no splits to merge in the kernel

    def append_token(self, k_cache: Tensor, v_cache: Tensor, k_new: Tensor, v_new: Tensor, positions: Tensor,
                     key_max: Tensor | None = None, key_min: Tensor | None = None, block_size: int = 16,
                     rope: Rope | None = None) -> Tensor | None:
        if key_max is not None or key_min is not None:
            raise ValueError("the torch backend leaves metadata to the selector's append_metadata: "
                             "pass key_max = key_min = None")
        return append_token_reference(k_cache, v_cache, k_new, v_new, positions, rope)

    def repair_scratch(self, batch: int, num_kv_heads: int, max_blocks: int, device: torch.device | str) -> Tensor:
        # Only its last dim (NB_max) is read here.
        return torch.zeros(batch, num_kv_heads, max_blocks, dtype=torch.int8, device=device)

    def repair_plan(self, sel_idx: Tensor, sel_cnt: Tensor, pred_idx: Tensor, pred_cnt: Tensor,
                    scratch: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        return repair_plan_reference(sel_idx, sel_cnt, pred_idx, pred_cnt, scratch.shape[-1])

    def merge_speculation(self, part_out: Tensor, part_lse: Tensor, keep: Tensor, rep_out: Tensor, rep_lse: Tensor,
                          out_dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
        out, lse = merge_speculation_reference(part_out, part_lse, keep, rep_out, rep_lse, torch.float32)
        return out.to(out_dtype), lse

    def repair_and_merge(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, sel_idx: Tensor, sel_cnt: Tensor,
                         pred_idx: Tensor, pred_cnt: Tensor, lengths: Tensor, part_out: Tensor | None,
                         part_lse: Tensor, block_size: int, scale: float, *, out_dtype: torch.dtype = torch.float32,
                         arrivals: Tensor | None = None,
                         tokens_per_split: int | None = None) -> tuple[Tensor, Tensor, Tensor]:
        out, lse, keep = repair_and_merge_reference(q, k_cache, v_cache, sel_idx, sel_cnt, pred_idx, pred_cnt, lengths,
                                                    part_out, part_lse, block_size, scale, torch.float32)
        return out.to(out_dtype), lse, keep

    def fused_tail_pays(self, sel_cap: int, pred_cap: int, rows: int, device: torch.device | str) -> bool:
        return False  # the same torch ops either way

    def counter_scratch(self, batch: int, num_kv_heads: int, max_blocks: int, device: torch.device | str) -> Tensor:
        # Only its last dim (NB) is read here.
        return torch.zeros(2, batch * num_kv_heads, max_blocks, dtype=torch.int8, device=device)

    def step_counters(self, sel_idx: Tensor, sel_cnt: Tensor, pred_idx: Tensor | None, pred_cnt: Tensor | None,
                      prev_idx: Tensor, prev_cnt: Tensor, scratch: Tensor, out: Tensor) -> None:
        out += step_counters_reference(sel_idx, sel_cnt, pred_idx, pred_cnt, prev_idx, prev_cnt, scratch.shape[-1])
        prev_idx.copy_(sel_idx)
        prev_cnt.copy_(sel_cnt)

    def layer_counter_scratch(self, layers: int, batch: int, num_kv_heads: int, max_blocks: int,
                              device: torch.device | str) -> Tensor:
        return torch.zeros(layers, 2, batch * num_kv_heads, max_blocks, dtype=torch.int8, device=device)

    def step_counters_layers(self, sel_idx: Tensor, sel_cnt: Tensor, pred_idx: Tensor | None,
                             pred_cnt: Tensor | None, prev_idx: Tensor, prev_cnt: Tensor, scratch: Tensor,
                             out: Tensor) -> None:
        for i in range(sel_idx.shape[0]):
            self.step_counters(sel_idx[i], sel_cnt[i], None if pred_idx is None else pred_idx[i],
                               None if pred_cnt is None else pred_cnt[i], prev_idx[i], prev_cnt[i], scratch[i], out[i])

    def append_newest_block(self, indices: Tensor, count: Tensor, num_blocks: Tensor, width: int,
                            out: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
        return append_newest_reference(indices, count, num_blocks, width, out)

    def keep_selection(self, indices: Tensor, count: Tensor, scores: Tensor | None, out_indices: Tensor,
                       out_count: Tensor, out_scores: Tensor | None) -> None:
        keep_selection_reference(indices, count, scores, out_indices, out_count, out_scores)

    def dense_gemv(self, x: Tensor, weight: Tensor, bias: Tensor | None = None, *,
                   norm_weight: Tensor | None = None, eps: float = 1e-6, residual: Tensor | None = None,
                   swiglu: bool = False, out: Tensor | None = None) -> Tensor:
        raise _needs_triton("dense_gemv")

    def qkv_rope_append(self, x: Tensor, weight_perm: Tensor, bias_perm: Tensor | None, norm_weight: Tensor | None,
                        eps: float, k_cache: Tensor, v_cache: Tensor, positions: Tensor, cos: Tensor, sin: Tensor,
                        key_max: Tensor | None, key_min: Tensor | None, block_size: int, num_q_heads: int,
                        num_kv_heads: int) -> Tensor:
        raise _needs_triton("qkv_rope_append")

    def rope_pair_permutation(self, num_q_heads: int, num_kv_heads: int, head_dim: int) -> Tensor:
        raise _needs_triton("rope_pair_permutation")


def _needs_triton(op: str) -> ValueError:
    return ValueError(f"{op} is a Triton-only projection kernel: StaticPlan.projections='fused' needs "
                      "backend=triton; with backend=torch use projections='torch'")


class TritonOps(EngineOps):
    """The prr.kernels launches: each method calls the launcher of the same name with the same
    arguments (nothing added, nothing converted)."""

    name = "triton"

    def __init__(self) -> None:
        from prr.kernels import (
            append_newest,
            cache_append,
            dense_gemv,
            keep_selection,
            prr_merge,
            prr_repair,
            qkv_append,
            sparse_decode,
            step_counters,
            token_sparse_decode,
        )

        self._attention: ModuleType = sparse_decode
        self._token_attention: ModuleType = token_sparse_decode  # block_size 1: a block is a token
        self._append: ModuleType = cache_append
        self._merge: ModuleType = prr_merge
        self._repair: ModuleType = prr_repair
        self._counters: ModuleType = step_counters
        self._gemv: ModuleType = dense_gemv
        self._qkv: ModuleType = qkv_append
        self._newest: ModuleType = append_newest
        self._keep: ModuleType = keep_selection

    def sparse_decode(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, block_ids: Tensor, block_counts: Tensor,
                      lengths: Tensor, block_size: int, scale: float, per_block: bool = False, *,
                      merge_splits: bool = True, out_dtype: torch.dtype = torch.float32, fuse_merge: bool = False,
                      arrivals: Tensor | None = None,
                      tokens_per_split: int | None = None) -> tuple[Tensor | None, Tensor]:
        if block_size == 1:  # token lists (selector=indexer): the token kernel
            if per_block:  # one state a token: (v, scale q·k); v stays in the cache (repair_and_merge reads it)
                return None, self._token_attention.token_scores(q, k_cache, block_ids, block_counts, lengths, scale,
                                                                tokens_per_program=tokens_per_split)
            return self._token_attention.token_sparse_decode(
                q, k_cache, v_cache, block_ids, block_counts, lengths, scale, merge_splits=merge_splits,
                out_dtype=out_dtype, fuse_merge=fuse_merge, arrivals=arrivals, tokens_per_split=tokens_per_split)
        return self._attention.sparse_decode(q, k_cache, v_cache, block_ids, block_counts, lengths, block_size, scale,
                                             per_block, merge_splits=merge_splits, out_dtype=out_dtype,
                                             fuse_merge=fuse_merge, arrivals=arrivals,
                                             tokens_per_split=tokens_per_split)

    def sparse_decode_one_wave(self, capacity: int, batch: int, num_kv_heads: int, block_size: int,
                               device: torch.device | str = "cuda", *, head_dim: int,
                               cache_dtype: torch.dtype) -> bool:
        if block_size == 1:  # (the token kernel's merge stays a launch of its own: not timed fused yet)
            return False
        return self._attention.sparse_decode_one_wave(capacity, batch, num_kv_heads, block_size, device,
                                                      head_dim=head_dim, cache_dtype=cache_dtype)

    def append_token(self, k_cache: Tensor, v_cache: Tensor, k_new: Tensor, v_new: Tensor, positions: Tensor,
                     key_max: Tensor | None = None, key_min: Tensor | None = None, block_size: int = 16,
                     rope: Rope | None = None) -> Tensor | None:
        return self._append.append_token(k_cache, v_cache, k_new, v_new, positions, key_max, key_min, block_size,
                                         rope=rope)

    def repair_scratch(self, batch: int, num_kv_heads: int, max_blocks: int, device: torch.device | str) -> Tensor:
        return self._merge.repair_scratch(batch, num_kv_heads, max_blocks, device)

    def repair_plan(self, sel_idx: Tensor, sel_cnt: Tensor, pred_idx: Tensor, pred_cnt: Tensor,
                    scratch: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        return self._merge.repair_plan(sel_idx, sel_cnt, pred_idx, pred_cnt, scratch)

    def merge_speculation(self, part_out: Tensor, part_lse: Tensor, keep: Tensor, rep_out: Tensor, rep_lse: Tensor,
                          out_dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
        return self._merge.merge_speculation(part_out, part_lse, keep, rep_out, rep_lse, out_dtype=out_dtype)

    def repair_and_merge(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, sel_idx: Tensor, sel_cnt: Tensor,
                         pred_idx: Tensor, pred_cnt: Tensor, lengths: Tensor, part_out: Tensor | None,
                         part_lse: Tensor, block_size: int, scale: float, *, out_dtype: torch.dtype = torch.float32,
                         arrivals: Tensor | None = None,
                         tokens_per_split: int | None = None) -> tuple[Tensor, Tensor, Tensor]:
        return self._repair.repair_and_merge(q, k_cache, v_cache, sel_idx, sel_cnt, pred_idx, pred_cnt, lengths,
                                             part_out, part_lse, block_size, scale, out_dtype=out_dtype,
                                             arrivals=arrivals, tokens_per_split=tokens_per_split)

    def fused_tail_pays(self, sel_cap: int, pred_cap: int, rows: int, device: torch.device | str) -> bool:
        return self._repair.fused_tail_pays(sel_cap, pred_cap, rows, device)

    def counter_scratch(self, batch: int, num_kv_heads: int, max_blocks: int, device: torch.device | str) -> Tensor:
        return self._counters.counter_scratch(batch, num_kv_heads, max_blocks, device)

    def step_counters(self, sel_idx: Tensor, sel_cnt: Tensor, pred_idx: Tensor | None, pred_cnt: Tensor | None,
                      prev_idx: Tensor, prev_cnt: Tensor, scratch: Tensor, out: Tensor) -> None:
        self._counters.step_counters(sel_idx, sel_cnt, pred_idx, pred_cnt, prev_idx, prev_cnt, scratch, out)

    def layer_counter_scratch(self, layers: int, batch: int, num_kv_heads: int, max_blocks: int,
                              device: torch.device | str) -> Tensor:
        return self._counters.layer_counter_scratch(layers, batch, num_kv_heads, max_blocks, device)

    def step_counters_layers(self, sel_idx: Tensor, sel_cnt: Tensor, pred_idx: Tensor | None,
                             pred_cnt: Tensor | None, prev_idx: Tensor, prev_cnt: Tensor, scratch: Tensor,
                             out: Tensor) -> None:
        self._counters.step_counters_layers(sel_idx, sel_cnt, pred_idx, pred_cnt, prev_idx, prev_cnt, scratch, out)

    def append_newest_block(self, indices: Tensor, count: Tensor, num_blocks: Tensor, width: int,
                            out: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
        return self._newest.append_newest_block(indices, count, num_blocks, width, out)

    def keep_selection(self, indices: Tensor, count: Tensor, scores: Tensor | None, out_indices: Tensor,
                       out_count: Tensor, out_scores: Tensor | None) -> None:
        self._keep.keep_selection(indices, count, scores, out_indices, out_count, out_scores)

    def dense_gemv(self, x: Tensor, weight: Tensor, bias: Tensor | None = None, *,
                   norm_weight: Tensor | None = None, eps: float = 1e-6, residual: Tensor | None = None,
                   swiglu: bool = False, out: Tensor | None = None) -> Tensor:
        return self._gemv.dense_gemv(x, weight, bias, norm_weight=norm_weight, eps=eps, residual=residual,
                                     swiglu=swiglu, out=out)

    def qkv_rope_append(self, x: Tensor, weight_perm: Tensor, bias_perm: Tensor | None, norm_weight: Tensor | None,
                        eps: float, k_cache: Tensor, v_cache: Tensor, positions: Tensor, cos: Tensor, sin: Tensor,
                        key_max: Tensor | None, key_min: Tensor | None, block_size: int, num_q_heads: int,
                        num_kv_heads: int) -> Tensor:
        return self._qkv.qkv_rope_append(x, weight_perm, bias_perm, norm_weight, eps, k_cache, v_cache, positions,
                                         cos, sin, key_max, key_min, block_size, num_q_heads, num_kv_heads)

    def rope_pair_permutation(self, num_q_heads: int, num_kv_heads: int, head_dim: int) -> Tensor:
        return self._qkv.rope_pair_permutation(num_q_heads, num_kv_heads, head_dim)


def engine_ops(backend: str) -> EngineOps:
    """The engine's ops on `backend` ("torch" or "triton": BACKENDS); a fresh instance each call."""
    if backend == "torch":
        return TorchOps()
    if backend == "triton":
        return TritonOps()
    raise ValueError(f"engine backend {backend!r} is not one of {list(BACKENDS)}")
