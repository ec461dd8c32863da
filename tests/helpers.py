"""Shared fixtures-by-function for the pipeline tests: random caches at odd sizes."""

from __future__ import annotations

import torch

from prr.cache import PagedKVCache
from prr.selectors.base import Selector


def random_cache(
    selector: Selector | None,
    length: int = 113,
    batch: int = 1,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    block_size: int = 8,
    extra: int = 0,
    seed: int = 0,
) -> PagedKVCache:
    """A one-layer cache holding `length` random tokens (room for `extra` more)."""
    g = torch.Generator().manual_seed(seed)
    cache = PagedKVCache(1, batch, num_kv_heads, head_dim, block_size, length + extra)
    shape = (batch, num_kv_heads, length, head_dim)
    cache.append(0, torch.randn(shape, generator=g) * 2, torch.randn(shape, generator=g))
    if selector is not None:
        selector.update_metadata(cache, 0, 0, length)
    return cache
