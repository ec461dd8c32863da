"""The `reuse` config group: selection reuse, named approximations that skip selection where an
A selected elsewhere stands in (issue 53). Not exact: the A a reusing layer or step attends is
not the one its selector would have chosen, and the output differs from serial DSA.

- `none` (default): every sparse layer selects at every step (serial DSA, or PRR).
- `layers` (IndexCache, arXiv 2603.12201; Kascade): anchor layers select; every other sparse
  layer attends the A its nearest anchor at or below it selected in the same step (the same KV
  heads; every layer's cache has one block layout), and its selector never runs. Not the
  `cross_layer` predictor, which only proposes P and leaves selection to every layer.
- `steps` (vllm-ascend, DeepSeek-V4): sparse layers select on steps 0, N, 2N, ...; between, a
  layer attends its last selected A (between=last) or its predictor's top-|A| proposal
  (between=predicted), each with the step's newest block added (the token's own key).

Decided once when the step is built (`anchors`); the step consults no flag per call. No torch
here: run.py checks these values before importing it (prr.config_check.CHECKED_BEFORE_TORCH)."""

from __future__ import annotations

from typing import Any

BETWEEN = ("last", "predicted")


class SelectionReuse:
    """Which sparse layers select at which decode steps (this base: all of them at every step)."""

    name = "none"
    varies_by_step = False  # whether a layer's choice depends on the step number (reuse=steps)

    def anchors(self, sparse: list[bool]) -> list[int | None]:
        """Per layer (sparse: per layer, whether it selects at all): the earlier layer whose A of
        the same step it attends, or None (it selects, or it is dense)."""
        return [None] * len(sparse)

    def selects_at(self, step: int) -> bool:
        """Whether the sparse layers without an anchor select at decode step `step` (0-based)."""
        return True

    def problems(self, sparse: list[bool], predictor_name: str, engine: str) -> list[str]:
        """Why this reuse cannot run with these groups (empty: it can), in decode runs and scored
        tasks alike. sparse: per model layer; predictor_name: the predictor option (none, ema, ...);
        engine: runtime.engine."""
        if self.name == "none":
            return []
        out = []
        if predictor_name == "oracle":
            out.append(f"reuse={self.name} with predictor=oracle: the oracle's P is the A a reusing layer or step does "
                       "not compute; use another predictor or reuse=none")
        return out

    def summary(self, sparse: list[bool], steps: int) -> dict[str, Any]:
        """The run summary's entry after `steps` decode steps: the policy and how many layer
        selections (per row and KV head alike) were made and skipped."""
        per_step = [self.anchors(sparse)[i] is None for i, s in enumerate(sparse) if s]  # layers selecting
        selecting_steps = sum(self.selects_at(t) for t in range(steps))
        made = sum(per_step) * selecting_steps
        return {"policy": self.name, "selections_made": made, "selections_skipped": len(per_step) * steps - made}


class NoReuse(SelectionReuse):
    """reuse=none: every sparse layer selects at every step."""


class LayerReuse(SelectionReuse):
    """reuse=layers. anchors: an int N (the first sparse layer and every N-th sparse layer after
    it select) or a list of model layers (each a sparse layer; the first sparse layer selects
    always). A layer between anchors attends the A of the nearest anchor at or below it."""

    name = "layers"

    def __init__(self, anchors: int | list[int] = 4) -> None:
        if isinstance(anchors, bool) or not isinstance(anchors, int):
            anchors = [int(a) for a in anchors]  # (Hydra passes a ListConfig)
            if not anchors:
                raise ValueError("reuse.anchors=[] names no layer: give a list of anchor layers or an int N (every N-th "
                                 "sparse layer)")
        elif anchors < 1:
            raise ValueError(f"reuse.anchors={anchors} must be >= 1 (every N-th sparse layer selects; 1: all, as "
                             "reuse=none)")
        self.anchor_layers = anchors

    def selecting_layers(self, sparse: list[bool]) -> list[int]:
        """The sparse layers that select (the anchors), ascending."""
        ids = [i for i, s in enumerate(sparse) if s]
        if isinstance(self.anchor_layers, int):
            return ids[:: self.anchor_layers]
        return sorted({*ids[:1], *(a for a in self.anchor_layers if a in ids)})

    def anchors(self, sparse: list[bool]) -> list[int | None]:
        chosen, out, anchor = set(self.selecting_layers(sparse)), [], None
        for i, s in enumerate(sparse):
            if s and i in chosen:
                anchor = i
            out.append(anchor if s and i not in chosen else None)
        return out

    def problems(self, sparse: list[bool], predictor_name: str, engine: str) -> list[str]:
        out = super().problems(sparse, predictor_name, engine)
        if isinstance(self.anchor_layers, list):
            bad = [a for a in self.anchor_layers if not (0 <= a < len(sparse)) or not sparse[a]]
            if bad:
                dense = [i for i, s in enumerate(sparse) if not s]
                out.append(f"reuse.anchors={self.anchor_layers}: {bad} are not sparse layers of the model (layers "
                           f"0..{len(sparse) - 1}, dense: {dense}); name sparse layers only")
        return out


class StepReuse(SelectionReuse):
    """reuse=steps. every: the sparse layers select on steps 0, every, 2·every, ... (1: every
    step, as reuse=none); between: what a layer attends on the other steps: `last` (its last
    selected A) or `predicted` (its predictor's top-|A| proposal from history), each with the
    step's newest block added."""

    name = "steps"
    varies_by_step = True

    def __init__(self, every: int = 4, between: str = "last") -> None:
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"reuse.every={every!r} must be an int >= 1 (select every N decode steps)")
        if between not in BETWEEN:
            raise ValueError(f"reuse.between={between!r} is not one of {list(BETWEEN)}")
        self.every, self.between = every, between

    def selects_at(self, step: int) -> bool:
        return step % self.every == 0

    def problems(self, sparse: list[bool], predictor_name: str, engine: str) -> list[str]:
        out = super().problems(sparse, predictor_name, engine)
        if self.between == "predicted" and predictor_name == "none":
            out.append(f"reuse.between=predicted needs a predictor (predictor={predictor_name} proposes nothing); "
                       "use reuse.between=last or a predictor such as ema")
        return out
