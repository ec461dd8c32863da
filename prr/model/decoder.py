"""Our decoder for the Llama family (Llama, Mistral, Qwen2), gpt-fast style.

It computes embeddings, norms, projections, RoPE and the MLP itself (the layer math of
prr.model.layer_math, run by `Decoder.layers`, the one forward the graph engine runs too) and
hands post-RoPE q/k/v to an AttentionBackend (prr.model.attention), which owns the KV cache
and decides what is attended. Module and parameter names mirror transformers' (`model.embed_tokens`,
`model.layers.N.self_attn.q_proj`, ..., `model.norm`, `lm_head`) so an HF state dict loads
with `load_state_dict(strict=True)`.

Shapes: B batch, T tokens in this call, H hidden size, Hq query heads, Hkv KV heads,
D head_dim, V vocab.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from prr.model.attention import AttentionBackend
from prr.model.config import ModelConfig
from prr.model.layer_math import final_norm, fuse_layer_weights, post_attention, pre_attention, rms_norm
from prr.model.rope import RopeTable, apply_rope


class Linear(nn.Module):
    """nn.Linear without its init: storage comes from torch.empty on the target device
    (loading or init_random_ fills it). nn.Linear on the meta device would pull in
    torch._dynamo (~1 s) through its reset_parameters."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype, device=device)) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        # x: [..., in] -> [..., out]
        return F.linear(x, self.weight, self.bias)


class Embedding(nn.Module):
    def __init__(self, num_embeddings: int, dim: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, dim, dtype=dtype, device=device))

    def forward(self, ids: Tensor) -> Tensor:
        # ids: [B, T] -> [B, T, H]
        return F.embedding(ids, self.weight)


class RMSNorm(nn.Module):
    """The norm's weight and eps (the math: layer_math.rms_norm)."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size, dtype=dtype, device=device))
        self.eps = eps


class Attention(nn.Module):
    """The attention projections (q, k, v, o); the math: layer_math via Decoder.layers."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        hq, hkv, d, h = config.num_heads, config.num_kv_heads, config.head_dim, config.hidden_size
        qkv_bias, out_bias = config.attention_bias, config.attention_out_bias
        self.q_proj = Linear(h, hq * d, qkv_bias, dtype, device)
        self.k_proj = Linear(h, hkv * d, qkv_bias, dtype, device)
        self.v_proj = Linear(h, hkv * d, qkv_bias, dtype, device)
        self.o_proj = Linear(hq * d, h, out_bias, dtype, device)
        self.num_heads, self.num_kv_heads, self.head_dim = hq, hkv, d


class MLP(nn.Module):
    """The SwiGLU projections: down(silu(gate(x)) * up(x)) (layer_math.post_attention)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        bias = config.mlp_bias
        self.gate_proj = Linear(h, i, bias, dtype, device)
        self.up_proj = Linear(h, i, bias, dtype, device)
        self.down_proj = Linear(i, h, bias, dtype, device)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.self_attn = Attention(config, dtype, device)
        self.mlp = MLP(config, dtype, device)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)


class DecoderBody(nn.Module):
    """Holds the HF `model.*` parameters: embed_tokens, layers, norm."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, dtype, device)
        self.layers = nn.ModuleList(DecoderLayer(config, dtype, device) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)


class Decoder(nn.Module):
    """Causal LM: tokens -> logits, attention delegated to an AttentionBackend.

    Parameters are allocated uninitialised with torch.empty on `device` (no CPU detour, no
    init cost; "meta" works for shape-only models): fill them with `load_state_dict`,
    prr.model.loading, or `init_random_`.
    """

    def __init__(
        self, config: ModelConfig, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
    ) -> None:
        super().__init__()
        self.config = config
        device = torch.device(device)
        self.model = DecoderBody(config, dtype, device)
        # A tied head shares the embedding: allocate nothing for it (meta placeholder).
        head_device = torch.device("meta") if config.tie_word_embeddings else device
        self.lm_head = Linear(config.hidden_size, config.vocab_size, False, dtype, head_device)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rope = RopeTable(config.head_dim, config.rope_theta, config.rope_scaling)
        self.register_load_state_dict_pre_hook(self._normalize_hf_state_dict)
        self.register_load_state_dict_post_hook(self._retie)
        # A tensor-parallel shard's TensorParallel (prr.model.tensor_parallel.shard_decoder): its
        # o_proj and down outputs are partial sums that every forward all-reduces. None: whole.
        self.tensor_parallel = None

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    def forward(
        self,
        input_ids: Tensor,
        start_pos: int,
        attention: AttentionBackend,
        *,
        last_logits_only: bool = False,
    ) -> Tensor:
        """input_ids: [B, T] (int64) -> logits [B, T, V] ([B, 1, V] with last_logits_only).

        T > 1 with start_pos == 0: prefill (attention.prefill); T == 1: one decode step at
        position start_pos (attention.decode). `last_logits_only` skips the [B, T, V] logits
        of a long prefill (4K tokens x 128K vocab is GBs) when only the next token matters.
        """
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [B, T], got shape {tuple(input_ids.shape)}")
        B, T = input_ids.shape
        if T > 1 and start_pos == 0:
            prefill = True
        elif T == 1 and start_pos >= 0:
            prefill = False
        else:
            raise ValueError(
                f"unsupported call: T={T} tokens at start_pos={start_pos}; use T > 1 with start_pos == 0 "
                "(prefill) or T == 1 with start_pos >= 0 (decode)"
            )
        window = self.config.sliding_window
        if window is not None and start_pos + T > window:
            raise ValueError(
                f"position {start_pos + T - 1} is beyond the model's sliding window ({window}); prr's "
                "attention backends attend the full context, so this would not match the model"
            )

        x = self.model.embed_tokens(input_ids)  # [B, T, H]
        cos, sin = self.rope.get(start_pos, T, x.device, x.dtype)  # [T, D] each

        def attend(layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            """q [B, T, Hq, D], k, v [B, T, Hkv, D] before RoPE -> [B, T, Hq*D]."""
            if prefill:
                q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, T, D]
                q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
                return attention.prefill(layer, q, k, v).transpose(1, 2).reshape(B, T, -1)
            q, k, v = q[:, 0], k[:, 0], v[:, 0]  # [B, H, D]; cos, sin: [1, D] broadcast
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            return attention.decode(layer, q, k, v).reshape(B, 1, -1)

        # A backend whose selector reads the layer's normed hidden state (the lightning indexer) hands
        # the layer loop a callback; the others none (no extra norm).
        hidden_hook = getattr(attention, "hidden_hook", None)
        hidden = self.layers(x, attend, normed=hidden_hook(prefill) if hidden_hook else None)  # [B, T, H]
        if last_logits_only:
            hidden = hidden[:, -1:]  # [B, 1, H]
        return self.lm_head(hidden)  # [B, T, V]

    def layers(self, x: Tensor, attend: Callable[[int, Tensor, Tensor, Tensor], Tensor], delta: Tensor | None = None,
               pre: Callable = pre_attention, post: Callable = post_attention, final: Callable = final_norm,
               normed: Callable[[int, Tensor], None] | None = None) -> Tensor:
        """Every decoder layer, then the final norm: x [B, T, H] embeddings -> [B, T, H] (the
        model's forward once, for the eager runtime and the graph engine alike).
        attend(layer, q, k, v): q [B, T, Hq, D], k, v [B, T, Hkv, D] before RoPE -> [B, T, Hq*D]
        in the model dtype (RoPE, the cache and what is attended are the caller's).
        delta: zeros [B, T, H] for the first layer's residual add (default: allocated here; the
        graph engine passes a static buffer). pre / post / final: layer_math's functions, or
        the same functions compiled (the engine's torch.compile). A tensor-parallel shard
        all-reduces post's o_proj and down outputs (`tensor_parallel`).
        normed(layer, x_normed): called before each layer's attend with its normed input [B, T, H]
        (RMSNorm with the layer's weight: what the q|k|v projection sees), for selectors that read
        it (the lightning indexer); None: not computed."""
        c = self.config
        split = [c.num_heads, c.num_kv_heads, c.num_kv_heads]
        delta = torch.zeros_like(x) if delta is None else delta
        if self.tensor_parallel is not None:  # a shard: o_proj's and down's outputs summed over ranks
            post = functools.partial(post, reduce=self.tensor_parallel.all_reduce)
        for i, w in enumerate(fuse_layer_weights(self)):
            x, qkv = pre(x, delta, w.ln1, w.wqkv, w.bqkv, c.rms_norm_eps, sum(split), c.head_dim)
            q, k, v = qkv.split(split, dim=-2)
            if normed is not None:
                normed(i, rms_norm(x, w.ln1, c.rms_norm_eps))
            x, delta = post(x, attend(i, q, k, v), w.wo, w.bo, w.ln2, w.w_gate_up, w.b_gate_up, w.w_down, w.b_down,
                            c.rms_norm_eps)
        return final(x, delta, self.model.norm.weight, self.model.norm.eps)

    @torch.no_grad()
    def init_random_(self, seed: int = 0, std: float = 0.02) -> Decoder:
        """Deterministic random init on the parameters' own device (no host round trip).

        Matrices and biases ~ N(0, std), norm weights = 1. Same seed and device -> same weights.
        """
        device = self.device
        if device.type == "meta":
            return self  # shapes only: nothing to fill
        generator = torch.Generator(device=device).manual_seed(seed)
        for name, param in self.named_parameters():  # tied lm_head is listed once
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.normal_(0.0, std, generator=generator)
        return self

    # ---- state-dict compatibility with transformers --------------------------------

    def _normalize_hf_state_dict(self, module, state_dict, prefix, *args) -> None:
        """Accept HF checkpoints as they come: a tied model may omit lm_head.weight, and old
        checkpoints carry rotary inv_freq buffers (recomputed here, not loaded)."""
        for key in [k for k in state_dict if k.startswith(prefix) and k.endswith("rotary_emb.inv_freq")]:
            del state_dict[key]
        embed, head = prefix + "model.embed_tokens.weight", prefix + "lm_head.weight"
        if self.config.tie_word_embeddings and head not in state_dict and embed in state_dict:
            state_dict[head] = state_dict[embed]

    def _retie(self, module, incompatible_keys) -> None:
        # load_state_dict(assign=True) replaces Parameters one by one, splitting the tie, and
        # the fused projections' views (layer_math.fuse_layer_weights rebuilds them on next use).
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.fused_layers = None
