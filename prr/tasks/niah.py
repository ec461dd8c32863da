"""`ruler_niah*`: needle in a haystack (RULER, arXiv 2404.06654), generated locally and seeded.

Needles "One of the special magic numbers for <key> is: <7-digit value>." are inserted at
chosen depths of a haystack of real prose (the Python Language Reference, `haystack=text`)
or RULER's repeated noise sentences (`haystack=noise`). Variants, by option:
  single      num_keys=1 num_values=1 num_queries=1
  multikey    num_keys=4: three distractor keys with their own numbers, one queried
  multivalue  num_values=4: the queried key has four numbers, all must be returned
  multiquery  num_queries=4 (num_keys=4): four keys queried, all their numbers returned
Depths: `depth` (a fraction in [0, 1]) for every sample's first needle, or null for depths
spread evenly over the samples (sample i of n at i/(n-1)); other needles at seeded depths.
Score: fraction of the queried values found in the output (RULER string_match_all).
"""

from __future__ import annotations

import random
from typing import Any

from prr.tasks.samples import Sample, SampleTask, count_tokens, fill_to_budget, insert_at_depths
from prr.tasks.text_sources import NOISE_SENTENCES, prose_sentences
from prr.tasks.vocabulary import ADJECTIVES, NOUNS

HAYSTACKS = ("text", "noise")


class NeedleTask(SampleTask):
    def __init__(
        self,
        context_tokens: int = 4096,
        num_samples: int = 20,
        num_keys: int = 1,
        num_values: int = 1,
        num_queries: int = 1,
        depth: float | None = None,
        haystack: str = "text",
        max_new_tokens: int = 32,
        chat_template: bool = True,
        seed: int = 0,
    ) -> None:
        super().__init__(context_tokens, num_samples, max_new_tokens, seed, chat_template)
        if num_keys < 1 or num_values < 1 or num_queries < 1:
            raise ValueError(f"task.num_keys={num_keys}, num_values={num_values}, num_queries={num_queries} "
                             "must all be >= 1")
        if num_queries > num_keys:
            raise ValueError(f"task.num_queries={num_queries} exceeds task.num_keys={num_keys}: "
                             "only inserted keys can be queried; raise num_keys")
        if num_keys > len(ADJECTIVES) * len(NOUNS):
            raise ValueError(f"task.num_keys={num_keys} exceeds the {len(ADJECTIVES) * len(NOUNS)} distinct keys")
        if depth is not None and not 0.0 <= depth <= 1.0:
            raise ValueError(f"task.depth={depth} must be in [0, 1] (0 = start of the haystack) or null")
        if haystack not in HAYSTACKS:
            raise ValueError(f"task.haystack={haystack!r} is not one of {list(HAYSTACKS)}")
        self.num_keys, self.num_values, self.num_queries = num_keys, num_values, num_queries
        self.depth, self.haystack = depth, haystack

    def sample_depth(self, index: int) -> float:
        if self.depth is not None:
            return self.depth
        return index / (self.num_samples - 1) if self.num_samples > 1 else 0.5

    def make_sample(self, tokenizer: Any, rng: random.Random, index: int) -> Sample:
        pairs = rng.sample([(a, n) for a in ADJECTIVES for n in NOUNS], self.num_keys)
        keys = [f"{a}-{n}" for a, n in pairs]
        values = {k: [str(rng.randint(1_000_000, 9_999_999)) for _ in range(self.num_values)] for k in keys}
        needles, needle_keys = [], []
        for k in keys:
            for v in values[k]:
                needles.append(f"One of the special magic numbers for {k} is: {v}.")
                needle_keys.append(k)
        queried = keys[: self.num_queries]  # keys are in random order already
        # The first queried key's first needle sits at the sample's depth; the others at seeded depths.
        depths = [rng.random() for _ in needles]
        depths[0] = self.sample_depth(index)
        order = list(range(1, len(needles)))
        rng.shuffle(order)  # distractor needles in random order
        needles = [needles[0]] + [needles[i] for i in order]
        needle_keys = [needle_keys[0]] + [needle_keys[i] for i in order]
        depths = [depths[0]] + [depths[i] for i in order]

        query = ", ".join(queried)
        many = self.num_values > 1 or self.num_queries > 1
        question = (f"What are all the special magic numbers for {query} mentioned in the provided text?"
                    if many else f"What is the special magic number for {query} mentioned in the provided text?")
        header = ("Some special magic numbers are hidden within the following text. "
                  "Make sure to memorize them. I will quiz you about the numbers afterwards.")
        prefix = f"The special magic {'numbers' if many else 'number'} for {query} mentioned in the provided text {'are' if many else 'is'}"
        fixed = f"{header}\n\n{' '.join(needles)}\n\n{question}"
        budget = self.context_tokens - count_tokens(tokenizer, fixed) - count_tokens(tokenizer, prefix) - 4
        if budget < 16:
            raise ValueError(f"task.context_tokens={self.context_tokens} leaves no room for a haystack around "
                             f"{len(needles)} needles; raise context_tokens")
        pool = NOISE_SENTENCES if self.haystack == "noise" else rotated(prose_sentences(), rng)
        haystack = fill_to_budget(tokenizer, pool, budget)
        lengths = [count_tokens(tokenizer, " " + s) for s in haystack]  # depth is a share of the haystack's tokens
        body, where = insert_at_depths(haystack, needles, depths, lengths)
        context = " ".join(body)
        prompt = f"{header}\n\n{context}\n\n{question}"
        answers = tuple(v for k in queried for v in values[k])
        return Sample(prompt, answers, {
            "depth": depths[0], "needles": needles, "needle_keys": needle_keys, "needle_depths": depths,
            "needle_sentence_index": where, "haystack_sentences": len(haystack), "queried_keys": queried,
        }, gen_prefix=prefix)


def rotated(sentences: list[str], rng: random.Random) -> list[str]:
    """The sentence list started at a seeded offset: each sample gets another stretch of text."""
    start = rng.randrange(len(sentences))
    return sentences[start:] + sentences[:start]
