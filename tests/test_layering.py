"""prr's layers, lowest first: a module imports only from its own layer or those below it
(every import counts: module level, inside functions, and under `if TYPE_CHECKING:`, since an
annotation's type is a dependency too). tests/test_import_graph.py checks the cycles; this
checks the direction. docs/design.md ("Layers") says the same order in words.

An entry names a package (every module under it) or a module; a module's layer is that of the
longest entry naming it, so `prr.tasks.lm_eval_task` (a task that drives lm-eval over a built
evaluation Engine) sits above the rest of prr.tasks. A new module must be listed (or fall under
a listed package): the test names any that is not."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.test_import_graph import module_files

LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("kernels", ("prr.kernels",)),
    ("core", ("prr.attention_state", "prr.blocks", "prr.step_record", "prr.cli_exits", "prr.eos", "prr.intervals",
              "prr.lazy_exports", "prr.override_check", "prr.paths", "prr.progress", "prr.gpu_probe", "prr.bench_args",
              "prr.run_inputs", "prr.sinks")),
    ("model", ("prr.model",)),
    ("tasks", ("prr.tasks",)),  # prompts, samples and their scoring: they know the model's tokenizer only
    ("cache", ("prr.cache", "prr.block_attention")),
    ("selectors", ("prr.selectors",)),
    ("policies", ("prr.predictors", "prr.budget", "prr.reuse")),
    ("measurement", ("prr.metrics", "prr.run_records", "prr.cost_model")),  # a step's records -> rows and aggregates
    ("runtime", ("prr.runtime",)),
    ("run", ("prr.evaluation", "prr.config_check", "prr.summary_table", "prr.results_store", "prr.provenance")),
    ("driver", ("prr.driver",)),
    ("front ends", ("prr.runner", "prr.front_door", "prr.benchmarking", "prr.lm_eval_model", "prr.lm_eval_cli",
                    "prr.tasks.lm_eval_task")),
]
EXEMPT = {"prr"}  # the package's __init__: maps kernels/ and analysis/, imports nothing of prr


def layer_of(module: str) -> tuple[int, str] | None:
    """(rank, layer name) of the longest LAYERS entry naming `module`, None if none does."""
    best: tuple[int, int, str] | None = None  # (entry length, rank, name)
    for rank, (name, entries) in enumerate(LAYERS):
        for entry in entries:
            if (module == entry or module.startswith(entry + ".")) and (best is None or len(entry) > best[0]):
                best = (len(entry), rank, name)
    return None if best is None else (best[1], best[2])


def imported_modules(source: str, known: set[str]) -> list[tuple[int, str]]:
    """(line, module) of every prr import in `source` that names a module in `known`
    (`from a.b import c` names a.b.c when that is a module, else a.b; relative imports are not used in prr)."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:
                name = f"{node.module}.{alias.name}"
                out.append((node.lineno, name if name in known else node.module))
        elif isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
    return [(line, module) for line, module in out if module in known]


def upward_imports(importer: str, where: str, source: str, known: set[str]) -> list[str]:
    """One message per import of `source` (module `importer`, file `where`) that runs up a layer."""
    own = layer_of(importer)
    if own is None:
        return [f"{where}: module {importer} is in no layer of tests/test_layering.py's LAYERS: add it"]
    out = []
    for line, module in imported_modules(source, known):
        target = layer_of(module)
        if target is not None and target[0] > own[0]:
            out.append(f"{where}:{line}: {importer} (layer {own[1]}) imports {module} (layer {target[1]}, above it)")
    return out


def test_no_import_inside_prr_runs_up_a_layer():
    modules = module_files()
    root = Path(__file__).resolve().parents[1]
    problems = []
    for name, path in sorted(modules.items()):
        if name not in EXEMPT:
            problems += upward_imports(name, str(path.relative_to(root)), path.read_text(encoding="utf-8"),
                                       set(modules))
    assert problems == [], "\n".join(problems)


def test_a_planted_upward_import_is_named_with_its_line_and_both_layers():  # the check above can fail
    known = set(module_files())
    source = "import torch\n\ndef f():\n    from prr.runtime.graph_run import GraphDecode\n"
    assert upward_imports("prr.cache", "prr/cache.py", source, known) == [
        "prr/cache.py:4: prr.cache (layer cache) imports prr.runtime.graph_run (layer runtime, above it)"]
    typing_only = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from prr.runtime import eager_run\n"
    assert upward_imports("prr.budget.base", "prr/budget/base.py", typing_only, known) == [
        "prr/budget/base.py:3: prr.budget.base (layer policies) imports prr.runtime.eager_run (layer runtime, "
        "above it)"]
    assert upward_imports("prr.runtime.eager_run", "x.py", "from prr.cache import PagedKVCache\n", known) == []


def test_a_module_in_no_layer_is_named():
    assert upward_imports("prr.newthing", "prr/newthing.py", "", set()) == [
        "prr/newthing.py: module prr.newthing is in no layer of tests/test_layering.py's LAYERS: add it"]
    assert layer_of("prr.tasks.lm_eval_task") == (len(LAYERS) - 1, "front ends")
    assert layer_of("prr.tasks.niah")[1] == "tasks"
