"""prr: Predict–Reuse–Repair for dynamic sparse attention in long-context LLM decoding."""

import importlib.util
import sys
from pathlib import Path


def _map_folder(name: str, folder_name: str) -> None:
    """Make the repo's `folder_name`/ folder importable as prr.`name` from a source checkout.

    Installed builds map kernels/ and analysis/ through setuptools (pyproject: package-dir
    "prr.kernels" = "kernels", "prr.analysis" = "analysis"); a plain checkout on PYTHONPATH
    (e.g. the GPU machine) has no such mapping. In a checkout (pyproject.toml beside prr/) its
    own folder wins over an editable install's mapping, which may be another checkout's (a
    worktree run with PYTHONPATH beside an install of the main one). The folders are never
    importable under their bare names through this path.
    """
    module_name = f"prr.{name}"
    if module_name in sys.modules:
        return
    root = Path(__file__).resolve().parent.parent
    folder = root / folder_name
    in_checkout = (root / "pyproject.toml").is_file() and (folder / "__init__.py").is_file()
    if not in_checkout:
        return  # an installed build: setuptools' mapping (or none)
    spec = importlib.util.spec_from_file_location(module_name, folder / "__init__.py",
                                                  submodule_search_locations=[str(folder)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)


_map_folder("kernels", "kernels")
_map_folder("analysis", "analysis")
