"""Times selection, speculation and the whole attention stage (the eager runtime's step:
`PRRStep.sparse_attention` run stage by stage, as DSABackend runs it) for one layer of
the model's shape on the running device, on random data in a scratch cache: what
`budget=profiled` measures when the eager runtime decodes."""

from __future__ import annotations

import math
import platform
import time

import torch

from prr.blocks import BlockSet, controlled_predictions
from prr.budget.base import StageTiming
from prr.cache import PagedKVCache
from prr.predictors.base import NEVER, Predictor
from prr.runtime.prr_step import PRRStep
from prr.runtime.timing import StageTimer
from prr.selectors.base import Selection, Selector


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu:{platform.processor() or platform.machine()}:threads={torch.get_num_threads()}"


def host_timing(fn, repeats: int, device: torch.device) -> StageTiming:
    """fn() timed by the host clock over `repeats` runs after one warm-up (seconds; on CUDA
    with a synchronisation around each run, so it is the eager launch-and-wait time)."""
    fn()
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        samples.append(time.perf_counter() - start)
    return StageTiming.of(samples)


class GivenPrediction(Predictor):
    """P fixed from outside (a controlled hit rate): what the stage timing speculates over.
    It ranks P's blocks first (in P's order) and never proposes any other."""

    def __init__(self, blocks: BlockSet, max_blocks: int) -> None:
        self.blocks, self.max_blocks = blocks, max_blocks

    def init_state(self, num_layers, batch, num_kv_heads, max_blocks, device) -> None:
        return None

    def rank(self, state, layer, num_blocks):
        """-> [B, Hkv, max_blocks]: P's i-th block scores C - i, every other block NEVER."""
        idx, valid = self.blocks.indices.long(), self.blocks.valid()
        c = idx.shape[-1]
        scores = torch.full((*idx.shape[:-1], self.max_blocks + 1), NEVER, device=idx.device)
        order = (c - torch.arange(c, device=idx.device, dtype=torch.float32)).expand(idx.shape)
        return scores.scatter_(-1, torch.where(valid, idx, self.max_blocks), order)[..., : self.max_blocks]

    def update(self, state, layer: int, selection: Selection) -> None:
        return None

    def propose(self, state, layer, num_blocks, budget_blocks, current=None, query=None) -> BlockSet:
        return self.blocks


class StageProbe:
    # The eager step (StaticPlan.eager) runs speculate, select, repair and merge one after the
    # other, on any device: budget=profiled's stage check then knows |P| = 0 without timing.
    stages_in_sequence = True

    def __init__(
        self,
        selector: Selector,
        repair_mode: str,
        batch: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        max_tokens: int,
        dtype: torch.dtype,
        device: torch.device,
        repeats: int = 9,
        seed: int = 0,
        backend: str = "torch",
    ) -> None:
        """backend: the op backend the runtime's step runs on (prr/runtime/engine_ops.py)."""
        self.selector, self.repair_mode, self.repeats = selector, repair_mode, repeats
        self.device, self.backend, self.num_heads = device, backend, num_heads
        self.device_name = device_name(device)
        self.shape_key = (f"B={batch} Hq={num_heads} Hkv={num_kv_heads} D={head_dim} block={block_size} "
                          f"dtype={dtype} ops={backend} selector={type(selector).__name__}:{selector.gqa_reduce} repair={repair_mode}")
        self._shape = (batch, num_heads, num_kv_heads, head_dim, block_size, max_tokens, dtype, seed)
        self.scale = 1.0 / math.sqrt(head_dim)
        self._cache: PagedKVCache | None = None  # built on first use: budgets that never probe pay nothing

    def _scratch(self) -> tuple[PagedKVCache, torch.Tensor]:
        """A one-layer cache full of random keys/values, and a random grouped query."""
        if self._cache is None:
            batch, num_heads, num_kv_heads, head_dim, block_size, max_tokens, dtype, seed = self._shape
            gen = torch.Generator(device="cpu").manual_seed(seed)
            cache = PagedKVCache(1, batch, num_kv_heads, head_dim, block_size, max_tokens, dtype, self.device)
            shape = (batch, num_kv_heads, cache.max_tokens, head_dim)
            cache.append(0, torch.randn(shape, generator=gen).to(self.device, dtype),
                         torch.randn(shape, generator=gen).to(self.device, dtype))
            self.selector.update_metadata(cache, 0, 0, cache.max_tokens)
            self._q = torch.randn(batch, num_kv_heads, num_heads // num_kv_heads, head_dim, generator=gen).to(self.device, dtype)
            self._cache = cache
        return self._cache, self._q

    def _timing(self, fn) -> StageTiming:
        return host_timing(fn, self.repeats, self.device)

    def time_select(self, context_blocks: int) -> StageTiming:
        cache, q = self._scratch()
        length = context_blocks * cache.block_size
        return self._timing(lambda: self.selector.select(q, cache, 0, length=length))

    def _engine(self, cache: PagedKVCache, predictor: Predictor | None, timer: StageTimer | None = None
                ) -> PRRStep:
        """The eager runtime's step over the scratch cache (stages one after the other)."""
        return PRRStep.eager(cache, self.num_heads, self.selector, predictor, self.backend,
                                          self.repair_mode, timer)

    @staticmethod
    def _positions(cache: PagedKVCache, context_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (lengths [B], num_blocks [B]) int32 of a context of context_blocks whole blocks."""
        b, dev = cache.batch, cache.keys[0].device
        return (torch.full((b,), context_blocks * cache.block_size, dtype=torch.int32, device=dev),
                torch.full((b,), context_blocks, dtype=torch.int32, device=dev))

    def time_speculate(self, predicted_blocks: int, context_blocks: int) -> StageTiming:
        cache, q = self._scratch()
        lengths, _ = self._positions(cache, context_blocks)
        b, h = q.shape[:2]
        ids = torch.randperm(context_blocks)[:predicted_blocks].sort().values.to(self.device, torch.int32)
        idx = ids.expand(b, h, -1).contiguous()
        cnt = torch.full((b, h), predicted_blocks, dtype=torch.int32, device=self.device)
        engine, flat = self._engine(cache, None), q.reshape(b, -1, q.shape[-1])  # [B, Hq, D]
        per_block = self.repair_mode == "exact"
        return self._timing(lambda: engine.attend(0, flat, idx, cnt, lengths, per_block=per_block))

    def time_stage(self, context_blocks: int, predicted_blocks: int, hit_rate: float) -> StageTiming:
        """The eager runtime's attention stage (PRRStep.sparse_attention, stages one
        after the other, timed) over this context: serial DSA for predicted_blocks = 0, else PRR
        with P of that many blocks holding hit_rate of A."""
        cache, q = self._scratch()
        length = context_blocks * cache.block_size
        selection = self.selector.select(q, cache, 0, length=length)
        gen = torch.Generator().manual_seed(self._shape[-1])
        idx, cnt = controlled_predictions((selection.blocks.indices, selection.blocks.count), hit_rate,
                                          context_blocks, gen, size=predicted_blocks)
        given = GivenPrediction(BlockSet(idx[..., :predicted_blocks], cnt), cache.max_blocks)
        timer = StageTimer(self.device)
        engine = self._engine(cache, given, timer)
        lengths, num_blocks = self._positions(cache, context_blocks)
        flat = q.reshape(q.shape[0], -1, q.shape[-1])  # [B, Hq, D]

        def stage() -> None:
            engine.sparse_attention(0, flat, lengths, num_blocks, predicted_blocks=predicted_blocks)
            timer.take()
        return self._timing(stage)
