"""A selector's config overrides at a study's token budget, so studies compare selectors at the
same number of attended tokens whatever their unit of selection.

A study counts its budget in blocks of its own block size (Quest, InfLLM, LESS, exact select
blocks of the cache, any size). Two selectors fix their unit instead: `indexer` selects tokens
(runtime.block_size=1, selector.topk_tokens) and `infllm_v2` the paper's 64-token blocks
(runtime.block_size=64, selector.topk_blocks in those blocks). A budget its unit does not divide
is refused, not rounded: rounding would compare selectors at different budgets.

The indexer's weights: `trained` (the model's distilled indexer in the cache,
prr.selectors.indexer_weights.stored_indexer_configs; its shape and dense layers come with it)
or, only when asked, `random` (seeded: latency and plumbing, not accuracy or locality).
"""

from __future__ import annotations

from prr.selectors.options import INFLLM_V2_BLOCK_TOKENS, IndexerSelectorOptions, InfLLMV2SelectorOptions

# selector -> (its unit of selection in tokens, its top-K's config key): those whose unit is not the study's
OWN_UNIT = {"indexer": (1, IndexerSelectorOptions.topk_option),
            "infllm_v2": (INFLLM_V2_BLOCK_TOKENS, InfLLMV2SelectorOptions.topk_option)}


def selector_unit(selector: str, block_size: int) -> int:
    """The tokens of one selection unit of `selector` in a study whose blocks are `block_size` tokens."""
    return OWN_UNIT[selector][0] if selector in OWN_UNIT else block_size


def budget_overrides(selector: str, budget_tokens: int, block_size: int) -> list[str]:
    """`selector` at `budget_tokens` attended tokens (forced ones included) in a study whose blocks
    are `block_size` tokens -> ["selector=...", "runtime.block_size=...", "selector.<top-K>=..."]."""
    unit = selector_unit(selector, block_size)
    key = OWN_UNIT[selector][1] if selector in OWN_UNIT else "topk_blocks"
    if budget_tokens < 1 or budget_tokens % unit:
        raise ValueError(f"a budget of {budget_tokens} tokens is not a positive multiple of selector={selector}'s "
                         f"{unit}-token unit of selection; choose budgets that are multiples of {unit} tokens")
    return [f"selector={selector}", f"runtime.block_size={unit}", f"selector.{key}={budget_tokens // unit}"]


def indexer_weight_overrides(model: str, weights: str) -> list[str]:
    """selector=indexer's weights for `model` (its config's name_or_path, as conf/selector/indexer.yaml's
    selector.model). weights="trained": the stored distilled indexer's shape and dense layers (exactly
    one stored: several are refused naming them), or a ValueError naming `make train-indexer MODEL=...`
    when none is; weights="random": the conf's seeded random weights."""
    from prr.selectors.indexer_weights import stored_indexer_configs

    if weights == "random":
        return ["selector.weights=random"]
    if weights != "trained":
        raise ValueError(f"indexer weights {weights!r} is not one of ['trained', 'random']")
    stored = stored_indexer_configs(model)
    if not stored:
        raise ValueError(f"no trained indexer for model {model!r} in the cache: train one with `make train-indexer "
                         f"MODEL={model}` (docs/results/indexer.md); random weights (the studies' --indexer-weights random) check "
                         "the plumbing only")
    if len(stored) > 1:
        raise ValueError(f"{len(stored)} trained indexers for model {model!r} in the cache ({stored}): keep one "
                         "(prr.selectors.indexer_weights.indexer_weights_file names each's file)")
    c = stored[0]
    return ["selector.weights=trained", f"selector.index_heads={c.index_heads}", f"selector.index_dim={c.index_dim}",
            f"selector.rope_dim={c.rope_dim}", f"selector.dense_layers=[{','.join(map(str, c.dense_layers))}]"]
