"""prr entry point: `python run.py selector=quest predictor=ema budget=profiled`.
Sweeps: `python run.py -m selector=quest,exact predictor=none,last_step,ema`.
It ends by prr/cli_exits.py's convention: a refused input exits with 2, an interrupted run
with 130, each with one line on stderr.

Everything is imported inside `__main__`'s try, so that a Ctrl-C during the imports (torch's
take seconds) ends as any other Ctrl-C. The command line, paths and values are checked
(prr/front_door.py) before Hydra starts a job or creates its run dir; torch is imported only
for the value checks, after the cheaper ones passed."""

from __future__ import annotations

import sys
import time
from pathlib import Path

# standard library only
from prr.cli_exits import interrupted, refuse, refuse_without_teardown, storage_refused, watch_ctrl_c

CONF_DIR = Path(__file__).resolve().parent / "conf"
STARTED = time.time()  # before Hydra makes the run dir: an empty run dir newer than this is this process's


def hydra_app() -> None:
    """Hydra's app over conf/ (Hydra parses sys.argv itself)."""
    import hydra
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import DictConfig

    from prr.config_check import ConfigError
    from prr.model.loading import CorruptModelFile
    from prr.paths import remove_empty_run_dir
    from prr.runner import RunDirTaken, run

    @hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
    def main(cfg: DictConfig) -> float | None:
        hydra_cfg = HydraConfig.get()
        run_dir = Path(hydra_cfg.runtime.output_dir)
        try:
            summary = run(cfg, run_dir, hydra_cfg)
        except ConfigError as err:
            remove_empty_run_dir(run_dir, STARTED)  # refused before anything was written: no empty dir left behind
            refuse(*err.problems)
        except (RunDirTaken, CorruptModelFile) as err:  # the message names the file and what to do
            refuse(str(err))
        except KeyboardInterrupt as err:  # Ctrl-C; SIGTERM arrives as its subclass prr.cli_exits.Terminated
            interrupted(err, run_dir)
        except OSError as err:  # a full disk (or quota, or a read-only remount): one line; other errors keep Hydra's report
            line = storage_refused(err, run_dir)
            if line is None:
                raise
            refuse(line)
        return summary.get("hit_rate")

    main()


if __name__ == "__main__":
    watch_ctrl_c()
    try:
        from prr.front_door import BadOverride, ConfigError, preflight

        try:
            # Hydra would report a bad override in several lines, in a sweep only at the bad job's turn
            sys.argv[1:], chosen = preflight(sys.argv[1:], CONF_DIR)
        except BadOverride as err:
            refuse_without_teardown(str(err))
        except ConfigError as err:
            refuse_without_teardown(*err.problems)
        if chosen:
            print(chosen, flush=True)
        hydra_app()
    except KeyboardInterrupt as err:  # outside a job (importing, composing, between a sweep's jobs): no run to name
        interrupted(err, None)
