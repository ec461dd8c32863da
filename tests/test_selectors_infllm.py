"""InfLLM: the published retrieval (selector=infllm) against a reference written from the
paper's repository, and both it and prr's variant (selector=infllm_prr) on their defining
properties: sinks and window always attended, metadata incremental and idempotent, RoPE undone
exactly, serial DSA = PRR, clear errors."""

from types import SimpleNamespace

import pytest
import torch
from prr.kernels.reference_selection import infllm_reference_selections

from prr.budget.fixed import FixedBudget
from prr.cache import PagedKVCache
from prr.model.rope import apply_rope, rope_cos_sin, rope_inv_freq
from prr.predictors import EmaPredictor, LastStepPredictor, NoPredictor, OraclePredictor
from prr.runtime.dsa_backend import DSABackend
from prr.selectors import InfLLMSelector
from prr.selectors.infllm import rotate
from tests.helpers import random_cache
from tests.test_runtime import run_backend

PUBLISHED: dict = {}
PRR_VARIANT = {"scoring": "rope", "representatives_from": "one_query"}
VARIANTS = {"published": PUBLISHED, "prr": PRR_VARIANT}


def infllm(variant: str, head_dim: int = 16, **kwargs) -> InfLLMSelector:
    sel = InfLLMSelector(**kwargs, **VARIANTS[variant])
    sel.bind_model(SimpleNamespace(head_dim=head_dim, rope_theta=10000.0, rope_scaling=None))
    return sel


def prefilled(sel, length, num_kv_heads=2, head_dim=16, block_size=8, extra=0, group=3, seed=0):
    """A one-layer cache of `length` random tokens with the prefill's metadata and backlog done
    (random prompt queries), as the runtime leaves it; -> (cache, generator)."""
    cache = random_cache(sel, length=length, num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size,
                         extra=extra, seed=seed)
    g = torch.Generator().manual_seed(seed + 100)
    queries = torch.randn(1, num_kv_heads, group, length, head_dim, generator=g)
    sel.catch_up(queries[:, :, :, -1], cache, 0, length, queries=queries)
    return cache, g


def decode_tokens(sel, cache, steps, group, g):
    """Append `steps` tokens one at a time (the decode's metadata update), selecting after each;
    yields (length, q, selection)."""
    b, h, d = cache.batch, cache.num_kv_heads, cache.head_dim
    for _ in range(steps):
        k = torch.randn(b, h, 1, d, generator=g) * 2
        start, end = cache.append(0, k, torch.randn(b, h, 1, d, generator=g))
        sel.append_metadata(cache, 0, torch.full((b,), start))
        q = torch.randn(b, h, group, d, generator=g)
        yield end, q, sel.select(q, cache, 0)


# --- the published rule against its reference --------------------------------------------------


class Recorder:
    """The eager runtime (DSABackend) with the post-RoPE q and k of every position kept."""

    def __init__(self, backend: DSABackend) -> None:
        self.backend, self.q, self.k = backend, {}, {}

    def prefill(self, layer, q, k, v):  # q: [1, Hq, T, D], k: [1, Hkv, T, D]
        self.q[layer], self.k[layer] = [q[0].transpose(0, 1)], [k[0].transpose(0, 1)]
        return self.backend.prefill(layer, q, k, v)

    def decode(self, layer, q, k, v):  # q: [1, Hq, D], k: [1, Hkv, D]
        self.q[layer].append(q[0][None])
        self.k[layer].append(k[0][None])
        return self.backend.decode(layer, q, k, v)


def unrotate(x: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D] rotated at positions 0..T-1 -> before RoPE (fp64, this test's own rotation)."""
    angles = torch.arange(x.shape[0], dtype=torch.float64)[:, None] * inv_freq.double()  # [T, D/2]
    cos, sin = torch.cat((angles.cos(), angles.cos()), -1)[:, None], torch.cat((angles.sin(), angles.sin()), -1)[:, None]
    half = x.shape[-1] // 2
    x = x.double()
    return x * cos - torch.cat((-x[..., half:], x[..., :half]), -1) * sin


@pytest.mark.parametrize("local_blocks, representatives, topk", [(2, 3, 6), (1, 4, 5)])
def test_infllm_selects_what_the_reference_selects(local_blocks, representatives, topk):
    """selector=infllm on a random-init model (tiny-random-d64: GQA 4/2, head_dim 64), fp32,
    CPU, driven by the eager runtime through the model's forward: its block set equals the
    reference's (kernels/reference_selection.infllm_reference_selections, an explicit loop from
    InfLLM's repository) at each of 70 decode steps (blocks of 16: four boundaries crossed),
    in every sparse layer and KV head."""
    from prr.model.spec import ModelSpec

    model = ModelSpec("tiny-random-d64").load("float32", "cpu")
    mc = model.config
    prompt, steps, bs = 203, 70, 16
    sel = InfLLMSelector(topk_blocks=topk, sink_blocks=1, local_blocks=local_blocks, representatives=representatives,
                         dense_layers=[0])
    sel.bind_model(mc)
    cache = PagedKVCache(mc.num_layers, 1, mc.num_kv_heads, mc.head_dim, bs, prompt + steps)
    backend = DSABackend(cache, mc.num_heads, sel, NoPredictor(), FixedBudget(), mode="sparse", calibration_tokens=8)
    recorder = Recorder(backend)
    token = torch.randint(0, mc.vocab_size, (1, prompt), generator=torch.Generator().manual_seed(1))
    selected = {layer: [] for layer in range(1, mc.num_layers)}
    with torch.inference_mode():
        logits = model.decoder(token, 0, recorder, last_logits_only=True)[:, -1]
        backend.finish_prefill()
        for step in range(steps):
            logits = model.decoder(logits.argmax(-1)[:, None], prompt + step, recorder)[:, -1]
            for record in backend.end_step()[0]:
                selected[record.layer].append(record.selected[0])  # [Hkv, max_blocks] bool
    inv_freq = rope_inv_freq(mc.head_dim, mc.rope_theta, mc.rope_scaling)
    for layer, masks in selected.items():
        q_raw = unrotate(torch.cat(recorder.q[layer]), inv_freq)  # [T, Hq, D]
        k_raw = unrotate(torch.cat(recorder.k[layer]), inv_freq)  # [T, Hkv, D]
        want = infllm_reference_selections(q_raw, k_raw, inv_freq, prompt, bs, 1, local_blocks, True, topk,
                                           representatives)
        assert len(want) == len(masks) == steps
        retrieved = 0
        for step, (mask, blocks) in enumerate(zip(masks, want, strict=True)):
            for head in range(mc.num_kv_heads):
                got = mask[head].nonzero().flatten().tolist()
                assert got == blocks, (layer, step, head)
            retrieved += len(blocks) - 1 - (local_blocks + 1)
        assert retrieved > steps  # blocks were retrieved, not only forced


def test_position_agnostic_scores_do_not_depend_on_where_a_block_lies():
    """The same pre-RoPE keys in an old and a recent memory block score the same (InfLLM's
    lookup ignores position); under prr's variant (true positions) they do not."""
    bs, d, g = 8, 16, 2
    for variant, same in (("published", True), ("prr", False)):
        sel = infllm(variant, topk_blocks=4, sink_blocks=1, local_blocks=1, representatives=8)
        cache = PagedKVCache(1, 1, 1, d, bs, 80)
        inv_freq = rope_inv_freq(d, 10000.0)
        raw = torch.randn(1, 1, 80, d, generator=torch.Generator().manual_seed(0))
        raw[:, :, 40:48] = raw[:, :, 8:16]  # blocks 1 and 5: the same keys before RoPE
        cos, sin = rope_cos_sin(torch.arange(80), inv_freq)
        cache.append(0, apply_rope(raw, cos, sin), torch.randn(1, 1, 80, d))
        sel.update_metadata(cache, 0, 0, 80)
        queries = torch.randn(1, 1, g, 80, d)
        sel.catch_up(queries[:, :, :, -1], cache, 0, 80, queries=queries)  # r = block size: every token kept
        scores = sel.head_scores(queries[:, :, :, -1], cache, 0, torch.tensor([80]))[0, 0, 0]
        assert torch.isclose(scores[1], scores[5], rtol=1e-5, atol=1e-5) == same, variant


def test_rotate_undoes_the_models_rope():
    inv_freq = rope_inv_freq(16, 10000.0)
    x = torch.randn(3, 50, 16)
    cos, sin = rope_cos_sin(torch.arange(50), inv_freq)
    positions = torch.arange(50).expand(3, 50)
    torch.testing.assert_close(rotate(x, positions, inv_freq), apply_rope(x, cos, sin))
    torch.testing.assert_close(rotate(apply_rope(x, cos, sin), positions, inv_freq, sign=-1.0), x, rtol=1e-5, atol=1e-5)


# --- both variants ----------------------------------------------------------------------------


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("reduce", ["max", "sum", "union"])
@pytest.mark.parametrize("per_head", [False, True])
def test_infllm_always_attends_initial_and_local_tokens(variant, group, reduce, per_head):
    sink, local, bs = 2, 3, 8
    sel = infllm(variant, head_dim=12, topk_blocks=8, sink_blocks=sink, local_blocks=local, gqa_reduce=reduce,
                 per_head=per_head)
    cache, g = prefilled(sel, 61, head_dim=12, block_size=bs, extra=45, group=group, seed=group)
    for length, _, a in decode_tokens(sel, cache, 45, group, g):
        covered = a.blocks.mask(cache.max_blocks).repeat_interleave(bs, -1)  # [B, Hkv, max_tokens]
        nb = cache.num_blocks(0)
        first_local = (nb - 1 - local) * bs  # local window: the last `local` full blocks + the newest
        assert torch.all(covered[..., : sink * bs]), "initial tokens"
        assert torch.all(covered[..., first_local:length]), "local window"
        if reduce != "union":
            assert torch.all(a.blocks.count == 8)
        if not per_head:  # one selection for the whole layer
            assert torch.equal(a.blocks.mask(cache.max_blocks)[:, 0], a.blocks.mask(cache.max_blocks)[:, 1])


@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("group", [1, 3, 4])
def test_prr_variant_representatives_and_block_score(per_head, group):
    """prr's variant: the r tokens of largest q·k under the finalising query (summed over the
    group, or over the layer), their mean post-RoPE key, scored at true positions."""
    r, bs, d = 3, 8, 12
    sel = infllm("prr", head_dim=d, topk_blocks=5, sink_blocks=1, local_blocks=2, representatives=r, per_head=per_head)
    cache = random_cache(sel, length=77, num_kv_heads=2, head_dim=d, block_size=bs, seed=group)
    q = torch.randn(1, 2, group, d)
    sel.catch_up(q, cache, 0, 77)  # the prefill's backlog: finalises blocks 0..6 (window: blocks 7, 8, 9)
    scores = sel.head_scores(q, cache, 0, torch.tensor([77]))
    final = int(cache.metadata[0]["infllm_finalised"])
    assert final == 10 - 3
    keys = cache.keys[0][:, :, : final * bs].view(1, 2, final, bs, d)
    token_scores = torch.einsum("bhgd,bhnsd->bhns", q, keys)  # Σ over the group
    if not per_head:
        token_scores = token_scores.sum(1, keepdim=True).expand_as(token_scores)
    top = token_scores.topk(r, dim=-1).indices
    expected = torch.gather(keys, 3, top.unsqueeze(-1).expand(1, 2, final, r, d)).mean(3)  # [1, 2, final, D]
    slot = cache.metadata[0]["infllm_repr"][:, :, :final]  # [1, 2, final, G, D]: the same for every head of a group
    torch.testing.assert_close(slot, expected.unsqueeze(3).expand_as(slot))
    per_query_head = torch.einsum("bhgd,bhnd->bhgn", q, expected)
    want = per_query_head if per_head else per_query_head.sum((1, 2), keepdim=True).expand_as(per_query_head)
    torch.testing.assert_close(scores[..., :final], want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_infllm_metadata_is_incremental_and_idempotent(variant):
    bs = 8
    sel = infllm(variant, head_dim=12, topk_blocks=6, sink_blocks=1, local_blocks=2, representatives=2)
    cache, g = prefilled(sel, 27, head_dim=12, block_size=bs, extra=60, group=3, seed=3)
    frozen: dict[int, torch.Tensor] = {}
    for length, q, a in decode_tokens(sel, cache, 60, 3, g):
        final = int(cache.metadata[0]["infllm_finalised"])
        assert final == max(0, min(length // bs, cache.num_blocks(0) - 3))  # exactly the blocks out of the window
        slot = cache.metadata[0]["infllm_repr"]
        for block, value in frozen.items():  # a final block's summary never changes afterwards
            assert torch.equal(slot[:, :, block], value)
        for block in range(final):
            frozen.setdefault(block, slot[:, :, block].clone())
        before = {name: t.clone() for name, t in cache.metadata[0].items()}
        again = sel.select(q, cache, 0)  # a second selection at the same step (the oracle's look)
        assert all(torch.equal(before[name], t) for name, t in cache.metadata[0].items())
        assert torch.equal(again.blocks.indices, a.blocks.indices)
        # The newest block (not final) holds the mean of its live keys, as scored.
        newest = cache.num_blocks(0) - 1
        live = cache.keys[0][:, :, newest * bs : length]
        if variant == "published":
            live = rotate(live, torch.arange(newest * bs, length), sel.inv_freq, sign=-1.0)
        torch.testing.assert_close(cache.metadata[0]["infllm_live"][:, :, newest], live.mean(2))


def test_window_scores_are_the_window_queries_summed_softmax():
    """Each token's score, per query head, is the sum over the queries whose window held it of
    the softmax probability (over sinks + window) they gave it: checked token by token."""
    bs, d, sinks, local, length, group = 4, 8, 1, 1, 23, 2
    sel = infllm("published", head_dim=d, topk_blocks=4, sink_blocks=sinks, local_blocks=local)
    cache = random_cache(sel, length=length, num_kv_heads=1, head_dim=d, block_size=bs)
    queries = torch.randn(1, 1, group, length, d)
    sel.catch_up(queries[:, :, :, -1], cache, 0, length, queries=queries)
    keys = cache.keys[0][0, 0]
    want = torch.zeros(group, length)
    for p in range(length):
        nb, window = p // bs + 1, local + 1
        attended = [j for j in range(p + 1) if j // bs < sinks or j // bs >= nb - window]
        for h in range(group):
            probs = torch.softmax(torch.stack([queries[0, 0, h, p] @ keys[j] for j in attended]) / d ** 0.5, 0)
            for j, prob in zip(attended, probs, strict=True):
                if j // bs >= nb - window:
                    want[h, j] += prob
    got = cache.metadata[0]["infllm_window"][0, 0]  # [NB, G, S]
    got = got.permute(1, 0, 2).reshape(group, -1)[:, :length]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def catch_up_stepwise(sel, q, cache, layer, length, queries):
    """catch_up as it was (the reference): the prompt's queries add their window probabilities
    256 at a time through the decode step's `_add_window_attention`, then the backlog finalises."""
    for start in range(0, length, 256):
        end = min(start + 256, length)
        positions = torch.arange(start, end).repeat(cache.batch, 1)  # [B, C]
        sel._add_window_attention(queries[:, :, :, start:end], positions, cache, layer)
    rows = torch.full((cache.batch,), length)
    sel._finalise(q, cache, layer, rows, torch.zeros_like(rows), cache.num_blocks(layer, length))


@pytest.mark.parametrize("block_size, group, batch", [(8, 1, 2), (8, 3, 1), (16, 1, 1), (16, 4, 2)])
def test_catch_up_in_large_chunks_equals_the_stepwise_one(block_size, group, batch, monkeypatch):
    """catch_up's window work in a few large chunks (sized by PROMPT_KEYS_BYTES) leaves bitwise
    the metadata, and so the selection, of the old 256-query chunks: prompts not a multiple of the
    block size, one chunk (the default budget) and chunks of 37 queries."""
    import prr.selectors.infllm as module

    seed = block_size + 10 * group + 100 * batch
    length, d, h = 219 + seed % 17, 16, 2
    queries = torch.randn(batch, h, group, length, d, generator=torch.Generator().manual_seed(seed))
    q = torch.randn(batch, h, group, d, generator=torch.Generator().manual_seed(seed + 1))

    def after(catch_up):  # -> the metadata and the selection at `length`
        sel = infllm("published", topk_blocks=6, local_blocks=2, representatives=3, per_head=group > 1)
        cache = random_cache(sel, length=length, batch=batch, num_kv_heads=h, head_dim=d, block_size=block_size,
                             seed=seed)
        catch_up(sel, queries[:, :, :, -1], cache, 0, length, queries)
        return cache.metadata[0], sel.select(q, cache, 0)

    want, want_a = after(catch_up_stepwise)
    per_query = 4 * batch * h * (1 + 2 + 1) * block_size * d  # fp32 keys gathered per query (sinks + window)
    for budget in (module.PROMPT_KEYS_BYTES, 37 * per_query):
        monkeypatch.setattr(module, "PROMPT_KEYS_BYTES", budget)
        got, got_a = after(lambda sel, q, cache, layer, n, queries: sel.catch_up(q, cache, layer, n, queries=queries))
        assert want.keys() == got.keys()
        for name, slot in want.items():
            assert torch.equal(slot, got[name]), (budget, name)
        assert torch.equal(want_a.blocks.indices, got_a.blocks.indices)
        assert torch.equal(want_a.blocks.count, got_a.blocks.count) and torch.equal(want_a.scores, got_a.scores)


@pytest.mark.parametrize("predictor", [LastStepPredictor(), EmaPredictor(), OraclePredictor()],
                         ids=lambda p: type(p).__name__)
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_exact_prr_equals_serial_dsa(variant, predictor, group):
    def make():
        return infllm(variant, topk_blocks=6, local_blocks=2, per_head=True)
    _, outs, rows = run_backend(predictor, selector=make(), group=group, seed=group, steps=6)
    assert rows["serial_relerr"].max() <= 1e-5
    _, serial, _ = run_backend(NoPredictor(), selector=make(), group=group, seed=group, steps=6)
    for (_, _, out), (_, _, ref) in zip(outs, serial, strict=True):
        assert (out - ref).norm() <= 1e-5 * ref.norm()


def test_infllm_bad_options_are_clear_errors():
    with pytest.raises(ValueError, match=r"representatives=0"):
        InfLLMSelector(topk_blocks=8, representatives=0)
    with pytest.raises(ValueError, match=r"per_head='yes' is not one of \[True, False\]"):
        InfLLMSelector(topk_blocks=8, per_head="yes")
    with pytest.raises(ValueError, match="gqa_reduce='mean'"):
        InfLLMSelector(topk_blocks=8, gqa_reduce="mean")
    with pytest.raises(ValueError, match="raise topk_blocks"):
        InfLLMSelector(topk_blocks=4, sink_blocks=1, local_blocks=4)
    with pytest.raises(ValueError, match=r"scoring='alibi' is not one of \['position_agnostic', 'rope'\]"):
        InfLLMSelector(topk_blocks=8, scoring="alibi")
    with pytest.raises(ValueError, match=r"representatives_from='keys'"):
        InfLLMSelector(topk_blocks=8, representatives_from="keys")
    with pytest.raises(ValueError, match="needs a local window"):
        InfLLMSelector(topk_blocks=8, local_blocks=0, force_newest=False)
    unbound = InfLLMSelector(topk_blocks=8)
    with pytest.raises(ValueError, match=r"call selector.bind_model\(model.config\)"):
        random_cache(unbound, length=40)
    sel = infllm("published", topk_blocks=8)
    cache = random_cache(sel, length=40)
    with pytest.raises(ValueError, match="needs the prefill's queries"):
        sel.catch_up(torch.randn(1, 2, 1, 16), cache, 0, 40)
    wrong = infllm("published", head_dim=32, topk_blocks=8)
    with pytest.raises(ValueError, match="head_dim is 16"):
        random_cache(wrong, length=40)
    assert InfLLMSelector(topk_blocks=8).triton_problems() == []  # its kernels: prr.kernels.infllm
    assert "gqa_reduce=union" in InfLLMSelector(topk_blocks=8, gqa_reduce="union").triton_problems()[0]
