"""`long_text`: decode after a long prompt of real text (the default experiment).

The document (the Python Language Reference by default, or task.prompt_file) is cut to
`prompt_tokens` tokens and followed by an instruction; the chat template wraps it when
the tokenizer has one. Random-init models (no tokenizer) get seeded random token ids of
the same length instead, so latency runs need no tokenizer.
"""

from __future__ import annotations

from typing import Any

from prr.cli_exits import ConfigError
from prr.tasks.base import PromptBatch, Task
from prr.tasks.text_sources import python_reference_text, read_prompt_file

CHAT_TEMPLATE_SLACK = 64  # tokens the template and instruction may add around the document


class LongTextTask(Task):
    def __init__(
        self,
        prompt_tokens: int = 4096,
        prompt_file: str | None = None,
        instruction: str = "Summarize the text above in a few sentences.",
        chat_template: bool = True,
        max_new_tokens: int = 64,
        temperature: float = 0.0,
        top_p: float = 1.0,
        stop_at_eos: bool = True,
        seed: int = 0,
    ) -> None:
        if prompt_tokens < 1:
            raise ValueError(f"task.prompt_tokens={prompt_tokens} must be >= 1")
        if max_new_tokens < 1:
            raise ValueError(f"task.max_new_tokens={max_new_tokens} must be >= 1")
        if temperature < 0 or not 0 < top_p <= 1:
            raise ValueError(f"task.temperature={temperature} must be >= 0 and task.top_p={top_p} in (0, 1]")
        if prompt_file is not None:
            # A missing, binary or too short file fails at startup, not after the model loads.
            read_prompt_file(prompt_file, prompt_tokens, "task.prompt_tokens")
        self.prompt_tokens = prompt_tokens
        self.prompt_file = prompt_file
        self.instruction = instruction
        self.chat_template = chat_template
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.top_p = top_p
        self.stop_at_eos = stop_at_eos
        self.seed = seed

    def prompt_tokens_upper_bound(self) -> int:
        return self.prompt_tokens + CHAT_TEMPLATE_SLACK

    def build(self, tokenizer: Any, vocab_size: int, batch_size: int) -> PromptBatch:
        import torch  # here, not at the top: run.py checks a task's options before torch is imported

        if tokenizer is None:
            if self.prompt_file:
                raise ConfigError([prompt_file_needs_a_tokenizer(self.prompt_file, "the model loaded has no tokenizer")])
            gen = torch.Generator().manual_seed(self.seed)
            ids = torch.randint(0, vocab_size, (1, self.prompt_tokens), generator=gen)
            return PromptBatch(ids.expand(batch_size, -1).contiguous(), f"{self.prompt_tokens} random token ids (seed {self.seed})")
        source = (read_prompt_file(self.prompt_file, self.prompt_tokens, "task.prompt_tokens") if self.prompt_file
                  else python_reference_text())
        from prr.model.prompt import encode_prompt, truncate_text_to_tokens

        available = len(tokenizer(source, add_special_tokens=False)["input_ids"])
        if available < self.prompt_tokens:  # a refused input found only now the tokenizer is loaded
            raise ConfigError([f"task.prompt_tokens={self.prompt_tokens} but the text has only {available} tokens; "
                               "lower prompt_tokens or give a longer task.prompt_file"])
        document = truncate_text_to_tokens(tokenizer, source, self.prompt_tokens)  # a prefix of the original text
        text = f"{document}\n\n{self.instruction}"

        ids = encode_prompt(tokenizer, text, use_chat_template=self.chat_template)  # [1, T]
        where = self.prompt_file or "Python Language Reference (pydoc_data)"
        return PromptBatch(ids.expand(batch_size, -1).contiguous(), f"{self.prompt_tokens} tokens of {where} + instruction", text)


def prompt_file_needs_a_tokenizer(prompt_file: str, why: str) -> str:
    """The refusal of a prompt file for a model without a tokenizer (for random-init models run.py
    says it before torch is imported: prr.config_check)."""
    return (f"task.prompt_file={prompt_file!r} needs a model with a tokenizer, but {why}; choose a model with one "
            "(model=smollm2-135m) or drop task.prompt_file")
