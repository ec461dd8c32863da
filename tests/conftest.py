"""Test-session setup. TRITON_INTERPRET must be set before any kernel module imports, so
Triton kernels (when present) run on the CPU interpreter here."""

import os
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never reach a hub

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# Triton decides at decoration time whether a @triton.jit function is interpreted. Decorate
# triton.language and every kernel now, under this process's TRITON_INTERPRET: a test that
# unsets it (to check what backend=triton refuses on a CPU) must not be the first to import
# them, or later tests in the same process get compiled kernels that cannot run on a CPU.
try:
    import triton.language  # noqa: F401
except ImportError:  # `make install-run` has no Triton: kernel tests skip or refuse on their own
    pass
else:
    import importlib
    import pkgutil

    _kernels = importlib.import_module("prr.kernels")
    for _module in pkgutil.iter_modules(_kernels.__path__):
        importlib.import_module(f"prr.kernels.{_module.name}")
