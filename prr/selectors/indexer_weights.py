"""A DeepSeek-V3.2-style lightning indexer's parameters for any zoo model, its training-time
forward (fp32, prefill scores) and its files.

Per sparse layer, from the layer's normed hidden state x (the attention input after the
layer's RMSNorm, weight included) [.., T, hidden]:

    q_I = reshape(x @ W_qᵀ)            [.., T, H_I, d_I]    index queries
    w   = x @ W_wᵀ                     [.., T, H_I]         head weights
    k_I = LayerNorm(x @ W_kᵀ)          [.., T, d_I]         one index key per token, shared by the heads
    RoPE (rotate-half, non-interleaved) on the first `rope_dim` dims of q_I and k_I
    score(i, j) = Σ_h w_h(i) · ReLU(q_I,h(i) · k_I(j)),      causal (j <= i; later keys -inf)

DeepSeek-V3.2 scales the head weights by H_I^-1/2 · d_I^-1/2 at run time; here those factors are
folded into W_w (its random init is scaled by them and training learns W_w as it is), so the
decode kernels compute `w = x @ W_wᵀ` and the score above with no other factor. The LayerNorm
has an affine weight and bias (DeepSeek's k_norm) and eps `key_norm_eps`. RoPE: prr's
rotate-half layout (the indexer's RoPE in DeepSeek-V3.2 is non-interleaved too) on the first
`rope_dim` dims, with the model's theta and scaling at rope_dim's frequencies; rope_dim = 0: none.
Departures from DeepSeek-V3.2: q_I comes from x (DeepSeek's from its 1536-rank query latent, which
its attention computes anyway), so W_q is hidden × H_I·d_I: on the 8B shape at 64 × 128, 33.5M
parameters a layer, 1.03B over its 30 sparse layers (2.1 GB of bf16 read per decoded token, beside
the model's 16 GB), where DeepSeek's is 12.6M a layer; no Hadamard rotation before quantisation
(fp8 is the kernels' business, `index_dtype`; training is fp32).

Dense layers (`dense_layers`, as the selectors' conf: [0, 1]) have no indexer.

Files: safetensors in cache_dir()/indexer/<model>-<hash>.safetensors (`indexer_weights_file`:
the hash covers the model name, the IndexerConfig and the format version); the header holds the
config, the model shape and the sha256 of the tensors, which `load` recomputes and refuses on a
mismatch. `make train-indexer MODEL=...` (prr.selectors.indexer_training) writes them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from prr.kernels.reference_indexer import index_keys_from_projection, index_rope_angles, rope_leading
from prr.model.config import ModelConfig
from prr.model.rope import rope_inv_freq
from prr.paths import cache_dir, write_safetensors_atomic

FORMAT_VERSION = 1


@dataclass(frozen=True)
class IndexerConfig:
    """The indexer's shape (DeepSeek-V3.2's: 64 heads × 128 dims, RoPE on 64 of them)."""

    index_heads: int = 64  # H_I
    index_dim: int = 128  # d_I
    rope_dim: int = 64  # leading dims of q_I and k_I that RoPE rotates (0: none)
    dense_layers: tuple[int, ...] = (0, 1)  # layers without selection, hence without an indexer
    key_norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        object.__setattr__(self, "dense_layers", tuple(sorted(int(i) for i in self.dense_layers)))
        if self.index_heads < 1 or self.index_dim < 1:
            raise ValueError(f"index_heads={self.index_heads} and index_dim={self.index_dim} must be >= 1")
        if not (0 <= self.rope_dim <= self.index_dim and self.rope_dim % 2 == 0):
            raise ValueError(f"rope_dim={self.rope_dim} must be even and in [0, index_dim={self.index_dim}]")

    def sparse_layers(self, num_layers: int) -> list[int]:
        bad = [i for i in self.dense_layers if not 0 <= i < num_layers]
        if bad:
            raise ValueError(f"dense_layers {bad} are not layers of a {num_layers}-layer model")
        return [i for i in range(num_layers) if i not in self.dense_layers]

    def as_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "dense_layers": list(self.dense_layers)}


def train_hint(model: str, config: IndexerConfig) -> str:
    """The command that distils the indexer of `model` with `config`."""
    return (f"make train-indexer MODEL={model} ARGS='--index-heads {config.index_heads} --index-dim {config.index_dim} "
            f"--rope-dim {config.rope_dim} --dense-layers {','.join(map(str, config.dense_layers))}'")


def index_scores(q: Tensor, w: Tensor, k: Tensor) -> Tensor:
    """The indexer's score, unmasked: Σ_h w_h · ReLU(q_h · k_j). q: [B, Tq, H_I, d_I] (RoPE'd),
    w: [B, Tq, H_I], k: [B, T, d_I] (RoPE'd) -> [B, Tq, T] (a decode step: Tq = 1)."""
    logits = torch.einsum("bqhd,bkd->bqhk", q, k)  # [B, Tq, H_I, T]
    return torch.einsum("bqh,bqhk->bqk", w, F.relu(logits))


class LayerIndexer(nn.Module):
    """One sparse layer's indexer parameters: wq [H_I·d_I, hidden], ww [H_I, hidden] (the scalings
    folded in), wk [d_I, hidden], key_norm_weight / key_norm_bias [d_I]."""

    def __init__(self, hidden_size: int, config: IndexerConfig, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu") -> None:
        super().__init__()
        h_i, d_i = config.index_heads, config.index_dim
        self.config = config
        self.wq = nn.Parameter(torch.empty(h_i * d_i, hidden_size, dtype=dtype, device=device))
        self.ww = nn.Parameter(torch.empty(h_i, hidden_size, dtype=dtype, device=device))
        self.wk = nn.Parameter(torch.empty(d_i, hidden_size, dtype=dtype, device=device))
        self.key_norm_weight = nn.Parameter(torch.ones(d_i, dtype=dtype, device=device))
        self.key_norm_bias = nn.Parameter(torch.zeros(d_i, dtype=dtype, device=device))

    def queries(self, x: Tensor, positions: Tensor, inv_freq: Tensor) -> Tensor:
        """x: [.., T, hidden], positions [T] -> q_I [.., T, H_I, d_I] fp32 (RoPE'd in fp32)."""
        c = self.config
        q = F.linear(x, self.wq).unflatten(-1, (c.index_heads, c.index_dim))  # [.., T, H_I, d_I]
        cos, sin = index_rope_angles(positions, inv_freq)  # [T, rope_dim]
        return rope_leading(q.float(), cos.unsqueeze(-2), sin.unsqueeze(-2), c.rope_dim)

    def head_weights(self, x: Tensor) -> Tensor:
        """x: [.., T, hidden] -> w [.., T, H_I] fp32."""
        return F.linear(x, self.ww).float()

    def keys(self, x: Tensor, positions: Tensor, inv_freq: Tensor) -> Tensor:
        """x: [.., T, hidden], positions [T] -> k_I [.., T, d_I] fp32 (LayerNorm'd and RoPE'd in fp32)."""
        c = self.config
        cos, sin = index_rope_angles(positions, inv_freq)
        return index_keys_from_projection(F.linear(x, self.wk), cos, sin, self.key_norm_weight, self.key_norm_bias,
                                          c.key_norm_eps, c.rope_dim)

    def step_weight(self) -> Tensor:
        """[W_q; W_k; W_w] stacked: [H_I·d_I + d_I + H_I, hidden], one projection of a decode step's
        hidden state for the three (kernels.indexer_step's layout)."""
        return torch.cat((self.wq, self.wk, self.ww))

    def scores(self, x: Tensor, inv_freq: Tensor, query_positions: Tensor | None = None) -> Tensor:
        """A prefill's index scores. x: [B, T, hidden] (positions 0..T-1); query_positions: [Tq]
        (default: all T) -> [B, Tq, T], -inf where the key is after the query."""
        t_len = x.shape[-2]
        positions = torch.arange(t_len, device=x.device)
        query_positions = positions if query_positions is None else query_positions.to(x.device)
        xq = x[..., query_positions, :]  # [B, Tq, hidden]
        q = self.queries(xq, query_positions, inv_freq)  # [B, Tq, H_I, d_I]
        k = self.keys(x, positions, inv_freq)  # [B, T, d_I]
        score = index_scores(q, self.head_weights(xq), k)  # [B, Tq, T]
        later = positions[None, :] > query_positions[:, None]  # [Tq, T]
        return score.masked_fill(later, float("-inf"))


class IndexerWeights(nn.Module):
    """Every sparse layer's LayerIndexer for one model shape (hidden size, layers, RoPE)."""

    def __init__(self, config: IndexerConfig, hidden_size: int, num_layers: int, rope_theta: float,
                 rope_scaling: dict[str, Any] | None = None, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu") -> None:
        super().__init__()
        self.config = config
        self.hidden_size, self.num_layers = hidden_size, num_layers
        self.rope_theta, self.rope_scaling = rope_theta, rope_scaling
        self.sparse_layers = config.sparse_layers(num_layers)
        self.layers = nn.ModuleDict({str(i): LayerIndexer(hidden_size, config, dtype, device) for i in self.sparse_layers})
        inv_freq = rope_inv_freq(config.rope_dim, rope_theta, rope_scaling) if config.rope_dim else torch.zeros(0)
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)  # [rope_dim // 2] fp32

    @classmethod
    def for_model(cls, model_config: ModelConfig, config: IndexerConfig, seed: int | None = 0,
                  dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> IndexerWeights:
        """An indexer shaped for `model_config`, seeded random (seed None: left uninitialised, for load)."""
        out = cls(config, model_config.hidden_size, model_config.num_layers, model_config.rope_theta,
                  model_config.rope_scaling, dtype, device)
        return out if seed is None else out.init_random_(seed)

    @torch.no_grad()
    def init_random_(self, seed: int = 0) -> IndexerWeights:
        """Seeded init on the parameters' device: W_q, W_k ~ N(0, 1/hidden) (unit-scale q_I and k_I
        from a unit-RMS x), W_w the same times H_I^-1/2 · d_I^-1/2 (DeepSeek's scalings, folded in),
        the key norm at identity. Same seed, device and dtype -> same weights."""
        if self.inv_freq.device.type == "meta":
            return self  # shapes only: nothing to fill
        c = self.config
        std = 1.0 / math.sqrt(self.hidden_size)
        generator = torch.Generator(device=self.inv_freq.device).manual_seed(seed)
        for layer in self.layers.values():
            layer.wq.normal_(0.0, std, generator=generator)
            layer.wk.normal_(0.0, std, generator=generator)
            layer.ww.normal_(0.0, std / math.sqrt(c.index_heads * c.index_dim), generator=generator)
            layer.key_norm_weight.fill_(1.0)
            layer.key_norm_bias.zero_()
        return self

    def layer(self, layer: int) -> LayerIndexer:
        if str(layer) not in self.layers:
            raise KeyError(f"layer {layer} has no indexer: the sparse layers are {self.sparse_layers} "
                           f"(dense_layers={list(self.config.dense_layers)})")
        return self.layers[str(layer)]

    def scores(self, layer: int, x: Tensor, query_positions: Tensor | None = None) -> Tensor:
        """x: [B, T, hidden] the layer's normed hidden states of a prefill -> [B, Tq, T] causal scores."""
        return self.layer(layer).scores(x, self.inv_freq, query_positions)

    def model_shape(self) -> dict[str, Any]:
        return {"hidden_size": self.hidden_size, "num_layers": self.num_layers, "rope_theta": self.rope_theta,
                "rope_scaling": self.rope_scaling}

    # --- files ---------------------------------------------------------------------------------
    def save(self, path: Path, meta: dict) -> str:
        """Atomic safetensors write with the config, model shape and the tensors' sha256 in the header.
        -> the sha256."""
        tensors = {name: t.detach().float().contiguous().cpu() for name, t in self.state_dict().items()}
        digest = tensors_sha256(tensors)
        header = {"format_version": str(FORMAT_VERSION), "config": json.dumps(self.config.as_dict()),
                  "model_shape": json.dumps(self.model_shape()), "sha256": digest, "meta": json.dumps(meta)}
        write_safetensors_atomic(path, tensors, header)
        return digest

    @classmethod
    def load(cls, path: Path, hint: str = "make train-indexer") -> IndexerWeights:
        """The indexer in `path`; a changed file (sha256 of its tensors != its header's) is refused."""
        from safetensors import safe_open
        from safetensors.torch import load_file

        with safe_open(str(path), framework="pt") as f:
            header = f.metadata() or {}
        if header.get("format_version") != str(FORMAT_VERSION):
            raise ValueError(f"{path}: indexer format {header.get('format_version')!r}, expected {FORMAT_VERSION}; "
                             f"rerun `{hint}`")
        tensors = load_file(str(path))
        digest = tensors_sha256(tensors)
        if digest != header.get("sha256"):
            raise ValueError(f"{path}: its tensors' sha256 {digest[:16]}… is not the {str(header.get('sha256'))[:16]}… "
                             f"its header records (changed or corrupt); delete it and rerun `{hint}`")
        config = json.loads(header["config"])
        shape = json.loads(header["model_shape"])
        out = cls(IndexerConfig(**{**config, "dense_layers": tuple(config["dense_layers"])}), shape["hidden_size"],
                  shape["num_layers"], shape["rope_theta"], shape["rope_scaling"])
        out.load_state_dict(tensors)
        out.meta = json.loads(header.get("meta", "{}"))
        return out.eval().requires_grad_(False)


def tensors_sha256(tensors: dict[str, Tensor]) -> str:
    """sha256 over the tensors in name order: each name, dtype, shape and bytes."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].contiguous().cpu()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def indexer_weights_file(model: str, config: IndexerConfig) -> Path:
    """Where the distilled indexer of `model` with `config` lives."""
    key = hashlib.sha256(f"{model}|{json.dumps(config.as_dict(), sort_keys=True)}|v{FORMAT_VERSION}".encode())
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", Path(model).name or model)
    return cache_dir() / "indexer" / f"{safe}-{key.hexdigest()[:12]}.safetensors"


def load_indexer(model: str, model_config: ModelConfig, config: IndexerConfig) -> IndexerWeights:
    """The distilled indexer of `model` with `config`, checked against the model's shape."""
    path = indexer_weights_file(model, config)
    if not path.is_file():
        raise FileNotFoundError(f"no distilled indexer for model {model!r} with {config} at {path}; "
                                f"train it with `{train_hint(model, config)}`")
    weights = IndexerWeights.load(path, train_hint(model, config))
    want = {"hidden_size": model_config.hidden_size, "num_layers": model_config.num_layers,
            "rope_theta": model_config.rope_theta, "rope_scaling": model_config.rope_scaling}
    if weights.model_shape() != want or weights.config != config:
        raise ValueError(f"{path}: made for {weights.model_shape()} with {weights.config}, not model {model!r} "
                         f"{want} with {config}; rerun `{train_hint(model, config)}`")
    return weights


def stored_indexer_configs(model: str) -> list[IndexerConfig]:
    """The configs of the distilled indexers of `model` in the cache (files `make train-indexer`
    wrote: the name's hash is recomputed from the header's config, so another model's file or a
    renamed one is not counted), in file-name order; [] when there is none."""
    from safetensors import safe_open

    found = []
    for path in sorted((cache_dir() / "indexer").glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            header = f.metadata() or {}
        if header.get("format_version") != str(FORMAT_VERSION) or "config" not in header:
            continue
        stored = json.loads(header["config"])
        config = IndexerConfig(**{**stored, "dense_layers": tuple(stored["dense_layers"])})
        if indexer_weights_file(model, config) == path:
            found.append(config)
    return found
