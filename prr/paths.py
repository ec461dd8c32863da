"""Where prr keeps caches, and atomic file writes (a crash never leaves a half file)."""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any


def cache_dir() -> Path:
    """$PRR_CACHE_DIR, else ~/.cache/prr. Converted models and budget profiles live here."""
    env = os.environ.get("PRR_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "prr"


def cache_dir_problem() -> str | None:
    """Why the cache dir cannot hold prr's caches (one line), or None: a file where the dir
    should be, or a missing dir that cannot be created."""
    root = cache_dir()
    source = f"PRR_CACHE_DIR={os.environ['PRR_CACHE_DIR']!r}" if os.environ.get("PRR_CACHE_DIR") else f"the cache dir {root}"
    existing = root
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return f"{source}: {existing} is a file, not a directory; point PRR_CACHE_DIR at a directory"
    if existing != root and not os.access(existing, os.W_OK | os.X_OK):  # (a cache already there may be read-only)
        return f"{source}: {root} cannot be created in {existing}; point PRR_CACHE_DIR at a writable directory"
    return None


def write_text_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; give the file the user's usual permissions
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_safetensors_atomic(path: Path, tensors: dict, metadata: dict[str, str]) -> None:
    """tensors (name -> CPU tensor) as safetensors with `metadata` in its header, written atomically
    (never pickle)."""
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata=metadata)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json_atomic(path: Path, obj: Any) -> None:
    """obj as strict JSON (strict_json_dumps), written atomically."""
    write_text_atomic(path, strict_json_dumps(obj, indent=2) + "\n")


def strict_json_dumps(obj: Any, indent: int | None = None, default: Any = str) -> str:
    """JSON that strict parsers (jq, browsers, json.loads with parse_constant refusing NaN) read:
    NaN and +-Infinity (a rate over nothing, e.g. precision with no predicted block) become null,
    which readers take as missing (prr.results_store turns a summary's null back into NaN).
    Values JSON has no type for are written as default(value) (their str()) and checked again."""
    return json.dumps(finite_or_null(obj), indent=indent, default=lambda v: finite_or_null(default(v)),
                      allow_nan=False)


def finite_or_null(obj: Any) -> Any:
    """obj with every non-finite float (numpy's float64 included) replaced by None, recursively."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite_or_null(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite_or_null(v) for v in obj]
    return obj


def remove_empty_run_dir(run_dir: Path, created_after: float) -> bool:
    """Remove run_dir when it is empty and was created (or last changed) at or after
    `created_after` (a time.time() taken before Hydra made the dir): the run dir of a run that
    was refused before writing anything. A dir holding anything, or an empty one that was
    already there before this process started, is left alone. True when removed."""
    try:
        if any(run_dir.iterdir()) or run_dir.stat().st_mtime < created_after:
            return False
        run_dir.rmdir()  # fails, and keeps the dir, if something appeared in it meanwhile
    except OSError:
        return False
    return True
