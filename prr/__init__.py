"""prr: Predict–Reuse–Repair for dynamic sparse attention in long-context LLM decoding."""

import importlib.util
import sys
from pathlib import Path


def _map_kernels_folder() -> None:
    """Make the repo's kernels/ folder importable as prr.kernels from a source checkout.

    Installed builds map it through setuptools (pyproject: package-dir "prr.kernels" =
    "kernels"); a plain checkout on PYTHONPATH (e.g. the GPU machine) has no such mapping.
    The folder is never importable under the bare name `kernels` through this path.
    """
    if "prr.kernels" in sys.modules or importlib.util.find_spec("prr.kernels") is not None:
        return
    folder = Path(__file__).resolve().parent.parent / "kernels"
    if (folder / "__init__.py").is_file():
        spec = importlib.util.spec_from_file_location("prr.kernels", folder / "__init__.py",
                                                      submodule_search_locations=[str(folder)])
        module = importlib.util.module_from_spec(spec)
        sys.modules["prr.kernels"] = module
        spec.loader.exec_module(module)


_map_kernels_folder()
