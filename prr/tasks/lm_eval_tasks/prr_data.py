"""Data and scoring of the local lm-eval tasks (prr_niah, prr_vt, prr_qa): the same seeded
generators as `python run.py task=ruler_*`, turned into lm-eval datasets offline.

lm-eval passes the task's metadata plus the model_args as keyword arguments: `model` (a
prr model name) picks the tokenizer that sizes the context (byte ids for random-init
models); `context_tokens`, `num_samples` and `seed` size the data (--metadata '{...}')."""

from __future__ import annotations

from typing import Any

from prr.tasks.samples import ByteTokenizer, SampleTask, string_match_all


def tokenizer_for(model: str) -> Any:
    """The tokenizer of a prr model name (zoo name, local dir or hub id), without its weights."""
    from prr.model.zoo import ZOO, ChunkedWheelGGUFSpec, RandomInitSpec, WheelGGUFSpec

    spec = ZOO.get(model)
    if isinstance(spec, RandomInitSpec):
        return ByteTokenizer()
    from transformers import AutoTokenizer

    if isinstance(spec, WheelGGUFSpec | ChunkedWheelGGUFSpec):  # the converted weights' directory holds it
        from prr.model.loading import zoo_weights_dir

        return AutoTokenizer.from_pretrained(zoo_weights_dir(spec))
    return AutoTokenizer.from_pretrained(model)


def _dataset(task_class: type[SampleTask], metadata: dict[str, Any], **options: Any) -> dict[str, Any]:
    import datasets

    model = metadata.get("model.name_or_path") or metadata.get("model") or "smollm2-135m"
    task = task_class(context_tokens=int(metadata.get("context_tokens", 1024)),
                      num_samples=int(metadata.get("num_samples", 20)), seed=int(metadata.get("seed", 0)), **options)
    rows = [{"input": s.prompt, "outputs": list(s.answers), "gen_prefix": s.gen_prefix}
            for s in task.samples(tokenizer_for(str(model)))]
    return {"test": datasets.Dataset.from_list(rows)}


def niah(**metadata: Any) -> dict[str, Any]:
    from prr.tasks.niah import NeedleTask

    return _dataset(NeedleTask, metadata)


def variable_tracking(**metadata: Any) -> dict[str, Any]:
    from prr.tasks.variable_tracking import VariableTrackingTask

    return _dataset(VariableTrackingTask, metadata)


def qa(**metadata: Any) -> dict[str, Any]:
    from prr.tasks.qa import ClozeQATask

    return _dataset(ClozeQATask, metadata)


def process_results(doc: dict[str, Any], results: list[str]) -> dict[str, float]:
    """RULER's string_match_all: the fraction of the expected strings in the generation."""
    return {"string_match": string_match_all(results[0], tuple(doc["outputs"]))}
