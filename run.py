"""prr entry point: `python run.py selector=quest predictor=ema budget=profiled`.
Sweeps: `python run.py -m selector=quest,exact predictor=none,last_step,ema`."""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from prr.config_check import ConfigError
from prr.runner import run


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> float | None:
    try:
        hydra_cfg = HydraConfig.get()
        summary = run(cfg, Path(hydra_cfg.runtime.output_dir), hydra_cfg)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    return summary.get("hit_rate")


if __name__ == "__main__":
    main()
