"""Models: our Llama-family decoder, its dense reference attention, loading and the zoo.

transformers is imported lazily (only to read configs, convert GGUF and load tokenizers).
The names below are imported on first use, not with the package: run.py checks a model's
config (prr.model.spec, prr.model.describe) before torch is imported.
"""

from __future__ import annotations

from prr.lazy_exports import lazy_getattr

_HOMES = {
    "AttentionBackend": "prr.model.attention",
    "SUPPORTED_ARCHS": "prr.model.config",
    "SUPPORTED_ROPE_TYPES": "prr.model.config",
    "ModelConfig": "prr.model.config",
    "Decoder": "prr.model.decoder",
    "DenseAttention": "prr.model.dense",
    "describe_model": "prr.model.describe",
    "LoadedModel": "prr.model.loading",
    "load_model": "prr.model.loading",
    "parse_dtype": "prr.model.loading",
    "encode_prompt": "prr.model.prompt",
    "truncate_text_to_tokens": "prr.model.prompt",
    "ZOO": "prr.model.zoo",
    "zoo_names": "prr.model.zoo",
}

__all__ = sorted(_HOMES)

__getattr__ = lazy_getattr(__name__, _HOMES)
