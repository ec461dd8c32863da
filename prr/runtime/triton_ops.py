"""The `triton` backend of BlockAttentionOps: prr.kernels' sparse_decode and merge.

Runs on a CUDA device, or on the CPU under TRITON_INTERPRET=1 (correctness tests only).
`problems()` lists what this backend cannot run, for startup validation.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from prr.attention_state import AttentionState
from prr.blocks import BlockSet
from prr.cache import PagedKVCache

SUPPORTED_HEAD_DIMS = (64, 128)


def problems(device: str, head_dim: int, block_size: int) -> list[str]:
    """Reasons backend=triton cannot run this configuration (empty when it can)."""
    out = []
    try:
        import triton  # noqa: F401
    except ImportError:
        return ["backend=triton needs the triton package (pip install triton), or use backend=torch"]
    if not device.startswith("cuda") and os.environ.get("TRITON_INTERPRET") != "1":
        out.append(f"backend=triton runs on a CUDA device (runtime.device={device!r}); on a CPU only under "
                   "TRITON_INTERPRET=1, for tests. Use backend=torch on the CPU")
    if head_dim not in SUPPORTED_HEAD_DIMS:
        out.append(f"backend=triton supports head_dim in {list(SUPPORTED_HEAD_DIMS)}, the model has {head_dim}; "
                   "use backend=torch")
    if block_size < 16:
        out.append(f"backend=triton needs runtime.block_size >= 16, got {block_size}")
    return out


class TritonOps:
    name = "triton"

    def __init__(self) -> None:
        from prr.kernels.sparse_decode import merge_partials, sparse_decode

        self._sparse_decode = sparse_decode
        self._merge = merge_partials

    def _run(self, q: Tensor, cache: PagedKVCache, layer: int, blocks: BlockSet, length: int, scale: float,
             per_block: bool) -> tuple[Tensor, Tensor]:
        b, h, g, d = q.shape
        lengths = torch.full((b,), length, dtype=torch.int32, device=q.device)
        return self._sparse_decode(q.reshape(b, h * g, d), cache.keys[layer], cache.values[layer], blocks.indices,
                                   blocks.count, lengths, cache.block_size, scale, per_block=per_block)

    def partials(self, q, cache, layer, blocks, length, scale):
        # kernel: out [B, Hq, C, D], lse [B, Hq, C] -> [B, Hkv, G, C, (D)]
        b, h, g, d = q.shape
        out, lse = self._run(q, cache, layer, blocks, length, scale, per_block=True)
        c = blocks.capacity
        return AttentionState(out.view(b, h, g, c, d), lse.view(b, h, g, c))

    def attend(self, q, cache, layer, blocks, length, scale):
        # kernel: out [B, Hq, D], lse [B, Hq] -> [B, Hkv, G, (D)]
        b, h, g, d = q.shape
        out, lse = self._run(q, cache, layer, blocks, length, scale, per_block=False)
        return AttentionState(out.view(b, h, g, d), lse.view(b, h, g))

    def merge_many(self, out, lse, keep):
        keep = None if keep is None else keep.expand(lse.shape).contiguous()
        merged_out, merged_lse = self._merge(out.contiguous(), lse.contiguous(), keep)
        return AttentionState(merged_out, merged_lse)
