"""Dense-reference metrics of sampled steps (plan.measure_dense; every step in shadow mode), an
observer of the PRR step: attention-mass recall of A and the output's relative error against
dense attention, summed on the device per layer over measured (row, KV head)s."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from prr.block_attention import relative_error
from prr.selectors import Selection


class DenseMetrics:
    """Sums per layer ([L] fp64): mass recall, output error, and how many (row, KV head)s were measured."""

    NAMES = ("mass_recall", "output_relerr", "measured")

    def __init__(self, num_layers: int, device: torch.device) -> None:
        self.mass_recall = torch.zeros(num_layers, dtype=torch.float64, device=device)
        self.output_relerr = torch.zeros(num_layers, dtype=torch.float64, device=device)
        self.measured = torch.zeros(num_layers, dtype=torch.float64, device=device)

    def measure(self, attend: Callable[..., tuple[Tensor, Tensor]], all_blocks: Tensor, layer: int, q: Tensor,
                out: Tensor, selection: Selection, lengths: Tensor, num_blocks: Tensor) -> tuple[Tensor, Tensor]:
        """Add this layer's step -> (recall, error) [B, Hkv] per (row, KV head) — the eager
        runtime's definitions, from the attention kernels (`attend`, the step's): dense attention
        (out, lse) over every block (all_blocks [B, Hkv, NB]), and one lse per block of A, so
        mass(A) = Σ_{b∈A} exp(lse_b − lse_dense). q [B, Hq, D], out [B, Hq, D] the sparse output."""
        b, hkv = all_blocks.shape[:2]
        counts = num_blocks.view(b, 1).expand(b, hkv).contiguous()
        dense_out, dense_lse = attend(layer, q, all_blocks, counts, lengths)  # [B, Hq, D], [B, Hq] fp32
        _, block_lse = attend(layer, q, selection.blocks.indices, selection.blocks.count, lengths,
                              per_block=True)  # [B, Hq, |A|]; -inf for padding entries
        mass = torch.exp(block_lse - dense_lse.unsqueeze(-1)).sum(-1)  # [B, Hq]
        recall = mass.view(b, hkv, -1).mean(-1)  # [B, Hkv]
        error = relative_error(out.view(b, hkv, -1, out.shape[-1]), dense_out.view(b, hkv, -1, out.shape[-1]))
        self.mass_recall[layer] += recall.sum()
        self.output_relerr[layer] += error.sum()
        self.measured[layer] += recall.numel()
        return recall, error

    def tensors(self) -> list[Tensor]:
        """The sums (a checkpoint's share, and what `begin` clears)."""
        return [self.mass_recall, self.output_relerr, self.measured]
