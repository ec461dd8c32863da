"""`ruler_cwe` and `ruler_fwe`: aggregation tasks (RULER).

cwe (common words): a numbered list of words where `num_common` words appear
`common_repeats` times each and every other word `rare_repeats` times; the question asks
for the `num_common` most common words. fwe (frequent words): coded words drawn from a
Zipf distribution (exponent `alpha`); the question asks for the 3 most frequent.
Lists grow to fill context_tokens. Score: fraction of the expected words in the output."""

from __future__ import annotations

import random
import string
from collections import Counter
from typing import Any

from prr.tasks.samples import Sample, SampleTask, count_tokens
from prr.tasks.vocabulary import ADJECTIVES, NOUNS

WORDS = tuple(sorted(set(ADJECTIVES + NOUNS)))


class CommonWordsTask(SampleTask):
    def __init__(
        self,
        context_tokens: int = 4096,
        num_samples: int = 20,
        num_common: int = 10,
        common_repeats: int = 30,
        rare_repeats: int = 3,
        max_new_tokens: int = 64,
        chat_template: bool = True,
        seed: int = 0,
    ) -> None:
        super().__init__(context_tokens, num_samples, max_new_tokens, seed, chat_template)
        if not 1 <= num_common < len(WORDS):
            raise ValueError(f"task.num_common={num_common} must be in [1, {len(WORDS) - 1}]")
        if common_repeats <= rare_repeats or rare_repeats < 1:
            raise ValueError(f"task.common_repeats={common_repeats} must exceed task.rare_repeats={rare_repeats} >= 1")
        self.num_common, self.common_repeats, self.rare_repeats = num_common, common_repeats, rare_repeats

    def make_sample(self, tokenizer: Any, rng: random.Random, index: int) -> Sample:
        words = list(WORDS)
        rng.shuffle(words)
        compounds = [f"{a}-{n}" for a in ADJECTIVES for n in NOUNS]  # more rare words, so long lists fit
        rng.shuffle(compounds)
        common, rare = words[: self.num_common], words[self.num_common:] + compounds
        question = f"Question: What are the {self.num_common} most common words in the above list?"
        prefix = f"Answer: The top {self.num_common} words that appear most often in the list are:"
        header = "Below is a numbered list of words. In these words, some appear more often than others. Memorize the ones that appear most often."
        overhead = count_tokens(tokenizer, f"{header}\n\n\n\n{question}") + count_tokens(tokenizer, prefix) + 4
        # Grow the rare part until the list would not fit: common words always keep their counts.
        listing = self._listing(rng, common, rare, tokenizer, self.context_tokens - overhead)
        prompt = f"{header}\n\n{listing}\n\n{question}"
        return Sample(prompt, tuple(common), {"common": common}, gen_prefix=prefix)

    def _listing(self, rng: random.Random, common: list[str], rare: list[str], tokenizer: Any, budget: int) -> str:
        """The longest list (most rare words) that fits `budget` tokens; bisection over the rare count."""
        order_seed = rng.random()

        def listing(n_rare: int) -> str:
            items = common * self.common_repeats + rare[:n_rare] * self.rare_repeats
            order = random.Random(order_seed).sample(items, len(items))
            return " ".join(f"{i + 1}. {w}" for i, w in enumerate(order))

        if count_tokens(tokenizer, listing(0)) > budget:
            raise ValueError(f"task.context_tokens={self.context_tokens} is too small for {self.num_common} words x "
                             f"{self.common_repeats} repeats; raise context_tokens or lower common_repeats")
        lo, hi = 0, len(rare)  # listing(lo) fits; find the largest n that fits
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if count_tokens(tokenizer, listing(mid)) <= budget:
                lo = mid
            else:
                hi = mid - 1
        return listing(lo)


class FrequentWordsTask(SampleTask):
    def __init__(
        self,
        context_tokens: int = 4096,
        num_samples: int = 20,
        alpha: float = 2.0,
        vocab_size: int = 2000,
        max_new_tokens: int = 32,
        chat_template: bool = True,
        seed: int = 0,
    ) -> None:
        super().__init__(context_tokens, num_samples, max_new_tokens, seed, chat_template)
        if alpha <= 1.0:
            raise ValueError(f"task.alpha={alpha} must be > 1 (a Zipf exponent)")
        if vocab_size < 10:
            raise ValueError(f"task.vocab_size={vocab_size} must be >= 10")
        self.alpha, self.vocab_size = alpha, vocab_size

    def make_sample(self, tokenizer: Any, rng: random.Random, index: int) -> Sample:
        vocab: set[str] = set()
        while len(vocab) < self.vocab_size:
            vocab.add("".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(3, 6))))
        ranked = sorted(vocab)
        rng.shuffle(ranked)
        weights = [1.0 / (r + 1) ** self.alpha for r in range(len(ranked))]
        header = "Read the following coded text and track the frequency of each coded word. Find the three most frequently appeared coded words."
        question = "Question: Do not provide any explanation. Please ignore the dots '....'. What are the three most frequently appeared words in the above coded text?"
        prefix = "Answer: According to the coded text above, the three most frequently appeared words are:"
        budget = self.context_tokens - count_tokens(tokenizer, f"{header}\n\n\n\n{question}") - count_tokens(tokenizer, prefix) - 4
        words: list[str] = []
        step = 64
        while True:  # grow in chunks, check the real token count
            more = rng.choices(ranked, weights, k=step)
            if count_tokens(tokenizer, " ".join(words + more) + " ....") > budget:
                break
            words += more
        counts = Counter(words)
        top = [w for w, _ in sorted(counts.items(), key=lambda kv: (-kv[1], ranked.index(kv[0])))[:3]]
        third, fourth = counts[top[2]], sorted(counts.values(), reverse=True)[3] if len(counts) > 3 else 0
        prompt = f"{header}\n\n{' '.join(words)} ....\n\n{question}"
        return Sample(prompt, tuple(top), {"counts": dict(counts.most_common(5)), "tie_at_third": third == fourth},
                      gen_prefix=prefix)
