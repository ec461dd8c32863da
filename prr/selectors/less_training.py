"""A trained feature map for LESS (`selector.feature_map=trained`), and its training CLI.

`python -m prr.selectors.less_training` (or `make train-less`) captures per-layer post-RoPE
q/k/v of a model on offline text (python_reference_text, a few windows, prefill only), then
fits per layer one small feature map, shared by the layer's heads, with separate query and
key branches:

    log φ_r(x) = W_r x' − ‖x'‖²/2 − ½ log m + MLP_r(x'),     x' = √scale · x,  r ∈ {q, k}

W_q = W_k start as the selector's random-feature draw (KV head 0 of the layer) and the MLPs'
last layer starts at zero, so training starts from the training-free map. The loss is that
of the LESS compensation computed as less.py computes it (centred keys, per-block
summaries, unselected = all − selected, merged with the selected blocks' exact state by
log-sum-exp): the relative error of the merged output against dense attention, plus the
error of the unselected blocks' log mass (its gradient does not vanish when the estimate
is far too small, as random features are on SmolLM2). Unselected sets: the top blocks by
true mass with Gumbel noise stay selected (what a top-K selector keeps), a random K.

Weights: safetensors, written atomically to cache_dir()/less/<model>-<hash>.safetensors
(`feature_map_file`); the hash covers the model name, m and the format version.

Measured on SmolLM2-135M (defaults, ~95 s): the unselected log-mass error drops from ~8 to
~1.7, but the merged output error does not generalise to held-out text or to the 4K-token
shadow run (worse than random features and Quest there): the map is measurable, not yet useful.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import re
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from prr.paths import cache_dir

FORMAT_VERSION = 1
TRAIN_HINT = "make train-less"


def feature_map_file(model: str, num_features: int) -> Path:
    """Where the trained map of `model` with m = num_features lives."""
    key = hashlib.sha256(f"{model}|m={num_features}|v{FORMAT_VERSION}".encode()).hexdigest()[:12]
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", Path(model).name or model)
    return cache_dir() / "less" / f"{safe}-{key}.safetensors"


def random_rows(m: int, d: int, seed: int, layer: int) -> Tensor:
    """The selector's orthogonal random-feature draw for KV head 0 of `layer` (less.py)."""
    g = torch.Generator().manual_seed(seed * 100_003 + layer)
    chunks = []
    for _ in range(-(-m // d)):
        qmat, _ = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))
        chunks.append(qmat.T)
    norms = torch.randn(m, d, generator=g, dtype=torch.float64).norm(dim=-1, keepdim=True)
    return (torch.cat(chunks)[:m] * norms).float()


class LayerFeatureMap(nn.Module):
    """One layer's map: logits(x, role) = log φ_role(x), x [..., D] -> [..., m]."""

    def __init__(self, head_dim: int, num_features: int, hidden: int = 64, init: Tensor | None = None) -> None:
        super().__init__()
        w = init if init is not None else torch.randn(num_features, head_dim)
        self.scale = 1.0 / math.sqrt(head_dim)
        self.w = nn.ParameterDict({r: nn.Parameter(w.clone()) for r in ("q", "k")})
        self.mlp = nn.ModuleDict({r: nn.Sequential(nn.Linear(head_dim, hidden), nn.GELU(), nn.Linear(hidden, num_features))
                                  for r in ("q", "k")})
        for r in ("q", "k"):
            nn.init.zeros_(self.mlp[r][2].weight)
            nn.init.zeros_(self.mlp[r][2].bias)

    @property
    def num_features(self) -> int:
        return self.w["q"].shape[0]

    def logits(self, x: Tensor, role: str) -> Tensor:
        x = x.float() * math.sqrt(self.scale)
        m = self.num_features
        return x @ self.w[role].T - 0.5 * (x * x).sum(-1, keepdim=True) - 0.5 * math.log(m) + self.mlp[role](x)


class TrainedFeatureMap(nn.Module):
    def __init__(self, num_layers: int, head_dim: int, num_features: int, hidden: int = 64, seed: int = 0) -> None:
        super().__init__()
        self.head_dim, self.hidden = head_dim, hidden
        self.layers = nn.ModuleList(LayerFeatureMap(head_dim, num_features, hidden, random_rows(num_features, head_dim, seed, i))
                                    for i in range(num_layers))

    @property
    def num_features(self) -> int:
        return self.layers[0].num_features

    def logits(self, x: Tensor, layer: int, role: str) -> Tensor:
        return self.layers[layer].logits(x, role)

    # --- files ---------------------------------------------------------------------------------
    def save(self, path: Path, meta: dict) -> None:
        """Atomic safetensors write (never pickle)."""
        from safetensors.torch import save_file

        path.parent.mkdir(parents=True, exist_ok=True)
        header = {"format_version": str(FORMAT_VERSION), "num_layers": str(len(self.layers)),
                  "head_dim": str(self.head_dim), "num_features": str(self.num_features), "hidden": str(self.hidden),
                  "meta": json.dumps(meta)}
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        os.close(fd)
        try:
            tensors = {name: t.detach().contiguous().cpu() for name, t in self.state_dict().items()}
            save_file(tensors, tmp, metadata=header)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    @classmethod
    def load(cls, path: Path) -> TrainedFeatureMap:
        from safetensors import safe_open
        from safetensors.torch import load_file

        with safe_open(str(path), framework="pt") as f:
            header = f.metadata() or {}
        if header.get("format_version") != str(FORMAT_VERSION):
            raise ValueError(f"{path}: LESS feature map format {header.get('format_version')!r}, expected "
                             f"{FORMAT_VERSION}; rerun `{TRAIN_HINT}`")
        fmap = cls(int(header["num_layers"]), int(header["head_dim"]), int(header["num_features"]), int(header["hidden"]))
        fmap.load_state_dict(load_file(str(path)))
        return fmap.eval().requires_grad_(False)


def load_trained_map(model: str, num_features: int) -> TrainedFeatureMap:
    path = feature_map_file(model, num_features)
    if not path.is_file():
        raise FileNotFoundError(
            f"selector.feature_map=trained: no trained LESS feature map for model {model!r} with "
            f"num_features={num_features} at {path}; train it with `{TRAIN_HINT}` "
            f"(python -m prr.selectors.less_training --model {model} --num-features {num_features})")
    return TrainedFeatureMap.load(path)


# --- capture -----------------------------------------------------------------------------------


class CaptureAttention:
    """An AttentionBackend that records each layer's prefill q, k, v and attends densely."""

    def __init__(self) -> None:
        self.qkv: dict[int, tuple[Tensor, Tensor, Tensor]] = {}

    def prefill(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        from prr.model.dense import _sdpa

        self.qkv[layer] = (q[0].float().clone(), k[0].float().clone(), v[0].float().clone())
        return _sdpa(q, k, v, causal=True)

    def decode(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:  # pragma: no cover
        raise NotImplementedError("capture is prefill-only")


def text_windows(loaded, windows: int, length: int, seed: int) -> list[Tensor]:
    """`windows` token windows of `length` tokens from python_reference_text (random ids without a tokenizer)."""
    from prr.tasks.text_sources import python_reference_text

    g = torch.Generator().manual_seed(seed)
    if loaded.tokenizer is None:
        data = torch.tensor(list(python_reference_text()[: 200_000].encode()), dtype=torch.long) % loaded.config.vocab_size
    else:
        text = python_reference_text()
        chunk = len(text) // windows
        out = []
        for i in range(windows):
            ids = loaded.tokenizer(text[i * chunk : (i + 1) * chunk], add_special_tokens=False)["input_ids"][:length]
            out.append(torch.tensor(ids, dtype=torch.long))
        return out
    starts = torch.randint(0, data.numel() - length, (windows,), generator=g).tolist()
    return [data[s : s + length] for s in starts]


@torch.no_grad()
def capture(loaded, windows: list[Tensor]) -> list[dict[int, tuple[Tensor, Tensor, Tensor]]]:
    out = []
    for ids in windows:
        backend = CaptureAttention()
        loaded.decoder(ids[None].to(loaded.decoder.device), 0, backend, last_logits_only=True)
        out.append(backend.qkv)
    return out


# --- the loss ----------------------------------------------------------------------------------


def layer_loss(fmap: LayerFeatureMap, q: Tensor, k: Tensor, v: Tensor, block_size: int, queries: int,
               g: torch.Generator, min_context_blocks: int = 4) -> tuple[Tensor, dict]:
    """One sample of the LESS loss on one layer's window. q: [Hq, T, D], k, v: [Hkv, T, D].

    Query positions t at random; full blocks before t's block are selectable (t's own block
    is always selected, as force_newest does); a random top-K-with-noise set stays selected.
    Returns the loss and the merged / selected-only output errors (for logging)."""
    hq, t_len, d = q.shape
    hkv = k.shape[0]
    group = hq // hkv
    scale = 1.0 / math.sqrt(d)
    nb = t_len // block_size
    k = k - k.mean(1, keepdim=True)  # centred keys (less.py: the mean prompt key; softmax is shift-invariant)
    lo = max(min_context_blocks, nb // 2) * block_size  # late positions: long contexts, as at decode
    pos = torch.randint(lo, nb * block_size, (queries,), generator=g)  # [N]
    qs = q[:, pos]  # [Hq, N, D]
    kk = k[:, : nb * block_size].repeat_interleave(group, 0)  # [Hq, T', D]
    vv = v[:, : nb * block_size].repeat_interleave(group, 0)
    t_idx = torch.arange(nb * block_size)
    causal = t_idx[None] <= pos[:, None]  # [N, T']
    scores = scale * qs @ kk.transpose(-1, -2)  # [Hq, N, T']
    scores = scores.masked_fill(~causal, float("-inf"))
    lse_dense = torch.logsumexp(scores, -1)
    out_dense = torch.softmax(scores, -1) @ vv  # [Hq, N, D]

    # Block masses of the full blocks before the query's block; the selection.
    own = pos // block_size  # [N]
    blk = torch.arange(nb)
    before = blk[None] < own[:, None]  # [N, NB] selectable (full, older) blocks
    block_lse = torch.logsumexp(scores.view(hq, queries, nb, block_size), -1)  # [Hq, N, NB]
    kv_lse = torch.logsumexp(block_lse.view(hkv, group, queries, nb), 1)  # per KV head (GQA)
    gumbel = -torch.log(-torch.log(torch.rand(kv_lse.shape, generator=g).clamp(1e-9, 1 - 1e-9)))
    noisy = (kv_lse + gumbel).masked_fill(~before[None], float("-inf"))
    n_before = before.sum(-1)  # [N]
    frac = torch.rand(queries, generator=g) * 0.45 + 0.05
    kcount = (frac * n_before).long().clamp(min=1)  # [N]
    order = noisy.argsort(-1, descending=True).argsort(-1)  # rank of each block
    selected = order < kcount[None, :, None]  # [Hkv, N, NB]
    unselected = before[None] & ~selected  # [Hkv, N, NB]
    unsel_q = unselected.repeat_interleave(group, 0)  # [Hq, N, NB]
    tok_unsel = unsel_q.repeat_interleave(block_size, -1)  # [Hq, N, T']

    sel_scores = scores.masked_fill(tok_unsel, float("-inf"))
    lse_sel = torch.logsumexp(sel_scores, -1)
    out_sel = torch.softmax(sel_scores, -1) @ vv
    true_unsel = scores.masked_fill(~tok_unsel, float("-inf"))
    lse_true_u = torch.logsumexp(true_unsel, -1)  # [Hq, N]

    # The compensation, as less.py computes it: block summaries with offsets, U = all - selected.
    lk = fmap.logits(k[:, : nb * block_size], "k")  # [Hkv, T', m]
    m = lk.shape[-1]
    c_tot = lk.amax(1, keepdim=True).detach()  # [Hkv, 1, m]
    wk = torch.exp(lk - c_tot).view(hkv, nb, block_size, m)
    vb = v[:, : nb * block_size].view(hkv, nb, block_size, d)
    s_b = wk.sum(2)  # [Hkv, NB, m]
    big_b = wk.transpose(-1, -2) @ vb  # [Hkv, NB, m, D]
    lq = fmap.logits(qs, "q").view(hkv, group, queries, m) + c_tot.unsqueeze(1)  # [Hkv, G, N, m]
    top = lq.amax(-1, keepdim=True).detach()
    wq = torch.exp(lq - top)  # [Hkv, G, N, m]
    uf = unselected.float()  # [Hkv, N, NB]
    rest_small = uf @ s_b  # [Hkv, N, m]
    rest_big = torch.einsum("hnb,hbmd->hnmd", uf, big_b)  # [Hkv, N, m, D]
    mass = (wq * rest_small.unsqueeze(1)).sum(-1)  # [Hkv, G, N]
    num = torch.einsum("hgnm,hnmd->hgnd", wq, rest_big)
    has_u = unselected.any(-1).unsqueeze(1).expand_as(mass)  # [Hkv, G, N]
    safe = mass.clamp(min=1e-30)
    out_u = (num / safe.unsqueeze(-1)).reshape(hq, queries, d)
    lse_u = (top.squeeze(-1) + torch.log(safe)).reshape(hq, queries)
    has_u = has_u.reshape(hq, queries)
    lse_u = torch.where(has_u, lse_u, torch.full_like(lse_u, float("-inf")))

    lse_m = torch.logaddexp(lse_sel, lse_u)
    merged = (torch.exp(lse_sel - lse_m).unsqueeze(-1) * out_sel
              + torch.where(has_u, torch.exp(lse_u - lse_m), torch.zeros_like(lse_m)).unsqueeze(-1) * out_u)
    norm = out_dense.norm(dim=-1).clamp(min=1e-6)
    err_merged = (merged - out_dense).norm(dim=-1) / norm
    err_sel = (out_sel - out_dense).norm(dim=-1) / norm
    d_lse = torch.where(has_u, lse_u - lse_true_u, torch.zeros_like(lse_u))
    loss = err_merged.mean() + 0.05 * F.smooth_l1_loss(d_lse, torch.zeros_like(d_lse))
    del lse_dense
    return loss, {"merged": err_merged.mean().item(), "selected": err_sel.mean().item(),
                  "lse_err": d_lse[has_u].abs().mean().item() if has_u.any() else 0.0}


def train(fmap: TrainedFeatureMap, data: list[dict[int, tuple[Tensor, Tensor, Tensor]]], steps: int, lr: float = 3e-3,
          block_size: int = 16, queries: int = 32, seed: int = 0, progress: bool = True) -> list[dict]:
    """Adam on every layer at once (layers are independent); -> per-step mean stats over layers."""
    from tqdm import tqdm

    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam(fmap.parameters(), lr=lr)
    history = []
    bar = tqdm(range(steps), desc="train LESS feature map", disable=not progress)
    layers = len(fmap.layers)
    for _ in bar:
        opt.zero_grad(set_to_none=True)
        stats = {"loss": 0.0, "merged": 0.0, "selected": 0.0, "lse_err": 0.0}
        for layer in range(layers):
            window = data[int(torch.randint(len(data), (1,), generator=g))]
            loss, info = layer_loss(fmap.layers[layer], *window[layer], block_size, queries, g)
            loss.backward()
            stats["loss"] += loss.item() / layers
            for key, value in info.items():
                stats[key] += value / layers
        opt.step()
        history.append(stats)
        bar.set_postfix(loss=f"{stats['loss']:.4f}", merged=f"{stats['merged']:.4f}", sel=f"{stats['selected']:.4f}",
                        dlse=f"{stats['lse_err']:.2f}")
    return history


@torch.no_grad()
def evaluate(fmap: TrainedFeatureMap, data, block_size: int = 16, queries: int = 64, seed: int = 1234) -> dict:
    g = torch.Generator().manual_seed(seed)
    out = {"loss": 0.0, "merged": 0.0, "selected": 0.0, "lse_err": 0.0}
    layers = len(fmap.layers)
    for layer in range(layers):
        for window in data:
            loss, info = layer_loss(fmap.layers[layer], *window[layer], block_size, queries, g)
            info["loss"] = loss.item()
            for key, value in info.items():
                out[key] += value / (layers * len(data))
    return out


def main(argv: list[str] | None = None) -> Path:
    p = argparse.ArgumentParser(description="Train the LESS feature map (selector.feature_map=trained).")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--num-features", type=int, default=64)
    p.add_argument("--hidden", type=int, default=16)
    p.add_argument("--windows", type=int, default=12, help="text windows (the last is held out for evaluation)")
    p.add_argument("--window-tokens", type=int, default=1024)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--queries", type=int, default=32, help="query positions per layer and step")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--seed", type=int, default=0, help="the random-feature draw the map starts from (selector.seed)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from prr.model.loading import load_model

    t0 = time.perf_counter()
    loaded = load_model(args.model)
    windows = text_windows(loaded, args.windows, args.window_tokens, args.seed)
    data = capture(loaded, windows)
    train_data, held_out = (data[:-1], data[-1:]) if len(data) > 1 else (data, data)
    mc = loaded.config
    print(f"captured {len(data)} windows x {[w.numel() for w in windows]} tokens, {mc.num_layers} layers "
          f"in {time.perf_counter() - t0:.1f}s")
    torch.manual_seed(args.seed)
    fmap = TrainedFeatureMap(mc.num_layers, mc.head_dim, args.num_features, args.hidden, args.seed)
    before = evaluate(fmap, held_out, args.block_size)
    t1 = time.perf_counter()
    train(fmap, train_data, args.steps, args.lr, args.block_size, args.queries, args.seed)
    train_s = time.perf_counter() - t1
    after = evaluate(fmap, held_out, args.block_size)
    print(f"held-out window, mean over layers: selected-only rel. err {before['selected']:.4f}; "
          f"merged with random features {before['merged']:.4f} (|Δlse| {before['lse_err']:.2f}); "
          f"merged with the trained map {after['merged']:.4f} (|Δlse| {after['lse_err']:.2f}); training {train_s:.0f}s")
    path = feature_map_file(args.model, args.num_features)
    fmap.save(path, {"model": args.model, "args": vars(args), "train_s": round(train_s, 1),
                     "held_out_before": before, "held_out_after": after})
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    main()
