"""`perplexity`: perplexity of long real text under sparse decoding.

Each sample is a window of the text (the Python Language Reference, or task.prompt_file)
at a seeded offset: the first context_tokens tokens are prefilled (dense), the next
score_tokens are fed one decode step at a time (teacher forcing), so every scored token is
predicted through the selector/PRR path with the whole window before it as context.
Reports perplexity = exp(mean NLL over all scored tokens) and the NLL itself."""

from __future__ import annotations

import math
import random
from typing import Any

from prr.cli_exits import ConfigError
from prr.tasks.base import PromptBatch, Task
from prr.tasks.text_sources import python_reference_text, read_prompt_file

WINDOW_SETTINGS = "task.context_tokens + task.score_tokens"  # what sets the tokens a window takes from the text


class PerplexityTask(Task):
    def __init__(
        self,
        context_tokens: int = 2048,
        score_tokens: int = 64,
        num_samples: int = 2,
        prompt_file: str | None = None,
        seed: int = 0,
    ) -> None:
        if context_tokens < 2 or score_tokens < 1 or num_samples < 1:
            raise ValueError(f"task.context_tokens={context_tokens} (>= 2), task.score_tokens={score_tokens} (>= 1) and "
                             f"task.num_samples={num_samples} (>= 1) out of range")
        if prompt_file is not None:
            # A missing, binary or too short file fails at startup, not after the model loads.
            read_prompt_file(prompt_file, context_tokens + score_tokens, WINDOW_SETTINGS)
        self.context_tokens = self.prompt_tokens = context_tokens
        self.score_tokens = self.max_new_tokens = score_tokens
        self.num_samples, self.prompt_file, self.seed = num_samples, prompt_file, seed

    def prompt_tokens_upper_bound(self) -> int:
        return self.context_tokens

    def windows(self, tokenizer: Any) -> list[list[int]]:
        """num_samples windows of context_tokens + score_tokens token ids, at seeded offsets."""
        length = self.context_tokens + self.score_tokens
        text = read_prompt_file(self.prompt_file, length, WINDOW_SETTINGS) if self.prompt_file else python_reference_text()
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) < length:  # a refused input found only now the tokenizer is loaded
            raise ConfigError([f"the text has {len(ids)} tokens, fewer than task.context_tokens + task.score_tokens "
                               f"= {length}; give a longer task.prompt_file or shorten the window"])
        rng = random.Random(f"perplexity:{self.seed}")
        return [ids[s:s + length] for s in (rng.randrange(len(ids) - length + 1) for _ in range(self.num_samples))]

    def evaluate(self, engine: Any) -> dict[str, Any]:
        import torch  # here, not at the top: run.py checks a task's options before torch is imported

        nll, count = 0.0, 0
        for window in self.windows(engine.tokenizer):
            context = torch.tensor([window[: self.context_tokens]])  # [1, T]
            logprob, _, per_token = engine.score(context, window[self.context_tokens:])
            nll -= logprob
            count += len(per_token)
            engine.log_sample({"prompt_tokens": self.context_tokens, "nll": -logprob / len(per_token),
                               "token_logprobs": per_token})
        return {"perplexity": math.exp(nll / count), "nll_per_token": nll / count, "scored_tokens": count,
                "num_samples": self.num_samples}

    def build(self, tokenizer: Any, vocab_size: int, batch_size: int) -> PromptBatch:
        import torch

        from prr.tasks.samples import ByteTokenizer

        window = self.windows(tokenizer if tokenizer is not None else ByteTokenizer())[0]
        ids = torch.tensor([window[: self.context_tokens]])
        return PromptBatch(ids.expand(batch_size, -1).contiguous(), f"perplexity window 0 ({self.context_tokens} tokens)")
