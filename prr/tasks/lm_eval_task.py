"""`task=lm_eval`: any lm-eval task through the `prr` lm-eval model, inside a prr run.

    python run.py task=lm_eval task.tasks=[prr_niah] task.limit=8 selector=quest predictor=ema

Local YAML tasks (prr/tasks/lm_eval_tasks: RULER-style data generated offline) are always
on the include path; hub tasks (e.g. LongBench) work for users with the hub. The scores
land in summary.json and the logger as `lm_eval/<task>/<metric>`; lm-eval's full results
in lm_eval_results.json; the runtime's per-step records as in any run."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from prr.paths import strict_json_dumps
from prr.tasks.base import PromptBatch, Task

LOCAL_TASKS = Path(__file__).resolve().parent / "lm_eval_tasks"


class LmEvalTask(Task):
    batches_requests = True  # (prr.lm_eval_model.PRRLM scores lm-eval's request lists in batches)

    def __init__(
        self,
        tasks: list[str],
        limit: int | None = None,
        num_fewshot: int | None = None,
        include_path: str | None = None,
        context_tokens: int = 2048,
        max_new_tokens: int = 64,
        metadata: dict | None = None,
        seed: int = 0,
    ) -> None:
        if not tasks:
            raise ValueError("task.tasks is empty: name lm-eval tasks, e.g. task.tasks=[prr_niah]")
        if limit is not None and limit < 1:
            raise ValueError(f"task.limit={limit} must be >= 1 or null (all documents)")
        if include_path is not None and not Path(include_path).expanduser().is_dir():
            raise ValueError(f"task.include_path={include_path!r} is not a directory")
        if context_tokens < 2 or max_new_tokens < 1:
            raise ValueError(f"task.context_tokens={context_tokens} (>= 2) and task.max_new_tokens={max_new_tokens} "
                             "(>= 1) out of range")
        self.tasks, self.limit, self.num_fewshot = list(tasks), limit, num_fewshot
        self.include_path = include_path
        self.context_tokens = self.prompt_tokens = context_tokens  # requests are left-truncated to this
        self.max_new_tokens = max_new_tokens
        self.metadata = dict(metadata or {})
        self.seed = seed

    def prompt_tokens_upper_bound(self) -> int:
        return self.context_tokens

    def evaluate(self, engine: Any) -> dict[str, Any]:
        from lm_eval import simple_evaluate
        from lm_eval.tasks import TaskManager

        from prr.lm_eval_model import PRRLM

        paths = [str(LOCAL_TASKS)] + ([str(Path(self.include_path).expanduser())] if self.include_path else [])
        # The local generators size their data with the run's tokenizer: pass the model name.
        metadata = {"model": engine.model.name, "seed": self.seed, **self.metadata}
        manager = TaskManager(include_path=paths, metadata=metadata)
        lm = PRRLM(engine=engine, max_length=self.context_tokens + self.max_new_tokens, max_gen_toks=self.max_new_tokens)
        results = simple_evaluate(model=lm, tasks=self.tasks, limit=self.limit, num_fewshot=self.num_fewshot,
                                  task_manager=manager, random_seed=self.seed, numpy_random_seed=self.seed,
                                  torch_random_seed=self.seed, fewshot_random_seed=self.seed, log_samples=False)
        if engine.run_dir is not None:
            (engine.run_dir / "lm_eval_results.json").write_text(strict_json_dumps(results["results"], indent=2, default=str))
        metrics: dict[str, Any] = {}
        for task, values in results["results"].items():
            for key, value in values.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool) and key != "alias":
                    metric = key.replace(",none", "")
                    metrics[f"lm_eval/{task}/{metric}"] = None if isinstance(value, float) and math.isnan(value) else value
        metrics["lm_eval/truncated_requests"] = lm.truncated_requests  # cut to context_tokens + max_new_tokens
        return metrics

    def build(self, tokenizer: Any, vocab_size: int, batch_size: int) -> PromptBatch:
        raise ValueError("task=lm_eval is scored through lm-eval (the runner's evaluation path), not one prompt")
