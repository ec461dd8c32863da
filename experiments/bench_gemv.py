"""The decode projections of the Llama-3.1-8B shape on one GPU: cuBLAS (F.linear) against the
fused Triton projections (prr.kernels.dense_gemv: the GEMV at batch 1, tensor-core row tiles
above) over a grid of tile sizes, at batch 1 and 8, each
as a ratio to its byte floor (weight + input + output bytes / the read bandwidth measured in the
same run). Every Triton config is checked against the torch layer math before it is timed.
Weights rotate through enough copies that no call finds its weight in L2 (as in a real step,
where 32 layers' weights stream by). The cuBLAS rows time F.linear alone: the norm, SiLU and
residual kernels the torch path adds around it are not counted (in cuBLAS's favour).

    python experiments/bench_gemv.py            # -> experiments/results/h200/bench_gemv.{json,csv}
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from prr.kernels.dense_gemv import ROW_TILES, default_tiles, dense_gemv

from prr.benchmarking import environment, graph_time_us, read_bandwidth
from prr.model.layer_math import rms_norm
from prr.model.zoo import ZOO
from prr.paths import strict_json_dumps

ROOT = Path(__file__).resolve().parents[1]

COLD_BYTES = 512 << 20  # weights streamed per timed graph: several times the L2


def shapes(arch: str) -> list[dict]:
    c = ZOO[arch].config
    qkv = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
    return [dict(name="qkv", n=qkv, k=c.hidden_size, form="norm"),
            dict(name="o_proj", n=c.hidden_size, k=c.num_heads * c.head_dim, form="residual"),
            dict(name="gate_up", n=2 * c.intermediate_size, k=c.hidden_size, form="swiglu"),
            dict(name="down", n=c.hidden_size, k=c.intermediate_size, form="residual"),
            dict(name="lm_head", n=c.vocab_size, k=c.hidden_size, form="norm")]


def tile_grid(batch: int) -> list[tuple[int, int, int]]:
    """(BLOCK_N, BLOCK_K, num_warps) to try: the GEMV's at batch 1, tensor-core tiles above."""
    if batch > 1:
        return [(bn, bk, warps) for bn in (16, 32, 64) for bk in (64, 128, 256) for warps in (4, 8)]
    out = []
    for bn in (1, 2, 4, 8, 16):
        for bk in (256, 512, 1024, 2048):
            for warps in (2, 4, 8):
                per_thread = bn * bk // (32 * warps)
                if 8 <= per_thread <= 64:  # 16-byte loads for every thread; accumulators fit in registers
                    out.append((bn, bk, warps))
    return out


def torch_form(form: str, x, w, ln, res):
    """What the torch path computes (F.linear plus its pointwise kernels)."""
    if form == "norm":
        return F.linear(rms_norm(x, ln, 1e-5), w)
    if form == "swiglu":
        gate, up = F.linear(rms_norm(x, ln, 1e-5), w).chunk(2, dim=-1)
        return F.silu(gate) * up
    return res + F.linear(x, w)


def fused_call(form: str, x, w, ln, res, tiles):
    if form == "residual":
        return dense_gemv(x, w, residual=res, tiles=tiles)
    return dense_gemv(x, w, norm_weight=ln, eps=1e-5, swiglu=form == "swiglu", tiles=tiles)


def bench_shape(shape: dict, batch: int, bandwidth: float, grid: list, gen: torch.Generator) -> list[dict]:
    n, k, form = shape["n"], shape["k"], shape["form"]
    out_n = n // 2 if form == "swiglu" else n
    weight_bytes = n * k * 2
    sets = max(1, min(16, math.ceil(COLD_BYTES / weight_bytes)))
    ws = [(torch.randn(n, k, device="cuda", generator=gen) * k ** -0.5).to(torch.bfloat16) for _ in range(sets)]
    x = torch.randn(batch, k, device="cuda", generator=gen).to(torch.bfloat16)
    ln = (1 + 0.1 * torch.randn(k, device="cuda", generator=gen)).to(torch.bfloat16)
    res = torch.randn(batch, out_n, device="cuda", generator=gen).to(torch.bfloat16)
    # bytes a call must move: its weight, x, and y (read and written back for a residual)
    floor_bytes = weight_bytes + batch * k * 2 + batch * out_n * 2 * (2 if form == "residual" else 1)
    floor_us = floor_bytes / bandwidth * 1e6
    base = dict(shape=shape["name"], n=n, k=k, form=form, batch=batch, weight_copies=sets, floor_us=floor_us)
    rows = []
    cublas = graph_time_us(lambda i: (lambda: F.linear(x, ws[i])), sets)
    rows.append(base | dict(kernel="cublas_linear", tiles=None, us=cublas, over_floor=cublas / floor_us, rel_err=0.0))
    want = torch_form(form, x.double(), ws[0].double(), ln.double(), res.double())
    default = default_tiles(out_n, k, form == "swiglu") if batch == 1 else ROW_TILES
    for tiles in grid + ([default] if default not in grid else []):
        got = fused_call(form, x, ws[0], ln, res.clone(), tiles)
        err = float((got.double() - want).abs().max() / want.abs().max())
        if err > 2e-2:
            raise AssertionError(f"{shape['name']} batch {batch} tiles {tiles}: relative error {err:.3g}")
        r = res.clone()
        us = graph_time_us(lambda i, t=tiles, r=r: (lambda: fused_call(form, x, ws[i], ln, r, t)), sets)
        rows.append(base | dict(kernel="triton_fused", tiles=list(tiles), default=tiles == default, us=us,
                                over_floor=us / floor_us, vs_cublas=us / cublas, rel_err=err))
    ws.clear()  # free the copies before the next shape
    torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="llama-3.1-8b-shape")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--quick", action="store_true", help="default tiles only")
    parser.add_argument("--out", type=Path, default=ROOT / "experiments/results/h200/bench_gemv")
    args = parser.parse_args()
    if args.arch not in ZOO:
        parser.error(f"--arch={args.arch!r} is not one of {sorted(ZOO)}")
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device (run it on the GPU machine)")
    bw = read_bandwidth()
    bandwidth = max(bw.values())
    env = environment()
    results = {"command": "python " + " ".join(sys.argv), "environment": env, "read_bandwidth": bw, "rows": []}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    print(f"{env['gpu']}: read bandwidth {bandwidth / 1e12:.2f} TB/s", flush=True)
    for batch in (int(b) for b in args.batches.split(",")):
        grid = [] if args.quick else tile_grid(batch)
        for shape in shapes(args.arch):
            rows = bench_shape(shape, batch, bandwidth, grid, gen)
            results["rows"].extend(rows)
            args.out.with_suffix(".json").write_text(strict_json_dumps(results, indent=1))  # keep what ran
            fused = [r for r in rows if r["kernel"] == "triton_fused"]
            best = min(fused, key=lambda r: r["us"])
            dflt = next(r for r in fused if r["default"])
            print(f"B={batch} {shape['name']:8s} floor {rows[0]['floor_us']:7.1f} µs  cublas {rows[0]['us']:7.1f} "
                  f"({rows[0]['over_floor']:.2f}x)  fused default {dflt['us']:7.1f} ({dflt['over_floor']:.2f}x)  "
                  f"best {best['us']:7.1f} ({best['over_floor']:.2f}x) tiles {best['tiles']}", flush=True)
    import pandas as pd

    df = pd.DataFrame(results["rows"]).assign(command=results["command"])
    df.to_csv(args.out.with_suffix(".csv"), index=False)


if __name__ == "__main__":
    main()
