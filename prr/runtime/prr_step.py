"""One layer's PRR decode step, wired in the one direction DESIGN.md §2 fixes:

    predict -> (speculate ∥ select) -> repair -> merge -> update predictor

Selectors that `compensate` (LESS) add one partial state for the unselected blocks, merged
after repair in the merge stage (also under serial DSA, |P| = 0), so exact-mode PRR and
serial DSA receive the same compensation.

The research runtime's step (DSABackend): the stages run one after the other and are timed
one by one, with host-side stage timers, on the CPU and on a GPU alike — it does not overlap
speculation with selection anywhere. The overlapped, CUDA-graph-captured step is the engine's
(prr/runtime/graph_decode.py), which runs the same selector and predictor objects. No stage
calls another; each returns a typed value, and the record of the step is built from them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from prr.attention_state import AttentionState, merge
from prr.blocks import BlockSet
from prr.cache import PagedKVCache
from prr.predictors.base import Predictor
from prr.runtime.ops import BlockAttentionOps, TorchOps
from prr.runtime.timing import StageTimer
from prr.selectors.base import Selection, Selector

REPAIR_MODES = ("exact", "superset")


@dataclass(frozen=True)
class PrrStepResult:
    state: AttentionState  # sparse attention output: out [B, Hkv, G, D], lse [B, Hkv, G]
    selection: Selection  # A
    predicted: BlockSet  # P
    missed: Tensor  # [B, Hkv, max_blocks] bool: A \ P, the blocks repair attended


def prr_attention(
    q: Tensor,
    cache: PagedKVCache,
    layer: int,
    selector: Selector,
    predictor: Predictor,
    predictor_state: Any,
    budget_blocks: int,
    repair_mode: str,
    timer: StageTimer,
    scale: float,
    current: Selection | None = None,
    ops: BlockAttentionOps | None = None,
) -> PrrStepResult:
    """q: [B, Hkv, G, D] post-RoPE, the current token already in `cache`.

    current: this step's selection computed beforehand, untimed; only for predictors that
    `needs_current_selection` (the oracle), for whom it is required.
    ops: the attention backend (default: the torch reference).
    """
    ops = ops or TorchOps()
    length = cache.length(layer)
    num_blocks = cache.num_blocks(layer)
    max_blocks = cache.max_blocks
    if predictor.needs_current_selection and current is None:
        raise ValueError(f"{type(predictor).__name__} needs the current selection: pass current=selector.select(...)")

    with timer.stage("predict"):
        # Predictors that declare `needs_query` (query_similarity) also get q: it is known before selection.
        query = {"query": q} if getattr(predictor, "needs_query", False) else {}
        predicted = predictor.propose(predictor_state, layer, num_blocks, budget_blocks, current, **query)
    speculating = predicted.capacity > 0  # static shape: known on the host, no sync
    if speculating:  # serial DSA (|P| = 0) has no speculate stage and nothing to merge
        with timer.stage("speculate"):
            if repair_mode == "exact":
                # One partial per predicted block, so blocks that selection rejects can be dropped exactly.
                partials = ops.partials(q, cache, layer, predicted, length, scale)  # [B, Hkv, G, |P|, (D)]
            else:
                speculative = ops.attend(q, cache, layer, predicted, length, scale)  # [B, Hkv, G, (D)]
    with timer.stage("select"):
        # Selection runs (and is timed) for every predictor, the oracle included.
        selection = selector.select(q, cache, layer)
    with timer.stage("repair"):
        selected = selection.blocks.mask(max_blocks)
        missed = selected & ~predicted.mask(max_blocks)  # A \ P
        repaired = ops.attend(q, cache, layer, BlockSet.from_mask(missed, selection.blocks.capacity), length, scale)
    state = repaired
    if speculating:
        with timer.stage("merge"):
            if repair_mode == "exact":
                keep = torch.gather(selected, -1, predicted.indices) & predicted.valid()  # P ∩ A: [B, Hkv, |P|]
                speculative = ops.merge_many(partials.out, partials.lse, keep.unsqueeze(2))
            state = merge(speculative, repaired)
    if selector.compensates:  # LESS: the unselected blocks' low-rank estimate, one more partial state
        with timer.stage("merge"):
            state = merge(state, selector.compensation(q, cache, layer, selection))
    with timer.stage("predict"):
        predictor.update(predictor_state, layer, selection)
    return PrrStepResult(state=state, selection=selection, predicted=predicted, missed=missed)
