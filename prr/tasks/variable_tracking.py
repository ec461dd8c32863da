"""`ruler_vt`: variable tracking (RULER). Chains "VAR X1 = 12345", "VAR X2 = VAR X1", ...
are scattered (in order) through a haystack; the question asks for every variable that
holds the first chain's value. Distractor chains carry other values. Score: fraction of the
chain's variables found in the output."""

from __future__ import annotations

import random
import string
from typing import Any

from prr.tasks.niah import HAYSTACKS, rotated
from prr.tasks.samples import Sample, SampleTask, count_tokens, fill_to_budget, insert_at_depths
from prr.tasks.text_sources import NOISE_SENTENCES, prose_sentences


class VariableTrackingTask(SampleTask):
    def __init__(
        self,
        context_tokens: int = 4096,
        num_samples: int = 20,
        num_chains: int = 1,
        num_hops: int = 4,
        haystack: str = "noise",
        max_new_tokens: int = 32,
        chat_template: bool = True,
        seed: int = 0,
    ) -> None:
        super().__init__(context_tokens, num_samples, max_new_tokens, seed, chat_template)
        if num_chains < 1 or num_hops < 1:
            raise ValueError(f"task.num_chains={num_chains} and task.num_hops={num_hops} must be >= 1")
        if haystack not in HAYSTACKS:
            raise ValueError(f"task.haystack={haystack!r} is not one of {list(HAYSTACKS)}")
        self.num_chains, self.num_hops, self.haystack = num_chains, num_hops, haystack

    def make_sample(self, tokenizer: Any, rng: random.Random, index: int) -> Sample:
        names: set[str] = set()
        while len(names) < self.num_chains * (self.num_hops + 1):
            names.add("".join(rng.choice(string.ascii_uppercase) for _ in range(5)))
        pool_names = sorted(names)
        rng.shuffle(pool_names)
        values = rng.sample(range(10_000, 100_000), self.num_chains)
        statements, depths, chains = [], [], []
        for c in range(self.num_chains):
            chain = pool_names[c * (self.num_hops + 1):(c + 1) * (self.num_hops + 1)]
            chains.append(chain)
            cuts = sorted(rng.random() for _ in chain)  # a chain's statements in order of depth
            statements.append(f"VAR {chain[0]} = {values[c]}.")
            statements += [f"VAR {chain[i]} = VAR {chain[i - 1]}." for i in range(1, len(chain))]
            depths += cuts
        question = (f"Find all variables that are assigned the value {values[0]} in the text above.")
        header = "Memorize and track the chain(s) of variable assignment hidden in the following text."
        prefix = f"Answer: According to the chain(s) of variable assignment in the text above, {len(chains[0])} variables are assigned the value {values[0]}, they are:"
        fixed = f"{header}\n\n{' '.join(statements)}\n\n{question}"
        budget = self.context_tokens - count_tokens(tokenizer, fixed) - count_tokens(tokenizer, prefix) - 4
        if budget < 16:
            raise ValueError(f"task.context_tokens={self.context_tokens} leaves no room for a haystack around "
                             f"{len(statements)} assignments; raise context_tokens or lower num_chains/num_hops")
        pool = NOISE_SENTENCES if self.haystack == "noise" else rotated(prose_sentences(), rng)
        haystack = fill_to_budget(tokenizer, pool, budget)
        lengths = [count_tokens(tokenizer, " " + s) for s in haystack]
        body, where = insert_at_depths(haystack, statements, depths, lengths)
        prompt = f"{header}\n\n{' '.join(body)}\n\n{question}"
        return Sample(prompt, tuple(chains[0]), {"chains": chains, "values": values, "statement_depths": depths,
                                                "statement_sentence_index": where}, gen_prefix=prefix)
