"""LESS-style compensation in the PRR step: selectors that `compensate` merge their estimate of
the unselected blocks after the repair (also under serial DSA, so exact-mode PRR and serial DSA
receive the same compensation). Where the decode token's summaries are only the compensation's
input (`Selector.summaries_apart`), the graph engine's step updates them on the side stream
beside selection and attention (serial) or the repair (PRR), joined by an event before the
compensation reads them (plan.side_summaries)."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager

import torch
from torch import Tensor

from prr.cache import PagedKVCache
from prr.runtime.side_stream import SideStream
from prr.selectors import Selection, Selector


class SummaryCompensation:
    """The run's selector's summaries and compensation over `cache`."""

    def __init__(self, selector: Selector, cache: PagedKVCache) -> None:
        self.selector, self.cache = selector, cache
        self.active = selector.compensates  # decided once: the step merges A's partials with the summaries

    def beside(self, side_summaries: bool, eager: bool, backend: str) -> bool:
        """Whether the step updates the decode token's summaries apart (plan.side_summaries, the
        graph engine's step, backend triton: the append kernels take Quest's key max / min) and,
        with a side stream, beside selection and attention (`summarise_beside`)."""
        return side_summaries and not eager and backend == "triton" and self.selector.summaries_apart()

    def summarise_beside(self, streams: SideStream, layer: int, positions: Tensor | None) -> torch.cuda.Event | None:
        """The selector's summaries of this step's token (positions [B], in the cache: the append is
        queued before) on the side stream; -> the event the compensation waits for (None: nothing
        queued, or one stream, where program order is the order)."""
        if positions is None:
            return None
        streams.fork()  # the side stream waits for the append (and whatever main queued before)
        with streams.on_side():
            self.selector.append_summaries(self.cache, layer, positions)
        return streams.mark_side()

    def compensated(self, layer: int, q: Tensor, out: Tensor, lse: Tensor, selection: Selection, lengths: Tensor,
                    out_dtype: torch.dtype, stage: Callable[[str], AbstractContextManager],
                    summarised: torch.cuda.Event | None = None) -> Tensor:
        """q [B, Hkv, G, D]; out [B, Hq, D] fp32, lse [B, Hq] of the attended blocks (or their split
        partials [B, Hq, S, D], [B, Hq, S]) ⊕ the selector's estimate of the others
        (`Selector.compensated`) -> [B, Hq, D] in out_dtype. summarised: the side stream's summary
        update of this step, which the compensation reads: waited for first."""
        if summarised is not None:
            torch.cuda.current_stream(q.device).wait_event(summarised)
        with stage("merge"):
            return self.selector.compensated(q, self.cache, layer, selection, lengths, out, lse, out_dtype)
