"""Megatron-style tensor parallelism of a Decoder over `world` ranks (torch.distributed).

Each rank holds a shard: the q|k|v and gate|up projections split by heads and columns (its
Hq / world query heads, Hkv / world KV heads, I / world FFN columns), o_proj and down_proj split
by rows of their input, with one all-reduce (sum) after each per layer. Embedding, norms and
lm_head are whole on every rank, so every rank computes the same logits and greedy token. A
rank's KV cache, selector metadata, selection, speculation, repair and merge cover its own KV
heads only: selections and predictions are per KV head, so the attention stage needs no
communication and TP is exact up to the all-reduce's summation order.

The transport is torch.distributed's (gloo on a CPU, NCCL on GPUs); `TensorParallel.all_reduce`
is the one place it is called.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from prr.blocks import BlockSet, Selection
from prr.model.config import ModelConfig
from prr.model.decoder import Decoder


@dataclass(frozen=True)
class TensorParallel:
    rank: int
    world: int
    group: Any = None  # a torch.distributed process group (None: the default group)

    def all_reduce(self, x: Tensor) -> Tensor:
        """x: a rank's partial sum [..., H] -> the sum over ranks (in place; returned)."""
        dist.all_reduce(x, group=self.group)
        return x

    def sum_on_host(self, x: Tensor) -> Tensor:
        """A host tensor summed over ranks (e.g. hit counters): -> a new host tensor."""
        device = "cuda" if dist.get_backend(self.group) == "nccl" else "cpu"
        total = x.to(device, copy=True)
        dist.all_reduce(total, group=self.group)
        return total.cpu()

    def gather_heads(self, selection: Selection) -> Selection:
        """A rank's selection of its KV heads ([B, Hkv / world, ...]) -> every rank's, in head
        order ([B, Hkv, ...]): what a fit over all heads (predictor calibration) must see."""
        def gathered(x: Tensor) -> Tensor:
            parts = [torch.empty_like(x) for _ in range(self.world)]
            dist.all_gather(parts, x.contiguous(), group=self.group)
            return torch.cat(parts, dim=1)
        return Selection(BlockSet(gathered(selection.blocks.indices), gathered(selection.blocks.count)),
                         gathered(selection.scores))

    def problems(self, config: ModelConfig) -> list[str]:
        """Why `config` cannot be split over this many ranks (empty: it can)."""
        out = []
        if not 0 <= self.rank < self.world:
            out.append(f"rank {self.rank} is outside world size {self.world}")
        for name, value in (("num_kv_heads", config.num_kv_heads), ("num_heads", config.num_heads),
                            ("intermediate_size", config.intermediate_size)):
            if value % self.world:
                out.append(f"the model's {name}={value} does not split over tensor_parallel={self.world} ranks "
                           f"(it must be a multiple)")
        return out


def shard_config(config: ModelConfig, world: int) -> ModelConfig:
    """One rank's share of the model's shape: Hq / world, Hkv / world, I / world."""
    return dataclasses.replace(config, num_heads=config.num_heads // world, num_kv_heads=config.num_kv_heads // world,
                               intermediate_size=config.intermediate_size // world)


@torch.no_grad()
def shard_decoder(model: Decoder, tp: TensorParallel) -> Decoder:
    """This rank's shard of `model` (a new Decoder of `shard_config`'s shape; `model` unchanged).
    The o_proj and down_proj biases stay on rank 0 only (zeros elsewhere), so the all-reduce adds
    them once."""
    problems = tp.problems(model.config)
    if problems:
        raise ValueError("; ".join(problems))
    c, r, n = model.config, tp.rank, tp.world
    d = c.head_dim
    q_rows = slice(r * c.num_heads // n * d, (r + 1) * c.num_heads // n * d)
    kv_rows = slice(r * c.num_kv_heads // n * d, (r + 1) * c.num_kv_heads // n * d)
    ffn_rows = slice(r * c.intermediate_size // n, (r + 1) * c.intermediate_size // n)
    split = {"q_proj": q_rows, "k_proj": kv_rows, "v_proj": kv_rows, "gate_proj": ffn_rows, "up_proj": ffn_rows}
    shard = Decoder(shard_config(c, n), model.dtype, model.device)
    state = {}
    for name, value in model.state_dict().items():
        module, kind = name.split(".")[-2:]  # e.g. ("q_proj", "weight")
        if module in split:  # split by output rows (weight and bias alike)
            value = value[split[module]]
        elif module in ("o_proj", "down_proj") and kind == "weight":  # split by input columns
            value = value[:, q_rows if module == "o_proj" else ffn_rows]
        elif module in ("o_proj", "down_proj"):  # their bias: added once, by rank 0
            value = value if r == 0 else torch.zeros_like(value)
        state[name] = value.clone()
    shard.load_state_dict(state)
    shard.tensor_parallel = tp  # every forward of the shard all-reduces (Decoder.layers)
    return shard
