"""The `runtime` config group: how a run executes (not what it selects or predicts). No torch
here: run.py checks these values before importing it (prr.config_check.CHECKED_BEFORE_TORCH)."""

from __future__ import annotations

import os
from dataclasses import dataclass

RUN_MODES = ("sparse", "shadow")
REPAIR_MODES = ("exact", "superset")
ENGINES = ("eager", "graph")
PROJECTIONS = ("auto", "torch", "fused")


def is_power_of_two(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


@dataclass
class RuntimeSettings:
    mode: str = "sparse"  # sparse | shadow
    repair_mode: str = "exact"  # exact | superset
    block_size: int = 16  # tokens per KV block (page)
    batch_size: int = 1
    device: str = "cpu"
    dtype: str = "float32"
    calibration_tokens: int = 32  # prefill-tail positions replayed for predictor calibration/warm-up
    dense_metrics_every: int = 1  # compute dense attention for recall/error every N decode steps
    check_serial: bool = False  # also attend A in one piece and record PRR-vs-serial error
    # eager: the research runtime (per-head records); graph: the CUDA-graph engine
    # (prr/runtime/graph_decode.py; runtime=cuda's default): the same selector and predictor
    # objects, per-layer device counters, per-token device time. Both run scored tasks.
    engine: str = "eager"
    # engine=graph only: the decode step's projections. torch: F.linear (cuBLAS) with separate
    # norm / SiLU / residual kernels; fused: prr.kernels.dense_gemv (one Triton launch each, those
    # inside; faster than cuBLAS at batch 1, slower above it on the H200); auto: fused on a GPU
    # at batch_size 1, torch otherwise.
    projections: str = "auto"
    # A ragged batch (engine=graph only): one prompt length per row, row b decoding from the
    # prompt's last row_tokens[b] tokens (e.g. [4000, 1000]); batch_size must equal its length.
    # None: every row holds the whole prompt.
    row_tokens: list[int] | None = None
    # Tensor parallelism over this many processes (engine=graph; launch with
    # `torchrun --nproc_per_node N run.py ...`): each holds its share of heads and FFN columns
    # (prr.model.tensor_parallel), rank 0 writes the run dir.
    tensor_parallel: int = 1

    def __post_init__(self) -> None:
        if self.row_tokens is not None:  # (Hydra passes a ListConfig)
            self.row_tokens = [int(n) for n in self.row_tokens]

    def graph_projections(self) -> str:
        """The graph engine's projections for this run (`projections` with auto resolved)."""
        if self.projections != "auto":
            return self.projections
        fused = self.device.startswith("cuda") and self.batch_size == 1 and self.tensor_parallel == 1
        return "fused" if fused else "torch"

    def problems(self) -> list[str]:
        out = []
        if self.mode not in RUN_MODES:
            out.append(f"runtime.mode={self.mode!r} is not one of {list(RUN_MODES)}")
        if self.repair_mode not in REPAIR_MODES:
            out.append(f"runtime.repair_mode={self.repair_mode!r} is not one of {list(REPAIR_MODES)}")
        if not is_power_of_two(self.block_size):
            out.append(f"runtime.block_size={self.block_size} must be a power of two (e.g. 16, 32, 64)")
        if self.batch_size < 1:
            out.append(f"runtime.batch_size={self.batch_size} must be >= 1")
        if self.dtype not in ("float32", "float16", "bfloat16"):
            out.append(f"runtime.dtype={self.dtype!r} is not one of ['float32', 'float16', 'bfloat16']")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            out.append(f"runtime.device={self.device!r} must be 'cpu' or 'cuda[:N]'")
        if self.calibration_tokens < 1:
            out.append(f"runtime.calibration_tokens={self.calibration_tokens} must be >= 1")
        if self.engine not in ENGINES:
            out.append(f"runtime.engine={self.engine!r} is not one of {list(ENGINES)}")
        if self.projections not in PROJECTIONS:
            out.append(f"runtime.projections={self.projections!r} is not one of {list(PROJECTIONS)}")
        elif self.projections != "auto" and self.engine != "graph":
            out.append(f"runtime.projections={self.projections} applies to runtime.engine=graph only (engine is "
                       f"{self.engine!r}); leave it at auto or add runtime.engine=graph")
        if self.dense_metrics_every < 1:
            out.append(f"runtime.dense_metrics_every={self.dense_metrics_every} must be >= 1")
        if self.tensor_parallel < 1:
            out.append(f"runtime.tensor_parallel={self.tensor_parallel} must be >= 1")
        elif self.tensor_parallel > 1 and self.engine != "graph":
            out.append(f"runtime.tensor_parallel={self.tensor_parallel} runs on runtime.engine=graph only (engine is "
                       f"{self.engine!r})")
        elif self.tensor_parallel > 1 and os.environ.get("WORLD_SIZE") != str(self.tensor_parallel):
            tp = self.tensor_parallel
            out.append(f"runtime.tensor_parallel={tp} needs {tp} processes (this one sees WORLD_SIZE="
                       f"{os.environ.get('WORLD_SIZE')}): launch with `torchrun --nproc_per_node {tp} run.py ...`")
        if self.row_tokens is not None:
            if self.engine != "graph":
                out.append(f"runtime.row_tokens={self.row_tokens} (a ragged batch) runs on runtime.engine=graph only "
                           f"(engine is {self.engine!r}): the eager runtime keeps one length per layer for every row")
            if len(self.row_tokens) != self.batch_size:
                out.append(f"runtime.row_tokens has {len(self.row_tokens)} lengths but runtime.batch_size="
                           f"{self.batch_size}: give one length per row")
            short = [n for n in self.row_tokens if n <= self.calibration_tokens]
            if short:
                out.append(f"runtime.row_tokens {short} must exceed runtime.calibration_tokens="
                           f"{self.calibration_tokens} (each row's prefill tail warms the predictor)")
        return out
