"""A package's names imported on first use (PEP 562), so that importing the package costs nothing:
run.py checks config values through torch-free modules of packages whose classes import torch."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_getattr(package: str, homes: dict[str, str]) -> Callable[[str], Any]:
    """The package's module `__getattr__`: each name of `homes` (name -> its module) imported from
    its module when first read."""

    def __getattr__(name: str) -> Any:
        if name not in homes:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(homes[name]), name)

    return __getattr__
