"""Progress of prr's long work, on stderr: tqdm bars like the decode loop's, so that the
summary and tables printed on stdout stay clean (`python run.py > out.txt` keeps only them).

- `progress_bar`: the one way prr opens a bar (the model prefill per layer, budget=profiled's
  timing points, the GGUF conversion's steps).
- `PrefillProgress`: an AttentionBackend that ticks a bar once per layer it prefills.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

from tqdm.auto import tqdm

if TYPE_CHECKING:  # annotations only: budget=profiled's options are checked before torch is imported
    from torch import Tensor


def progress_bar(total: int, desc: str, unit: str, **kwargs: Any) -> tqdm:
    """A tqdm bar on stderr (resolved now, so a redirected or captured stderr gets it)."""
    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, dynamic_ncols=True, **kwargs)


class PrefillProgress:
    """`backend`, except that every prefill of a layer also ticks `bar` once: a bar of
    `num_layers` shows how far a long prompt's prefill is (the default ~4K-token prompt takes
    about a minute on a 2-core CPU)."""

    def __init__(self, backend: Any, bar: tqdm) -> None:
        self.backend, self.bar = backend, bar

    def prefill(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        out = self.backend.prefill(layer, q, k, v)
        self.bar.update(1)
        return out

    def decode(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return self.backend.decode(layer, q, k, v)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.backend, name)
