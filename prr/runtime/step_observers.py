"""The PRR step's observers, attached at its fixed hooks: after A is known (`selected`: the step
counters, the studies' step count) and after a layer's output (`measure`: the dense-reference
metrics). They read the step; none changes what it computes. Read on the host once per window."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from prr.runtime.dense_metrics import DenseMetrics
from prr.runtime.predictor_schedule import PredictorSchedule
from prr.runtime.side_stream import SideStream
from prr.runtime.static_plan import StaticPlan
from prr.runtime.step_counting import StepCounters
from prr.runtime.study_counting import StudyCounters
from prr.selectors import Selection


class StepObservers:
    """Step counters, dense metrics and study counters of every layer of one engine."""

    COUNTERS = StepCounters.NAMES + DenseMetrics.NAMES

    def __init__(self, counting: StepCounters, metrics: DenseMetrics, study: StudyCounters) -> None:
        self.counting, self.metrics, self.study = counting, metrics, study

    def view(self) -> StepObservers:
        """The same counters for another plan's step (its own held selections)."""
        return StepObservers(self.counting.view(), self.metrics, self.study)

    def selected(self, plan: StaticPlan, layer: int, selection: Selection, speculating: bool,
                 schedule: PredictorSchedule, streams: SideStream, eager: bool) -> None:
        """The hook after A is known (after the repair in PRR: the counters read P before the side
        stream may rewrite it). With plan.count_hits: count this step now, or hold A for the count
        of every layer at the step's end (`counts_at_end`). eager: the eager runtime's step."""
        if not plan.count_hits:
            return
        if plan.study_counters:
            self.study.count_step(layer)
        if self.counts_at_end(plan, layer, speculating, schedule, eager):
            if self.counting.hold(layer, selection.blocks, speculating):
                self.counting.count_layers(streams, schedule.pred_all, schedule.pred_cnt_all)
            return
        self.counting.count(layer, selection.blocks, schedule.prediction(layer) if speculating else None)

    @staticmethod
    def counts_at_end(plan: StaticPlan, layer: int, speculating: bool, schedule: PredictorSchedule, eager: bool) -> bool:
        """Whether this step's counters wait for the last sparse layer and count every layer in
        one launch on the side stream (plan.count_at_step_end, the graph engine's step over a
        contiguous range of sparse layers), where each layer's P stays what the layer speculated
        over until then (`PredictorSchedule.keeps_p_until_step_end`)."""
        if not plan.count_at_step_end or eager or schedule.learn_range is None:
            return False
        return not speculating or schedule.keeps_p_until_step_end(layer, plan.learn_layers_at_once)

    def measure(self, plan: StaticPlan, attend: Callable[..., tuple[Tensor, Tensor]], all_blocks: Tensor,
                layer: int, q: Tensor, out: Tensor, selection: Selection, lengths: Tensor, num_blocks: Tensor) -> None:
        """The hook after a layer's output: dense-reference metrics (`DenseMetrics.measure`), per
        (row, KV head) too with plan.study_counters."""
        recall, error = self.metrics.measure(attend, all_blocks, layer, q, out, selection, lengths, num_blocks)
        if plan.study_counters:
            self.study.count_measured(layer, recall, error)

    def counters(self) -> dict[str, list[float]]:
        """The device counters per layer, summed since the last `clear` (one host read: call once
        per window): |A|, |P|, |P ∩ A|, |A_t ∩ A_{t-1}|, and over dense-measured (row, KV head)s the
        sums of mass recall and output error and their count."""
        counts = self.counting.counts.sum(-1).double().T  # [4, L]
        stacked = torch.cat([counts, torch.stack(self.metrics.tensors())]).cpu()
        return dict(zip(self.COUNTERS, stacked.tolist(), strict=True))

    def study_counters(self, batch: int, per_row: bool = False) -> dict[str, Tensor]:
        """The study counters summed since the last `clear`, in one host read (call once per
        request or run): name -> [L, Hkv] fp64 CPU tensor summed over rows ([L, B, Hkv] with
        per_row). Names: the step counters' selected, predicted, hits (the plan's P), overlap
        (|A_t ∩ A_{t-1}|), then `StudyCounters.names`. Dense layers hold zeros."""
        L, _, rows_heads = self.counting.counts.shape
        steps = self.counting.counts.view(L, 4, batch, rows_heads // batch).transpose(0, 1).double()
        stacked = torch.cat([steps, self.study.counts]).cpu()
        if not per_row:
            stacked = stacked.sum(2)
        return dict(zip(StepCounters.NAMES + self.study.names, stacked.unbind(0), strict=True))

    def clear(self) -> None:
        """Every counter back to zero (a new window or request)."""
        for counter in (self.counting.counts, *self.metrics.tensors(), self.study.counts):
            counter.zero_()

    def tensors(self) -> list[Tensor]:
        """What a step mutates here (a checkpoint's share)."""
        return [*self.counting.tensors(), *self.metrics.tensors(), self.study.counts]
