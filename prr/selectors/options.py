"""The selector group's options without torch: each selector's constructor (its keys, their
types, the checks of their values) and what the config's cross-checks read (top-K, dense
layers, `selects_every_block`). The selectors of prr.selectors inherit these constructors
unchanged and add the torch work, so that run.py refuses a bad selector value before torch
is imported (prr.config_check.CHECKED_BEFORE_TORCH names the pairs). A shortcut for the built-in
selectors, not a registry: a new selector's constructor may live in its own module, and run.py
checks its values there once torch is imported (docs/extending.md)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

GQA_REDUCTIONS = ("max", "sum", "union")
SCORINGS = ("position_agnostic", "rope")  # InfLLM's
REPRESENTATIVES_FROM = ("window_attention", "one_query")  # InfLLM's
# InfLLM-v2's sizes (arXiv 2509.24663, sec. 3.3 and 4.1; MiniCPM4's sparse_config): selection blocks of
# B = 64 tokens, keys mean-pooled over windows of B/2 = 32 tokens at a stride of B/4 = 16.
INFLLM_V2_BLOCK_TOKENS = 64
INFLLM_V2_WINDOW_TOKENS = 32
INFLLM_V2_WINDOW_STRIDE = 16


class SelectorOptions:
    """The options every top-K selector takes (quest, exact; the base of the others)."""

    # True for `dense`: A is every block of the context, |A| grows with it (no fixed top-K).
    selects_every_block = False
    topk_option = "topk_blocks"  # the config key of the top-K (`indexer`'s counts tokens: topk_tokens)

    def __init__(
        self,
        topk_blocks: int,
        sink_blocks: int = 1,
        local_blocks: int = 0,
        force_newest: bool = True,
        gqa_reduce: str = "max",
        dense_layers: Sequence[int] = (),
        hinted_topk: bool = False,
    ) -> None:
        if topk_blocks <= 0:
            raise ValueError(f"selector.topk_blocks={topk_blocks} must be a positive number of blocks")
        if gqa_reduce not in GQA_REDUCTIONS:
            raise ValueError(f"selector.gqa_reduce={gqa_reduce!r} is not one of {list(GQA_REDUCTIONS)}")
        if sink_blocks < 0 or local_blocks < 0:
            raise ValueError(f"sink_blocks={sink_blocks} and local_blocks={local_blocks} must be >= 0")
        forced = sink_blocks + local_blocks + int(force_newest)
        if forced > topk_blocks:
            raise ValueError(
                f"selector keeps {forced} blocks always (sink_blocks={sink_blocks} + local_blocks={local_blocks}"
                f" + force_newest={force_newest}) but topk_blocks={topk_blocks}; raise topk_blocks to >= {forced}"
            )
        if not isinstance(hinted_topk, bool):
            raise ValueError(f"selector.hinted_topk={hinted_topk!r} is not one of [True, False]")
        if hinted_topk and gqa_reduce == "union":
            raise ValueError("selector.hinted_topk=true hints one top-k per (row, KV head), but gqa_reduce=union "
                             "takes one per query head; use gqa_reduce=max or sum, or selector.hinted_topk=false")
        self.topk_blocks = topk_blocks
        self.sink_blocks = sink_blocks
        self.local_blocks = local_blocks
        self.force_newest = force_newest
        self.gqa_reduce = gqa_reduce
        self.dense_layers = frozenset(int(x) for x in dense_layers)
        # The top-k from a threshold guess per (row, KV head): the previous decode step's k-th score
        # (Selector.topk_hint, prr.kernels.hinted_topk). The same A, exactly; only its time changes.
        self.hinted_topk = hinted_topk

    def block_size_problems(self, block_size: int) -> list[str]:
        """What this selector cannot take of `runtime.block_size` (prr.config_check runs it before
        torch is imported); [] for selectors whose blocks are the cache's, whatever their size."""
        return []


class DenseSelectorOptions(SelectorOptions):
    selects_every_block = True  # |A| grows with the context

    def __init__(self, gqa_reduce: str = "max", dense_layers: Sequence[int] = ()) -> None:
        # topk is irrelevant: every block is selected.
        super().__init__(topk_blocks=1, sink_blocks=0, local_blocks=0, force_newest=False,
                         gqa_reduce=gqa_reduce, dense_layers=dense_layers)


class InfLLMSelectorOptions(SelectorOptions):
    def __init__(
        self,
        topk_blocks: int,
        sink_blocks: int = 1,
        local_blocks: int = 4,
        force_newest: bool = True,
        gqa_reduce: str = "sum",
        dense_layers: Sequence[int] = (),
        representatives: int = 4,
        per_head: bool = False,
        scoring: str = "position_agnostic",
        representatives_from: str = "window_attention",
        hinted_topk: bool = False,
    ) -> None:
        super().__init__(topk_blocks, sink_blocks, local_blocks, force_newest, gqa_reduce, dense_layers, hinted_topk)
        if isinstance(representatives, bool) or not isinstance(representatives, int) or representatives < 1:
            raise ValueError(f"selector.representatives={representatives!r} must be a positive integer "
                             "(tokens per block, at most runtime.block_size)")
        if not isinstance(per_head, bool):
            raise ValueError(f"selector.per_head={per_head!r} is not one of [True, False]")
        if scoring not in SCORINGS:
            raise ValueError(f"selector.scoring={scoring!r} is not one of {list(SCORINGS)}")
        if representatives_from not in REPRESENTATIVES_FROM:
            raise ValueError(f"selector.representatives_from={representatives_from!r} is not one of "
                             f"{list(REPRESENTATIVES_FROM)}")
        self.window_blocks = local_blocks + int(force_newest)
        if representatives_from == "window_attention" and self.window_blocks == 0:
            raise ValueError("selector.representatives_from=window_attention needs a local window: set "
                             "selector.local_blocks >= 1 or selector.force_newest=true")
        self.representatives = representatives
        self.per_head = per_head
        self.scoring = scoring
        self.representatives_from = representatives_from
        self.inv_freq: Any = None  # [D/2] fp32 tensor: the RoPE the cache's keys carry (InfLLMSelector.bind_model)


class InfLLMV2SelectorOptions(SelectorOptions):
    """`infllm_v2`: InfLLM-v2's block selection (prr.selectors.infllm_v2). The group's scores are
    summed (the paper's Eq. 6) before the max-pooling onto blocks, inside the scoring: no
    `gqa_reduce` option. Its blocks are the paper's 64 tokens: `runtime.block_size` must be 64."""

    def __init__(
        self,
        topk_blocks: int,
        sink_blocks: int = 1,
        local_blocks: int = 1,
        force_newest: bool = True,
        dense_layers: Sequence[int] = (),
        hinted_topk: bool = False,
    ) -> None:
        super().__init__(topk_blocks, sink_blocks, local_blocks, force_newest, "sum", dense_layers, hinted_topk)

    def block_size_problems(self, block_size: int) -> list[str]:
        if block_size == INFLLM_V2_BLOCK_TOKENS:
            return []
        return [f"selector=infllm_v2 selects InfLLM-v2's blocks of {INFLLM_V2_BLOCK_TOKENS} tokens (keys pooled over "
                f"{INFLLM_V2_WINDOW_TOKENS} at stride {INFLLM_V2_WINDOW_STRIDE}) but runtime.block_size={block_size}; "
                f"add runtime.block_size={INFLLM_V2_BLOCK_TOKENS}"]


INDEX_DTYPE_NAMES = ("bf16", "fp8", "fp32")  # fp32: torch backend only (the kernels keep bf16 or fp8 e4m3)
INDEXER_WEIGHTS = ("random", "trained")


class IndexerSelectorOptions(SelectorOptions):
    """`indexer`: a DeepSeek-V3.2-style lightning indexer (prr.selectors.indexer). Its unit of
    selection is one token, so it runs with `runtime.block_size=1`: every "block" of the engine
    (A, P, repair, merge, counters, predictors) is then a token. One selection per row, shared by
    every KV head (the indexer's scores have no head of the model's): no `gqa_reduce` option."""

    topk_option = "topk_tokens"

    def __init__(
        self,
        topk_tokens: int = 2048,
        sink_tokens: int = 4,
        local_tokens: int = 63,
        force_newest: bool = True,
        dense_layers: Sequence[int] = (0, 1),
        index_heads: int = 64,
        index_dim: int = 128,
        rope_dim: int = 64,
        index_dtype: str = "bf16",
        weights: str = "random",
        seed: int = 0,
        model: str | None = None,
        hinted_topk: bool = False,
    ) -> None:
        super().__init__(topk_tokens, sink_tokens, local_tokens, force_newest, "max", dense_layers, hinted_topk)
        for name, value in (("index_heads", index_heads), ("index_dim", index_dim), ("seed", seed)):
            if isinstance(value, bool) or not isinstance(value, int) or value < (0 if name == "seed" else 1):
                raise ValueError(f"selector.{name}={value!r} must be a {'non-negative' if name == 'seed' else 'positive'}"
                                 " integer")
        if isinstance(rope_dim, bool) or not isinstance(rope_dim, int) or not 0 <= rope_dim <= index_dim \
                or rope_dim % 2:
            raise ValueError(f"selector.rope_dim={rope_dim!r} must be even and in [0, index_dim={index_dim}]")
        if index_dtype not in INDEX_DTYPE_NAMES:
            raise ValueError(f"selector.index_dtype={index_dtype!r} is not one of {list(INDEX_DTYPE_NAMES)}")
        if weights not in INDEXER_WEIGHTS:
            raise ValueError(f"selector.weights={weights!r} is not one of {list(INDEXER_WEIGHTS)}")
        if hinted_topk:
            raise ValueError("selector.hinted_topk=true is not built for selector=indexer yet (its hint slot is per KV "
                             "head, the indexer's top-K one per row); use selector.hinted_topk=false")
        if weights == "trained" and not model:
            raise ValueError("selector.weights=trained loads the indexer distilled for a model: set selector.model "
                             "(conf/selector/indexer.yaml sets ${model.name_or_path})")
        self.topk_tokens = topk_tokens
        self.index_heads, self.index_dim, self.rope_dim = index_heads, index_dim, rope_dim
        self.index_dtype, self.weights, self.seed, self.model = index_dtype, weights, seed, model

    def block_size_problems(self, block_size: int) -> list[str]:
        if block_size == 1:
            return []
        return [f"selector=indexer selects tokens (a selection unit of one token) but runtime.block_size={block_size};"
                " add runtime.block_size=1"]
