"""Property tests (hypothesis) of selection sets, metadata upkeep and config composition."""

from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prr.cache import PagedKVCache
from prr.config_check import GROUPS
from prr.selectors import QuestSelector
from tests.helpers import instantiate_or_refuse_ruler

CONF = Path(__file__).resolve().parents[1] / "conf"


@settings(max_examples=40, deadline=None)
@given(length=st.integers(1, 400), block_pow=st.integers(0, 3), k=st.integers(1, 30), sinks=st.integers(0, 3),
       local=st.integers(0, 3), newest=st.booleans(), reduce=st.sampled_from(["max", "sum"]),
       group=st.sampled_from([1, 3, 4]), seed=st.integers(0, 1000))
def test_selection_has_k_blocks_and_every_forced_block(length, block_pow, k, sinks, local, newest, reduce, group, seed):
    if sinks + local + int(newest) > k:
        k = sinks + local + int(newest)
    block = 4 << block_pow
    g = torch.Generator().manual_seed(seed)
    sel = QuestSelector(topk_blocks=k, sink_blocks=sinks, local_blocks=local, force_newest=newest, gqa_reduce=reduce)
    cache = PagedKVCache(1, 1, 2, 8, block, length)
    cache.append(0, torch.randn(1, 2, length, 8, generator=g), torch.randn(1, 2, length, 8, generator=g))
    sel.update_metadata(cache, 0, 0, length)
    a = sel.select(torch.randn(1, 2, group, 8, generator=g), cache, 0)
    nb = cache.num_blocks(0)
    mask = a.blocks.mask(cache.max_blocks)
    assert torch.all(a.blocks.count == min(k, nb))
    assert torch.all(mask.sum(-1) == a.blocks.count)  # no duplicates among the valid entries
    forced = sel.forced_mask(nb, cache.max_blocks, torch.device("cpu"))[0, 0]  # [max_blocks]
    if forced.sum() <= k:
        assert torch.all(mask[..., forced])
    assert not mask[..., nb:].any()


@settings(max_examples=30, deadline=None)
@given(chunks=st.lists(st.integers(1, 40), min_size=1, max_size=8), block_pow=st.integers(0, 3), seed=st.integers(0, 99))
def test_quest_metadata_after_any_append_pattern_equals_a_rebuild(chunks, block_pow, seed):
    g = torch.Generator().manual_seed(seed)
    sel = QuestSelector(topk_blocks=2)
    cache = PagedKVCache(1, 1, 2, 8, 4 << block_pow, sum(chunks))
    for n in chunks:
        k = torch.randn(1, 2, n, 8, generator=g)
        start, end = cache.append(0, k, k)
        sel.update_metadata(cache, 0, start, end)
    incremental = {name: t.clone() for name, t in cache.metadata[0].items()}
    cache.metadata[0].clear()
    sel.update_metadata(cache, 0, 0, cache.length(0))
    for name, tensor in cache.metadata[0].items():
        assert torch.equal(incremental[name], tensor)


def options(group):
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.fixed_dictionaries({g: st.sampled_from(options(g)) for g in GROUPS}))
def test_any_combination_of_options_composes_and_instantiates(choice):
    overrides = [f"{g}={o}" for g, o in choice.items()]
    if choice["model"] == "hf":
        overrides.append("model.name_or_path=/nonexistent")
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides)
    for group in GROUPS:
        instantiate_or_refuse_ruler(cfg[group])
