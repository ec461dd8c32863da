"""A trained feature map for LESS (`selector.feature_map=trained`), and its training CLI.

`python -m prr.selectors.less_training` (or `make train-less`) captures per-layer post-RoPE
k/v and the last queries of a model on held-out text (python_reference_text after its first
8192 tokens: the default task's prompt is the first 4096, never seen here), windows as long
as that prompt (4096 tokens), prefill only; then fits per sparse layer one small feature map,
shared by the layer's heads, with separate query and key branches:

    log φ_r(x) = W_r x'_r − ‖x'_r‖²/2 − ½ log m + MLP_r(√scale x),   x'_r = τ_r √scale x,  r ∈ {q, k}

W_q = W_k start as the selector's random-feature draw (KV head 0 of the layer), τ_r (learned)
at 0.7 — random features of a softened kernel, whose estimator is far less heavy-tailed
than the exact kernel's at SmolLM2's ‖q‖ — and the MLPs' last layer at zero. The loss is that
of the LESS compensation computed as less.py computes it, for the blocks *Quest* leaves out
at the fidelity study's budgets (16–128 blocks; `quest_unselected` reproduces the runtime's
selection, tested): the merged output's relative error against dense attention (per KV
head, as the runtime measures it) divided by Quest's, plus a small log-mass term. Early
stopping and a per-layer gate use the held-out window(s): a layer whose compensation did not
lower the held-out error gets `enabled = 0` and less.py adds no compensation there.

Weights: safetensors, written atomically to cache_dir()/less/<model>-<hash>.safetensors
(`feature_map_file`); the hash covers the model name, m and the format version.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import re
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from prr.paths import cache_dir, write_safetensors_atomic

FORMAT_VERSION = 2  # 2: learned temperatures and a per-layer `enabled` flag
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
    """One layer's map: logits(x, role) = log φ_role(x), x [..., D] -> [..., m].

    Random features of a softened kernel (temperature τ_r = exp(log_temp_r), learned, start
    `temp`): x' = τ_r √scale x, so φ_q·φ_k estimates exp(τ_q τ_k scale q·k), whose estimator has
    far less variance than the exact kernel's at SmolLM2's ‖q‖; the query MLP also shifts
    all features at once, i.e. rescales the estimated mass per query (a learned calibration).
    `enabled` (a buffer, set by held-out validation) turns the layer's compensation off."""

    def __init__(self, head_dim: int, num_features: int, hidden: int = 64, init: Tensor | None = None,
                 temp: float = 1.0) -> None:
        super().__init__()
        w = init if init is not None else torch.randn(num_features, head_dim)
        self.scale = 1.0 / math.sqrt(head_dim)
        self.w = nn.ParameterDict({r: nn.Parameter(w.clone()) for r in ("q", "k")})
        self.log_temp = nn.ParameterDict({r: nn.Parameter(torch.tensor(math.log(temp))) for r in ("q", "k")})
        self.mlp = nn.ModuleDict({r: nn.Sequential(nn.Linear(head_dim, hidden), nn.GELU(), nn.Linear(hidden, num_features))
                                  for r in ("q", "k")})
        for r in ("q", "k"):
            nn.init.zeros_(self.mlp[r][2].weight)
            nn.init.zeros_(self.mlp[r][2].bias)
        self.register_buffer("enabled", torch.ones(()))

    @property
    def num_features(self) -> int:
        return self.w["q"].shape[0]

    def logits(self, x: Tensor, role: str) -> Tensor:
        x = x.float() * math.sqrt(self.scale)
        xt = x * self.log_temp[role].exp()
        m = self.num_features
        return xt @ self.w[role].T - 0.5 * (xt * xt).sum(-1, keepdim=True) - 0.5 * math.log(m) + self.mlp[role](x)


class TrainedFeatureMap(nn.Module):
    def __init__(self, num_layers: int, head_dim: int, num_features: int, hidden: int = 64, seed: int = 0,
                 temp: float = 1.0) -> None:
        super().__init__()
        self.head_dim, self.hidden = head_dim, hidden
        self.layers = nn.ModuleList(LayerFeatureMap(head_dim, num_features, hidden, random_rows(num_features, head_dim, seed, i),
                                                    temp) for i in range(num_layers))

    @property
    def num_features(self) -> int:
        return self.layers[0].num_features

    def logits(self, x: Tensor, layer: int, role: str) -> Tensor:
        return self.layers[layer].logits(x, role)

    def enabled(self, layer: int) -> bool:
        """Whether held-out validation kept `layer`'s compensation (less.py skips it otherwise)."""
        return bool(self.layers[layer].enabled > 0.5)

    # --- files ---------------------------------------------------------------------------------
    def save(self, path: Path, meta: dict) -> None:
        """Atomic safetensors write (never pickle)."""
        header = {"format_version": str(FORMAT_VERSION), "num_layers": str(len(self.layers)),
                  "head_dim": str(self.head_dim), "num_features": str(self.num_features), "hidden": str(self.hidden),
                  "meta": json.dumps(meta)}
        tensors = {name: t.detach().contiguous().cpu() for name, t in self.state_dict().items()}
        write_safetensors_atomic(path, tensors, header)

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

Window = dict[int, tuple[Tensor, Tensor, Tensor]]  # layer -> (q of the last queries [Hq, NQ, D], k, v [Hkv, T, D])


class CaptureAttention:
    """An AttentionBackend that records each layer's prefill k, v and the last `query_tokens`
    queries (the positions a decode step resembles), and attends densely."""

    def __init__(self, query_tokens: int) -> None:
        self.query_tokens = query_tokens
        self.qkv: Window = {}

    def prefill(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        from prr.model.dense import _sdpa

        # q: [1, Hq, T, D], k, v: [1, Hkv, T, D]
        self.qkv[layer] = (q[0, :, -self.query_tokens :].float().clone(), k[0].float().clone(), v[0].float().clone())
        return _sdpa(q, k, v, causal=True)

    def decode(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:  # pragma: no cover
        raise NotImplementedError("capture is prefill-only")


def text_windows(loaded, windows: int, length: int, seed: int, skip_tokens: int = 8192) -> list[Tensor]:
    """`windows` token windows of `length` tokens of python_reference_text, spread over the
    text after its first `skip_tokens` tokens: the default task's prompt is the text's first
    4096 tokens, so training never sees the evaluation text. Random ids without a tokenizer."""
    from prr.tasks.text_sources import python_reference_text

    if loaded.tokenizer is None:
        g = torch.Generator().manual_seed(seed)
        data = torch.tensor(list(python_reference_text()[: 200_000].encode()), dtype=torch.long) % loaded.config.vocab_size
        starts = torch.randint(0, data.numel() - length, (windows,), generator=g).tolist()
        return [data[s : s + length] for s in starts]
    ids = loaded.tokenizer(python_reference_text(), add_special_tokens=False)["input_ids"]
    room = len(ids) - skip_tokens - length
    if room < 0:
        raise ValueError(f"--skip-tokens {skip_tokens} + --window-tokens {length} exceed the text's {len(ids)} tokens")
    stride = room // max(windows - 1, 1)
    return [torch.tensor(ids[skip_tokens + i * stride : skip_tokens + i * stride + length], dtype=torch.long)
            for i in range(windows)]


@torch.no_grad()
def capture(loaded, windows: list[Tensor], query_tokens: int) -> list[Window]:
    out = []
    for ids in windows:
        backend = CaptureAttention(query_tokens)
        loaded.decoder(ids[None].to(loaded.decoder.device), 0, backend, last_logits_only=True)
        out.append(backend.qkv)
    return out


# --- the loss ----------------------------------------------------------------------------------


@torch.no_grad()
def quest_unselected(q: Tensor, k: Tensor, pos: Tensor, budget_blocks: int, block_size: int,
                     sink_blocks: int = 1) -> tuple[Tensor, Tensor]:
    """Quest's selection as the runtime makes it (selector defaults: sinks, the newest block
    forced, GQA max, top-K counting the forced blocks), for queries at positions `pos`.
    q: [Hq, N, D], k: [Hkv, T, D], pos: [N] -> (unselected [Hkv, N, NB], older [N, NB]) over the
    window's full blocks; `older`: the blocks before each query's own (newest) block."""
    hq, n, d = q.shape
    hkv, t_len, _ = k.shape
    nb = t_len // block_size
    own = pos // block_size  # [N]
    if int(own.min()) < budget_blocks:
        raise ValueError(f"a query at position {int(pos.min())} has fewer than budget_blocks={budget_blocks} older "
                         f"blocks of {block_size} tokens; use longer windows (--window-tokens) or smaller budgets")
    blocks = k[:, : nb * block_size].view(hkv, nb, block_size, d)
    key_max, key_min = blocks.amax(2), blocks.amin(2)  # [Hkv, NB, D]
    qg = q.view(hkv, hq // hkv, n, 1, d)
    upper = torch.maximum(qg * key_max[:, None, None], qg * key_min[:, None, None]).sum(-1).amax(1)  # [Hkv, N, NB]
    older = torch.arange(nb)[None] < own[:, None]  # [N, NB]
    upper = upper.masked_fill(~older[None], float("-inf"))
    upper[..., :sink_blocks] = float("inf")
    top = upper.topk(budget_blocks - 1, dim=-1).indices  # the newest block is the K-th
    selected = torch.zeros_like(older[None].expand_as(upper)).scatter(-1, top, True)
    return older[None] & ~selected, older


def layer_loss(fmap: LayerFeatureMap, window: tuple[Tensor, Tensor, Tensor], block_size: int, budget_blocks: int,
               pick: Tensor) -> tuple[Tensor, dict]:
    """The LESS compensation on one layer's window for Quest's selection at `budget_blocks`,
    as less.py computes it. window: q [Hq, NQ, D] (the last NQ positions), k, v [Hkv, T, D];
    pick: [N] indices into the NQ query positions.

    Errors per KV head as the runtime measures them (‖·‖ over the group's heads); the loss is
    the merged error relative to Quest's, averaged (so every budget weighs alike), plus a
    small term on the unselected blocks' log mass (whose gradient does not vanish when the
    estimate is far off). Returns the loss and the mean errors (merged, Quest's, |Δlse|)."""
    q_late, k, v = window
    hq, nq, d = q_late.shape
    hkv, t_len, _ = k.shape
    group = hq // hkv
    scale = 1.0 / math.sqrt(d)
    nb = t_len // block_size
    n = pick.numel()
    pos = t_len - nq + pick  # [N]
    qs = q_late[:, pick]  # [Hq, N, D]
    with torch.no_grad():
        unselected, _ = quest_unselected(qs, k, pos, budget_blocks, block_size)  # [Hkv, N, NB]
        kk, vv = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)  # [Hq, T, D]
        scores = (scale * qs @ kk.transpose(-1, -2)).masked_fill(torch.arange(t_len)[None] > pos[:, None], float("-inf"))
        out_dense = torch.softmax(scores, -1) @ vv  # [Hq, N, D]
        tok_unsel = torch.zeros(hq, n, t_len, dtype=torch.bool)
        tok_unsel[..., : nb * block_size] = unselected.repeat_interleave(group, 0).repeat_interleave(block_size, -1)
        sel_scores = scores.masked_fill(tok_unsel, float("-inf"))
        lse_sel = torch.logsumexp(sel_scores, -1)  # [Hq, N]
        out_sel = torch.softmax(sel_scores, -1) @ vv
        lse_true_u = torch.logsumexp(scores.masked_fill(~tok_unsel, float("-inf")), -1)

    # The compensation, as less.py computes it: centred keys, block summaries at the totals'
    # offset, unselected = Σ over U of the block summaries.
    center = k.mean(1, keepdim=True)  # less.py: the mean prompt key
    lk = fmap.logits(k[:, : nb * block_size] - center, "k")  # [Hkv, T', m]
    m = lk.shape[-1]
    c_tot = lk.amax(1, keepdim=True).detach()  # [Hkv, 1, m]
    wk = torch.exp(lk - c_tot).view(hkv, nb, block_size, m)
    s_b = wk.sum(2)  # [Hkv, NB, m]
    big_b = wk.transpose(-1, -2) @ v[:, : nb * block_size].view(hkv, nb, block_size, d)  # [Hkv, NB, m, D]
    lq = fmap.logits(qs, "q").view(hkv, group, n, m) + c_tot.unsqueeze(1)  # [Hkv, G, N, m]
    top = lq.amax(-1, keepdim=True).detach()
    wq = torch.exp(lq - top)
    uf = unselected.float()
    rest_small = uf @ s_b  # [Hkv, N, m]
    rest_big = (uf @ big_b.flatten(2)).view(hkv, n, m, d)  # [Hkv, N, m, D]
    mass = (wq * rest_small.unsqueeze(1)).sum(-1)  # [Hkv, G, N]
    num = torch.einsum("hgnm,hnmd->hgnd", wq, rest_big)
    safe = mass.clamp(min=1e-30)
    exact = scale * (qs * center.repeat_interleave(group, 0)).sum(-1)  # [Hq, N]: the centre's exact factor
    lse_u = (top.squeeze(-1) + torch.log(safe)).reshape(hq, n) + exact
    out_u = (num / safe.unsqueeze(-1)).reshape(hq, n, d)

    lse_m = torch.logaddexp(lse_sel, lse_u)
    merged = torch.exp(lse_sel - lse_m).unsqueeze(-1) * out_sel + torch.exp(lse_u - lse_m).unsqueeze(-1) * out_u

    def per_kv_head(x: Tensor) -> Tensor:  # [Hq, N, D] -> [Hkv, N]
        return x.view(hkv, group, n, d).transpose(1, 2).flatten(2).norm(dim=-1)

    norm = per_kv_head(out_dense).clamp(min=1e-12)
    err_merged = per_kv_head(merged - out_dense) / norm
    err_sel = per_kv_head(out_sel - out_dense) / norm
    d_lse = lse_u - lse_true_u
    loss = (err_merged / err_sel.clamp(min=1e-6)).mean() + 0.01 * F.smooth_l1_loss(d_lse, torch.zeros_like(d_lse))
    return loss, {"merged": err_merged.mean().item(), "selected": err_sel.mean().item(),
                  "lse_err": d_lse.abs().mean().item()}


def train(fmap: TrainedFeatureMap, data: list[Window], steps: int, layers: list[int], budgets: list[int],
          lr: float = 1e-2, block_size: int = 16, queries: int = 16, seed: int = 0, progress: bool = True,
          held_out: list[Window] | None = None, eval_every: int = 25) -> list[dict]:
    """Adam on the `layers` at once (layers are independent; each step draws a window and a
    budget per layer). With `held_out`, every eval_every steps the map is scored there and the
    best state is kept (early stopping). -> per-step mean stats over layers."""
    from tqdm import tqdm

    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam(fmap.parameters(), lr=lr)
    history: list[dict] = []
    best = (math.inf, None)
    bar = tqdm(range(steps), desc="train LESS feature map", disable=not progress)
    for step in bar:
        opt.zero_grad(set_to_none=True)
        stats = {"loss": 0.0, "merged": 0.0, "selected": 0.0, "lse_err": 0.0}
        for layer in layers:
            window = data[int(torch.randint(len(data), (1,), generator=g))][layer]
            budget = budgets[int(torch.randint(len(budgets), (1,), generator=g))]
            pick = torch.randint(window[0].shape[1], (queries,), generator=g)
            loss, info = layer_loss(fmap.layers[layer], window, block_size, budget, pick)
            loss.backward()
            stats["loss"] += loss.item() / len(layers)
            for key, value in info.items():
                stats[key] += value / len(layers)
        opt.step()
        if held_out is not None and ((step + 1) % eval_every == 0 or step + 1 == steps):
            stats["held_out"] = evaluate(fmap, held_out, layers, budgets, block_size)["ratio"]
            if stats["held_out"] < best[0]:
                best = (stats["held_out"], {k: t.detach().clone() for k, t in fmap.state_dict().items()})
        history.append(stats)
        bar.set_postfix(loss=f"{stats['loss']:.4f}", merged=f"{stats['merged']:.4f}", sel=f"{stats['selected']:.4f}",
                        dlse=f"{stats['lse_err']:.2f}", held=f"{stats.get('held_out', float('nan')):.4f}")
    if best[1] is not None:
        fmap.load_state_dict(best[1])
    return history


@torch.no_grad()
def evaluate(fmap: TrainedFeatureMap, data: list[Window], layers: list[int], budgets: list[int], block_size: int = 16,
             queries: int = 32) -> dict:
    """Mean errors on fixed, evenly spaced query positions. -> {"ratio": mean merged/Quest error
    ratio, "merged"/"selected": {budget: mean error}, "layer_ratio": {layer: mean ratio}, "lse_err"}."""
    out: dict = {"merged": {}, "selected": {}, "layer_ratio": {}, "lse_err": 0.0}
    ratios = []
    for budget in budgets:
        merged, selected = [], []
        for layer in layers:
            for window in data:
                pick = torch.linspace(0, window[layer][0].shape[1] - 1, queries).long()
                _, info = layer_loss(fmap.layers[layer], window[layer], block_size, budget, pick)
                if not fmap.enabled(layer):  # gated off: the runtime adds no compensation there
                    info["merged"] = info["selected"]
                merged.append(info["merged"])
                selected.append(info["selected"])
                out["lse_err"] += info["lse_err"] / (len(budgets) * len(layers) * len(data))
                out["layer_ratio"].setdefault(layer, []).append(info["merged"] / max(info["selected"], 1e-12))
        out["merged"][budget] = sum(merged) / len(merged)
        out["selected"][budget] = sum(selected) / len(selected)
        ratios.append(out["merged"][budget] / max(out["selected"][budget], 1e-12))
    out["layer_ratio"] = {layer: sum(r) / len(r) for layer, r in out["layer_ratio"].items()}
    out["ratio"] = sum(ratios) / len(ratios)
    return out


def gate_layers(fmap: TrainedFeatureMap, layer_ratio: dict[int, float], margin: float = 0.0) -> list[int]:
    """Keep a layer's compensation only where it lowered the held-out error (ratio < 1 − margin);
    layers not scored (dense layers) are off. -> the enabled layers."""
    kept = []
    for layer, lmap in enumerate(fmap.layers):
        on = layer in layer_ratio and layer_ratio[layer] < 1.0 - margin
        lmap.enabled.fill_(1.0 if on else 0.0)
        if on:
            kept.append(layer)
    return kept


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_training_args(p: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """A training CLI's arguments (it defines --windows and --held-out), with --threads added:
    the windows checked and torch's threads set."""
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = p.parse_args(argv)
    if args.held_out < 1 or args.windows <= args.held_out:
        raise ValueError(f"--windows {args.windows} must exceed --held-out {args.held_out} >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    return args


def main(argv: list[str] | None = None) -> Path:
    p = argparse.ArgumentParser(description="Train the LESS feature map (selector.feature_map=trained).")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--num-features", type=int, default=32, help="m (conf/selector/less.yaml's; a map is per m)")
    p.add_argument("--hidden", type=int, default=16)
    p.add_argument("--windows", type=int, default=6, help="text windows; the last --held-out are for validation")
    p.add_argument("--held-out", type=int, default=1, help="windows kept for early stopping and the layer gate")
    p.add_argument("--window-tokens", type=int, default=4096, help="as long as the default task's prompt")
    p.add_argument("--query-tokens", type=int, default=512, help="query positions kept per window (its last tokens)")
    p.add_argument("--skip-tokens", type=int, default=8192,
                   help="text tokens never used (the default task's prompt is the first 4096)")
    p.add_argument("--budgets", default="16,32,64,128", help="Quest top-K budgets in blocks (the fidelity study's)")
    p.add_argument("--dense-layers", default="0,1", help="layers without selection (conf/selector/less.yaml)")
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--queries", type=int, default=16, help="query positions per layer and step")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--temp", type=float, default=0.7, help="initial kernel temperature τ (learned)")
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--seed", type=int, default=0, help="the random-feature draw the map starts from (selector.seed)")
    args = parse_training_args(p, argv)
    from prr.model.loading import load_model

    t0 = time.perf_counter()
    loaded = load_model(args.model)
    mc = loaded.config
    budgets, dense = _ints(args.budgets), set(_ints(args.dense_layers))
    layers = [i for i in range(mc.num_layers) if i not in dense]
    windows = text_windows(loaded, args.windows, args.window_tokens, args.seed, args.skip_tokens)
    data = capture(loaded, windows, args.query_tokens)
    train_data, held_out = data[: -args.held_out], data[-args.held_out :]
    print(f"captured {len(data)} windows x {[w.numel() for w in windows]} tokens (held out: {args.held_out}), "
          f"{len(layers)} sparse layers in {time.perf_counter() - t0:.1f}s", flush=True)
    torch.manual_seed(args.seed)
    fmap = TrainedFeatureMap(mc.num_layers, mc.head_dim, args.num_features, args.hidden, args.seed, args.temp)
    t1 = time.perf_counter()
    train(fmap, train_data, args.steps, layers, budgets, args.lr, args.block_size, args.queries, args.seed,
          held_out=held_out)
    train_s = time.perf_counter() - t1
    after = evaluate(fmap, held_out, layers, budgets, args.block_size)
    kept = gate_layers(fmap, after["layer_ratio"])
    for budget in budgets:
        print(f"held-out, K={budget} blocks: Quest rel. err {after['selected'][budget]:.4f}, "
              f"with the trained compensation {after['merged'][budget]:.4f}", flush=True)
    print(f"compensation kept in {len(kept)}/{len(layers)} sparse layers (held-out error lowered): {kept}; "
          f"training {train_s:.0f}s, total {time.perf_counter() - t0:.0f}s")
    path = feature_map_file(args.model, args.num_features)
    fmap.save(path, {"model": args.model, "args": vars(args), "train_s": round(train_s, 1), "enabled_layers": kept,
                     "held_out": {"merged": after["merged"], "quest": after["selected"], "layer_ratio": after["layer_ratio"]}})
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    main()
