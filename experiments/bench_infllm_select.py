"""InfLLM's selection per layer through its Triton path (issue 33 item 1), beside Quest's, in the
same run: experiments/bench_decode.py's part `select` adds these columns to each of its rows;
run alone it writes its own results file (the same columns).

    python experiments/bench_infllm_select.py --out experiments/results/h200/bench_infllm_select
    python experiments/bench_infllm_select.py --tiny   # CPU smoke run under TRITON_INTERPRET=1 (no speed)

Per layer, batch 1, the 8B shape (32 query / 8 KV heads, D 128, bf16 cache), over `layers` caches
of `context` random tokens, CUDA-graph replays (median), each selector as conf/selector/*.yaml
builds it (1 sink + 4 local + the newest block forced, r = 4, Σ over the layer's heads):
- infllm_select, infllm_prr_select: the decode token's metadata update (`append_metadata`: the
  live-mean kernel) + `select` (the step kernel: window work + finalising; the score kernel;
  top-k), as GraphDecoder.attention calls them. Every replay does the worst step's work: the
  query is fresh (its window softmax added) and a block is finalised; the two resets that make it
  so (`scored` and `finalised` back, two small launches) are timed alone (*_reset) and subtracted;
- their parts: *_live (the live mean), *_step (the step kernel), *_scores (the score kernel) and
  the score kernel's tilings (blocks per program x warps; the best beside the default);
- quest_select_beside_infllm: Quest's score + top-k on the same caches, the ratios' baseline;
- floors: bytes / the run's bandwidth. InfLLM reads its representatives (NB·Hkv·G·D fp32, infllm;
  NB·Hkv·D, infllm_prr: one per block shared by the group), the forced blocks' keys, the window
  slots and the scores; Quest its key max and min (2·NB·Hkv·D bf16);
- checks on layer 0's twin caches against each selector's torch path over 20 decode steps
  (a block boundary crossed): the fraction of (step, KV head) sets equal, the largest relative
  score error, and whether every differing set sits at a near-tie (relative gap < 1e-5).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

from prr.paths import strict_json_dumps

ROOT = Path(__file__).resolve().parents[1]

VARIANTS = {"infllm": {}, "infllm_prr": {"scoring": "rope", "representatives_from": "one_query"}}
SCORE_TILINGS = [(4, 4), (8, 4), (16, 4), (8, 8), (32, 8)]  # (blocks per program, warps)
CHECK_STEPS = 20


def infllm_selector(name: str, k_blocks: int, head_dim: int):
    from prr.selectors import InfLLMSelector

    sel = InfLLMSelector(k_blocks, sink_blocks=1, local_blocks=4, force_newest=True, gqa_reduce="sum",
                         representatives=4, per_head=False, **VARIANTS[name])
    # Llama-3.1's RoPE base; the timings do not depend on the frequencies' values.
    sel.bind_model(SimpleNamespace(head_dim=head_dim, rope_theta=500000.0, rope_scaling=None))
    return sel


def build_metadata(sel, cache, layer: int, context: int, q) -> None:
    """The prefill's metadata as GraphDecoder.start_at builds it (q stands for every prompt query)."""
    sel.update_metadata(cache, layer, 0, context)
    every = q.unsqueeze(3).expand(*q.shape[:3], context, q.shape[-1])
    sel.catch_up(q, cache, layer, context, queries=every)


def twin_of_layer(cache, layer: int):
    """A one-layer copy of `layer` (keys, values, metadata) for the torch-path checks."""
    from prr.cache import PagedKVCache

    twin = PagedKVCache(1, cache.batch, cache.num_kv_heads, cache.head_dim, cache.block_size, cache.max_tokens,
                        cache.dtype, cache.device)
    twin.keys[0].copy_(cache.keys[layer])
    twin.values[0].copy_(cache.values[layer])
    twin.set_length(0, cache.length(layer))
    for name, t in cache.metadata[layer].items():
        twin.state_slot(0, name, tuple(t.shape), t.dtype).copy_(t)
    return twin


def check_against_torch(name: str, fast, k_blocks: int, cache, context: int, group: int, seed: int = 1) -> dict:
    """CHECK_STEPS decode steps on twin copies of layer 0: the Triton path against the torch path."""
    ref = infllm_selector(name, k_blocks, cache.head_dim)
    mine, theirs = twin_of_layer(cache, 0), twin_of_layer(cache, 0)
    b, h, d = cache.batch, cache.num_kv_heads, cache.head_dim
    gen = torch.Generator(device=cache.device).manual_seed(seed)
    equal = total = 0
    worst_err, ties_only = 0.0, True
    for step in range(CHECK_STEPS):
        pos = context + step
        k = torch.randn(b, h, 1, d, generator=gen, device=cache.device).to(cache.dtype)
        v = torch.randn(b, h, 1, d, generator=gen, device=cache.device).to(cache.dtype)
        q = torch.randn(b, h, group, d, generator=gen, device=cache.device).to(cache.dtype)
        positions = torch.full((b,), pos, dtype=torch.int32, device=cache.device)
        for sel, c in ((fast, mine), (ref, theirs)):
            c.keys[0][:, :, pos : pos + 1] = k
            c.values[0][:, :, pos : pos + 1] = v
            c.set_length(0, pos + 1)
            sel.append_metadata(c, 0, positions)
        lengths = positions + 1
        got = fast.select(q, mine, 0, lengths, num_blocks=(positions + cache.block_size) // cache.block_size)
        want = ref.select(q, theirs, 0, lengths)
        same = (got.blocks.indices == want.blocks.indices).all(-1)
        equal += int(same.sum())
        total += same.numel()
        finite = torch.isfinite(want.scores)
        err = ((got.scores[finite].double() - want.scores[finite].double()).norm()
               / want.scores[finite].double().norm()).item()
        worst_err = max(worst_err, err)
        if not same.all():
            forced = ref.forced_mask((lengths + cache.block_size - 1) // cache.block_size, cache.max_blocks, cache.device)
            top = want.scores.masked_fill(forced, float("inf")).double().sort(-1, descending=True).values
            kth, nxt = top[..., k_blocks - 1], top[..., k_blocks]
            gap = ((kth - nxt) / kth.abs()).nan_to_num(posinf=float("inf"))
            ties_only &= bool((gap[~same] < 1e-5).all())
    return {f"{name}_sets_equal": equal / total, f"{name}_scores_rel_err": worst_err,
            f"{name}_differences_are_ties": ties_only}


def infllm_select_columns(batch: int, context: int, cache_tokens: int, block: int, k_blocks: int, layers: int,
                          bandwidth: float, device: torch.device, heads: tuple[int, int] = (32, 8),
                          head_dim: int = 128, dtype: torch.dtype = torch.bfloat16, tilings: bool = True) -> dict:
    """InfLLM's selection columns of one (context, block, top-K) cell; see the module docstring."""
    from prr.kernels.infllm import default_tiling, infllm_scores, infllm_step

    from prr.cache import PagedKVCache
    from prr.runtime.graph_budget import stage_timing
    from prr.selectors import QuestSelector

    hq, hkv = heads
    group = hq // hkv
    gen = torch.Generator(device=device).manual_seed(0)
    cache = PagedKVCache(layers, batch, hkv, head_dim, block, cache_tokens, dtype, device)
    for i in range(layers):
        cache.append(i, torch.randn(batch, hkv, context, head_dim, generator=gen, device=device).to(dtype),
                     torch.randn(batch, hkv, context, head_dim, generator=gen, device=device).to(dtype))
    qs = [torch.randn(batch, hkv, group, head_dim, generator=gen, device=device).to(dtype) for _ in range(layers)]
    # This step's token is the context's last (position context - 1): its selection as the engine makes it.
    pos = torch.full((batch,), context - 1, dtype=torch.int32, device=device)
    lengths = pos + 1
    nb = (pos + block) // block
    quest = QuestSelector(k_blocks, sink_blocks=1, local_blocks=4)
    quest.set_backend("triton")
    for i in range(layers):
        quest.update_metadata(cache, i, 0, context)
    col = {"infllm_layers_timed": layers}

    def every_layer(step):
        return lambda: [step(i) for i in range(layers)]

    def timed(fn) -> float:
        fn()  # compile / warm up outside any capture
        return stage_timing(fn, device, per_call=layers).median_s * 1e6  # µs per layer

    col["quest_select_beside_infllm"] = timed(every_layer(lambda i: quest.select(qs[i], cache, i, lengths,
                                                                                   num_blocks=nb)))
    sels = {}
    for name in VARIANTS:
        sel = infllm_selector(name, k_blocks, head_dim)
        if sel.set_backend("triton") != "triton":
            raise RuntimeError(f"{name} has no Triton path here: {sel.triton_problems()}")
        for i in range(layers):
            cache.reset_metadata(i)  # (the other variant's slots: InfLLM's share names; Quest was timed first)
            build_metadata(sel, cache, i, context - 1, qs[i])  # the prompt: every token before this step's
            sel._arrivals(cache, i)
        sels[name] = sel
        # The checks first, on copies of layer 0 (the timed replays below move its state).
        col.update(check_against_torch(name, sel, k_blocks, cache, context - 1, group))
        window = sel.representatives_from == "window_attention"
        slots = [(sel._scored(cache, i) if window else None, sel._finalised(cache, i)) for i in range(layers)]
        # Every replay a fresh query and a block to finalise: scored back to 0, finalised one back.
        first = [(f.clone() - 1).clamp(min=0) for _, f in slots]

        def reset(i, slots=slots, first=first):
            scored, finalised = slots[i]
            if scored is not None:
                scored.zero_()
            finalised.copy_(first[i])

        def layer_select(i, sel=sel, reset=reset):
            reset(i)
            sel.append_metadata(cache, i, pos)
            sel.select(qs[i], cache, i, lengths, num_blocks=nb)

        def step_only(i, sel=sel, reset=reset, window=window):
            reset(i)
            g = group
            infllm_step(qs[i].view(batch, hq, head_dim), cache.keys[i], lengths, sel._repr(cache, i, g),
                        sel._finalised(cache, i), sel._arrivals(cache, i), block, sel.sink_blocks, sel.window_blocks,
                        sel.representatives, window=sel._window(cache, i, g) if window else None,
                        scored=sel._scored(cache, i) if window else None,
                        inv_freq=sel._freqs(cache) if sel.scoring == "position_agnostic" else None,
                        layer_sum=not window and not sel.per_head)

        def scores_only(i, sel=sel, block_n=None, num_warps=None, window=window):
            infllm_scores(qs[i].view(batch, hq, head_dim), lengths, nb, sel._finalised(cache, i),
                          sel._repr(cache, i, group), sel._live(cache, i),
                          inv_freq=sel._freqs(cache) if sel.scoring == "position_agnostic" else None,
                          fixed_position=sel.window_blocks * block - 1, layer_sum=not sel.per_head,
                          gqa_reduce=sel.gqa_reduce, shared_repr=not window, block_n=block_n, num_warps=num_warps)

        col[f"{name}_reset"] = timed(every_layer(reset))
        col[f"{name}_select_with_reset"] = timed(every_layer(layer_select))
        col[f"{name}_select"] = col[f"{name}_select_with_reset"] - col[f"{name}_reset"]
        col[f"{name}_live"] = timed(every_layer(lambda i, sel=sel: sel.append_metadata(cache, i, pos)))
        col[f"{name}_step"] = timed(every_layer(step_only)) - col[f"{name}_reset"]
        col[f"{name}_scores"] = timed(every_layer(scores_only))
        col[f"{name}_scores_tiling"] = "x".join(map(str, default_tiling(group, head_dim, not window, not sel.per_head)))
        if tilings:
            found = {}
            for block_n, warps in SCORE_TILINGS:
                found[f"{block_n}x{warps}"] = timed(every_layer(
                    lambda i, f=scores_only, bn=block_n, w=warps: f(i, block_n=bn, num_warps=w)))
            col[f"{name}_scores_tilings"] = found
            col[f"{name}_scores_best_tiling"] = min(found, key=found.get)
            col[f"{name}_scores_best"] = found[col[f"{name}_scores_best_tiling"]]
        col[f"{name}_over_quest"] = col[f"{name}_select"] / col["quest_select_beside_infllm"]
        col[f"{name}_above_quest_us"] = col[f"{name}_select"] - col["quest_select_beside_infllm"]
    # Byte floors (µs at the run's bandwidth).
    nb_ctx = -(-context // block)
    elt = torch.empty((), dtype=dtype).element_size()
    forced_keys = batch * hkv * (1 + 4 + 1 + 1) * block * head_dim * elt  # sinks + window + the finalised block
    window_slots = 2 * batch * hkv * 5 * group * block * 4  # read + written
    scores = batch * hkv * nb_ctx * 4 * 2  # written, read by the top-k
    floors = {"quest_select_beside_infllm": 2 * batch * hkv * nb_ctx * head_dim * elt + scores,
              "infllm_select": batch * hkv * nb_ctx * group * head_dim * 4 + forced_keys + window_slots + scores,
              "infllm_prr_select": batch * hkv * nb_ctx * head_dim * 4 + forced_keys + scores}
    for name, nbytes in floors.items():
        col[f"{name}_floor_us"] = nbytes / bandwidth * 1e6
    col["infllm_repr_mib_per_layer"] = batch * hkv * cache.max_blocks * group * head_dim * 4 / 2**20
    return col


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", default="32768:16:32",
                        help="comma-separated cache_tokens:block:topk_blocks (context = cache_tokens - HEADROOM)")
    parser.add_argument("--layers", type=int, default=4, help="caches the timing walks through")
    parser.add_argument("--no-tilings", action="store_true", help="skip the score kernel's tiling sweep")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke sizes under TRITON_INTERPRET=1 (no speed)")
    parser.add_argument("--out", type=Path, default=ROOT / "experiments/results/h200/bench_infllm_select")
    args = parser.parse_args()
    from prr.benchmarking import HEADROOM, environment, read_bandwidth

    on_gpu = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")
    if not on_gpu and not args.tiny:
        parser.error("without a CUDA device (or under TRITON_INTERPRET=1) only --tiny runs: a smoke run")
    if on_gpu:
        env, bandwidth = environment(), max(read_bandwidth().values())
    else:
        import triton

        env = {"gpu": "none (CPU, TRITON_INTERPRET=1)", "torch": torch.__version__, "triton": triton.__version__}
        bandwidth = float("nan")
    device = torch.device("cuda" if on_gpu else "cpu")
    cells = [(200, 256, 16, 8)] if args.tiny else \
        [(c - HEADROOM, c, bs, k) for c, bs, k in (tuple(int(x) for x in cell.split(":")) for cell in args.cells.split(","))]
    rows = []
    for context, cache_tokens, block, k in cells:
        kw = dict(heads=(8, 2), head_dim=64, tilings=False) if args.tiny else {}
        row = dict(context=context, block=block, topk_blocks=k)
        row.update(infllm_select_columns(1, context, cache_tokens, block, k, 2 if args.tiny else args.layers,
                                         bandwidth, device, **kw))
        rows.append(row)
        print(f"select ctx={context} bs={block} K={k}: quest {row['quest_select_beside_infllm']:.1f}, infllm "
              f"{row['infllm_select']:.1f} ({row['infllm_over_quest']:.2f}x; live {row['infllm_live']:.1f} step "
              f"{row['infllm_step']:.1f} scores {row['infllm_scores']:.1f}), infllm_prr {row['infllm_prr_select']:.1f} "
              f"({row['infllm_prr_over_quest']:.2f}x) µs/layer; sets equal {row['infllm_sets_equal']:.3f} / "
              f"{row['infllm_prr_sets_equal']:.3f}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    out = {"command": "python " + " ".join(sys.argv), "environment": env, "bandwidth": bandwidth, "rows": rows}
    args.out.with_suffix(".json").write_text(strict_json_dumps(out, indent=1, default=str))
    print(json.dumps(rows, indent=1, default=str))


if __name__ == "__main__":
    main()
