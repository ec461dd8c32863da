"""kernels/ is importable only as prr.kernels; transformers' probe for the PyPI package
`kernels` must not mistake our folder for it (DESIGN.md §2)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_transformers_does_not_see_our_kernels_folder():
    # From the repo root, where `python run.py` puts our folder on sys.path.
    code = "from transformers.utils.import_utils import is_kernels_available; print(is_kernels_available())"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "False"


def test_kernels_folder_has_no_side_effects_or_version():
    text = (ROOT / "kernels" / "__init__.py").read_text()
    assert "__version__" not in text and "import" not in text



def make_rule(makefile: str, target: str) -> str:
    """The rule of `target`: its line and its recipe (the tab-indented lines after it)."""
    found = re.search(rf"^{re.escape(target)}:.*\n(?:\t.*\n)+", makefile, re.M)
    assert found, f"no rule for {target} in the Makefile"
    return found.group(0)


def test_make_run_installs_the_core_only_and_make_test_the_extras():
    """Issue 23: `make run` needs the core dependencies and the model, not the extras; the 1 GB
    Triton is a test (dev) dependency, not a core one (a CPU run uses torch ops)."""
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert not [d for d in project["dependencies"] if d.startswith("triton")]
    assert [d for d in project["optional-dependencies"]["dev"] if d.startswith("triton")]
    makefile = (ROOT / "Makefile").read_text()
    run_install, test_install = make_rule(makefile, "$(RUN_STAMP)"), make_rule(makefile, "$(TEST_STAMP)")
    assert "$(PIP) install -q -e .\n" in run_install and ".[" not in run_install
    assert make_rule(makefile, "run").startswith("run: $(RUN_STAMP)")
    assert 'install -q -e ".[$(EXTRAS)]"' in test_install and "EXTRAS ?= wandb,dev,analysis,eval" in makefile
    for target in ("install", "test", "test-full", "lint", "figures"):
        assert "$(TEST_STAMP)" in make_rule(makefile, target)
    for recipe in (run_install, test_install):  # every pip step says first what it installs
        assert recipe.count("prr: installing") >= recipe.count("$(PIP) install") > 0
