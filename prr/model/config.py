"""ModelConfig: the architecture facts our decoder needs, read from a transformers config.

One flat, frozen record for the Llama family (Llama, Mistral, Qwen2). It is what the rest
of prr validates against (context length, head counts) without touching weights.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

SUPPORTED_ARCHS = ("llama", "mistral", "qwen2")
# here, not in prr.model.rope, so that a config is checked without importing torch
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
_REQUIRED_KEYS = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}


def validate_rope_scaling(scaling: dict[str, Any] | None) -> None:
    """Raise ValueError unless `scaling` is None or a supported {"rope_type": ..., params} dict."""
    if scaling is None:
        return
    rope_type = scaling.get("rope_type", scaling.get("type"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"unsupported RoPE scaling type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    missing = [key for key in _REQUIRED_KEYS.get(rope_type, ()) if scaling.get(key) is None]
    if missing:
        raise ValueError(f"RoPE scaling {rope_type!r} needs {', '.join(missing)}; got {scaling}")


@dataclass(frozen=True)
class ModelConfig:
    arch: str  # transformers model_type: "llama", "mistral" or "qwen2"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int  # query heads (Hq)
    num_kv_heads: int  # key/value heads (Hkv); Hq % Hkv == 0 (GQA)
    head_dim: int
    rope_theta: float
    # None for plain RoPE; else a dict with "rope_type" ("linear" | "llama3") and its
    # parameters, without rope_theta (see prr.model.rope).
    rope_scaling: dict[str, Any] | None
    rms_norm_eps: float
    tie_word_embeddings: bool
    attention_bias: bool = False  # bias on q/k/v projections (Qwen2; Llama attention_bias)
    attention_out_bias: bool = False  # bias on o_proj (Llama attention_bias only)
    mlp_bias: bool = False  # bias on gate/up/down (Llama mlp_bias)
    max_position_embeddings: int = 2048
    # Active sliding-window size, or None for full attention. Our attention backends attend
    # the whole context, so the decoder refuses positions beyond the window.
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.arch not in SUPPORTED_ARCHS:
            raise ValueError(f"unsupported arch {self.arch!r}; supported: {', '.join(SUPPORTED_ARCHS)}")
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")
        validate_rope_scaling(self.rope_scaling)

    @property
    def gqa_group_size(self) -> int:
        """Query heads per KV head (Hq // Hkv)."""
        return self.num_heads // self.num_kv_heads

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    # ---- transformers interop -------------------------------------------------------

    @classmethod
    def from_hf(cls, hf_config: Any) -> ModelConfig:
        """Read a transformers config (4.x or 5.x layout) of a Llama, Mistral or Qwen2 model."""
        model_type = getattr(hf_config, "model_type", None)
        if model_type not in SUPPORTED_ARCHS:
            raise ValueError(
                f"unsupported model_type {model_type!r}: prr's decoder implements "
                f"{', '.join(SUPPORTED_ARCHS)}"
            )
        act = getattr(hf_config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"unsupported hidden_act {act!r} for {model_type}; prr's MLP is SwiGLU (silu)")

        num_heads = hf_config.num_attention_heads
        num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or num_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
        rope_theta, rope_scaling = _read_rope(hf_config)

        if model_type == "qwen2":
            # Qwen2 hard-wires bias on q/k/v and none on o_proj or the MLP.
            qkv_bias, out_bias, mlp_bias = True, False, False
        elif model_type == "mistral":
            qkv_bias, out_bias, mlp_bias = False, False, False
        else:
            attention_bias = bool(getattr(hf_config, "attention_bias", False))
            qkv_bias, out_bias = attention_bias, attention_bias
            mlp_bias = bool(getattr(hf_config, "mlp_bias", False))

        eos = getattr(hf_config, "eos_token_id", None)
        if isinstance(eos, list):
            eos = tuple(eos)
        return cls(
            arch=model_type,
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size,
            num_layers=hf_config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            rms_norm_eps=float(hf_config.rms_norm_eps),
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            attention_bias=qkv_bias,
            attention_out_bias=out_bias,
            mlp_bias=mlp_bias,
            max_position_embeddings=int(hf_config.max_position_embeddings),
            sliding_window=_read_sliding_window(hf_config, model_type),
            bos_token_id=getattr(hf_config, "bos_token_id", None),
            eos_token_id=eos,
        )

    def to_hf(self) -> Any:
        """The equivalent transformers config (LlamaConfig, MistralConfig or Qwen2Config)."""
        import transformers

        rope_parameters = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling is not None:
            rope_parameters = {**self.rope_scaling, "rope_theta": self.rope_theta}
        eos = list(self.eos_token_id) if isinstance(self.eos_token_id, tuple) else self.eos_token_id
        common = dict(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            hidden_act="silu",
            max_position_embeddings=self.max_position_embeddings,
            rms_norm_eps=self.rms_norm_eps,
            tie_word_embeddings=self.tie_word_embeddings,
            rope_parameters=rope_parameters,
            bos_token_id=self.bos_token_id,
            eos_token_id=eos,
        )
        if self.arch == "llama":
            if self.attention_bias != self.attention_out_bias:
                raise ValueError("Llama has one attention_bias flag for q/k/v and o_proj; they differ here")
            return transformers.LlamaConfig(
                attention_bias=self.attention_bias, mlp_bias=self.mlp_bias, **common
            )
        if self.arch == "mistral":
            return transformers.MistralConfig(sliding_window=self.sliding_window, **common)
        return transformers.Qwen2Config(
            use_sliding_window=self.sliding_window is not None,
            sliding_window=self.sliding_window,
            max_window_layers=0,  # with a window, every layer slides
            **common,
        )


def _read_rope(hf_config: Any) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling) from transformers 5.x `rope_parameters` or 4.x `rope_theta`/`rope_scaling`."""
    params = getattr(hf_config, "rope_parameters", None)
    if params is None:  # transformers 4.x
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    params = dict(params)
    if any(isinstance(value, dict) for value in params.values()):
        raise ValueError(f"per-layer-type rope parameters are not supported: {params}")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(
            f"partial_rotary_factor={params['partial_rotary_factor']} is not supported (only 1.0)"
        )
    params.pop("partial_rotary_factor", None)
    theta = params.pop("rope_theta", None) or 10000.0
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if rope_type == "default":
        return theta, None
    if rope_type == "llama3":
        params.setdefault("original_max_position_embeddings", hf_config.max_position_embeddings)
    scaling = {"rope_type": rope_type, **params}
    validate_rope_scaling(scaling)
    return theta, scaling


def _read_sliding_window(hf_config: Any, model_type: str) -> int | None:
    window = getattr(hf_config, "sliding_window", None)
    if window is None:
        return None
    if model_type == "qwen2":
        if not getattr(hf_config, "use_sliding_window", False):
            return None
        layer_types = getattr(hf_config, "layer_types", None)  # 5.x: which layers slide
        if layer_types is not None and "sliding_attention" not in layer_types:
            return None
    if model_type == "llama":
        return None  # Llama has no sliding window; a stray field is ignored by transformers too
    return int(window)
