"""The runtime's shape, checked from the source (issue 51's acceptance): no class in prr/runtime/
over 300 lines or 25 instance attributes, and no module reads another object's private
(`_name`) attribute: what a class keeps to itself stays there."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_CLASS_LINES, MAX_ATTRIBUTES = 300, 25
# Underscored names that are no prr class's private state: Hydra's config key, the standard way to
# exit a process without cleanup, torch's tensor version counter (its documented in-place check),
# and Hydra's own rule for applying a key override (prr/override_check.py sets each swept job's
# keys exactly as Hydra will; hydra-core is pinned below 1.4, and tests/test_sweeps.py and
# tests/test_front_door_faults.py would catch a change of it).
NOT_PRIVATE = {"_target_", "_exit", "_version", "_apply_overrides_to_config"}


def class_sizes(source: str) -> list[tuple[str, int, set[str]]]:
    """(class name, lines, names assigned as self.<name> in its methods) of every class in `source`."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef):
            assigned = set()
            for sub in ast.walk(node):
                targets = sub.targets if isinstance(sub, ast.Assign) else [sub.target] if isinstance(
                    sub, ast.AnnAssign | ast.AugAssign) else []
                for target in targets:
                    for t in ast.walk(target):
                        if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                            assigned.add(t.attr)
            out.append((node.name, node.end_lineno - node.lineno + 1, assigned))
    return out


def private_reads(source: str) -> list[tuple[int, str]]:
    """(line, expression) of every `<obj>._name` in `source` where obj is not self or cls."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                and node.attr not in NOT_PRIVATE
                and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))):
            out.append((node.lineno, ast.unparse(node)))
    return out


def test_runtime_classes_stay_small():
    too_big = [f"{path.relative_to(ROOT)}: {name} has {lines} lines and {len(attrs)} instance attributes"
               for path in sorted((ROOT / "prr" / "runtime").glob("*.py"))
               for name, lines, attrs in class_sizes(path.read_text())
               if lines > MAX_CLASS_LINES or len(attrs) > MAX_ATTRIBUTES]
    assert not too_big, f"over {MAX_CLASS_LINES} lines or {MAX_ATTRIBUTES} attributes: {too_big}"


def test_no_module_reads_another_objects_private_state():
    reads = [f"{path.relative_to(ROOT)}:{line}: {expr}" for path in sorted((ROOT / "prr").rglob("*.py"))
             for line, expr in private_reads(path.read_text())]
    assert not reads, "private attributes read from outside their object (make them public or ask the object): " + \
        "; ".join(reads)


def test_the_checks_catch_what_they_name():
    big = "class Big:\n    def __init__(self):\n" + "".join(f"        self.a{i} = {i}\n" for i in range(30))
    ((name, lines, attrs),) = class_sizes(big)
    assert name == "Big" and lines == 32 and len(attrs) == 30
    assert private_reads("engine.attn._k['x']\nself._ok = 1\ncfg._target_\n") == [(1, "engine.attn._k")]
