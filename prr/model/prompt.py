"""Text -> prompt token ids, with the model's chat template when it has one."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


def encode_prompt(tokenizer: Any, text: str, use_chat_template: bool = True) -> Tensor:
    """-> input_ids [1, T] (int64).

    With a chat template: `text` is one user message followed by the generation prompt.
    Without one (or use_chat_template=False): plain encoding with the tokenizer's special
    tokens (e.g. BOS).
    """
    if use_chat_template and getattr(tokenizer, "chat_template", None):
        # Render to a string, then encode without special tokens: templates already contain
        # BOS where the model wants it. (transformers 5 apply_chat_template(tokenize=True)
        # returns a BatchEncoding, not a list as in 4.x.)
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
        )
        ids = tokenizer(rendered, add_special_tokens=False)["input_ids"]
    else:
        ids = tokenizer(text)["input_ids"]
    return torch.tensor([ids], dtype=torch.long)  # [1, T]


def truncate_text_to_tokens(tokenizer: Any, text: str, n_tokens: int) -> str:
    """The longest prefix of `text` that encodes to at most `n_tokens` tokens (no specials).

    Cuts at a token boundary of the original text (character offsets when the tokenizer
    provides them), then re-checks, since a cut can re-tokenize differently.
    """
    if n_tokens < 0:
        raise ValueError(f"n_tokens must be >= 0, got {n_tokens}")

    def count(s: str) -> int:
        return len(tokenizer(s, add_special_tokens=False)["input_ids"])

    try:
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        offsets = enc["offset_mapping"]
    except (NotImplementedError, TypeError, ValueError, KeyError):
        enc, offsets = tokenizer(text, add_special_tokens=False), None
    ids = enc["input_ids"]
    if len(ids) <= n_tokens:
        return text
    keep = n_tokens
    while keep > 0:
        if offsets is not None:
            prefix = text[: offsets[keep - 1][1]]
        else:
            prefix = tokenizer.decode(ids[:keep], skip_special_tokens=True)
        if count(prefix) <= n_tokens:
            return prefix
        keep -= 1
    return ""
