"""The interface between the run driver (prr/driver.py) and a runtime strategy (the eager
research runtime, prr/runtime/eager_run.py; the CUDA-graph engine, prr/runtime/graph_run.py).

A decode strategy has `inputs` (prr.run_inputs.RunInputs), `progress_label`, `window` (decode
steps between host looks: EOS is checked after each window), and
- `prefill() -> Tensor`: the prompt prefilled; the first token [B] step 0 reads;
- `decode(n) -> Window`: n decode steps;
- `results(token_ids) -> Results`: what the run's summary and tables need, once decoding ended
  after token_ids.shape[1] steps (token_ids [B, steps]: the token each step read)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch


@dataclass
class Window:
    """n decode steps: tokens [B, n] each step wrote (the next step's input, on the host), and
    per step its wall time, its untimed measurement work, and the variant it ran (graph engine)."""

    tokens: torch.Tensor
    wall_s: list[float]
    measure_s: list[float]
    variants: list[str] | None = None


@dataclass
class Results:
    """A decode's results: `summary`, the runtime's keyword arguments of prr.driver.run_summary;
    per-layer table `layers` (layers_csv: what layers.csv holds, default layers); per-step rows
    `steps` for the logger."""

    summary: dict[str, Any]
    layers: Any
    steps: Any
    layers_csv: Any = None


@dataclass
class Steps:
    """What n decode steps of one request wrote, per step: the token it read, the token it
    chose (greedy, or the forced one when scoring), that token's log-probability, whether it is
    the argmax, the top-1 minus top-2 logit, wall time and untimed measurement work; `records`:
    the eager runtime's per-(layer, row, KV head) records of each step (None on the graph engine)."""

    read: list[int] = field(default_factory=list)
    chosen: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    greedy: list[bool] = field(default_factory=list)
    margins: list[float] = field(default_factory=list)
    wall_s: list[float] = field(default_factory=list)
    measure_s: list[float] = field(default_factory=list)
    records: list[list[Any]] | None = None


class DecodeStrategy(Protocol):
    inputs: Any
    progress_label: str
    window: int

    def prefill(self) -> torch.Tensor: ...

    def decode(self, n: int) -> Window: ...

    def results(self, token_ids: torch.Tensor) -> Results: ...


def topk_label(selector: Any) -> int | str:
    """The summary's top-K: "all" for a selector that selects every block (dense)."""
    return "all" if selector.selects_every_block else selector.topk_blocks
