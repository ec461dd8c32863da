"""Our decoder + DenseAttention vs transformers, same weights: logits and RoPE tables."""

from __future__ import annotations

import inspect

import pytest
import torch
import transformers
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from prr.model import Decoder, DenseAttention, ModelConfig
from prr.model.rope import RopeTable, rope_cos_sin, rope_inv_freq

PROMPT_LEN = 37  # odd on purpose
DECODE_STEPS = 16
REL_TOL = 1e-4

LLAMA3_ROPE = {
    # With head_dim 16 and original context 64 the wavelengths (6.3 ... 19869) fall in all
    # three llama3 regions: kept (< 16), smoothed (16..64), divided by factor (> 64).
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def _common(**overrides) -> dict:
    base = dict(
        vocab_size=211,
        hidden_size=64,
        intermediate_size=136,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        attn_implementation="eager",
    )
    base.update(overrides)
    return base


CASES = {
    "llama-llama3-rope": lambda: transformers.LlamaForCausalLM(
        transformers.LlamaConfig(**_common(rope_parameters={**LLAMA3_ROPE, "rope_theta": 10000.0}))
    ),
    "llama-linear-rope-bias-mha": lambda: transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            **_common(
                num_key_value_heads=4,
                attention_bias=True,
                mlp_bias=True,
                rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 5000.0},
            )
        )
    ),
    "mistral": lambda: transformers.MistralForCausalLM(
        transformers.MistralConfig(**_common(num_key_value_heads=1, sliding_window=None))
    ),
    "qwen2-tied": lambda: transformers.Qwen2ForCausalLM(
        transformers.Qwen2Config(**_common(tie_word_embeddings=True, rope_parameters={"rope_theta": 1e6}))
    ),
    "qwen2-untied": lambda: transformers.Qwen2ForCausalLM(
        transformers.Qwen2Config(**_common(tie_word_embeddings=False))
    ),
}


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights large enough that attention is far from uniform (HF's std 0.02 init is nearly
    uniform, which would hide RoPE or masking errors)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * noise)
            else:
                param.copy_(0.15 * noise)


def _ref_step(ref: torch.nn.Module, ids: torch.Tensor, cache):
    """One transformers forward with its own KV cache -> (logits [B, T, V], cache).
    transformers 5.24 renamed past_key_values to cache (the old name is deprecated)."""
    if "cache" in inspect.signature(ref.forward).parameters:
        out = ref(input_ids=ids, cache=cache, use_cache=True)
        return out.logits, out.cache
    out = ref(input_ids=ids, past_key_values=cache, use_cache=True)
    return out.logits, out.past_key_values


def _rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours.double() - ref.double()).norm() / ref.double().norm()).item()


def _build(case: str, seed: int = 0):
    torch.manual_seed(seed)
    ref = CASES[case]().eval()
    _randomize(ref, seed)
    config = ModelConfig.from_hf(ref.config)
    ours = Decoder(config, dtype=torch.float32)
    ours.load_state_dict(ref.state_dict(), strict=True)
    return ref, ours.eval(), config


@pytest.mark.parametrize("case", list(CASES))
@torch.inference_mode()
def test_prefill_and_greedy_decode_match_transformers(case: str) -> None:
    ref, ours, config = _build(case)
    batch = 2 if case == "mistral" else 1  # one batched case
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (batch, PROMPT_LEN), generator=gen)  # [B, T]

    attention = DenseAttention(config.num_layers)
    logits = ours(ids, 0, attention)  # [B, T, V]
    ref_logits, cache = _ref_step(ref, ids, None)
    assert logits.shape == ref_logits.shape == (batch, PROMPT_LEN, config.vocab_size)
    assert _rel_err(logits, ref_logits) <= REL_TOL

    next_ids = ref_logits[:, -1].argmax(-1, keepdim=True)  # [B, 1]; the reference drives both
    for step in range(DECODE_STEPS):
        pos = PROMPT_LEN + step
        logits = ours(next_ids, pos, attention)  # [B, 1, V]
        ref_logits, cache = _ref_step(ref, next_ids, cache)
        err = _rel_err(logits, ref_logits)
        assert err <= REL_TOL, f"decode step {step} (position {pos}): rel err {err:.2e}"
        next_ids = ref_logits[:, -1].argmax(-1, keepdim=True)
    assert attention.seq_len == PROMPT_LEN + DECODE_STEPS


@torch.inference_mode()
def test_last_logits_only_is_the_last_row() -> None:
    _, ours, config = _build("llama-llama3-rope")
    ids = torch.randint(0, config.vocab_size, (1, 9))
    full = ours(ids, 0, DenseAttention(config.num_layers))  # [1, 9, V]
    last = ours(ids, 0, DenseAttention(config.num_layers), last_logits_only=True)  # [1, 1, V]
    assert last.shape == (1, 1, config.vocab_size)
    torch.testing.assert_close(last[:, 0], full[:, -1])


def test_tied_state_dict_without_lm_head_loads_strict() -> None:
    ref, _, config = _build("qwen2-tied")
    state = {k: v for k, v in ref.state_dict().items() if k != "lm_head.weight"}
    ours = Decoder(config)
    ours.load_state_dict(state, strict=True)
    assert ours.lm_head.weight is ours.model.embed_tokens.weight
    torch.testing.assert_close(ours.lm_head.weight, ref.lm_head.weight, rtol=0, atol=0)
    # assign=True swaps Parameters one by one; the tie must survive it.
    ours = Decoder(config, device="meta")
    ours.load_state_dict(state, strict=True, assign=True)
    assert ours.lm_head.weight is ours.model.embed_tokens.weight


def test_forward_rejects_other_call_shapes() -> None:
    config = ModelConfig.from_hf(CASES["mistral"]().config)
    ours = Decoder(config).init_random_(seed=0)
    attention = DenseAttention(config.num_layers)
    with pytest.raises(ValueError, match="start_pos=3"):
        ours(torch.zeros(1, 4, dtype=torch.long), 3, attention)  # multi-token chunk after position 0
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        ours(torch.zeros(4, dtype=torch.long), 0, attention)


def test_sliding_window_positions_beyond_window_are_refused() -> None:
    hf = transformers.MistralConfig(**_common(sliding_window=8))
    config = ModelConfig.from_hf(hf)
    assert config.sliding_window == 8
    ours = Decoder(config).init_random_(seed=0)
    ours(torch.zeros(1, 8, dtype=torch.long), 0, DenseAttention(config.num_layers))  # within: fine
    with pytest.raises(ValueError, match="sliding window"):
        ours(torch.zeros(1, 9, dtype=torch.long), 0, DenseAttention(config.num_layers))


def test_dense_prefill_on_non_empty_cache_raises() -> None:
    attention = DenseAttention(1)
    q, kv = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 3, 8)
    attention.prefill(0, q, kv, kv)
    with pytest.raises(ValueError, match="reset"):
        attention.prefill(0, q, kv, kv)
    attention.reset()
    assert attention.seq_len == 0


# ---- RoPE against transformers' own init functions ------------------------------------------

ROPE_CASES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_theta": 500000.0,
    },
}


@pytest.mark.parametrize("rope_type", list(ROPE_CASES))
def test_rope_matches_transformers(rope_type: str) -> None:
    hf_config = transformers.LlamaConfig(
        hidden_size=4096,
        num_attention_heads=32,
        head_dim=128,
        max_position_embeddings=131072,
        rope_parameters=dict(ROPE_CASES[rope_type]),
    )
    hf_rope = LlamaRotaryEmbedding(hf_config)
    config = ModelConfig.from_hf(hf_config)
    inv_freq = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)  # [64]
    assert torch.equal(inv_freq, hf_rope.inv_freq)

    positions = torch.tensor([0, 1, 2, 7, 100, 4095, 8191, 8192, 65537, 131071])
    x = torch.zeros(1, len(positions), config.head_dim)
    hf_cos, hf_sin = hf_rope(x, positions[None])  # [1, T, D]
    cos, sin = rope_cos_sin(positions, inv_freq)  # [T, D]
    assert torch.equal(cos, hf_cos[0]) and torch.equal(sin, hf_sin[0])

    table = RopeTable(config.head_dim, config.rope_theta, config.rope_scaling)
    tcos, tsin = table.get(8190, 3, torch.device("cpu"), torch.float32)  # positions 8190..8192
    full_cos, full_sin = hf_rope(x, torch.arange(8190, 8193)[None])
    assert torch.equal(tcos, full_cos[0]) and torch.equal(tsin, full_sin[0])


@pytest.mark.parametrize("rope_type", ["yarn", "dynamic", "longrope"])
def test_unsupported_rope_type_is_named(rope_type: str) -> None:
    with pytest.raises(ValueError, match=rf"'{rope_type}'.*default, linear, llama3"):
        rope_inv_freq(16, 10000.0, {"rope_type": rope_type, "factor": 2.0})


@pytest.mark.parametrize("case", list(CASES))
def test_config_round_trips_through_transformers(case: str) -> None:
    config = ModelConfig.from_hf(CASES[case]().config)
    assert ModelConfig.from_hf(config.to_hf()) == config


def test_zoo_configs_round_trip_through_transformers() -> None:
    from prr.model.zoo import ZOO

    for spec in ZOO.values():
        assert ModelConfig.from_hf(spec.config.to_hf()) == spec.config, spec.name
