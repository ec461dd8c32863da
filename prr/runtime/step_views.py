"""The graph engine's step views under reuse=steps (prr/reuse.py, prr/runtime/selection_reuse.py):
whether a step selects depends on its number, and a captured step takes no host value, so each
view a caller runs is captured twice, as the step that selects and as the step between selections
(`StaticPlan.between_selections`), and the host replays one or the other by the decode step's
number since the hand-off (`SelectionReuse.selects_at`). Under any other reuse the views and keys
pass through as they are."""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

from prr.reuse import NoReuse, SelectionReuse


class StepViews:
    """The views of a `GraphSession` (prr/runtime/graph_session.py) and which one a step replays."""

    def __init__(self, reuse: SelectionReuse | None) -> None:
        self.policy = reuse if reuse is not None else NoReuse()
        self.step = 0  # the next step's number since the hand-off (its first reads the prompt's last token)

    def views(self, views: dict[Hashable, dict[str, Any]]) -> dict[Hashable, dict[str, Any]]:
        """key -> plan changes (`GraphDecoder.with_plan`) => the views to capture: reuse=steps, each
        twice, (key, False) selecting and (key, True) between selections; else `views` itself."""
        if not self.policy.varies_by_step:
            return views
        return {(key, between): {**changes, "between_selections": between}
                for key, changes in views.items() for between in (False, True)}

    def keys(self, keys: list[Hashable]) -> list[Hashable]:
        """The views' keys of the next len(keys) steps => the captured views they replay (reuse=steps:
        the selecting one on the steps the policy selects at); the steps are counted as run."""
        if not self.policy.varies_by_step:
            return keys
        out = [(key, not self.policy.selects_at(self.step + i)) for i, key in enumerate(keys)]
        self.step += len(keys)
        return out

    def restart(self) -> None:
        """A hand-off: the next step is step 0 (it selects)."""
        self.step = 0
