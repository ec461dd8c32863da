"""The `model` config group: which model, in which dtype and on which device. Instantiating
it loads nothing; `describe()` reads only the config (for validation before loading)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ModelSpec:
    name_or_path: str = "smollm2-135m"  # a zoo name, a local safetensors dir or .gguf file, or an HF id
    cache_dir: str | None = None  # where converted weights go (default $PRR_CACHE_DIR or ~/.cache/prr)
    num_layers: int | None = None  # truncate/override layer count (random-init shapes only)

    def describe(self):
        from prr.model.describe import describe_model

        return describe_model(self.name_or_path, self.cache_dir, num_layers=self.num_layers)

    def load(self, dtype: str, device: str):
        from prr.model.loading import load_model

        return load_model(self.name_or_path, dtype=dtype, device=device, cache_dir=self.cache_dir,
                          num_layers=self.num_layers)
