"""`ruler_qa`: question answering over real offline text (RULER's QA, cloze form).

The Python Language Reference's sections are the documents (offline in every CPython).
A golden section is placed at a depth among seeded distractor sections up to
context_tokens; the question names the golden section and gives one of its sentences with
its final word removed; the answer is that word. (RULER uses SQuAD/HotpotQA, which need a
download; the cloze question keeps the task's shape: find the right document among
distractors, then read the answer out of it.)"""

from __future__ import annotations

import random
import re
from typing import Any

from prr.tasks.samples import Sample, SampleTask, count_tokens, insert_at_depths
from prr.tasks.text_sources import reference_sections


class ClozeQATask(SampleTask):
    def __init__(
        self,
        context_tokens: int = 4096,
        num_samples: int = 20,
        depth: float | None = None,
        max_new_tokens: int = 16,
        chat_template: bool = True,
        seed: int = 0,
    ) -> None:
        super().__init__(context_tokens, num_samples, max_new_tokens, seed, chat_template)
        if depth is not None and not 0.0 <= depth <= 1.0:
            raise ValueError(f"task.depth={depth} must be in [0, 1] or null")
        self.depth = depth

    def make_sample(self, tokenizer: Any, rng: random.Random, index: int) -> Sample:
        sections = reference_sections()
        names = sorted(sections)
        # Golden sections of at most half the context: room is left for the question and distractors.
        fits = [n for n in names if count_tokens(tokenizer, " ".join(sections[n])) <= self.context_tokens // 2]
        candidates = [(n, s) for n in fits for s in sections[n] if re.search(r"\s([A-Za-z]{5,})\.$", s)]
        if not candidates:
            raise ValueError(f"task.context_tokens={self.context_tokens} is too short for any section of the "
                             "reference as a golden document; raise context_tokens")
        golden_name, sentence = rng.choice(candidates)
        answer = re.search(r"([A-Za-z]{5,})\.$", sentence).group(1)
        cloze = sentence[: -len(answer) - 1].rstrip()
        golden = f"Document [{golden_name}]: " + " ".join(sections[golden_name])
        question = (f"Question: In the document [{golden_name}], which word ends the sentence \"{cloze} ...\"? "
                    "Answer with that one word.")
        prefix = "Answer:"
        header = "Answer the question based on the given documents. Only give me the answer and do not output any other words.\n\nThe following are given documents."
        budget = (self.context_tokens - count_tokens(tokenizer, f"{header}\n\n{golden}\n\n{question}")
                  - count_tokens(tokenizer, prefix) - 4)
        if budget < 0:
            raise ValueError(f"task.context_tokens={self.context_tokens} is shorter than the golden document "
                             f"[{golden_name}] and the question; raise context_tokens")
        others = [n for n in names if n != golden_name]
        rng.shuffle(others)
        distractors, costs, used = [], [], 0
        for n in others:
            doc = f"Document [{n}]: " + " ".join(sections[n])
            cost = count_tokens(tokenizer, "\n\n" + doc)
            if used + cost <= budget:
                distractors.append(doc)
                costs.append(cost)
                used += cost
        depth = self.depth if self.depth is not None else (index / (self.num_samples - 1) if self.num_samples > 1 else 0.5)
        docs, where = insert_at_depths(distractors, [golden], [depth], costs)  # depth: share of distractor tokens
        prompt = f"{header}\n\n" + "\n\n".join(docs) + f"\n\n{question}"
        return Sample(prompt, (answer,), {"depth": depth, "golden": golden_name, "golden_index": where[0],
                                          "documents": len(docs)}, gen_prefix=prefix)
