"""prr entry point: `python run.py selector=quest predictor=ema budget=profiled`.
Sweeps: `python run.py -m selector=quest,exact predictor=none,last_step,ema`.
It ends by prr/cli_exits.py's convention: a refused input exits with 2, an interrupted run
with 130, each with one line on stderr."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from prr.cli_exits import interrupted, refuse
from prr.config_check import ConfigError
from prr.override_check import BadOverride, check_command_line
from prr.paths import remove_empty_run_dir
from prr.runner import RunDirTaken, run

CONF_DIR = Path(__file__).resolve().parent / "conf"
STARTED = time.time()  # before Hydra makes the run dir: an empty run dir newer than this is this process's


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> float | None:
    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    try:
        summary = run(cfg, run_dir, hydra_cfg)
    except ConfigError as err:
        remove_empty_run_dir(run_dir, STARTED)  # refused before anything was written: no empty dir left behind
        refuse(*err.problems)
    except RunDirTaken as err:
        refuse(str(err))
    except KeyboardInterrupt as err:  # Ctrl-C; SIGTERM arrives as its subclass prr.runner.Terminated
        interrupted(err, run_dir)
    return summary.get("hit_rate")


if __name__ == "__main__":
    try:
        # Hydra would report a bad override in several lines, in a sweep only at the bad job's turn
        check_command_line(sys.argv[1:], CONF_DIR, "config")
        main()
    except BadOverride as err:
        refuse(str(err))
    except KeyboardInterrupt as err:  # outside a job (composing, between a sweep's jobs): no run to name
        interrupted(err, None)
