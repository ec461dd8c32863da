"""The PRR step's second CUDA stream: speculation, learning and the end-of-step counters run there
beside selection and attention on the main stream (DESIGN.md §2). On a CPU, or with
plan.overlap=False, there is one stream and program order is the order: every method is then a
no-op."""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor


class SideStream:
    """The side stream of one engine view (`overlap`: the plan's), and whether this step forked it."""

    def __init__(self, device: torch.device, overlap: bool, stream: torch.cuda.Stream | None = None,
                 own: torch.cuda.Stream | None = None) -> None:
        """stream: an existing side stream to share (another view of the same engine); default:
        a new one on CUDA devices, none elsewhere. own: the engine's own (`using(None)` returns to it)."""
        if stream is None and device.type == "cuda":
            stream = torch.cuda.Stream(device)
        self.device, self.stream, self.overlap = device, stream, overlap
        self.own = own if own is not None else stream
        self.active = stream is not None and overlap
        self.forked = False

    def view(self, overlap: bool) -> SideStream:
        """The same stream for another plan's step (its own fork flag)."""
        return SideStream(self.device, overlap, self.stream, self.own)

    def using(self, stream: torch.cuda.Stream | None) -> SideStream:
        """Side work on `stream` instead (benchmarks of stream priorities); None: the engine's own."""
        out = SideStream(self.device, self.overlap, stream if stream is not None else self.own, self.own)
        out.forked = self.forked
        return out

    def on_side(self):
        """Queue the block's work on the side stream (on the main one when inactive)."""
        return torch.cuda.stream(self.stream) if self.active else contextlib.nullcontext()

    def fork(self) -> None:
        """The side stream waits for everything the main stream queued so far."""
        if self.active:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            self.forked = True

    def after(self, event: torch.cuda.Event | None = None) -> None:
        """The side stream waits for `event` (recorded on the main stream; recorded now when None)."""
        if not self.active:
            return
        if event is None:
            event = self.mark()
        self.stream.wait_event(event)
        self.forked = True

    def mark(self) -> torch.cuda.Event | None:
        """An event recorded now on the main stream (None when inactive)."""
        if not self.active:
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    def mark_side(self) -> torch.cuda.Event | None:
        """An event recorded now on the side stream (None when inactive)."""
        if not self.active:
            return None
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def join(self) -> None:
        """The main stream waits for the side stream's work (only if this step forked it: a graph
        capture refuses to wait on work it did not capture)."""
        if self.forked:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
            self.forked = False

    def share(self, *tensors: Tensor) -> None:
        """Tensors used on both streams: the caching allocator must not recycle them before both
        streams are done with them."""
        if self.active:
            main = torch.cuda.current_stream(self.device)
            for t in tensors:
                t.record_stream(self.stream)
                t.record_stream(main)
