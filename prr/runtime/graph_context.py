"""The context a graph engine decodes from, set in its cache in place (captured graphs stay
valid): random K/V for latency studies, K/V copied from elsewhere, and the selector's metadata of
every sparse layer rebuilt from the cache's first tokens. Rows may hold different lengths (a
ragged batch): each is filled and rebuilt from its own tokens only."""

from __future__ import annotations

import torch
from torch import Tensor

from prr.cache import PagedKVCache
from prr.selectors import Selector


def row_lengths(lengths: int | list[int] | Tensor, batch: int, max_tokens: int) -> list[int]:
    """A context length for every row (an int: all rows; a list or [B] tensor: per row, ragged
    batches) -> [B] host ints, each in [1, max_tokens)."""
    if isinstance(lengths, Tensor):
        lengths = lengths.tolist() if lengths.dim() else int(lengths)
    rows = [int(lengths)] * batch if isinstance(lengths, int) else [int(n) for n in lengths]
    if len(rows) != batch:
        raise ValueError(f"need one context length per row: {batch} rows, got {len(rows)} lengths")
    for n in rows:
        if not 0 < n < max_tokens:
            raise ValueError(f"context length {n} must be in [1, {max_tokens}) (max_tokens)")
    return rows


@torch.no_grad()
def fill_random(cache: PagedKVCache, rows: list[int], gen: torch.Generator) -> None:
    """Normal K/V (never zeros: timings do not depend on values) at positions [0, rows[b]) of row b
    of every layer; the rest zeroed."""
    for layer in range(cache.num_layers):
        for tensor in (cache.keys[layer], cache.values[layer]):
            tensor.zero_()
            if len(set(rows)) == 1:
                tensor[:, :, : rows[0]].normal_(generator=gen)
                continue
            for b, n in enumerate(rows):
                tensor[b, :, :n].normal_(generator=gen)


@torch.no_grad()
def copy_context(cache: PagedKVCache, keys: list[Tensor], values: list[Tensor], rows: list[int]) -> None:
    """keys / values [B, Hkv, >= rows[b], D] per layer into the cache (row b's tokens past rows[b]
    zeroed; the cache's own tensors stay as they are)."""
    longest = max(rows)
    if len(keys) != cache.num_layers or len(values) != cache.num_layers:
        raise ValueError(f"need keys and values of {cache.num_layers} layers; got {len(keys)} and {len(values)}")
    for layer in range(cache.num_layers):
        for tensor, source in ((cache.keys[layer], keys[layer]), (cache.values[layer], values[layer])):
            if source.shape[:2] != tensor.shape[:2] or source.shape[3] != cache.head_dim or source.shape[2] < longest:
                raise ValueError(f"layer {layer}: cache of shape {tuple(source.shape)} does not hold [B={cache.batch}, "
                                 f"Hkv={cache.num_kv_heads}, >= {longest}, D={cache.head_dim}]")
            if source.data_ptr() != tensor.data_ptr():
                tensor.zero_()
                for b, n in enumerate(rows):
                    tensor[b, :, :n].copy_(source[b, :, :n])


@torch.no_grad()
def rebuild_metadata(selector: Selector, cache: PagedKVCache, sparse: list[bool], rows: list[int], group: int,
                     gen: torch.Generator, query: Tensor | None = None) -> None:
    """The selector's metadata of every sparse layer rebuilt in place from each row's first
    rows[b] tokens, its backlog (`Selector.catch_up`, InfLLM's finalising) done with a random
    query from `gen` (or `query` [B, Hkv, G, D], one per layer alike; the prompt's queries are not
    known here, so it also stands for every prompt position's query in InfLLM's window scores).
    Rows of different lengths are rebuilt one by one (`PagedKVCache.row`); the cache's host
    length is then the longest row's."""
    ragged = len(set(rows)) > 1
    if ragged and not selector.per_row_metadata:
        raise ValueError(f"{type(selector).__name__} keeps metadata a row view cannot rebuild "
                         "(per_row_metadata=False): rows of different lengths need per-row metadata")
    device, d = cache.keys[0].device, cache.head_dim
    for layer in range(cache.num_layers):
        if not sparse[layer]:
            continue
        cache.reset_metadata(layer)
        cache.set_length(layer, max(rows))
        q = query if query is not None else torch.randn(cache.batch, cache.num_kv_heads, group, d, generator=gen,
                                                        device=device)
        q = q.to(device, cache.dtype)
        # a selector whose metadata comes from the layer's hidden states (the indexer): random ones, as the K/V
        hidden = torch.randn(cache.batch, max(rows), selector.hidden_size, generator=gen, device=device).to(
            cache.dtype) if selector.needs_hidden else None  # [B, T, hidden]
        if not ragged:
            if hidden is not None:
                selector.take_hidden(cache, layer, hidden, prefill=True)
            selector.update_metadata(cache, layer, 0, rows[0])
            every = q.unsqueeze(3).expand(*q.shape[:3], rows[0], d)  # [B, Hkv, G, T, D]
            selector.catch_up(q, cache, layer, rows[0], queries=every)
            continue
        for b, n in enumerate(rows):  # each row from its own first n tokens
            view = cache.row(b)
            view.set_length(layer, n)
            if hidden is not None:
                selector.take_hidden(view, layer, hidden[b : b + 1], prefill=True)
            selector.update_metadata(view, layer, 0, n)
            qb = q[b : b + 1]
            selector.catch_up(qb, view, layer, n, queries=qb.unsqueeze(3).expand(*qb.shape[:3], n, d))
