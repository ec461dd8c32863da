"""Whether this machine can have a GPU that torch would see, asked without importing torch
(1-1.5 s on a 2-core machine): run.py refuses runtime.device=cuda on a machine without a GPU
driver before torch is imported. Only the negative answer is trusted: where a driver is present,
torch decides (prr.config_check.validate asks it)."""

from __future__ import annotations

import glob
import os

# What a GPU driver that torch.cuda can use leaves on Linux: NVIDIA's, AMD's ROCm (torch.cuda is HIP
# there), WSL's GPU paravirtualization
DRIVER_PATHS = ("/proc/driver/nvidia/version", "/dev/nvidiactl", "/dev/nvidia[0-9]*", "/dev/kfd", "/dev/dxg")


def missing_gpu_driver() -> str | None:
    """Why this machine has no GPU driver (the paths looked for), or None where one may be present."""
    if any(glob.glob(path) for path in DRIVER_PATHS):
        return None
    if not os.path.isdir("/dev"):  # not Linux (Windows): no way to tell here; torch decides
        return None
    return f"none of {', '.join(DRIVER_PATHS)} exists"
