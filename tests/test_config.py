"""Every option of every config group composes and instantiates; bad input gets one clear
error naming the value and the valid choices, before any model loads."""

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException

from prr.config_check import CHECKED_BEFORE_TORCH, GROUPS, ConfigError, validate
from tests.helpers import instantiate_or_refuse_ruler

CONF = Path(__file__).resolve().parents[1] / "conf"
TINY = ["model=tiny-random", "selector.dense_layers=[]", "task.prompt_tokens=512", "selector.topk_blocks=8"]


def cfg(*overrides):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def options(group):
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


@pytest.mark.parametrize("group,option", [(g, o) for g in GROUPS for o in options(g)])
def test_every_option_composes_and_instantiates(group, option):
    overrides = [f"{group}={option}"]
    if group == "model" and option == "hf":
        overrides.append("model.name_or_path=/nonexistent")
    c = cfg(*overrides)
    obj = instantiate_or_refuse_ruler(c[group])
    if obj is None:  # task=ruler without its data: refused with the command that fetches it
        return
    assert type(obj).__name__ == c[group]._target_.rsplit(".", 1)[-1]


def test_default_config_validates_on_tiny_model():
    validate(cfg(*TINY))


def test_unknown_option_lists_choices():
    with pytest.raises(ConfigCompositionException, match="Available options") as err:
        cfg("selector=nope")
    assert "quest" in str(err.value.__cause__ or err.value) or "quest" in str(err.value)


@pytest.mark.parametrize(
    "override,message",
    [
        ("selector.topk_blocks=0", "topk_blocks=0 must be a positive"),
        ("selector.topk_blocks=-3", "topk_blocks=-3"),
        ("runtime.block_size=24", "block_size=24 must be a power of two"),
        ("runtime.block_size=1024", "block_size=1024 exceeds the prompt"),
        ("selector.topk_blocks=64", "covers the whole prompt"),
        ("model.name_or_path=/no/such/model", "/no/such/model"),
        ("+selector.topk=4", "did you mean selector.topk_blocks"),
        ("selector.topk_blocks=abc", "wrong type"),
        ("runtime.mode=dense", "runtime.mode='dense' is not one of"),
        ("runtime.projections=cublas", "runtime.projections='cublas' is not one of"),
        ("runtime.projections=fused", "applies to runtime.engine=graph only"),
        ("task.max_new_tokens=100000", "exceeds the model's context"),
        ("selector.dense_layers=[7]", "outside the model's layers"),
        ("selector=infllm_v2", "selects InfLLM-v2's blocks of 64 tokens .* add runtime.block_size=64"),
    ],
)
def test_bad_input_is_one_clear_error(override, message):
    with pytest.raises(ConfigError, match=message):
        validate(cfg(*TINY, override))


PERPLEXITY = ["model=tiny-random", "selector.dense_layers=[]", "selector.topk_blocks=8", "task=perplexity",
              "task.context_tokens=256", "task.score_tokens=8"]


@pytest.mark.parametrize(
    "content,task,message",
    [
        (b"text\x00" * 200, TINY, r"is binary, not text \(a NUL byte at offset 4 of 1000\); give a UTF-8 text file"),
        ("caf\xe9 ".encode("latin-1") * 200, TINY,
         r"is not UTF-8 text \(byte 0xe9 at offset 3 of 1000\); give a UTF-8 text file"),
        (b"", TINY, r"is empty \(0 bytes\); task.prompt_tokens takes 512 tokens from it: give a UTF-8 text file of "
                    r"at least 512 bytes"),
        (b" \n\t\n" * 10, TINY, r"holds only whitespace \(40 bytes\)"),
        (b"hello world " * 10, TINY, r"holds 120 bytes, too few for the 512 tokens task.prompt_tokens takes from it "
                                     r"\(a token is at least one byte of text\); give a file of at least 512 bytes or "
                                     r"lower task.prompt_tokens"),
        (b"", PERPLEXITY, r"is empty \(0 bytes\); task.context_tokens \+ task.score_tokens takes 264 tokens"),
        (b"hello world " * 10, PERPLEXITY, r"holds 120 bytes, too few for the 264 tokens task.context_tokens \+ "
                                           r"task.score_tokens takes from it"),
        (b"\xff\xfe" + "long text ".encode("utf-16-le") * 100, PERPLEXITY, r"is binary, not text"),
    ],
    ids=["nul-bytes", "latin-1", "empty", "whitespace", "short", "perplexity-empty", "perplexity-short", "utf-16"],
)
def test_a_prompt_file_that_cannot_be_the_prompt_is_one_line_naming_it(tmp_path, content, task, message):
    prompt = tmp_path / "prompt.txt"
    prompt.write_bytes(content)
    with pytest.raises(ConfigError, match=message) as err:
        validate(cfg(*task, f"task.prompt_file={prompt}"))
    assert len(err.value.problems) == 1 and err.value.problems[0].startswith(f"task: task.prompt_file='{prompt}' ")


def test_a_utf8_prompt_file_long_enough_in_bytes_passes_startup(tmp_path):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("naïve café, déjà vu. " * 25, encoding="utf-8")
    assert 512 <= prompt.stat().st_size < 512 * 2  # enough bytes for task.prompt_tokens=512, not a lot more
    for overrides in (TINY, PERPLEXITY):  # the bytes pass; only the random-init model's missing tokenizer is left
        with pytest.raises(ConfigError) as refused:
            validate(cfg(*overrides, f"task.prompt_file={prompt}"))
        (problem,) = refused.value.problems
        assert "needs a model with a tokenizer" in problem and "'tiny-random' is a random-init model" in problem


def test_triton_backend_on_cpu_is_refused_with_reasons(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ConfigError, match="backend=triton runs on a CUDA device"):
        validate(cfg(*TINY, "backend=triton"))
    with pytest.raises(ConfigError, match="gqa_reduce=union has no Triton Quest kernel"):
        validate(cfg(*TINY, "backend=triton", "selector.gqa_reduce=union"))


def test_all_problems_reported_at_once():
    with pytest.raises(ConfigError) as err:
        validate(cfg(*TINY, "runtime.block_size=24", "runtime.mode=dense"))
    assert len(err.value.problems) == 2


def test_graph_projections_auto_means_fused_only_on_a_gpu_at_batch_one():
    from prr.runtime.settings import RuntimeSettings

    assert RuntimeSettings(device="cuda", batch_size=1).graph_projections() == "fused"
    assert RuntimeSettings(device="cuda:1", batch_size=8).graph_projections() == "torch"
    assert RuntimeSettings(device="cpu", batch_size=1).graph_projections() == "torch"
    assert RuntimeSettings(device="cuda", batch_size=8, projections="fused").graph_projections() == "fused"


def conf_targets() -> dict[str, tuple[str, str]]:
    """`_target_` -> (group, option) of the first conf/ option that names it (compositions left out)."""
    import yaml

    found: dict[str, tuple[str, str]] = {}
    for g in GROUPS:
        for option in options(g):
            target = (yaml.safe_load((CONF / g / f"{option}.yaml").read_text()) or {}).get("_target_")
            if target:
                found.setdefault(target, (g, option))
    return found


@pytest.mark.parametrize("target", sorted(CHECKED_BEFORE_TORCH))
def test_a_target_checked_before_torch_inherits_that_classs_constructor(target):
    """One definition of each check: the class run.py checks before torch is the target's own
    constructor, with the capabilities the cross-checks read."""
    from prr.config_check import resolve_target

    built, checked = resolve_target(target), resolve_target(CHECKED_BEFORE_TORCH[target])
    assert issubclass(built, checked) and built.__init__ is checked.__init__
    for capability in ("uses_budget", "replays_selections", "declared_hit_rate", "selects_every_block", "profiles"):
        if hasattr(checked, capability):
            assert getattr(built, capability) is getattr(checked, capability), capability


@pytest.mark.parametrize("target", sorted(set(conf_targets()) - CHECKED_BEFORE_TORCH.keys()))
def test_a_target_without_a_torch_free_class_is_checked_by_its_own_constructor(target):
    """CHECKED_BEFORE_TORCH is a shortcut, not a registry: an option it does not name (selector=less,
    the backend group; a new one) passes the round before torch and is refused by `validate`."""
    from prr.config_check import problems_before_torch

    group, option = conf_targets()[target]
    composed = cfg(*TINY, f"{group}={option}", f"+{group}.no_such_option=1")
    assert problems_before_torch(composed) == []
    with pytest.raises(ConfigError) as err:
        validate(composed)
    assert err.value.problems[0].startswith(f"{group}.no_such_option is not an option of {target.rsplit('.', 1)[1]}")


@pytest.mark.parametrize("target,message", [
    ("no_such_package.Thing", r"no module named 'no_such_package' on sys.path \(a package of your own: pip install"),
    ("prr.selectors.no_such_module.Thing", r"no module named 'prr.selectors.no_such_module' in package 'prr.selectors'"),
    ("prr.selectors.quest.NoSuchSelector", r"cannot be imported: AttributeError: module 'prr.selectors.quest' has no "
                                           r"attribute 'NoSuchSelector'"),
    ("QuestSelector", r"is not a dotted path module.Class"),
])
def test_an_unimportable_target_is_one_line_naming_it(target, message):
    """Any importable `_target_` is accepted (no fixed list); one that cannot be imported is refused in
    one line, before torch where finding its module needs no import."""
    from prr.config_check import problems_before_torch

    composed = cfg(*TINY, f"selector._target_={target}")
    with pytest.raises(ConfigError, match=message) as err:
        validate(composed)
    assert len(err.value.problems) == 1 and err.value.problems[0].startswith(f"selector._target_={target!r}")
    if "AttributeError" not in message:  # (a class missing from its module shows only when imported)
        assert problems_before_torch(composed) == err.value.problems


def test_every_option_is_checked_before_torch_without_importing_it():
    """problems_before_torch on each option of the groups it checks, in a process where importing
    torch (or transformers, pandas, numpy) raises: a check that needed one would raise here."""
    import subprocess
    import sys

    code = ("import sys\nfor heavy in ('torch', 'transformers', 'pandas', 'numpy'): sys.modules[heavy] = None\n"
            "from hydra import compose, initialize_config_dir\n"
            "from prr.config_check import problems_before_torch\n"
            f"with initialize_config_dir(config_dir={str(CONF)!r}, version_base='1.3'):\n"
            "    for line in sys.argv[1:]:\n"
            "        problems_before_torch(compose('config', overrides=['model=tiny-random', line]))\n")
    lines = [f"{g}={o}" for g in ("model", "selector", "predictor", "budget", "task", "logger", "runtime")
             for o in options(g) if (g, o) != ("model", "hf")]  # hf: a path of the user's
    done = subprocess.run([sys.executable, "-c", code, *lines], cwd=CONF.parent, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.parametrize("overrides", [
    ["selector.topk_blocks=0"], ["selector=infllm", "selector.scoring=alibi"], ["predictor.alpha=1.5"],
    ["selector.dense_layers=[7]"], ["task.max_new_tokens=100000"], ["model.name_or_path=/no/such/model"],
    ["+selector.topk=4"], ["selector.topk_blocks=abc"], ["predictor=oracle", "budget=profiled"],
    ["budget.ratio=-1"], ["logger=wandb", "logger.project=7"], ["runtime.block_size=24"],
    ["runtime.engine=fast", "runtime.batch_size=0"], ["selector=infllm_v2"],
])
def test_the_checks_before_torch_find_what_validate_finds(overrides):
    from prr.config_check import problems_before_torch

    composed = cfg(*TINY, *overrides)
    with pytest.raises(ConfigError) as err:
        validate(composed)
    assert problems_before_torch(composed) == err.value.problems


def test_the_runtimes_cross_checks_are_left_to_validate():
    from prr.config_check import problems_before_torch

    assert problems_before_torch(cfg(*TINY)) == []
    # (the shard's head counts and the engine's limits: prr/runtime/graph_run.py, after torch)
    assert problems_before_torch(cfg(*TINY, "runtime.engine=graph", "runtime.row_tokens=[999999]")) == []
