"""A task turns a tokenizer into the prompt batch a run decodes from."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # annotations only: run.py checks a task's options before torch is imported
    from torch import Tensor


@dataclass(frozen=True)
class PromptBatch:
    input_ids: Tensor  # [B, T] int64, all rows the same length
    description: str  # one line for logs: where the prompt came from
    text: str | None = None  # the prompt text, when there is one


class Task(ABC):
    max_new_tokens: int
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    stop_at_eos: bool = True
    # A scored task that sends its requests in batches (Engine.generate_batch / score_batch):
    # runtime.batch_size > 1 decodes them together on runtime.engine=graph.
    batches_requests: bool = False

    @abstractmethod
    def prompt_tokens_upper_bound(self) -> int:
        """Most tokens `build` can return per row (validated against the model context before loading)."""

    @abstractmethod
    def build(self, tokenizer: Any, vocab_size: int, batch_size: int) -> PromptBatch:
        """-> the prompt batch; `tokenizer` may be None for random-init models."""
