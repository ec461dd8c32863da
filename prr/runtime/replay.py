"""The recorded serial pass of predictors that replay selections (`Predictor.replays_selections`:
the benchmark tool bench_hit_rate, prr/predictors/bench_hit_rate.py).

Before decoding, from where the engine stands (the prompt's end, the predictor state warmed):
checkpoint; decode the run's steps as serial DSA with the predictor learning from each sparse
layer's A (a `learn_in_serial` view, uncaptured), which it records; rewind to the checkpoint
(position, token, metadata, counters and predictor state; K/V past the prompt is rewritten by
the run); then the predictor builds P of every step from what it recorded. The run that follows
starts from the same state and reads, at each step, the recorded pass's next token as its input
(`GraphDecoder.forced_tokens`, teacher forcing), so it stays on the recorded trajectory even where
its bf16 output differs from serial DSA's in the last bits and a greedy token would flip: its
step t selects the recorded A_t, up to near-ties that such bits can flip (the engine's counters
measure the rate the run had).
"""

from __future__ import annotations

from typing import Any

import torch


def record_serial_pass(engine: Any, rows: list[int]) -> dict[str, Any]:
    """engine: a GraphDecoder built for PRR with a replaying predictor, at the prompt's end;
    rows: [B] tokens each row holds. The pass covers every step the engine's cache has room for
    (max_tokens - 1 - the longest row: the run's max_new_tokens, and up to a block more where the
    cache rounds its size up to whole blocks). -> the predictor's record of its script (steps,
    |P|, the hit rate it makes, exactly, and per step)."""
    predictor, state = engine.predictor, engine.predictor_state
    steps = engine.max_tokens - 1 - max(rows)
    if steps < 1:
        raise ValueError(f"no decode step fits after {max(rows)} tokens in a cache of {engine.max_tokens}")
    bs = engine.plan.block_size
    with torch.inference_mode():  # (the prefill's tensors, the predictor state among them, are inference tensors)
        capacity = engine.selector.capacity(engine.group, engine.max_blocks)  # |A| at most (the engine's A buffers)
        predictor.start_recording(state, steps, engine.batch, engine.hkv, capacity, engine.max_blocks)
        start = engine.checkpoint()
        serial = engine.with_plan(variant="serial", learn_in_serial=True, count_hits=False, measure_dense=False)
        tokens = []
        for _ in range(steps):
            serial.step(advance=True)
            tokens.append(serial.token.clone())
        engine.restore(start)
        # teacher forcing: each step of the run reads the recorded pass's next token, so it selects
        # from the recorded context even where its own bf16 output differs from serial DSA's in the
        # last bits (exact-mode PRR merges the same blocks in another grouping) and a greedy token flips
        forced = torch.full((engine.batch, engine.max_tokens), -1, dtype=torch.long, device=engine.device)
        recorded = torch.cat(tokens, 1)  # [B, steps]: row b's token after position rows[b] + s
        for b, n in enumerate(rows):  # one copy per row (rows may start at different positions)
            forced[b, n : n + steps] = recorded[b]
        engine.forced_tokens = forced
        # blocks of step s's context per row: rows[b] + s + 1 tokens
        num_blocks = torch.tensor([[(n + s + bs) // bs for n in rows] for s in range(steps)], dtype=torch.int64)
        info = predictor.finish_recording(state, num_blocks, engine.plan.predicted_blocks,
                                          [i for i in range(engine.num_layers) if engine.sparse[i]])
    info["serial_tokens"] = torch.cat(tokens, 1).tolist()  # [B][steps]: the trajectory the run replays
    info["tokens"] = "forced: each step's input is the recorded serial pass's (teacher forcing)"
    return info
