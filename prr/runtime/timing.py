"""Stage timers. CPU: perf_counter around each stage. CUDA: event pairs resolved when the
step's records are collected, so timing adds no host synchronisation inside the step.
Stage names are the same words everywhere (prr.step_record.STAGES)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from prr.step_record import STAGES


class StageTimer:
    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._pending: list[tuple[str, object, object]] = []

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._pending.append((name, start, end))
        else:
            start_s = time.perf_counter()
            yield
            self._pending.append((name, start_s, time.perf_counter()))

    def take(self) -> list[tuple[str, object, object]]:
        """The marks recorded since the last take (no synchronisation)."""
        marks, self._pending = self._pending, []
        return marks

    def resolve(self, marks: list[tuple[str, object, object]]) -> dict[str, float]:
        """Seconds per stage of some taken marks (stages entered twice are summed). On CUDA
        this waits for their events: call it once per decode step, after the last layer."""
        if self.cuda and marks:
            marks[-1][2].synchronize()  # type: ignore[union-attr]
        out = dict.fromkeys(STAGES, 0.0)
        for name, start, end in marks:
            seconds = start.elapsed_time(end) / 1e3 if self.cuda else end - start  # type: ignore[union-attr,operator]
            out[name] = out.get(name, 0.0) + seconds
        return out


def timed_steps(steps: list, device: torch.device) -> list[float]:
    """Run each step function once, back to back -> seconds of each: on CUDA the device time
    between events around each (no host sync until the window's end), elsewhere wall time."""
    if device.type == "cuda":
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in steps]
        for (start, stop), step in zip(events, steps, strict=True):
            start.record()
            step()
            stop.record()
        events[-1][1].synchronize()
        return [start.elapsed_time(stop) * 1e-3 for start, stop in events]
    out = []
    for step in steps:
        t0 = time.perf_counter()
        step()
        out.append(time.perf_counter() - t0)
    return out
