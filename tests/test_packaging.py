"""kernels/ is importable only as prr.kernels; transformers' probe for the PyPI package
`kernels` must not mistake our folder for it (DESIGN.md §2)."""

import subprocess
import sys
from pathlib import Path

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
