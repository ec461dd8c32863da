"""A new option is its class and its YAML, nothing else (docs/extending.md): a toy selector and a
toy predictor written into a package of their own (outside prr, on sys.path, found by Hydra through
`hydra.searchpath`) run through both engines and every budget of conf/budget/, with no file of prr
edited; run.py's checks find them, check their values with their own constructors, and refuse a
misspelled one in one line.

The toy pair has a property that shows in the record: the selector scores every block by its
position, so A = the sink + the newest K - 1 blocks; the predictor proposes the newest |P| blocks,
so at |P| = K it holds K - 1 blocks of A at every step: hit rate = precision = (K - 1) / K exactly."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from prr.config_check import ConfigError, problems_before_torch, validate
from prr.front_door import BadOverride, preflight
from prr.runner import run
from tests.test_graph_run import TINY

ROOT = Path(__file__).resolve().parents[1]
BUDGETS = sorted(p.stem for p in (ROOT / "conf" / "budget").glob("*.yaml"))
K = 6  # TINY's selector.topk_blocks

# The researcher's package: docs/extending.md shows the same files.
TOY_PACKAGE = {
    "recency.py": '''
import torch

from prr.selectors.base import Selector


class RecencySelector(Selector):
    """Every block scored by its position: A = the sinks + the newest blocks."""

    def head_scores(self, q, cache, layer, lengths):  # q: [B, Hkv, G, D]
        b, h, g, _ = q.shape
        blocks = torch.arange(cache.max_blocks, device=q.device, dtype=torch.float32)
        return blocks.expand(b, h, g, cache.max_blocks)  # [B, Hkv, G, max_blocks]
''',
    "selector/recency.yaml": '''
_target_: toy_options.recency.RecencySelector
topk_blocks: 32
sink_blocks: 1
dense_layers: [0, 1]
''',
    "newest.py": '''
import torch

from prr.blocks import block_counts, inside_context
from prr.predictors.base import NEVER, Predictor


class NewestBlocksPredictor(Predictor):
    """P = the newest |P| blocks of each row's context; it learns nothing."""

    def init_state(self, num_layers, batch, num_kv_heads, max_blocks, device):
        # one rank for every layer: [B, Hkv, max_blocks], newer blocks higher
        return torch.arange(max_blocks, device=device, dtype=torch.float32).expand(batch, num_kv_heads, max_blocks)

    def rank(self, state, layer, num_blocks):
        nb = block_counts(num_blocks, state.shape[0], state.device)  # [B]
        return state.masked_fill(~inside_context(nb, state.shape[-1]), NEVER)  # [B, Hkv, max_blocks]

    def update(self, state, layer, selection):
        pass  # P depends on the context's length alone
''',
    "predictor/newest.yaml": '''
_target_: toy_options.newest.NewestBlocksPredictor
''',
}
# A budget's options that keep it fast and its decisions free of timings: profiled times one ratio
# once; adaptive windows of 2 steps with min_hit = 1, so that a window that missed (every PRR window
# of this toy pair) is followed by serial DSA whatever the clocks say. Another budget runs as its YAML has it.
BUDGET_OVERRIDES = {
    "profiled": ["budget.ratios=[1.0]", "budget.max_rounds=1", "budget.use_cache=false"],
    "adaptive": ["budget.min_hit=1.0", "budget.window_steps=2", "budget.probe_every=2", "task.max_new_tokens=8"],
}


@pytest.fixture(scope="module")
def toy_options(tmp_path_factory) -> str:
    """The toy package on sys.path -> the override that puts its YAML dirs on Hydra's search path."""
    root = tmp_path_factory.mktemp("researcher")
    package = root / "toy_options"
    for name, text in TOY_PACKAGE.items():
        (package / name).parent.mkdir(parents=True, exist_ok=True)
        (package / name).write_text(text.lstrip())
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(root))
        yield f"hydra.searchpath=['file://{package}']"
    for module in [m for m in sys.modules if m.split(".")[0] == "toy_options"]:
        del sys.modules[module]


def toy_args(toy_options: str, *extra: str) -> list[str]:
    return [toy_options, *TINY, "++model.num_layers=2", "selector=recency", "predictor=newest", *extra]


def run_case(tmp_path: Path, args: list[str], name: str) -> dict:
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=args)
    return run(cfg, tmp_path / name)


def test_toy_options_run_in_both_engines_under_every_budget(tmp_path, monkeypatch, toy_options):
    monkeypatch.setenv("PRR_CACHE_DIR", str(tmp_path / "cache"))
    serial = run_case(tmp_path, toy_args(toy_options, "predictor=none", "task.max_new_tokens=8"), "serial")
    for budget in BUDGETS:
        args = toy_args(toy_options, f"budget={budget}", *BUDGET_OVERRIDES.get(budget, []))
        eager = run_case(tmp_path, [*args, "runtime.engine=eager"], f"{budget}-eager")
        graph = run_case(tmp_path, [*args, "runtime.engine=graph"], f"{budget}-graph")
        # exact repair: PRR decodes serial DSA's tokens, whatever P and |P| each engine chose
        steps = eager["decode_steps"]
        assert graph["generated_token_ids"] == eager["generated_token_ids"], budget
        assert eager["generated_token_ids"][0] == serial["generated_token_ids"][0][:steps], budget
        assert graph["decode_steps"] == steps >= 6, budget
        if graph["variant"] == "prr":  # the newest |P| blocks hold min(|P|, K - 1) of A's K
            assert graph["hit_rate"] == min(graph["predicted_blocks"], K - 1) / K, budget
        if budget == "fixed":  # |P| = |A| = K in both engines
            assert graph["predicted_blocks"] == K
            for record in (eager, graph):
                assert record["hit_rate"] == record["precision"] == (K - 1) / K
        if budget == "adaptive":  # the same windows from the hit rates alone, every PRR window at (K - 1) / K
            windows = [(w["variant"], w["hit_rate"]) for w in eager["budget_setup"]["windows"]]
            assert [(w["variant"], w["hit_rate"]) for w in graph["budget_setup"]["windows"]] == windows
            assert len(windows) == 4 and {v for v, _ in windows} == {"serial", "prr"}
            assert all(h == ((K - 1) / K if v == "prr" else None) for v, h in windows)


def test_toy_options_pass_run_pys_checks_and_a_bad_value_is_one_line(toy_options):
    """run.py's front door (prr.front_door.preflight) lists the search path's options, and the toy
    classes' own constructors (their base classes') check their values; prr keeps no list of them."""
    args = toy_args(toy_options, "runtime=cpu")
    assert preflight(args, ROOT / "conf")[0] == args
    with pytest.raises(BadOverride, match=r"selector=recncy: selector has no option 'recncy'; did you mean recency\?"):
        preflight([*args, "selector=recncy"], ROOT / "conf")
    sweep = ["-m", *args, "selector=recency,quest"]  # a sweep's jobs compose with the search path too
    assert preflight(sweep, ROOT / "conf")[0] == sweep
    with pytest.raises(BadOverride, match=r"selector=recncy: selector has no option 'recncy'"):
        preflight(["-m", *args, "selector=quest,recncy"], ROOT / "conf")
    with pytest.raises(ConfigError, match=r"selector.topk is not an option of RecencySelector; did you mean "
                                          r"selector.topk_blocks\?") as err:
        preflight([*args, "+selector.topk=4"], ROOT / "conf")
    assert len(err.value.problems) == 1
    with pytest.raises(ConfigError, match=r"selector.topk_blocks=0 must be a positive number of blocks"):
        preflight([*args, "selector.topk_blocks=0"], ROOT / "conf")


def test_a_toy_target_that_cannot_be_imported_is_refused_before_torch_in_one_line(toy_options):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=toy_args(toy_options, "predictor._target_=toy_options.newer.X"))
    want = ["predictor._target_='toy_options.newer.X' cannot be imported: no module named 'toy_options.newer' in "
            "package 'toy_options'"]
    assert problems_before_torch(cfg) == want
    with pytest.raises(ConfigError) as err:
        validate(cfg)
    assert err.value.problems == want
