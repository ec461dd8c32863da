"""Paged KV cache with per-block metadata slots.

Storage is block-aligned: block b of a layer holds tokens [b*block_size, (b+1)*block_size).
The buffers are allocated once for the whole run (prompt + new tokens), so every
block-indexed tensor has the static size `max_blocks`; `length(layer)` says how many
tokens are real. Selectors own named metadata slots ([B, Hkv, max_blocks, ...]) that they
fill as tokens append (Quest's key max/min, for instance).
"""

from __future__ import annotations

from collections.abc import Iterator, MutableMapping

import torch
from torch import Tensor


class PagedKVCache:
    def __init__(
        self,
        num_layers: int,
        batch: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        max_tokens: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        if block_size < 1 or block_size & (block_size - 1):  # not a power of two
            raise ValueError(f"block_size={block_size} must be a power of two (e.g. 16, 32, 64)")
        self.num_layers = num_layers
        self.batch = batch
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.block_size = block_size
        self.max_blocks = -(-max_tokens // block_size)
        self.max_tokens = self.max_blocks * block_size
        self.dtype = dtype
        self.device = torch.device(device)
        shape = (batch, num_kv_heads, self.max_tokens, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        self._lengths = [0] * num_layers
        self.metadata: list[dict[str, Tensor]] = [{} for _ in range(num_layers)]
        self.fills: list[dict[str, float]] = [{} for _ in range(num_layers)]  # slot -> its empty value
        self.per_row_slots: list[set[str]] = [set() for _ in range(num_layers)]  # slots whose dim 0 is the batch

    def length(self, layer: int) -> int:
        return self._lengths[layer]

    def num_blocks(self, layer: int, length: int | None = None) -> int:
        length = self._lengths[layer] if length is None else length
        return -(-length // self.block_size)

    def set_length(self, layer: int, length: int) -> None:
        """The first `length` tokens of `layer` are real (e.g. filled in place by a benchmark)."""
        if not 0 <= length <= self.max_tokens:
            raise ValueError(f"length {length} is outside the cache's [0, {self.max_tokens}] tokens")
        self._lengths[layer] = length

    def append(self, layer: int, k: Tensor, v: Tensor) -> tuple[int, int]:
        """k, v: [B, Hkv, T, D] -> the token range [start, end) they now occupy."""
        start = self._lengths[layer]
        end = start + k.shape[2]
        if end > self.max_tokens:
            raise ValueError(
                f"KV cache overflow in layer {layer}: {end} tokens > capacity {self.max_tokens}; "
                "raise the cache's max_tokens (prompt tokens + max_new_tokens)"
            )
        self.keys[layer][:, :, start:end] = k.to(self.dtype)
        self.values[layer][:, :, start:end] = v.to(self.dtype)
        self._lengths[layer] = end
        return start, end

    def block_view(self, layer: int) -> tuple[Tensor, Tensor]:
        """-> keys, values: [B, Hkv, max_blocks, block_size, D] views (no copy)."""
        shape = (self.batch, self.num_kv_heads, self.max_blocks, self.block_size, self.head_dim)
        return self.keys[layer].view(shape), self.values[layer].view(shape)

    def metadata_slot(
        self, layer: int, name: str, per_block_shape: tuple[int, ...], dtype: torch.dtype, fill: float = 0.0
    ) -> Tensor:
        """The slot `name` of `layer`: [B, Hkv, max_blocks, *per_block_shape], allocated on first use."""
        return self.state_slot(layer, name, (self.batch, self.num_kv_heads, self.max_blocks, *per_block_shape), dtype,
                               fill)

    def state_slot(self, layer: int, name: str, shape: tuple[int, ...], dtype: torch.dtype, fill: float = 0.0) -> Tensor:
        """A selector's per-layer state tensor of any shape (e.g. running totals, a counter),
        allocated on first use filled with `fill`, which `reset_metadata` restores."""
        slots = self.metadata[layer]
        if name not in slots:
            slots[name] = torch.full(shape, fill, dtype=dtype, device=self.device)
            self.fills[layer][name] = fill
            if shape and shape[0] == self.batch:
                self.per_row_slots[layer].add(name)
        return slots[name]

    def row(self, row: int) -> PagedKVCache:
        """Row `row` as a batch-1 cache sharing this one's storage: K/V, and every slot whose
        first dim is the batch, are [1, ...] views; other entries (constants) are shared; slots
        first allocated through the view are allocated here for every row. Its lengths start as
        this cache's. For per-row metadata rebuilds (ragged batches)."""
        if not 0 <= row < self.batch:
            raise ValueError(f"row {row} is outside the cache's batch of {self.batch}")
        return _RowCache(self, row)

    def reset_metadata(self, layer: int) -> None:
        """Every slot of `layer` back to its empty value, in place (captured CUDA graphs keep
        their pointers). Entries set without a fill (constants such as LESS's feature draw) stay."""
        for name, fill in self.fills[layer].items():
            self.metadata[layer][name].fill_(fill)


class _RowCache(PagedKVCache):
    """`PagedKVCache.row`'s batch-1 view."""

    def __init__(self, parent: PagedKVCache, row: int) -> None:  # noqa: D107 - no storage of its own
        self.parent, self.index = parent, row
        self.num_layers, self.batch = parent.num_layers, 1
        self.num_kv_heads, self.head_dim, self.block_size = parent.num_kv_heads, parent.head_dim, parent.block_size
        self.max_blocks, self.max_tokens, self.dtype, self.device = (parent.max_blocks, parent.max_tokens,
                                                                      parent.dtype, parent.device)
        self.keys = [k[row : row + 1] for k in parent.keys]
        self.values = [v[row : row + 1] for v in parent.values]
        self._lengths = [parent.length(i) for i in range(parent.num_layers)]
        self.metadata = [_RowSlots(parent, layer, row) for layer in range(parent.num_layers)]

    def state_slot(self, layer: int, name: str, shape: tuple[int, ...], dtype: torch.dtype, fill: float = 0.0) -> Tensor:
        if name not in self.parent.metadata[layer]:
            if not shape or shape[0] != 1:
                raise ValueError(f"slot {name!r} of shape {shape} allocated through a row view must lead with the "
                                 "batch dim (1 here)")
            self.parent.state_slot(layer, name, (self.parent.batch, *shape[1:]), dtype, fill)
        return self.metadata[layer][name]

    def reset_metadata(self, layer: int) -> None:
        for name, fill in self.parent.fills[layer].items():
            self.metadata[layer][name].fill_(fill)


class _RowSlots(MutableMapping):
    """One layer's slots of a row view: per-row slots as [1, ...] views, the others shared."""

    def __init__(self, parent: PagedKVCache, layer: int, row: int) -> None:
        self.slots, self.per_row, self.row = parent.metadata[layer], parent.per_row_slots[layer], row

    def __getitem__(self, name: str) -> Tensor:
        t = self.slots[name]
        return t[self.row : self.row + 1] if name in self.per_row else t

    def __setitem__(self, name: str, value: Tensor) -> None:  # a constant (e.g. LESS's feature draw): shared
        if name in self.per_row:
            raise ValueError(f"slot {name!r} is per row: write into it in place")
        self.slots[name] = value

    def __delitem__(self, name: str) -> None:
        raise ValueError("a row view cannot delete a slot")

    def __iter__(self) -> Iterator[str]:
        return iter(self.slots)

    def __len__(self) -> int:
        return len(self.slots)
