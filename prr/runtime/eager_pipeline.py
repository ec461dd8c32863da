"""The research runtime's pipeline (`runtime.engine=eager`): prefill -> steps, behind the same
interface as the graph engine's (prr/runtime/graph_pipeline.py), for run.py's eager decode
(`EagerDecode`, eager_decode.py: the run's own selector and predictor, a uniform batch, sampling)
and scored requests (`prr.evaluation.Engine`: a fresh selector and predictor per request, so
samples never share state; one request at a time).

Each prefill makes a fresh `EagerRuntime` (its own cache); steps run one at a time (one host look
each) with per-(step, layer, row, KV head) records.
"""

from __future__ import annotations

from typing import Any

import torch
from hydra.utils import instantiate
from torch import Tensor

from prr.runtime.eager_run import EagerRuntime, eager_budget_setup
from prr.runtime.run_strategy import Steps, topk_label


class EagerPipeline:
    """Scored requests on the research runtime (see the module docstring)."""

    label = "eager"
    window = 1
    rows = 1  # requests decoded together

    def __init__(self, cfg: Any, model: Any, settings: Any, budget: Any, ops: Any, max_tokens: int,
                 dtype: torch.dtype, selector: Any = None, predictor: Any = None, reuse: Any = None) -> None:
        """cfg: the run's config (its selector and predictor groups, instantiated per request
        unless selector / predictor give the objects every prefill uses: a decode run's);
        settings: the runtime group; ops: the backend group; max_tokens: the longest request;
        reuse: the decode's selection reuse (prr.reuse; default none)."""
        if selector is None and settings.batch_size != 1:
            raise ValueError(f"runtime.batch_size={settings.batch_size}: the research runtime decodes one "
                             "request at a time; use runtime.batch_size=1 (or runtime.engine=graph)")
        self.cfg, self.model, self.settings, self.budget, self.ops, self.dtype = cfg, model, settings, budget, ops, dtype
        self.selector, self.predictor, self.reuse = selector, predictor, reuse
        self.calibration: dict[str, Any] = {}
        selector = self.new_selector()
        self.selection_backend = selector.set_backend(ops.name)
        self.budget_info, self.device_name = eager_budget_setup(budget, selector, settings, model.decoder, max_tokens,
                                                                dtype, ops.name)
        self.topk_blocks = topk_label(selector)
        self.runtime: EagerRuntime | None = None
        self.position = 0  # the position of the token the next step reads

    def new_selector(self) -> Any:
        if self.selector is not None:
            return self.selector
        selector = instantiate(self.cfg.selector)
        selector.bind_model(self.model.config)
        return selector

    def prefill(self, prompts: Tensor | list[Tensor], kept: list[Any] | None = None, new_tokens: int = 0,
                progress: Any = None, phase: Any = None) -> Tensor | list[Tensor | None]:
        """A request's prompt ([1, T] in a list; a decode run's batch: [B, T]) through a fresh
        runtime of T + new_tokens tokens (kept[0]: a kept dense prefill replayed instead, its q/k/v and
        the hidden states a selector reading them needs),
        the predictor calibrated and warmed on its tail -> logits [B, V] at the last position
        ([None] where a kept prefill was replayed: the caller has them). progress: a tqdm bar of
        the prefill's layers; phase(name): called after each of "replay" (the prefill), "calibrate",
        "warm" and "begin" (experiments/request_cost.py times them)."""
        from prr.progress import PrefillProgress

        phase = phase or (lambda name: None)
        if isinstance(prompts, list) and len(prompts) != 1:
            raise ValueError(f"the research runtime prefills one request at a time, got {len(prompts)}")
        ids = prompts[0] if isinstance(prompts, list) else prompts
        selector = self.new_selector()
        selector.set_backend(self.ops.name)
        predictor = self.predictor if self.predictor is not None else instantiate(self.cfg.predictor)
        self.runtime = runtime = EagerRuntime(self.model.decoder, self.settings, selector, predictor, self.budget,
                                              self.ops.name, ids.shape[1] + new_tokens, self.dtype,
                                              batch=ids.shape[0], reuse=self.reuse)
        with torch.inference_mode():
            if kept is not None and kept[0] is not None:
                runtime.replay_prefill(kept[0])  # same q/k/v: selector metadata and tail rebuilt
                logits = [None]
            else:
                attention = PrefillProgress(runtime.backend, progress) if progress is not None else None
                # (a request's: the LM head at its last position only, as scoring always ran)
                logits = runtime.prefill(ids, attention, last_logits_only=isinstance(prompts, list))  # [B, V]
            phase("replay")
            if progress is not None:
                progress.set_postfix_str("calibrating the predictor")
            self.calibration = runtime.finish_prefill(phase=phase)
        self.position = ids.shape[1]
        phase("begin")
        return logits

    def steps(self, first: list[int], n: int, forced: list[list[int]] | None = None, step: int = 0,
              choose: Any = None) -> list[Steps]:
        """n steps of every row: step 0 reads first[b], step i > 0 the token step i - 1 chose:
        forced[b][i], choose(logits [B, V]) -> [B] (sampling), or the greedy token; `step`: the
        first one's index (records). -> one Steps per row; the step records (every row's) on the
        first row's."""
        rows = len(first)
        out = [Steps(records=[] if b == 0 else None) for b in range(rows)]
        token = torch.tensor(first)
        for i in range(n):
            with torch.inference_mode():
                logits, records, wall, measure_s = self.runtime.step(token, self.position, step + i)  # [B, V]
                scores = logits.float()
                top2 = scores.topk(2, -1).values  # [B, 2]
                best = scores.argmax(-1)  # [B]
                if choose is not None:
                    chosen = choose(logits).view(-1).cpu()
                elif forced is not None:
                    chosen = torch.tensor([row[i] for row in forced])
                else:
                    chosen = best.cpu()
                logprobs = scores.log_softmax(-1).gather(1, chosen.to(scores.device).view(-1, 1))[:, 0]
            for b, o in enumerate(out):
                o.read.append(int(token[b]))
                o.chosen.append(int(chosen[b]))
                o.greedy.append(int(best[b]) == int(chosen[b]))
                o.logprobs.append(float(logprobs[b]))
                o.margins.append(float(top2[b, 0] - top2[b, 1]))
                o.wall_s.append(wall)
                o.measure_s.append(measure_s)
            out[0].records.append(records)
            self.position += 1
            token = chosen
        return out

    def end(self) -> None:
        self.runtime = None

    def results(self) -> dict[str, Any]:
        return {"engine": "eager"}  # (hit rates and timings: from the step records)
