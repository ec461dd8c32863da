"""InfLLM's published retrieval against its reference, and against prr's variant, on SmolLM2.

    python experiments/infllm_fidelity.py [--prompts locality,qa,niah_multikey] [--samples 2]
        [--tail 256] [--topk 32,64] [--layers all] [--out experiments/results/cpu/infllm_fidelity]

How: each prompt (`locality`: the default long_text prompt of the locality study, 4,139
tokens; `qa` / `niah_multikey`: prr's ruler_qa / ruler_niah_multikey samples at 4,096
context tokens, --samples each) is prefilled once, dense, with its post-RoPE q/k/v kept. For
each variant (selector=infllm, the published rule; selector=infllm_prr, prr's variant) and K,
that prefill is replayed into a fresh cache through the eager runtime (DSABackend, shadow
mode, every layer sparse): its selections at the last --tail prompt positions are made as
decode makes them (metadata grown token by token, the prefill's backlog by catch_up with the
prompt's queries). At each of those positions, layer and KV head:
- `same_as_reference`: the published rule's set equals the reference's
  (prr.kernels.reference_selection.infllm_reference_selections: an explicit loop written from
  InfLLM's repository, fp64, on the pre-RoPE q/k recovered from the kept ones);
- `overlap_vs_prr`: |A_published ∩ A_prr \\ F| / |A_published \\ F| (F: forced blocks);
- `mass_recall`: the dense attention mass (mean over the GQA group's heads) inside A, for
  each variant and for the exact top-K with the same forced blocks;
- `last_step_overlap`: |A_t ∩ A_{t-1}| / |A_t|.
Means are taken per prompt, then over prompts with a bootstrap over prompts (n = prompts);
`same_as_reference` is a proportion over every (prompt, position, layer, KV head), Wilson;
each selection that differs is listed in OUT.json with the reference's scores of the blocks
only one of them took (a near tie in fp32 against fp64, or not). Only the checked --layers
are replayed (layers are independent).

Writes OUT.csv (per prompt x K x layer), OUT_summary.csv (per K, with 95% intervals) and
OUT.json (command, host, versions, date, summary).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import shlex
import sys
import time
from pathlib import Path

import pandas as pd
import torch
from hydra.utils import instantiate
from prr.kernels.reference_selection import infllm_reference_selections, unrotate_rope

from prr.budget.fixed import FixedBudget
from prr.config_check import compose_config
from prr.evaluation import CapturingAttention
from prr.intervals import bootstrap_mean, wilson
from prr.model.prompt import encode_prompt
from prr.model.rope import rope_inv_freq
from prr.paths import write_json_atomic
from prr.predictors.none import NoPredictor
from prr.runtime.eager_run import EagerRuntime

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = {"published": "infllm", "prr": "infllm_prr"}
PROMPTS = {"locality": None, "qa": "ruler_qa", "niah_multikey": "ruler_niah_multikey"}


def build_prompts(names: list[str], samples: int, tokenizer, vocab_size: int) -> list[tuple[str, torch.Tensor]]:
    """-> (name, input_ids [1, T]) per prompt."""
    out = []
    for name in names:
        if PROMPTS[name] is None:
            task = instantiate(compose_config([], check=False).task)
            out.append((name, task.build(tokenizer, vocab_size, 1).input_ids))
            continue
        cfg = compose_config([f"task={PROMPTS[name]}", "task.context_tokens=4096", f"task.num_samples={samples}"],
                             check=False)
        task = instantiate(cfg.task)
        for i, sample in enumerate(task.samples(tokenizer)):
            out.append((f"{name}_{i}", encode_prompt(tokenizer, sample.prompt, use_chat_template=True)))
    return out


def replay(model, qkv, variant: str, topk: int, tail: int, block_size: int, layers: list[int]):
    """The kept prefill of `layers` through DSABackend under `variant` at top-K `topk` ->
    (selector, per layer the selections of the last `tail` positions: [tail] Selection)."""
    mc = model.config
    cfg = compose_config([f"selector={VARIANTS[variant]}", f"selector.topk_blocks={topk}", "selector.dense_layers=[]",
                          "runtime.device=cpu", f"runtime.block_size={block_size}"], check=False)
    selector = instantiate(cfg.selector)
    selector.bind_model(mc)
    total = qkv[0][1].shape[2]
    runtime = EagerRuntime(model.decoder, instantiate(cfg.runtime), selector, NoPredictor(), FixedBudget(), "torch",
                           total, torch.float32, batch=1, mode="shadow", repair_mode="exact", calibration_tokens=tail,
                           dense_metrics_every=1, check_serial=False)
    backend, max_blocks = runtime.backend, runtime.cache.max_blocks
    with torch.inference_mode():
        for layer in layers:  # (layers are independent: the others are not needed)
            backend.absorb_prefill(layer, *qkv[layer])
    return selector, {layer: [(s.blocks.mask(max_blocks), s.scores) for s in backend.history[layer]]
                      for layer in layers}


def block_mass(q: torch.Tensor, k: torch.Tensor, positions: range, block_size: int, group: int) -> torch.Tensor:
    """q: [1, Hq, T, D], k: [1, Hkv, T, D] post-RoPE -> dense attention mass per block at each
    position, mean over each GQA group: [len(positions), Hkv, NB]."""
    qs = q[0, :, positions.start:positions.stop].float()  # [Hq, P, D]
    keys = k[0].float().repeat_interleave(group, 0)  # [Hq, T, D]
    logits = qs @ keys.transpose(-1, -2) / q.shape[-1] ** 0.5  # [Hq, P, T]
    t = keys.shape[1]
    causal = torch.arange(t)[None, :] > torch.tensor(list(positions))[:, None]
    probs = torch.softmax(logits.masked_fill(causal, float("-inf")), -1)
    nb = -(-t // block_size)
    probs = torch.nn.functional.pad(probs, (0, nb * block_size - t)).view(*probs.shape[:2], nb, block_size).sum(-1)
    return probs.view(-1, group, len(positions), nb).mean(1).permute(1, 0, 2)  # [P, Hkv, NB]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", default=",".join(PROMPTS), help=f"comma-separated subset of {list(PROMPTS)}")
    parser.add_argument("--samples", type=int, default=2, help="samples of each generated task")
    parser.add_argument("--tail", type=int, default=256, help="prompt positions selected as decode would")
    parser.add_argument("--topk", default="32,64", help="top-K in blocks of 16")
    parser.add_argument("--layers", default="all", help="'all' or comma-separated layers checked against the reference")
    parser.add_argument("--out", type=Path, default=ROOT / "experiments/results/cpu/infllm_fidelity")
    args = parser.parse_args()
    names = [x for x in args.prompts.split(",") if x]
    if unknown := [x for x in names if x not in PROMPTS]:
        parser.error(f"--prompts: {unknown} not among {list(PROMPTS)}")
    topks = [int(x) for x in args.topk.split(",") if x]
    torch.set_num_threads(1)
    started = time.time()
    cfg = compose_config(["selector=infllm"], check=False)
    model = instantiate(cfg.model).load("float32", "cpu")
    mc, bs = model.config, 16
    group = mc.num_heads // mc.num_kv_heads
    layers = list(range(mc.num_layers)) if args.layers == "all" else [int(x) for x in args.layers.split(",")]
    inv_freq = rope_inv_freq(mc.head_dim, mc.rope_theta, mc.rope_scaling)
    rows, mismatches = [], []
    for name, ids in build_prompts(names, args.samples, model.tokenizer, mc.vocab_size):
        capture = CapturingAttention(1.0 / mc.head_dim ** 0.5)
        with torch.inference_mode():
            model.decoder(ids, 0, capture, last_logits_only=True)
        total = ids.shape[1]
        positions = range(total - args.tail, total)
        print(f"{name}: {total} tokens", flush=True)
        for topk in topks:
            runs = {v: replay(model, capture.qkv, v, topk, args.tail, bs, layers) for v in VARIANTS}
            selector = runs["published"][0]
            for layer in layers:
                q, k, _ = capture.qkv[layer]
                mass = block_mass(q, k, positions, bs, group)  # [P, Hkv, NB]
                want, want_scores = infllm_reference_selections(
                    unrotate_rope(q[0].transpose(0, 1), inv_freq), unrotate_rope(k[0].transpose(0, 1), inv_freq),
                    inv_freq, positions.start, bs, selector.sink_blocks, selector.local_blocks, selector.force_newest,
                    topk, selector.representatives, return_scores=True)
                stats = {"same": 0, "n": 0, "overlap": [], "last_pub": [], "last_prr": [], "mass_pub": [],
                         "mass_prr": [], "mass_exact": []}
                for i, p in enumerate(positions):
                    pub, prr = runs["published"][1][layer][i][0][0], runs["prr"][1][layer][i][0][0]  # [Hkv, NB]
                    nb = p // bs + 1
                    forced = torch.zeros(pub.shape[-1], dtype=torch.bool)
                    forced[: min(selector.sink_blocks, nb)] = True
                    forced[max(nb - selector.window_blocks, 0): nb] = True
                    for h in range(mc.num_kv_heads):
                        stats["n"] += 1
                        got = pub[h].nonzero().flatten().tolist()
                        stats["same"] += int(got == want[i])
                        if got != want[i]:  # how near a tie: the reference's scores of the blocks only one took
                            mine, ref = sorted(set(got) - set(want[i])), sorted(set(want[i]) - set(got))
                            scale = max(abs(x) for x in want_scores[i].values())
                            mismatches.append({
                                "prompt": name, "topk_blocks": topk, "layer": layer, "position": p, "kv_head": h,
                                "only_selector": mine, "only_reference": ref,
                                "reference_scores_only_selector": [want_scores[i][b] for b in mine],
                                "reference_scores_only_reference": [want_scores[i][b] for b in ref],
                                "relative_margin": (min(want_scores[i][b] for b in ref)
                                                    - max(want_scores[i][b] for b in mine)) / scale})
                        free = pub[h] & ~forced
                        stats["overlap"].append(float((free & prr[h]).sum() / free.sum().clamp(min=1)))
                        stats["mass_pub"].append(float(mass[i, h][pub[h]].sum()))
                        stats["mass_prr"].append(float(mass[i, h][prr[h]].sum()))
                        slots = min(topk, nb) - int(forced.sum())
                        exact = forced.clone()
                        exact[mass[i, h].masked_fill(forced, -1.0)[:nb].topk(max(slots, 0)).indices] = True
                        stats["mass_exact"].append(float(mass[i, h][exact].sum()))
                        if i:
                            for key, sets in (("last_pub", runs["published"][1]), ("last_prr", runs["prr"][1])):
                                now, before = sets[layer][i][0][0][h], sets[layer][i - 1][0][0][h]
                                stats[key].append(float((now & before).sum() / now.sum()))
                rows.append({"prompt": name, "tokens": total, "topk_blocks": topk, "layer": layer,
                             "selections": stats["n"], "same_as_reference": stats["same"],
                             **{key: sum(v) / len(v) for key, v in stats.items() if isinstance(v, list)}})
            print(f"  K={topk}: same as reference {sum(r['same_as_reference'] for r in rows if r['prompt'] == name and r['topk_blocks'] == topk)}"
                  f" / {sum(r['selections'] for r in rows if r['prompt'] == name and r['topk_blocks'] == topk)}"
                  f" ({time.time() - started:.0f} s)", flush=True)
    table = pd.DataFrame(rows)
    command = "python " + shlex.join(sys.argv)
    table["command"] = command  # each results file says how it was made
    args.out.parent.mkdir(parents=True, exist_ok=True)
    table.to_csv(args.out.with_suffix(".csv"), index=False)
    summary = []
    for topk, part in table.groupby("topk_blocks"):
        per_prompt = part.groupby("prompt").mean(numeric_only=True)
        row = {"topk_blocks": topk, **wilson(int(part["same_as_reference"].sum()),
                                             int(part["selections"].sum())).as_dict("same_as_reference")}
        for key in ("overlap", "mass_pub", "mass_prr", "mass_exact", "last_pub", "last_prr"):
            row.update(bootstrap_mean(per_prompt[key].tolist()).as_dict(key))
        summary.append(row)
    summary_table = pd.DataFrame(summary)
    summary_table["command"] = command
    summary_table.to_csv(args.out.with_name(args.out.name + "_summary.csv"), index=False)
    print(summary_table.to_string(index=False))
    write_json_atomic(args.out.with_suffix(".json"), {
        "command": "python " + shlex.join(sys.argv), "host": platform.node(), "machine": platform.processor() or
        platform.machine(), "python": platform.python_version(), "torch": torch.__version__,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), "model": model.name,
        "layers": layers, "tail": args.tail, "prompts": sorted(set(table["prompt"])), "wall_s": time.time() - started,
        "summary": json.loads(summary_table.to_json(orient="records")), "mismatches": mismatches})


if __name__ == "__main__":
    main()
