"""Times selection and speculation for one layer of the model's shape on the running
device, on random data in a scratch cache: what `budget=profiled` measures."""

from __future__ import annotations

import math
import platform
import statistics
import time

import torch

from prr.block_attention import attend_blocks, block_partials
from prr.blocks import BlockSet
from prr.cache import PagedKVCache
from prr.selectors.base import Selector


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu:{platform.processor() or platform.machine()}:threads={torch.get_num_threads()}"


class StageProbe:
    def __init__(
        self,
        selector: Selector,
        repair_mode: str,
        batch: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        max_tokens: int,
        dtype: torch.dtype,
        device: torch.device,
        repeats: int = 9,
        seed: int = 0,
    ) -> None:
        self.selector, self.repair_mode, self.repeats = selector, repair_mode, repeats
        self.device = device
        self.device_name = device_name(device)
        self.shape_key = (f"B={batch} Hq={num_heads} Hkv={num_kv_heads} D={head_dim} block={block_size} "
                          f"dtype={dtype} selector={type(selector).__name__}:{selector.gqa_reduce} repair={repair_mode}")
        gen = torch.Generator(device="cpu").manual_seed(seed)
        self.cache = PagedKVCache(1, batch, num_kv_heads, head_dim, block_size, max_tokens, dtype, device)
        shape = (batch, num_kv_heads, self.cache.max_tokens, head_dim)
        self.cache.append(0, torch.randn(shape, generator=gen).to(device, dtype), torch.randn(shape, generator=gen).to(device, dtype))
        selector.update_metadata(self.cache, 0, 0, self.cache.max_tokens)
        group = num_heads // num_kv_heads
        self.q = torch.randn(batch, num_kv_heads, group, head_dim, generator=gen).to(device, dtype)
        self.scale = 1.0 / math.sqrt(head_dim)

    def _median_seconds(self, fn) -> float:
        fn()  # warm-up
        samples = []
        for _ in range(self.repeats):
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            start = time.perf_counter()
            fn()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            samples.append(time.perf_counter() - start)
        return statistics.median(samples)

    def time_select(self, context_blocks: int) -> float:
        length = context_blocks * self.cache.block_size
        return self._median_seconds(lambda: self.selector.select(self.q, self.cache, 0, length=length))

    def time_speculate(self, predicted_blocks: int, context_blocks: int) -> float:
        length = context_blocks * self.cache.block_size
        b, h = self.q.shape[:2]
        ids = torch.randperm(context_blocks)[:predicted_blocks].sort().values.to(self.device)
        blocks = BlockSet(indices=ids.expand(b, h, -1).contiguous(),
                          count=torch.full((b, h), predicted_blocks, device=self.device))
        attend = block_partials if self.repair_mode == "exact" else attend_blocks
        return self._median_seconds(lambda: attend(self.q, self.cache, 0, blocks, length, self.scale))
