"""Tasks scored over many generated samples (RULER-style): the sample type, the task ABC,
RULER's string-match score, and the byte tokenizer for tokenizer-less (random-init) models.

A sample is a prompt (one user message) and the answers a correct output must contain.
Generation tasks are scored by `score`: the fraction of the sample's answers found in the
output, case-insensitively (RULER's `string_match_all`); accuracy = mean over samples.
"""

from __future__ import annotations

import random
from abc import abstractmethod
from dataclasses import dataclass, field
from typing import Any

from prr.tasks.base import PromptBatch, Task
from prr.tasks.long_text import CHAT_TEMPLATE_SLACK  # tokens a chat template may add around the user message


@dataclass(frozen=True)
class Sample:
    prompt: str  # the user message: context + question (the chat template is applied later)
    answers: tuple[str, ...]  # every string a correct output must contain
    metadata: dict[str, Any] = field(default_factory=dict)  # depths, positions, ...: what tests check
    gen_prefix: str = ""  # text the answer starts with, appended after the template (RULER's answer prefix)


def string_match_all(prediction: str, answers: tuple[str, ...]) -> float:
    """Fraction of `answers` that occur in `prediction`, case-insensitively (RULER)."""
    if not answers:
        raise ValueError("a sample needs at least one answer to be scored")
    text = prediction.lower()
    return sum(a.lower() in text for a in answers) / len(answers)


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255, for random-init models (vocab >= 256) that ship no
    tokenizer: lets text tasks and lm-eval run on `model=tiny-random` in tests."""

    chat_template = None
    eos_token_id = None

    def __call__(self, text: str, add_special_tokens: bool = True, **_: Any) -> dict[str, list[int]]:
        return {"input_ids": list(text.encode("utf-8"))}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


def count_tokens(tokenizer: Any, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


class SampleTask(Task):
    """A task of `num_samples` seeded samples of about `context_tokens` tokens each."""

    batches_requests = True

    def __init__(self, context_tokens: int, num_samples: int, max_new_tokens: int, seed: int,
                 chat_template: bool = True) -> None:
        if context_tokens < 64:
            raise ValueError(f"task.context_tokens={context_tokens} must be >= 64")
        if num_samples < 1:
            raise ValueError(f"task.num_samples={num_samples} must be >= 1")
        if max_new_tokens < 1:
            raise ValueError(f"task.max_new_tokens={max_new_tokens} must be >= 1")
        self.context_tokens = context_tokens
        self.prompt_tokens = context_tokens  # what config_check compares with block_size and top-K
        self.num_samples = num_samples
        self.max_new_tokens = max_new_tokens
        self.seed = seed
        self.chat_template = chat_template

    def prompt_tokens_upper_bound(self) -> int:
        return self.context_tokens + CHAT_TEMPLATE_SLACK

    def rng(self, index: int) -> random.Random:
        """Sample `index`'s own generator: a sample is the same whatever num_samples is."""
        return random.Random(f"{type(self).__name__}:{self.seed}:{index}")

    def samples(self, tokenizer: Any) -> list[Sample]:
        """-> num_samples samples; the same seed gives the same samples, exactly."""
        return [self.make_sample(tokenizer, self.rng(i), i) for i in range(self.num_samples)]

    @abstractmethod
    def make_sample(self, tokenizer: Any, rng: random.Random, index: int) -> Sample:
        """One sample whose prompt encodes to at most context_tokens tokens (no template)."""

    def score(self, prediction: str, sample: Sample) -> float:
        return string_match_all(prediction, sample.answers)

    def evaluate(self, engine: Any) -> dict[str, Any]:
        """Generate for every sample through `engine` (prr.evaluation.Engine) and score it.
        -> {"accuracy": mean score, "num_samples": n}; one records/samples.jsonl row each."""
        scores, samples = [], self.samples(engine.tokenizer)
        for start in range(0, len(samples), engine.rows):  # a batch of the engine's rows at a time
            batch = samples[start : start + engine.rows]
            prompts = [engine.encode_prompt(s.prompt, self.chat_template, s.gen_prefix) for s in batch]  # [1, T] each
            first = engine.request + 1  # the batch's requests are the next ones, in order
            for i, (sample, ids, generation) in enumerate(zip(batch, prompts, engine.generate_batch(
                    prompts, self.max_new_tokens), strict=True)):
                scores.append(self.score(generation.text, sample))
                engine.log_sample({"prompt_tokens": ids.shape[1], "prediction": generation.text,
                                   "answers": list(sample.answers), "score": scores[-1],
                                   "token_ids": generation.token_ids, "margins": generation.margins}, sample=first + i)
        return {"accuracy": sum(scores) / len(scores), "num_samples": len(scores)}

    def build(self, tokenizer: Any, vocab_size: int, batch_size: int) -> PromptBatch:
        """The first sample as a prompt batch (Task's interface; the runner scores all samples)."""
        from prr.model.prompt import encode_prompt

        tok = tokenizer if tokenizer is not None else ByteTokenizer()
        sample = self.samples(tok)[0]
        ids = encode_prompt(tok, sample.prompt, use_chat_template=self.chat_template)
        return PromptBatch(ids.expand(batch_size, -1).contiguous(), f"{type(self).__name__} sample 0", sample.prompt)


def fill_to_budget(tokenizer: Any, sentences: list[str], budget: int) -> list[str]:
    """The longest prefix of `sentences` (cycled if needed) whose joined text fits `budget` tokens.
    Token counts are summed per sentence as they are taken, then checked on the join."""
    if budget <= 0 or not sentences:
        return []
    lengths: dict[int, int] = {}
    out: list[str] = []
    total, i = 0, 0
    while True:
        j = i % len(sentences)
        if j not in lengths:
            lengths[j] = max(count_tokens(tokenizer, " " + sentences[j]), 1)
        if total + lengths[j] > budget:
            break
        out.append(sentences[j])
        total += lengths[j]
        i += 1
    while out and count_tokens(tokenizer, " ".join(out)) > budget:  # sums can undercount at the joins
        out.pop()
    return out


def insert_at_depths(items: list[str], needles: list[str], depths: list[float],
                     lengths: list[int] | None = None) -> tuple[list[str], list[int]]:
    """Insert each needle between items at its depth: the item boundary where the share of
    the haystack's length (`lengths`, e.g. tokens per item; default 1 each) before it is
    closest to depth (0 = start, 1 = end). -> (items with needles, index of each needle)."""
    lengths = lengths if lengths is not None else [1] * len(items)
    if len(lengths) != len(items):
        raise ValueError(f"{len(lengths)} lengths for {len(items)} items")
    total = sum(lengths)
    before = [0]
    for n in lengths:
        before.append(before[-1] + n)  # before[i]: length of items[:i]
    slots = [min(range(len(items) + 1), key=lambda i: abs(before[i] - d * total)) for d in depths]
    order = sorted(range(len(needles)), key=lambda j: (slots[j], j))
    out, where, cursor = [], [0] * len(needles), 0
    for j in order:
        out.extend(items[cursor:slots[j]])
        cursor = max(cursor, slots[j])
        where[j] = len(out)
        out.append(needles[j])
    out.extend(items[cursor:])
    return out, where
