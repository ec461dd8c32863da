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
