"""A run's record files under run_dir/records, each row defined once, flushed as written:
- steps.jsonl: one row per (decode step, layer, batch row, KV head) of the eager runtime;
- tokens.jsonl: one row per decode step (the token it read, its time);
- samples.jsonl: one row per scored sample (scored tasks).
Scored tasks add a `sample` column (the request's index) to steps and tokens."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prr.metrics import layer_step_rows
from prr.sinks import JsonlWriter
from prr.step_record import LayerStepRecord


def token_row(step: int, token: int, wall_s: float, measure_s: float, sample: int | None = None,
              variant: str | None = None) -> dict[str, Any]:
    """tokens.jsonl's row: latency_s is the step's wall time less its untimed measurement work;
    sample: a scored task's request; variant: the graph engine's (serial or prr) for this step."""
    return {**({"sample": sample} if sample is not None else {}), "step": step, "token": token, "wall_s": wall_s,
            "measure_s": measure_s, "latency_s": wall_s - measure_s, **({"variant": variant} if variant else {})}


class RunRecords:
    """The writers of a run dir's records (samples.jsonl with samples=True)."""

    def __init__(self, run_dir: Path, samples: bool = False) -> None:
        self.steps = JsonlWriter(run_dir / "records" / "steps.jsonl")
        self.tokens = JsonlWriter(run_dir / "records" / "tokens.jsonl")
        self.samples = JsonlWriter(run_dir / "records" / "samples.jsonl") if samples else None

    def close(self) -> None:
        for writer in (self.steps, self.tokens, self.samples):
            if writer is not None:
                writer.close()


def step_rows(records: list[LayerStepRecord], **extra: Any) -> list[dict[str, Any]]:
    """steps.jsonl's rows of one decode step's records (extra: e.g. the sample's index, first)."""
    return [{**extra, **row} for r in records for row in layer_step_rows(r)]
