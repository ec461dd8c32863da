"""prr.kernels.step_counters against its torch reference on fresh random sets at odd sizes
(CPU: the Triton interpreter; -m gpu: compiled)."""

from __future__ import annotations

import os

import pytest
import torch
from prr.kernels.reference_step_counters import step_counters_reference
from prr.kernels.step_counters import (
    counter_scratch,
    layer_counter_scratch,
    step_counters,
    step_counters_layers,
)

GPU = os.environ.get("TRITON_INTERPRET") == "0" and torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"


def random_sets(gen: torch.Generator, batch: int, heads: int, capacity: int, max_blocks: int, fill: float):
    """Distinct ids per (row, head) in random order, padded with 0; counts from empty to full."""
    idx = torch.zeros(batch, heads, capacity, dtype=torch.int32)
    cnt = torch.zeros(batch, heads, dtype=torch.int32)
    for b in range(batch):
        for h in range(heads):
            n = min(capacity, int(torch.randint(0, capacity + 1, (1,), generator=gen)) if fill < 1 else capacity)
            ids = torch.randperm(max_blocks, generator=gen)[:n]
            idx[b, h, :n], cnt[b, h] = ids.int(), n
    return idx.to(DEVICE), cnt.to(DEVICE)


@pytest.mark.parametrize("batch,heads,k,c,nb", [(1, 1, 1, 1, 3), (2, 3, 7, 11, 27), (3, 2, 29, 5, 61), (1, 8, 64, 96, 113)])
@pytest.mark.parametrize("with_pred", [True, False])
def test_counts_equal_the_mask_reference_over_steps(batch, heads, k, c, nb, with_pred):
    gen = torch.Generator().manual_seed(batch * 100 + k)
    k, c = min(k, nb), min(c, nb)
    prev, prev_cnt = random_sets(gen, batch, heads, k, nb, fill=0.5)
    scratch = counter_scratch(batch, heads, nb, DEVICE)
    out = torch.zeros(4, batch * heads, dtype=torch.int64, device=DEVICE)
    want = torch.zeros_like(out)
    for _ in range(3):  # A_t becomes the next step's A_{t-1}
        a, a_cnt = random_sets(gen, batch, heads, k, nb, fill=0.5)
        p, p_cnt = random_sets(gen, batch, heads, c, nb, fill=0.5) if with_pred else (None, None)
        want += step_counters_reference(a, a_cnt, p, p_cnt, prev, prev_cnt, nb)
        step_counters(a, a_cnt, p, p_cnt, prev, prev_cnt, scratch, out)
        assert torch.equal(out, want)
        assert torch.equal(prev, a) and torch.equal(prev_cnt, a_cnt)
        assert not scratch.any()  # left zeroed for the next launch
    assert want[2].sum() > 0 or not with_pred or k == 1  # the sets did overlap somewhere


def random_layers(gen: torch.Generator, layers: int, batch: int, heads: int, capacity: int, max_blocks: int):
    """`random_sets` of L layers stacked: ([L, B, Hkv, C], [L, B, Hkv])."""
    sets = [random_sets(gen, batch, heads, capacity, max_blocks, fill=0.5) for _ in range(layers)]
    return torch.stack([s[0] for s in sets]), torch.stack([s[1] for s in sets])


@pytest.mark.parametrize("layers,batch,heads,k,c,nb", [(1, 1, 1, 1, 1, 3), (3, 2, 3, 7, 11, 27), (5, 3, 1, 29, 5, 61)])
@pytest.mark.parametrize("with_pred", [True, False])
def test_layers_in_one_launch_equal_the_reference_layer_by_layer(layers, batch, heads, k, c, nb, with_pred):
    """step_counters_layers (the engine's end-of-step launch) at odd L, B, Hkv, K, |P| and NB:
    step_counters_reference of each layer, over steps (A_t kept as each layer's A_{t-1})."""
    gen = torch.Generator().manual_seed(layers * 1000 + batch * 100 + k)
    k, c = min(k, nb), min(c, nb)
    prev, prev_cnt = random_layers(gen, layers, batch, heads, k, nb)
    scratch = layer_counter_scratch(layers, batch, heads, nb, DEVICE)
    out = torch.zeros(layers, 4, batch * heads, dtype=torch.int64, device=DEVICE)
    want = torch.zeros_like(out)
    for _ in range(2):
        a, a_cnt = random_layers(gen, layers, batch, heads, k, nb)
        p, p_cnt = random_layers(gen, layers, batch, heads, c, nb) if with_pred else (None, None)
        for i in range(layers):
            want[i] += step_counters_reference(a[i], a_cnt[i], None if p is None else p[i],
                                               None if p is None else p_cnt[i], prev[i], prev_cnt[i], nb)
        step_counters_layers(a, a_cnt, p, p_cnt, prev, prev_cnt, scratch, out)
        assert torch.equal(out, want)
        assert torch.equal(prev, a) and torch.equal(prev_cnt, a_cnt)
        assert not scratch.any()
    assert want[:, 2].sum() > 0 or not with_pred or k == 1


def test_layers_bad_arguments_are_refused():
    a = torch.zeros(2, 1, 2, 4, dtype=torch.int32, device=DEVICE)
    cnt = torch.zeros(2, 1, 2, dtype=torch.int32, device=DEVICE)
    out = torch.zeros(2, 4, 2, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="scratch must be"):  # one layer's scratch for two layers
        step_counters_layers(a, cnt, None, None, a.clone(), cnt.clone(), counter_scratch(1, 2, 8, DEVICE), out)
    with pytest.raises(ValueError, match="out must be"):
        step_counters_layers(a, cnt, None, None, a.clone(), cnt.clone(), layer_counter_scratch(2, 1, 2, 8, DEVICE),
                             out[0])
    with pytest.raises(ValueError, match="sel_idx must be"):
        step_counters_layers(a[0], cnt[0], None, None, a[0].clone(), cnt[0].clone(),
                             layer_counter_scratch(2, 1, 2, 8, DEVICE), out)


def test_bad_arguments_are_refused():
    a = torch.zeros(1, 2, 4, dtype=torch.int32, device=DEVICE)
    cnt = torch.zeros(1, 2, dtype=torch.int32, device=DEVICE)
    scratch = counter_scratch(1, 2, 8, DEVICE)
    with pytest.raises(ValueError, match="out must be"):
        step_counters(a, cnt, None, None, a.clone(), cnt.clone(), scratch, torch.zeros(4, 3, dtype=torch.int64))
    with pytest.raises(ValueError, match="sel_idx must be"):
        step_counters(a.long(), cnt, None, None, a.clone(), cnt.clone(), scratch, torch.zeros(4, 2, dtype=torch.int64))
