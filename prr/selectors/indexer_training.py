"""Distil a lightning indexer (prr.selectors.indexer_weights) for a zoo model against the model's
own attention, and its CLI (`make train-indexer MODEL=...`).

DeepSeek-V3.2's dense warm-up stage: the model frozen, dense attention; for every query t of a
sparse layer the target p_t is the layer's attention probabilities summed over the query heads
and L1-normalised (the mean over heads), and the indexer minimises Σ_t KL(p_t ‖ softmax(I_t)),
I_t its causal scores. Here the loss is the mean over the layers and the sampled query positions
(`--queries` per step, drawn from the window's later `1 − --min-query-frac`; the indexer's cost
per query is the same, so sampling spends the CPU on the rows that resemble long-context decode).

Text: as LESS's training (prr.selectors.less_training.text_windows): windows of
python_reference_text after its first --skip-tokens tokens (the default task's prompt is the
first 4096, never seen here); the last --held-out windows are not trained on and give the report:
attention-mass recall of the indexer's top-k tokens at --eval-k (the target mass on the k keys it
ranks highest, per query and layer), before and after training, beside random selection of the
same k (expected recall k / (t + 1)), the newest k tokens, and the oracle (top-k of the target).

Weights: indexer_weights_file(model, config) (cache_dir()/indexer/), with the config, the model
shape, the tensors' sha256 and this run's arguments and held-out numbers in the header.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from prr.intervals import bootstrap_mean
from prr.model.dense import _sdpa
from prr.model.layer_math import pre_attention, rms_norm
from prr.model.rope import apply_rope
from prr.selectors.indexer_weights import (
    IndexerConfig,
    IndexerWeights,
    indexer_weights_file,
    load_indexer,
    train_hint,
)
from prr.selectors.less_training import parse_training_args, quest_unselected, text_windows


class LayerCapture(NamedTuple):
    """One layer's prefill of one window."""

    x: Tensor  # [T, hidden] the normed hidden states (the indexer's input)
    target: Tensor  # [T, T] head_mean_attention
    q: Tensor  # [Hq, T, D] post-RoPE queries (Quest's baseline in evaluate)
    k: Tensor  # [Hkv, T, D] post-RoPE keys


Window = dict[int, LayerCapture]  # layer -> its capture


def head_mean_attention(q: Tensor, k: Tensor) -> Tensor:
    """The distillation target: q [Hq, T, D], k [Hkv, T, D] post-RoPE -> causal attention
    probabilities summed over the query heads and L1-normalised per query, [T, T] fp32."""
    hq, t_len, d = q.shape
    kk = k.float().repeat_interleave(hq // k.shape[0], 0)  # [Hq, T, D]
    logits = (q.float() @ kk.transpose(-1, -2)) / math.sqrt(d)  # [Hq, T, T]
    later = torch.ones(t_len, t_len, dtype=torch.bool, device=q.device).triu(1)
    probs = torch.softmax(logits.masked_fill(later, float("-inf")), -1).sum(0)  # [T, T]
    return probs / probs.sum(-1, keepdim=True)


@torch.no_grad()
def capture_targets(loaded, ids: Tensor, layers: list[int]) -> tuple[Window, Tensor]:
    """One prefill of ids [T] through the model's own layer math, densely attended, recording per
    layer in `layers` its normed hidden states and head_mean_attention.
    -> (window, the final normed hidden states [1, T, hidden], to check against the model's forward)."""
    decoder = loaded.decoder
    ids = ids[None].to(decoder.device)  # [1, T]
    t_len = ids.shape[1]
    x = decoder.model.embed_tokens(ids)  # [1, T, H]
    cos, sin = decoder.rope.get(0, t_len, x.device, x.dtype)
    normed: list[Tensor] = []
    window: Window = {}
    wanted = set(layers)

    def recording_pre(x, delta, ln1, wqkv, bqkv, eps, heads, d):
        x, qkv = pre_attention(x, delta, ln1, wqkv, bqkv, eps, heads, d)
        normed.append(rms_norm(x, ln1, eps))  # the attention input, as pre_attention computes it
        return x, qkv

    def attend(layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        # q [1, T, Hq, D], k, v [1, T, Hkv, D] before RoPE (Decoder.forward's prefill path)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if layer in wanted:
            window[layer] = LayerCapture(normed[-1][0].float().clone(), head_mean_attention(q[0], k[0]),
                                         q[0].float().clone(), k[0].float().clone())
        return _sdpa(q, k, v, causal=True).transpose(1, 2).reshape(1, t_len, -1)

    return window, decoder.layers(x, attend, pre=recording_pre)


def capture(loaded, windows: list[Tensor], layers: list[int]) -> list[Window]:
    return [capture_targets(loaded, ids, layers)[0] for ids in windows]


def kl_per_query(target: Tensor, scores: Tensor) -> Tensor:
    """KL(target ‖ softmax(scores)) per row: target, scores [.., Nq, T] (scores -inf on later keys,
    where the target is 0) -> [.., Nq]."""
    log_q = torch.log_softmax(scores, -1).masked_fill(torch.isinf(scores), 0.0)
    return (torch.xlogy(target, target) - target * log_q).sum(-1)


def query_positions(t_len: int, min_query_frac: float, count: int, generator: torch.Generator | None) -> Tensor:
    """`count` query positions in [min_query_frac·T, T): random without replacement (generator)
    or evenly spaced (generator None). -> [count] long."""
    first = int(min_query_frac * t_len)
    if not 0 <= first < t_len:
        raise ValueError(f"min_query_frac={min_query_frac} leaves no query position in a {t_len}-token window")
    count = min(count, t_len - first)
    if generator is None:
        return torch.linspace(first, t_len - 1, count).round().long().unique()
    return first + torch.randperm(t_len - first, generator=generator)[:count].sort().values


def train(indexer: IndexerWeights, data: list[Window], steps: int, queries: int = 32, lr: float = 1e-3,
          min_query_frac: float = 0.25, seed: int = 0, log_every: int = 10, progress: bool = True) -> list[float]:
    """Adam on every sparse layer's indexer at once (the layers are independent); each step one
    window and `queries` query positions. Prints step, loss and elapsed time every log_every steps
    (progress). -> the loss of every step (mean KL over layers and queries, nats)."""
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam(indexer.parameters(), lr=lr)
    history: list[float] = []
    start = time.perf_counter()
    for step in range(steps):
        window = data[int(torch.randint(len(data), (1,), generator=g))]
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for layer in indexer.sparse_layers:
            x, target = window[layer].x, window[layer].target
            pos = query_positions(x.shape[0], min_query_frac, queries, g)
            loss = kl_per_query(target[pos], indexer.scores(layer, x[None], pos)[0]).mean() / len(indexer.sparse_layers)
            loss.backward()
            total += loss.item()
        opt.step()
        history.append(total)
        if progress and ((step + 1) % log_every == 0 or step + 1 == steps):
            recent = history[-log_every:]
            print(f"step {step + 1}/{steps}  KL {sum(recent) / len(recent):.4f} (mean of the last {len(recent)})  "
                  f"elapsed {time.perf_counter() - start:.0f}s", flush=True)
    return history


@torch.no_grad()
def quest_recall(capture: LayerCapture, pos: Tensor, k: int, block_size: int) -> Tensor:
    """Quest's attention-mass recall at the same budget, as the runtime selects and measures it:
    K = k / block_size blocks per KV head (the sink block and the query's own, partial block forced,
    the rest by Quest's bound; quest_unselected) and the mass of the KV head's group-mean attention on
    them (prr.metrics' mass_recall). pos: [N] query positions -> [N] recall (mean over KV heads)."""
    device = pos.device
    pos = pos.cpu()  # quest_unselected builds its masks on the CPU
    q, keys = capture.q[:, pos].cpu(), capture.k.cpu()  # [Hq, N, D], [Hkv, T, D]
    hq, n, d = q.shape
    hkv, t_len, _ = keys.shape
    if k % block_size:
        raise ValueError(f"k = {k} is not a multiple of block_size {block_size}: Quest's budget is whole blocks")
    budget = k // block_size
    unselected, older = quest_unselected(q, keys, pos, budget, block_size)  # [Hkv, N, NB], [N, NB]
    tokens = torch.arange(t_len, device=q.device)
    chosen = (older[None] & ~unselected).repeat_interleave(block_size, -1)  # [Hkv, N, NB * bs]
    chosen = F.pad(chosen, (0, t_len - chosen.shape[-1]))  # [Hkv, N, T]
    own = (tokens[None] >= (pos // block_size * block_size)[:, None]) & (tokens[None] <= pos[:, None])  # [N, T]
    later = tokens[None] > pos[:, None]
    logits = (q @ keys.repeat_interleave(hq // hkv, 0).transpose(-1, -2)) / math.sqrt(d)  # [Hq, N, T]
    group_mass = torch.softmax(logits.masked_fill(later, float("-inf")), -1).view(hkv, hq // hkv, n, t_len).mean(1)
    return (group_mass * (chosen | own[None])).sum(-1).mean(0).to(device)


@torch.no_grad()
def evaluate(indexer: IndexerWeights, data: list[Window], ks: list[int], queries: int = 64,
             min_query_frac: float = 0.25, block_size: int = 16) -> dict:
    """Attention-mass recall at each k of `ks` (the target mass on the k keys ranked highest) on
    evenly spaced query positions t >= max(ks) and >= min_query_frac·T (with fewer earlier keys
    than k every selection is total), the same positions for every k. Per window one value, the
    mean over its layers and queries (intervals are over windows).
    -> {"recall": {k: {"indexer", "random" (k / (t + 1), the expected recall of k random keys),
    "newest" (the k newest keys), "quest" (quest_recall at k / block_size blocks), "oracle" (the
    target's own top-k): [per window]}}, "kl": [per window], "active": [per window: active_fraction's
    mean over layers], "layer": {k: {layer: indexer recall}},
    "queries": per window, "layers": count}."""
    names = ("indexer", "random", "newest", "quest", "oracle")
    out: dict = {"recall": {k: {name: [] for name in names} for k in ks}, "kl": [], "active": [],
                 "layer": {k: dict.fromkeys(indexer.sparse_layers, 0.0) for k in ks}, "layers": len(indexer.sparse_layers)}
    top = max(ks)
    for window in data:
        t_len = next(iter(window.values())).x.shape[0]
        pos = query_positions(t_len, min_query_frac, queries, None)
        pos = pos[pos >= max(top, (top // block_size) * block_size)]
        if pos.numel() == 0:
            raise ValueError(f"k = {top} leaves no query position in a {t_len}-token window; use longer windows")
        out["queries"] = int(pos.numel())
        device = next(iter(window.values())).x.device
        pos, keys = pos.to(device), torch.arange(t_len, device=device)
        sums = {k: dict.fromkeys(names, 0.0) for k in ks}
        kl = active = 0.0
        for layer in indexer.sparse_layers:
            capture = window[layer]
            active += active_fraction(indexer, layer, capture.x, pos) / out["layers"]
            rows = capture.target[pos]  # [Nq, T]
            scores = indexer.scores(layer, capture.x[None], pos)[0]  # [Nq, T]
            kl += kl_per_query(rows, scores).mean().item() / out["layers"]
            for k in ks:
                recall = rows.gather(-1, scores.topk(k, -1).indices).sum(-1).mean().item()
                newest = (keys[None] > pos[:, None] - k) & (keys[None] <= pos[:, None])  # [Nq, T]
                sums[k]["indexer"] += recall
                sums[k]["random"] += (k / (pos + 1).float()).mean().item()
                sums[k]["newest"] += (rows * newest).sum(-1).mean().item()
                sums[k]["quest"] += quest_recall(capture, pos, k, block_size).mean().item()
                sums[k]["oracle"] += rows.topk(k, -1).values.sum(-1).mean().item()
                out["layer"][k][layer] += recall / len(data)
        out["kl"].append(kl)
        out["active"].append(active)
        for k in ks:
            for name in names:
                out["recall"][k][name].append(sums[k][name] / out["layers"])
    return out


@torch.no_grad()
def active_fraction(indexer: IndexerWeights, layer: int, x: Tensor, pos: Tensor) -> float:
    """Share of (query at pos, earlier key, index head) with q_I·k_I > 0 in one layer: the pairs whose
    ReLU passes. 0 means every ReLU is dead, every score 0 and the top-k a tie (x [T, hidden])."""
    layer_ix, positions = indexer.layer(layer), torch.arange(x.shape[0], device=x.device)
    q = layer_ix.queries(x[pos], pos, indexer.inv_freq)  # [Nq, H_I, d_I]
    k = layer_ix.keys(x, positions, indexer.inv_freq)  # [T, d_I]
    earlier = (positions[None, :] <= pos[:, None]).unsqueeze(1)  # [Nq, 1, T]
    return float(((q @ k.T > 0) & earlier).sum() / (earlier.sum() * q.shape[1]))


DEAD_BELOW = 0.01  # active_fraction under which the report warns that the indexer's ReLUs died


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def describe(name: str, values: list[float]) -> str:
    return f"{name} {bootstrap_mean(values)}" if len(values) > 1 else f"{name} {values[0]:.4f}"


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def main(argv: list[str] | None = None) -> Path:
    p = argparse.ArgumentParser(description="Distil a lightning indexer for a zoo model against its own attention "
                                            "(DeepSeek-V3.2's dense warm-up).")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--index-heads", type=int, default=IndexerConfig.index_heads)
    p.add_argument("--index-dim", type=int, default=IndexerConfig.index_dim)
    p.add_argument("--rope-dim", type=int, default=IndexerConfig.rope_dim)
    p.add_argument("--dense-layers", default="0,1", help="layers without an indexer (conf/selector/*.yaml)")
    p.add_argument("--windows", type=int, default=10, help="text windows; the last --held-out are for the report")
    p.add_argument("--held-out", type=int, default=3)
    p.add_argument("--window-tokens", type=int, default=512)
    p.add_argument("--skip-tokens", type=int, default=8192,
                   help="text tokens never used (the default task's prompt is the first 4096)")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--queries", type=int, default=16, help="query positions per layer and step")
    p.add_argument("--min-query-frac", type=float, default=0.25, help="queries come from the window's later part")
    p.add_argument("--lr", type=float, default=3e-3, help="(DeepSeek-V3.2's warm-up: 1e-3 over 1000 steps)")
    p.add_argument("--eval-k", default="32,64", help="tokens selected for the held-out recall (comma-separated)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--block-size", type=int, default=16, help="Quest's block size for its recall baseline")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--evaluate-only", action="store_true",
                   help="no training: the stored indexer of this model and config on the held-out windows")
    p.add_argument("--resume", action="store_true",
                   help="train the stored indexer of this model and config further (its earlier runs stay in the "
                        "file's header, `earlier`; the query draws continue after its steps)")
    args = parse_training_args(p, argv)
    if args.resume and args.evaluate_only:
        p.error("--resume trains and --evaluate-only does not: give one")
    from prr.model.loading import load_model

    t0 = time.perf_counter()
    config = IndexerConfig(args.index_heads, args.index_dim, args.rope_dim, _ints(args.dense_layers))
    loaded = load_model(args.model, device=args.device)
    path = indexer_weights_file(args.model, config)
    if args.evaluate_only or args.resume:
        indexer = load_indexer(args.model, loaded.config, config).to(args.device).requires_grad_(args.resume)
    else:
        indexer = IndexerWeights.for_model(loaded.config, config, seed=args.seed, device=args.device)
    windows = text_windows(loaded, args.windows, args.window_tokens, args.seed, args.skip_tokens)
    data = capture(loaded, windows[-args.held_out:] if args.evaluate_only else windows, indexer.sparse_layers)
    print(f"captured {len(data)} windows of {args.window_tokens} tokens, {len(indexer.sparse_layers)} sparse layers, "
          f"indexer {config} ({sum(p.numel() for p in indexer.parameters()) / 1e6:.1f}M parameters) in "
          f"{time.perf_counter() - t0:.0f}s", flush=True)
    ks = list(_ints(args.eval_k))
    if args.evaluate_only:
        report(None, evaluate(indexer, data, ks, block_size=args.block_size), ks, args)
        return path
    train_data, held_out = data[: -args.held_out], data[-args.held_out :]
    before = evaluate(indexer, held_out, ks, block_size=args.block_size)
    t1 = time.perf_counter()
    earlier = indexer.meta if args.resume else None
    steps_before = earlier.get("steps_total", earlier["args"]["steps"]) if earlier else 0
    history = train(indexer, train_data, args.steps, args.queries, args.lr, args.min_query_frac,
                    args.seed + steps_before)
    train_s = time.perf_counter() - t1
    after = evaluate(indexer, held_out, ks, block_size=args.block_size)
    report(before, after, ks, args)
    print(f"training {train_s:.0f}s, total {time.perf_counter() - t0:.0f}s", flush=True)
    digest = indexer.save(path, {
        "model": args.model, "args": vars(args), "train_s": round(train_s, 1), "final_kl": mean(history[-10:]),
        "steps_total": steps_before + args.steps, **({"earlier": earlier} if earlier else {}),
        "held_out": {"windows": args.held_out, "layers": after["layers"], "queries": after["queries"],
                     "kl_before": mean(before["kl"]), "kl_after": mean(after["kl"]), "active": mean(after["active"]),
                     "recall": {k: {"before": mean(before["recall"][k]["indexer"]),
                                    **{name: mean(v) for name, v in after["recall"][k].items()}} for k in ks}}})
    print(f"wrote {path} (sha256 {digest}); load it with prr.selectors.indexer_weights.load_indexer"
          f"({args.model!r}, model_config, {config}); retrain: {train_hint(args.model, config)}")
    return path


def report(before: dict | None, after: dict, ks: list[int], args: argparse.Namespace) -> None:
    """Print the held-out recall table (before: None when only the stored indexer was evaluated)."""
    print(f"held-out attention-mass recall ({len(after['kl'])} held-out windows of {args.window_tokens} tokens x "
          f"{after['layers']} layers x {after['queries']} queries; 95% bootstrap over windows; Quest at k / "
          f"{args.block_size} blocks of {args.block_size}):")
    for k in ks:
        parts = [] if before is None else [describe("indexer before training", before["recall"][k]["indexer"])]
        parts.append(describe("indexer" if before is None else "after", after["recall"][k]["indexer"]))
        parts += [describe(name, after["recall"][k][name]) for name in ("random", "newest", "quest", "oracle")]
        print(f"  top-{k} tokens: " + "; ".join(parts))
    kl_before = "" if before is None else f"{mean(before['kl']):.4f} -> "
    print(f"  held-out KL {kl_before}{mean(after['kl']):.4f} nats; index pairs with q·k > 0 (ReLU passing): "
          f"{100 * mean(after['active']):.1f}%", flush=True)
    if mean(after["active"]) < DEAD_BELOW:
        print(f"  WARNING: the indexer's ReLUs are dead ({100 * mean(after['active']):.2f}% of pairs pass): every "
              f"score is 0 and its top-k a tie; retrain with a lower --lr (now {args.lr}; Qwen2.5-Coder-0.5B at 3e-3 "
              f"died within 10 steps, 1e-3 trained)", flush=True)


if __name__ == "__main__":
    main()
