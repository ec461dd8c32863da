"""Tensor parallelism on the CPU: 2 processes over gloo decode, through the graph engine, the
tokens, selections and hit counts of one process holding the whole model (fp32)."""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from prr.model.config import ModelConfig
from prr.model.decoder import Decoder
from prr.model.dense import DenseAttention
from prr.model.tensor_parallel import TensorParallel, shard_config, shard_decoder
from prr.runtime.graph_decode import GraphDecoder, StaticPlan
from tests.helpers import graph_predictor, graph_selector

# 4 KV heads (2 per rank), GQA 2, 3 layers (layer 0 dense), FFN 96 (48 per rank)
CONFIG = ModelConfig(arch="llama", vocab_size=61, hidden_size=64, intermediate_size=96, num_layers=3, num_heads=8,
                     num_kv_heads=4, head_dim=16, rope_theta=10000.0, rope_scaling=None, rms_norm_eps=1e-5,
                     tie_word_embeddings=False, max_position_embeddings=512, attention_bias=True,
                     attention_out_bias=True, mlp_bias=True)
LENGTH, STEPS, MAX_TOKENS, WORLD = 90, 12, 128, 2
PREDICTORS = {"serial": "fixed", "prr": "ema_membership"}  # (serial: none)


def plan_of(name: str) -> StaticPlan:
    return StaticPlan(variant=name, predicted_blocks=3, block_size=8, count_hits=True, projections="torch")


def objects_of(name: str) -> dict:
    """The engine's selector and predictor for plan_of(name): Quest top-K 4, layer 0 dense."""
    return dict(selector=graph_selector("quest", 4, dense_layers=(0,)), predictor=graph_predictor(PREDICTORS[name]))


def decode(model: Decoder, plan_name: str, heads: slice) -> dict:
    """Greedy decode of a random context's KV heads `heads` -> tokens [STEPS], A indices per step
    and sparse layer [1, Hkv, K], and the device counters summed over steps."""
    gen = torch.Generator().manual_seed(11)
    shape = (1, CONFIG.num_kv_heads, MAX_TOKENS, CONFIG.head_dim)
    keys, values = [], []
    for _ in range(CONFIG.num_layers):
        k, v = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
        k[:, :, LENGTH:], v[:, :, LENGTH:] = 0, 0
        keys.append(k[:, heads].contiguous())
        values.append(v[:, heads].contiguous())
    token = torch.randint(0, CONFIG.vocab_size, (1,), generator=gen)
    engine = GraphDecoder(model, plan_of(plan_name), batch=1, max_tokens=MAX_TOKENS, backend="torch",
                          **objects_of(plan_name))
    engine.fill_from_cache(keys, values, LENGTH, token)
    tokens, selections = [], []
    for _ in range(STEPS):
        engine.step(advance=True)
        tokens.append(int(engine.token[0, 0]))
        selections.append([engine.last_selection[i][0].clone() for i in range(CONFIG.num_layers) if engine.sparse[i]])
    return {"tokens": tokens, "selections": selections, "counters": engine.counters()}


def prompt() -> torch.Tensor:
    """[1, 37] token ids."""
    return torch.randint(0, CONFIG.vocab_size, (1, 37), generator=torch.Generator().manual_seed(2))


def full_model() -> Decoder:
    return Decoder(CONFIG, torch.float32, "cpu").init_random_(seed=3, std=0.3)


def rank_main(rank: int, store: str, plan_name: str, out: str) -> None:
    """One rank of a 2-process run (spawned): its shard decodes its 2 KV heads."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    try:
        tp = TensorParallel(rank, WORLD)
        per_rank = CONFIG.num_kv_heads // WORLD
        shard = shard_decoder(full_model(), tp)
        result = decode(shard, plan_name, slice(rank * per_rank, (rank + 1) * per_rank))
        with torch.no_grad():  # the eager forward (the research runtime's prefill) all-reduces too
            result["prefill_logits"] = shard(prompt(), 0, DenseAttention(CONFIG.num_layers))
        torch.save(result, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("plan_name", ["serial", "prr"])
def test_two_ranks_over_gloo_decode_what_one_process_decodes(tmp_path, plan_name):
    alone = decode(full_model(), plan_name, slice(None))
    ctx = multiprocessing.get_context("spawn")
    ranks = [ctx.Process(target=rank_main, args=(r, str(tmp_path / "store"), plan_name, str(tmp_path)))
             for r in range(WORLD)]
    for p in ranks:
        p.start()
    for p in ranks:
        p.join(timeout=240)
    assert [p.exitcode for p in ranks] == [0, 0], "a rank failed (its traceback is above)"
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    with torch.no_grad():
        logits = full_model()(prompt(), 0, DenseAttention(CONFIG.num_layers))  # [1, 37, V]
    for r, result in enumerate(results):
        assert result["tokens"] == alone["tokens"], f"rank {r}"
        torch.testing.assert_close(result["prefill_logits"], logits, rtol=1e-4, atol=1e-4, msg=f"rank {r}")
        heads = slice(r * 2, r * 2 + 2)
        for step, (mine, whole) in enumerate(zip(result["selections"], alone["selections"], strict=True)):
            for layer, (a, b) in enumerate(zip(mine, whole, strict=True)):
                assert torch.equal(a, b[:, heads]), f"rank {r}, step {step}, sparse layer {layer}"
    for name in ("selected", "predicted", "hits", "overlap"):  # counts over each rank's heads add up
        summed = [sum(r["counters"][name][i] for r in results) for i in range(CONFIG.num_layers)]
        assert summed == alone["counters"][name], name
    if plan_name == "prr":
        assert 0 < sum(alone["counters"]["hits"]) < sum(alone["counters"]["selected"])


def test_shards_split_heads_and_columns_and_keep_biases_once():
    model = full_model()
    shards = [shard_decoder(model, TensorParallel(r, WORLD)) for r in range(WORLD)]
    assert shards[0].config == shard_config(CONFIG, WORLD)
    assert (shards[0].config.num_heads, shards[0].config.num_kv_heads, shards[0].config.intermediate_size) == (4, 2, 48)
    a = [s.model.layers[1].self_attn for s in shards]
    whole = model.model.layers[1].self_attn
    assert torch.equal(torch.cat([x.k_proj.weight for x in a]), whole.k_proj.weight)
    assert torch.equal(torch.cat([x.o_proj.weight for x in a], dim=1), whole.o_proj.weight)
    assert torch.equal(a[0].o_proj.bias, whole.o_proj.bias) and not a[1].o_proj.bias.any()
    x = torch.randn(2, CONFIG.num_heads * CONFIG.head_dim)  # o_proj over all heads = the sum of the shards'
    parts = [torch.nn.functional.linear(x[:, r * 64:(r + 1) * 64], a[r].o_proj.weight, a[r].o_proj.bias)
             for r in range(WORLD)]
    torch.testing.assert_close(parts[0] + parts[1], torch.nn.functional.linear(x, whole.o_proj.weight,
                                                                              whole.o_proj.bias))


def test_a_model_whose_kv_heads_do_not_split_is_refused():
    smollm2_like = ModelConfig(arch="llama", vocab_size=61, hidden_size=64, intermediate_size=96, num_layers=2,
                               num_heads=9, num_kv_heads=3, head_dim=16, rope_theta=10000.0, rope_scaling=None,
                               rms_norm_eps=1e-5, tie_word_embeddings=True)
    with pytest.raises(ValueError, match="num_kv_heads=3 does not split over tensor_parallel=2"):
        shard_decoder(Decoder(smollm2_like, torch.float32, "cpu"), TensorParallel(0, 2))


GPU = os.environ.get("TRITON_INTERPRET") == "0" and torch.cuda.is_available()
CONFIG64 = dataclasses.replace(CONFIG, hidden_size=128, head_dim=64)  # a head_dim the Triton kernels take


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs CUDA and TRITON_INTERPRET=0")
def test_one_rank_over_nccl_captures_the_all_reduce_in_a_cuda_graph(tmp_path):
    """TP = 1 through the TP code path on a GPU: the NCCL all-reduce is captured with the step
    and replayed; the tokens equal the engine's without tensor parallelism."""
    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = Decoder(CONFIG64, torch.float32, "cuda").init_random_(seed=3, std=0.3)
        tp = TensorParallel(0, 1)
        out = []
        for shard in (model, shard_decoder(model, tp)):
            engine = GraphDecoder(shard, dataclasses.replace(plan_of("prr"), block_size=16), batch=1,
                                  max_tokens=MAX_TOKENS, **objects_of("prr"))
            engine.fill_random_context(LENGTH, seed=5)
            graph = engine.capture(lambda e=engine: e.step(advance=True))
            engine.fill_random_context(LENGTH, seed=5)  # the capture's warm-up steps advanced it
            tokens = []
            for _ in range(STEPS):
                graph.replay()
                tokens.append(int(engine.token[0, 0]))
            out.append(tokens)
        assert out[0] == out[1]
    finally:
        dist.destroy_process_group()


def test_run_py_under_torchrun_with_two_ranks_decodes_the_single_process_run(tmp_path):
    """`torchrun --nproc_per_node 2 run.py runtime.tensor_parallel=2 ...` (gloo on the CPU):
    the tokens and hit rate of the same run in one process; only rank 0 writes the run dir."""
    import json
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    common = ["model=tiny-random-d64", "logger=none", "runtime.engine=graph", "selector.dense_layers=[0]",
              "selector.topk_blocks=6", "task.prompt_tokens=300", "task.max_new_tokens=6", "task.stop_at_eos=false",
              "predictor=ema", "predictor.calibrate=true", "runtime.calibration_tokens=24"]  # (EMA calibrates on the tail)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    one = subprocess.run([sys.executable, str(root / "run.py"), *common, f"hydra.run.dir={tmp_path / 'one'}"],
                         capture_output=True, text=True, timeout=300, env=env)
    assert one.returncode == 0, one.stderr[-2000:]
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                          str(root / "run.py"), *common, "runtime.tensor_parallel=2",
                          f"hydra.run.dir={tmp_path / 'two'}"], capture_output=True, text=True, timeout=300, env=env)
    assert two.returncode == 0, two.stderr[-3000:]
    single, parallel = (json.loads((tmp_path / d / "summary.json").read_text()) for d in ("one", "two"))
    assert parallel["tensor_parallel"] == 2 and single["tensor_parallel"] == 1
    assert (parallel["kv_heads_per_rank"], single["kv_heads_per_rank"]) == (1, 2)  # each rank held a shard
    assert parallel["generated_token_ids"] == single["generated_token_ids"]
    assert parallel["hit_rate"] == pytest.approx(single["hit_rate"], abs=1e-12) and 0 < single["hit_rate"] < 1
    # calibration fitted every KV head on each rank: the single process's choice
    assert parallel["budget_setup"]["calibration"] == single["budget_setup"]["calibration"]
    assert not list(tmp_path.glob("two/*rank*"))  # rank 1 wrote into a private temporary directory
    again = subprocess.run(two.args, capture_output=True, text=True, timeout=120, env=env)  # a finished run:
    assert again.returncode == 0 and "already holds this run" in again.stdout  # every rank skips it


def test_tensor_parallel_without_torchrun_is_refused(tmp_path):
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "WORLD_SIZE"}
    done = subprocess.run([sys.executable, str(root / "run.py"), "model=tiny-random-d64", "logger=none",
                           "runtime.engine=graph", "runtime.tensor_parallel=2", f"hydra.run.dir={tmp_path / 'x'}"],
                          capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 2 and "torchrun --nproc_per_node 2" in done.stderr
    assert not (tmp_path / "x").exists()
