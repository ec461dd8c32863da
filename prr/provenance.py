"""What produced a run: the code (git commit, and whether the checkout had uncommitted changes)
and the versions of the packages whose behaviour its numbers depend on. The runner writes it
into each run dir as provenance.json when the run goes ahead."""

from __future__ import annotations

import importlib.metadata
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("prr", "torch", "triton", "transformers")


def git_state(root: Path = ROOT) -> dict[str, Any]:
    """{"commit": sha or None, "dirty": bool or None}: None where root is not a git checkout or
    git is missing. git runs with fixed arguments and no shell."""
    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout if done.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    if commit is None:
        return {"commit": None, "dirty": None}
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": commit.strip(), "dirty": None if status is None else bool(status.strip())}


def versions() -> dict[str, str | None]:
    """Installed versions of PACKAGES (None: not installed)."""
    out: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    if out.get("torch") is not None and "torch" in sys.modules:  # the build actually imported (+cpu, +cu128)
        out["torch"] = sys.modules["torch"].__version__
    return out


def provenance() -> dict[str, Any]:
    return {"git": git_state(), "versions": versions(), "python": platform.python_version(),
            "argv": sys.argv[1:]}
