"""`hydra/sweeper=resume`: Hydra's basic sweeper (same `params`, same job numbering) that
launches only the jobs whose run directory does not already hold a complete run of the
same config.

Why not rely on the runner's own skip (prr/runner.py `finished_run`, which writes nothing into
a run dir it skips or refuses): a job that starts only to skip itself still costs a SLURM
allocation, and submitit adds `.submitit/<job id>/` files. Deciding here, before anything is
launched, makes re-running a finished sweep launch nothing and change no file.

Rules (the runner's, applied to each job's resolved config before launch):
- a job whose config prr's validation refuses (prr.config_check.validate) -> the sweep refused
  before any job launches: exit code 2 and one line per problem naming the job (run.py checked
  each swept value alone; this checks every combination the sweep makes);
- complete run of the same config in the job's dir -> skipped;
- no run, or one marked running/failed (killed, interrupted) -> launched again;
- complete run of a different config -> refused before any job launches: exit code 2 and one
  line on stderr, as run.py refuses it (prr/cli_exits.py).
Skipped jobs keep their numbers, so job i always lands in `<sweep dir>/<i>`.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf, open_dict


def contiguous_runs(indices: list[int]) -> list[tuple[int, int]]:
    """[0, 1, 3, 4, 5, 7] -> [(0, 2), (3, 6), (7, 8)]: half-open ranges of consecutive indices."""
    runs: list[tuple[int, int]] = []
    for i in indices:
        if runs and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs


class ResumeSweeper(BasicSweeper):
    def __init__(self, max_batch_size: int | None = None, params: dict[str, str] | None = None) -> None:
        super().__init__(max_batch_size=max_batch_size, params=params)

    def job_dir_and_config(self, overrides: list[str], job_num: int) -> tuple[Path, str]:
        """The run dir job `job_num` writes to and the config YAML the runner will record there,
        once prr's validation passed the job's config (ConfigError otherwise)."""
        from prr.config_check import ConfigError, validate
        assert self.hydra_context is not None and self.config is not None
        job_cfg = self.hydra_context.config_loader.load_sweep_config(self.config, overrides)
        with open_dict(job_cfg):
            job_cfg.hydra.job.id = job_num
            job_cfg.hydra.job.num = job_num
        HydraConfig.instance().set_config(job_cfg)  # ${hydra:job.num} in sweep.subdir resolves per job
        run_dir = Path(str(job_cfg.hydra.sweep.dir)) / str(job_cfg.hydra.sweep.subdir)
        task_cfg = copy.deepcopy(job_cfg)
        with open_dict(task_cfg):
            del task_cfg["hydra"]
        try:
            validate(task_cfg)
        except ConfigError as err:  # which job: the combination of swept values that does not go together
            raise ConfigError([f"sweep job #{job_num} ({' '.join(overrides)}): {p}" for p in err.problems]) from None
        return run_dir.absolute(), OmegaConf.to_yaml(task_cfg, resolve=True)

    def unfinished(self, batch: list[list[str]], first_job: int) -> list[int]:
        """Positions in `batch` whose job still has to run."""
        from prr.runner import finished_run  # the runner's rule, not a copy of it

        saved = HydraConfig.instance().cfg
        todo = []
        try:
            for pos, overrides in enumerate(batch):
                run_dir, config_yaml = self.job_dir_and_config(list(overrides), first_job + pos)
                if finished_run(run_dir, config_yaml) is None:
                    todo.append(pos)
                else:
                    print(f"prr: #{first_job + pos} skipped: {run_dir} already holds this run, complete")
        finally:
            if saved is not None:
                HydraConfig.instance().set_config(saved)
        return todo

    def sweep(self, arguments: list[str]) -> Any:
        from prr.cli_exits import refuse  # here, like finished_run: Hydra imports every plugin at startup
        from prr.config_check import ConfigError
        from prr.runner import RunDirTaken

        assert self.config is not None and self.launcher is not None and self.hydra_context is not None
        params_conf = self._parse_config()
        params_conf.extend(arguments)
        parser = OverridesParser.create(config_loader=self.hydra_context.config_loader)
        self.overrides = self.split_arguments(parser.parse_overrides(params_conf), self.max_batch_size)
        sweep_dir = Path(self.config.hydra.sweep.dir)
        # Decide every job before launching any (or writing anything): a conflict stops the sweep untouched.
        batches, first_job = [], 0
        while not self.is_done():
            batch = [list(job) for job in self.get_job_batch()]
            self.validate_batch_is_legal(batch)
            try:
                batches.append((first_job, batch, self.unfinished(batch, first_job)))
            except RunDirTaken as err:  # Hydra would print it with a traceback
                refuse(str(err))
            except ConfigError as err:  # each problem names the job (job_dir_and_config)
                refuse(*err.problems)
            first_job += len(batch)
        total, todo_total = first_job, sum(len(todo) for _, _, todo in batches)
        print(f"prr: {total - todo_total} of {total} jobs already complete in {sweep_dir}; launching {todo_total}")

        sweep_dir.mkdir(parents=True, exist_ok=True)
        saved = sweep_dir / "multirun.yaml"
        text = OmegaConf.to_yaml(self.config)
        if todo_total and (not saved.is_file() or saved.read_text() != text):  # nothing to run: leave the file alone
            saved.write_text(text)
        returns: list[Any] = []
        for first_job, batch, todo in batches:
            for start, stop in contiguous_runs(todo):
                results = self.launcher.launch(batch[start:stop], initial_job_idx=first_job + start)
                for r in results:
                    _ = r.return_value  # re-raises a failed job's exception, as the basic sweeper does
                returns.append(results)
        return returns
