"""The step's device counters (plan.count_hits), an observer of the PRR step: per layer, summed
over steps, rows and KV heads, |A|, |P|, |P ∩ A| and |A_t ∩ A_{t-1}| (prr.kernels.step_counters),
read on the host once per window. A_{t-1} of every layer is kept here."""

from __future__ import annotations

import torch
from torch import Tensor

from prr.blocks import BlockSet
from prr.runtime.side_stream import SideStream


class StepCounters:
    """Counters of every layer of a cache of `num_layers` layers ([L, 4, B * Hkv] int64) and A_{t-1}."""

    NAMES = ("selected", "predicted", "hits", "overlap")

    def __init__(self, ops, sparse: list[bool], batch: int, num_kv_heads: int, max_blocks: int, capacity: int,
                 learn_range: tuple[int, int] | None, device: torch.device) -> None:
        """ops: the step's op backend; sparse: per layer; capacity: |A| at most (the selector's);
        learn_range: the contiguous sparse layers (first, last) one end-of-step launch counts
        (None: the sparse layers are not contiguous)."""
        L, B, H, NB = len(sparse), batch, num_kv_heads, max_blocks
        self.ops, self.learn_range, self.max_blocks = ops, learn_range, max_blocks
        self.counts = torch.zeros(L, 4, B * H, dtype=torch.int64, device=device)
        # A_{t-1} of every layer in one buffer ([L, B, Hkv, K], [L, B, Hkv]; a layer's a view of it),
        # so one launch counts a range of layers (plan.count_at_step_end)
        self.prev_all = torch.zeros(L, B, H, capacity, dtype=torch.int32, device=device)
        self.prev_cnt_all = torch.zeros(L, B, H, dtype=torch.int32, device=device)
        self.prev_idx = [self.prev_all[i] if s else None for i, s in enumerate(sparse)]
        self.prev_cnt = [self.prev_cnt_all[i] if s else None for i, s in enumerate(sparse)]
        # The membership scratch: one per layer of learn_range for the end-of-step launch (its
        # layers run concurrently), the first also the per-layer launch's ([2, B * Hkv, NB]).
        counted = learn_range[1] - learn_range[0] + 1 if learn_range is not None else 1
        self.layer_scratch = ops.layer_counter_scratch(counted, B, H, NB, device)
        self.held: list[tuple[BlockSet, bool]] = []  # this step's (A, speculating) for the end-of-step count
        # (the held A's indices, the same stacked [L, B, Hkv, K]): the count's copy, which this
        # step's learning at once reuses
        self.stacked: tuple[list[Tensor], BlockSet] | None = None

    def view(self) -> StepCounters:
        """The same counters for another plan's step (its own held selections)."""
        view = object.__new__(StepCounters)
        view.__dict__.update(self.__dict__)
        view.held, view.stacked = [], None
        return view

    def count(self, layer: int, selection: BlockSet, prediction: BlockSet | None) -> None:
        """Add this step's counts of `layer` now (one launch); A_{t-1} <- A. prediction: the P the
        layer speculated over (None: a serial step)."""
        self.ops.step_counters(selection.indices, selection.count, None if prediction is None else prediction.indices,
                               None if prediction is None else prediction.count, self.prev_idx[layer],
                               self.prev_cnt[layer], self.layer_scratch[0], self.counts[layer])

    def hold(self, layer: int, selection: BlockSet, speculating: bool) -> bool:
        """Hold A for the count of every layer of learn_range at the step's end -> whether `layer`
        is the range's last (then call `count_layers`)."""
        self.held.append((selection, speculating))
        return layer == self.learn_range[1]

    def count_layers(self, streams: SideStream, pred_all: Tensor | None, pred_cnt_all: Tensor | None) -> None:
        """The counts of every layer of learn_range from the held A in one launch, on the side
        stream once the last layer's A is selected, beside the LM head (the step's `join` orders it
        before the next step reads the counters or A_{t-1}). pred_all [L, B, Hkv, C], pred_cnt_all
        [L, B, Hkv]: P of every layer (read where the held steps speculated). The held A are
        stacked there, one copy, which this step's learning at once reuses (`take_stacked`)."""
        first, last = self.learn_range
        held, self.held = self.held, []
        if len(held) != last - first + 1 or len({spec for _, spec in held}) != 1:
            raise RuntimeError(f"counting layers {first}..{last} at once got {len(held)} selections "
                               f"(speculating: {[spec for _, spec in held]}): a step ran some sparse layers "
                               "without holding A, or mixed serial and PRR layers")
        blocks, speculating = [b for b, _ in held], held[0][1]
        streams.after()
        streams.share(*(t for b in blocks for t in (b.indices, b.count)))  # made on main, read on the side
        span = slice(first, last + 1)
        with streams.on_side():
            stacked = BlockSet(torch.stack([b.indices for b in blocks]), torch.stack([b.count for b in blocks]))
            self.ops.step_counters_layers(
                stacked.indices, stacked.count, pred_all[span] if speculating else None,
                pred_cnt_all[span] if speculating else None, self.prev_all[span], self.prev_cnt_all[span],
                self.layer_scratch, self.counts[span])
        self.stacked = ([b.indices for b in blocks], stacked)

    def take_stacked(self, selections: list[Tensor]) -> BlockSet | None:
        """The stacked copy `count_layers` made of exactly these A indices (one per layer), or None."""
        stacked, self.stacked = self.stacked, None
        if stacked is None or len(stacked[0]) != len(selections):
            return None
        return stacked[1] if all(a is s for a, s in zip(stacked[0], selections, strict=True)) else None

    def set_previous(self, masks: list[Tensor | None], capacity: int) -> None:
        """A_{t-1} per layer ([B, Hkv, NB] bool, None for dense layers)."""
        for layer, mask in enumerate(masks):
            if mask is not None and self.prev_idx[layer] is not None:
                blocks = BlockSet.from_mask(mask[..., : self.max_blocks].to(self.prev_all.device), capacity)
                self.prev_idx[layer].copy_(blocks.indices)
                self.prev_cnt[layer].copy_(blocks.count)

    def tensors(self) -> list[Tensor]:
        """What a step mutates here (a checkpoint's share)."""
        return [self.counts, self.prev_all, self.prev_cnt_all]
