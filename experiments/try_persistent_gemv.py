"""Experiment (not wired in): a persistent GEMV at batch 1 (grid = SMs x programs per SM, each
program walks row tiles pid, pid + P, ... with its weight stream prefetched across tile
boundaries) against dense_gemv's default one-tile-per-program GEMV, per Llama-8B projection,
as ratios to the weight-read floor. Question: is the ~1.1-1.5x of the floor the GEMVs take at
batch 1 wave / ramp overhead a persistent loop removes?

    python experiments/try_persistent_gemv.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "experiments"))

from bench_decode import read_bandwidth  # noqa: E402
from bench_gemv import COLD_BYTES, fused_call, shapes, torch_form  # noqa: E402
from bench_kernels import environment, graph_time_us  # noqa: E402
from prr.kernels.dense_gemv import default_tiles  # noqa: E402
from prr.kernels.dense_gemv_jit import _epilogue  # noqa: E402


@triton.jit
def _persistent_gemv_kernel(x_ptr, norm_w_ptr, w_ptr, y_ptr, N, K, eps, stride_wn,
                            NORM: tl.constexpr, RESIDUAL: tl.constexpr, SWIGLU: tl.constexpr,
                            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    num_tiles = tl.cdiv(N, BLOCK_N)
    k_steps = tl.cdiv(K, BLOCK_K)
    total = tl.cdiv(num_tiles - pid, P) * k_steps
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    rows = pid * BLOCK_N + offs_n0
    w = tl.load(w_ptr + rows.to(tl.int64)[:, None] * stride_wn + offs_k[None, :],
                mask=(rows < N)[:, None] & (offs_k < K)[None, :], other=0.0)
    if SWIGLU:
        u = tl.load(w_ptr + (rows.to(tl.int64) + N)[:, None] * stride_wn + offs_k[None, :],
                    mask=(rows < N)[:, None] & (offs_k < K)[None, :], other=0.0)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    squares = tl.zeros([BLOCK_K], dtype=tl.float32)
    for it in range(0, total):
        tile = pid + (it // k_steps) * P
        ks = it % k_steps
        cols = ks * BLOCK_K + offs_k
        nxt = it + 1
        nrows = (pid + (nxt // k_steps) * P) * BLOCK_N + offs_n0
        ncols = (nxt % k_steps) * BLOCK_K + offs_k
        nmask = (nrows < N)[:, None] & (ncols < K)[None, :]
        w_next = tl.load(w_ptr + nrows.to(tl.int64)[:, None] * stride_wn + ncols[None, :], mask=nmask, other=0.0)
        if SWIGLU:
            u_next = tl.load(w_ptr + (nrows.to(tl.int64) + N)[:, None] * stride_wn + ncols[None, :], mask=nmask,
                             other=0.0)
        xf = tl.load(x_ptr + cols, mask=cols < K, other=0.0).to(tl.float32)
        if NORM:
            squares += xf * xf
            xf = xf * tl.load(norm_w_ptr + cols, mask=cols < K, other=0.0).to(tl.float32)
        acc += w.to(tl.float32) * xf[None, :]
        if SWIGLU:
            acc_up += u.to(tl.float32) * xf[None, :]
            u = u_next
        w = w_next
        if ks == k_steps - 1:
            offs_n = tile * BLOCK_N + offs_n0
            rstd = tl.rsqrt(tl.sum(squares, axis=0) / K + eps) if NORM else 1.0
            _epilogue(tl.sum(acc, axis=1), tl.sum(acc_up, axis=1), rstd, w_ptr, offs_n, N, y_ptr + offs_n,
                      offs_n < N, False, RESIDUAL, SWIGLU)
            acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
            acc_up = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
            squares = tl.zeros([BLOCK_K], dtype=tl.float32)


def persistent_call(form, x, w, ln, res, cfg, sms):
    bn, bk, warps, per_sm = cfg
    n = w.shape[0] // 2 if form == "swiglu" else w.shape[0]
    k = w.shape[1]
    y = res if form == "residual" else torch.empty(1, n, dtype=x.dtype, device=x.device)
    grid = min(triton.cdiv(n, bn), sms * per_sm)
    _persistent_gemv_kernel[(grid,)](x, ln, w, y, n, k, 1e-5, w.stride(0), NORM=form != "residual",
                                     RESIDUAL=form == "residual", SWIGLU=form == "swiglu",
                                     BLOCK_N=bn, BLOCK_K=bk, num_warps=warps)
    return y


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    bw = max(read_bandwidth().values())
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    configs = [(bn, bk, wp, ps) for bn in (1, 2, 4, 8) for bk in (512, 1024) for wp in (2, 4)
               for ps in (4, 8, 16) if 8 <= bn * bk // (32 * wp) <= 32]
    for shape in shapes("llama-3.1-8b-shape"):
        n, k, form = shape["n"], shape["k"], shape["form"]
        out_n = n // 2 if form == "swiglu" else n
        sets = max(1, min(16, math.ceil(COLD_BYTES / (n * k * 2))))
        ws = [(torch.randn(n, k, device="cuda", generator=gen) * k ** -0.5).to(torch.bfloat16) for _ in range(sets)]
        x = torch.randn(1, k, device="cuda", generator=gen).to(torch.bfloat16)
        ln = (1 + 0.1 * torch.randn(k, device="cuda", generator=gen)).to(torch.bfloat16)
        res = torch.randn(1, out_n, device="cuda", generator=gen).to(torch.bfloat16)
        floor = (n * k * 2) / bw * 1e6
        want = torch_form(form, x.double(), ws[0].double(), ln.double(), res.double())
        dflt = default_tiles(out_n, k, form == "swiglu")
        r = res.clone()
        base_us = graph_time_us(lambda i: (lambda: fused_call(form, x, ws[i], ln, r, dflt)), sets)
        rows.append(dict(shape=shape["name"], kernel="dense_gemv", cfg=list(dflt), us=base_us, x_floor=base_us / floor))
        best = None
        for cfg in configs:
            got = persistent_call(form, x, ws[0], ln, res.clone(), cfg, sms)
            err = float((got.double() - want).abs().max() / want.abs().max())
            if err > 2e-2:
                raise AssertionError(f"{shape['name']} {cfg}: relative error {err:.3g}")
            r = res.clone()
            us = graph_time_us(lambda i, c=cfg, r=r: (lambda: persistent_call(form, x, ws[i], ln, r, c, sms)), sets)
            rows.append(dict(shape=shape["name"], kernel="persistent", cfg=list(cfg), us=us, x_floor=us / floor))
            best = rows[-1] if best is None or us < best["us"] else best
        print(f"{shape['name']:8s} floor {floor:6.1f} µs  dense_gemv {base_us:6.1f} ({base_us / floor:.3f}x)  "
              f"persistent best {best['us']:6.1f} ({best['x_floor']:.3f}x) {best['cfg']}", flush=True)
        ws.clear()
        torch.cuda.empty_cache()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "try_persistent_gemv.json").write_text(json.dumps(dict(
        command="python " + " ".join(sys.argv), environment=environment(), read_bandwidth=bw, rows=rows), indent=1))


if __name__ == "__main__":
    main()
