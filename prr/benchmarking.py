"""Timing and provenance helpers shared by the GPU benchmark scripts in experiments/.

Every script there imports these from here (none imports another script): CUDA-graph timers,
the device's copy and read bandwidths (the byte floors' denominators), the environment a
results file records, the random-weight Llama-3.1-8B-shape model the decode benchmarks use, and
their selector / predictor / budget objects built from conf/ (`configured`, as run.py builds them).
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import subprocess

import torch

from prr.model.decoder import Decoder
from prr.model.zoo import ZOO
from prr.runtime.graph_budget import graph_median_us

# "128K context" = 131072 - HEADROOM tokens in a cache of 131072, so the decode steps fit and the
# block count stays a power of two (one more block would double the top-k row the kernel holds).
HEADROOM = 256
BF16 = 2


def graph_time_us(make_call, sets: int, reps: int = 20) -> float:
    """Median µs per call: `sets` calls (make_call(i) -> zero-arg fn) captured in one graph."""
    return graph_median_us([make_call(i) for i in range(sets)], reps)


def time_graph_us(fn, repeats: int = 15) -> float:
    """Median µs of one replay of a CUDA graph of fn()."""
    return graph_median_us([fn], repeats)


def copy_bandwidth() -> dict[str, float]:
    """Bytes/s (read + written) of device-to-device copies of 1 and 2 GiB in several element
    types; the floor uses the best, so no kernel looks faster than memory allows."""
    out = {}
    for dtype in (torch.uint8, torch.bfloat16, torch.float32):
        for gib in (1, 2):
            src = torch.empty((gib << 30) // torch.tensor([], dtype=dtype).element_size(), dtype=dtype, device="cuda")
            dst = torch.empty_like(src)
            us = graph_time_us(lambda i, s=src, d=dst: (lambda: d.copy_(s)), sets=1, reps=10)
            out[f"{dtype}".replace("torch.", "") + f"_{gib}GiB"] = 2 * (gib << 30) / (us * 1e-6)
            del src, dst
    return out


def read_bandwidth() -> dict[str, float]:
    """Bytes/s read by a sum over 2 and 4 GiB of bf16 (read-only traffic, as weight and KV
    reads are); the floors use the best of this and the copy bandwidth."""
    out = {}
    for gib in (2, 4):
        x = torch.ones((gib << 30) // BF16, dtype=torch.bfloat16, device="cuda")
        us = time_graph_us(lambda x=x: x.sum(dtype=torch.float32), repeats=10)
        out[f"read_sum_bf16_{gib}GiB"] = (gib << 30) / (us * 1e-6)
        del x
    return out


def environment() -> dict:
    """GPU, driver, versions and date, as every results file records them."""
    import triton

    try:
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        driver = "unknown"
    return {"gpu": torch.cuda.get_device_name(), "driver": driver, "torch": torch.__version__,
            "triton": triton.__version__, "cuda": torch.version.cuda,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def announce_gpu() -> tuple[dict, dict[str, float], float]:
    """(environment(), the copy and read bandwidths {name: bytes/s}, their best: the byte floors'
    denominator), after printing them on one line (GPU | torch | triton | floor bandwidth)."""
    env = environment()
    bandwidths = copy_bandwidth() | read_bandwidth()
    bandwidth = max(bandwidths.values())
    print(f"{env['gpu']} | torch {env['torch']} | triton {env['triton']} | floor bandwidth "
          f"{bandwidth / 1e12:.2f} TB/s", flush=True)
    return env, bandwidths, bandwidth


def graph_bench_record(command: str, env: dict, bandwidths: dict[str, float], **fields) -> dict:
    """A CUDA-graph benchmark's results record before its first cell: command, environment, timer,
    `fields` (e.g. the shape), the best and every bandwidth in GB/s, and an empty rows list."""
    return {"command": command, "environment": env, "timer": "cuda_graph_replay", **fields,
            "bandwidth_GBps": max(bandwidths.values()) / 1e9,
            "bandwidths_GBps": {key: v / 1e9 for key, v in bandwidths.items()}, "rows": []}


def model_of(layers: int, dtype: torch.dtype = torch.bfloat16) -> Decoder:
    """The Llama-3.1-8B shape with `layers` layers and random weights (bf16 unless said) on the GPU."""
    config = dataclasses.replace(ZOO["llama-3.1-8b-shape"].config, num_layers=layers)
    return Decoder(config, dtype, "cuda").init_random_(seed=0)


def configured(group: str, name: str, **overrides):
    """The object conf/<group>/<name>.yaml describes, with `overrides` of its fields, built as
    run.py builds it (the config composed over conf/, `prr.config_check.compose_config`; hydra
    instantiate): the benchmarks' selectors, predictors and budgets, e.g.
    configured("selector", "quest", topk_blocks=128, dense_layers=[0, 1])."""
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    from prr.config_check import compose_config

    cfg = OmegaConf.merge(compose_config([f"{group}={name}"], check=False), {group: overrides})
    return instantiate(cfg[group])


# The kernel benchmarks' decode shape: Llama-3.1-8B's attention (32 query / 8 KV heads, head_dim 128), bf16.
HQ, HKV, D = 32, 8, 128
DTYPE = torch.bfloat16


_CUDA_GEN: torch.Generator | None = None


def randn(*shape: int, dtype: torch.dtype = DTYPE) -> torch.Tensor:
    """Seeded normal values made on the GPU (host generation of GBs would dominate the run)."""
    global _CUDA_GEN
    if _CUDA_GEN is None:
        _CUDA_GEN = torch.Generator(device="cuda").manual_seed(0)
    return torch.randn(*shape, generator=_CUDA_GEN, device="cuda", dtype=torch.float32).to(dtype)


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.float(), ref.float()
    if not torch.isfinite(x).all():
        return float("inf")
    return float((x - ref).norm() / ref.norm().clamp(min=1e-30))


def random_block_lists(batch: int, num_blocks: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """[B, Hkv, k] int32 distinct random block ids per row, ascending."""
    ids = torch.stack([torch.randperm(num_blocks, generator=gen)[:k].sort().values for _ in range(batch * HKV)])
    return ids.view(batch, HKV, k).to(torch.int32).cuda()


def decode_inputs(batch: int, context: int, block: int, budget: int, sets: int, gen: torch.Generator):
    """`sets` random (K/V cache, query, block list) sets of one decode shape, with the shared
    counts, lengths and scale."""
    num_blocks, k = context // block, budget // block
    caches = [(randn(batch, HKV, context, D), randn(batch, HKV, context, D)) for _ in range(sets)]
    qs = [randn(batch, HQ, D) for _ in range(sets)]
    ids = [random_block_lists(batch, num_blocks, k, gen) for _ in range(sets)]
    counts = torch.full((batch, HKV), k, dtype=torch.int32, device="cuda")
    lengths = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    return caches, qs, ids, counts, lengths, 1 / math.sqrt(D)


def decode_step_bytes(config, contexts: list[int], sparse: bool, world: int = 1, block: int = 16,
                      topk_tokens: int = 2048, dense_layers: int = 2) -> int:
    """Bytes one decode step must read on one of `world` tensor-parallel GPUs (bf16), rows of
    these contexts: the rank's share of the layer weights, the norms, one embedding row per row
    and lm_head (whole on every rank), and per row its KV heads' bytes — dense attention: every
    layer's whole KV; sparse: the dense layers' whole KV, the sparse layers' Quest metadata (key
    max and min per block) and top-K tokens of KV. The byte floor's numerator."""
    c = config
    h, d, i = c.hidden_size, c.head_dim, c.intermediate_size
    per_layer = (h * (c.num_heads + 2 * c.num_kv_heads) * d + c.num_heads * d * h + 3 * h * i) * BF16 // world
    weights = c.num_layers * (per_layer + 2 * h * BF16) + h * BF16 + len(contexts) * h * BF16 + c.vocab_size * h * BF16
    per_token = 2 * c.num_kv_heads // world * d * BF16  # K and V of one token, one layer
    kv = sum((n + 1) * per_token for n in contexts)  # this step's token included
    if not sparse:
        return weights + c.num_layers * kv
    meta = sum(c.num_kv_heads // world * (n // block + 1) * 2 * d * BF16 for n in contexts)
    selected = sum(min(topk_tokens, n + 1) * per_token for n in contexts)
    return weights + dense_layers * kv + (c.num_layers - dense_layers) * (meta + selected)
