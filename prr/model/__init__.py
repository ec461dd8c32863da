"""Models: our Llama-family decoder, its dense reference attention, loading and the zoo.

transformers is imported lazily (only to read configs, convert GGUF and load tokenizers).
"""

from prr.model.attention import AttentionBackend
from prr.model.config import SUPPORTED_ARCHS, ModelConfig
from prr.model.decoder import Decoder
from prr.model.dense import DenseAttention
from prr.model.loading import LoadedModel, describe_model, load_model, parse_dtype
from prr.model.prompt import encode_prompt, truncate_text_to_tokens
from prr.model.rope import SUPPORTED_ROPE_TYPES
from prr.model.zoo import ZOO, zoo_names

__all__ = [
    "SUPPORTED_ARCHS",
    "SUPPORTED_ROPE_TYPES",
    "ZOO",
    "AttentionBackend",
    "Decoder",
    "DenseAttention",
    "LoadedModel",
    "ModelConfig",
    "describe_model",
    "encode_prompt",
    "load_model",
    "parse_dtype",
    "truncate_text_to_tokens",
    "zoo_names",
]
