"""Selectors: which KV blocks a decode step attends (set A). The classes are imported on first
use, not with the package, so that prr.selectors.options (their constructors) loads without
torch: run.py checks selector values before torch is imported."""

from __future__ import annotations

from prr.lazy_exports import lazy_getattr

_HOMES = {
    "Selection": "prr.selectors.base",
    "Selector": "prr.selectors.base",
    "DenseSelector": "prr.selectors.dense",
    "ExactSelector": "prr.selectors.exact",
    "InfLLMSelector": "prr.selectors.infllm",
    "IndexerSelector": "prr.selectors.indexer",
    "InfLLMV2Selector": "prr.selectors.infllm_v2",
    "LessSelector": "prr.selectors.less",
    "QuestSelector": "prr.selectors.quest",
}

__all__ = sorted(_HOMES)

__getattr__ = lazy_getattr(__name__, _HOMES)
