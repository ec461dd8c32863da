"""Where run records go: JSONL files in the run dir (appended and flushed as they come, so
a killed run keeps every finished step) and W&B (offline unless the user has a key)."""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pandas is imported where it is used: config validation imports this module
    import pandas as pd

log = logging.getLogger("prr")


def _clean(value: Any) -> Any:
    return None if isinstance(value, float) and math.isnan(value) else value


class JsonlWriter:
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._file = open(path, "w", encoding="utf-8")  # noqa: SIM115 - closed in close()

    def write(self, rows: list[dict[str, Any]]) -> None:
        # One write per step, then flush: a crash leaves whole lines plus at most one cut-off last line.
        self._file.write("".join(json.dumps({k: _clean(v) for k, v in row.items()}) + "\n" for row in rows))
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class RunLogger:
    """The `logger` group's interface: start, log the finished run, finish."""

    def start(self, run_dir: Path, config: dict[str, Any], name: str) -> None:
        pass

    def log_run(self, summary: dict[str, Any], layers: pd.DataFrame, steps: pd.DataFrame) -> None:
        pass

    def finish(self, ok: bool) -> None:
        pass


class NoLogger(RunLogger):
    """`logger=none`: nothing beyond the run directory's files. `note`: a line logged when the
    run starts (logger=auto says here why it logs nothing)."""

    def __init__(self, note: str | None = None) -> None:
        self.note = note

    def start(self, run_dir: Path, config: dict[str, Any], name: str) -> None:
        if self.note:
            log.info(self.note)


def missing_wandb_packages() -> list[str]:
    """The packages logger=wandb needs that this install lacks (`make run` installs neither):
    wandb, and matplotlib for the run's figures. Looked up without importing them."""
    return [name for name in ("wandb", "matplotlib") if importlib.util.find_spec(name) is None]


class AutoLogger(RunLogger):
    """`logger=auto` (the default): W&B (a WandbLogger with these settings) when wandb and
    matplotlib are installed, else no logger, and the run's log says so in one line."""

    def __init__(self, project: str = "prr", mode: str = "auto", group: str | None = None,
                 tags: list[str] | None = None, entity: str | None = None) -> None:
        missing = missing_wandb_packages()
        self.inner: RunLogger = (
            NoLogger(note=f"logger=auto: {' and '.join(missing)} not installed (`make install` adds them), so this run "
                          "logs to its run dir only, as logger=none; logger=wandb would be refused") if missing
            else WandbLogger(project=project, mode=mode, group=group, tags=tags, entity=entity))

    def start(self, run_dir: Path, config: dict[str, Any], name: str) -> None:
        self.inner.start(run_dir, config, name)

    def log_run(self, summary: dict[str, Any], layers: pd.DataFrame, steps: pd.DataFrame) -> None:
        self.inner.log_run(summary, layers, steps)

    def finish(self, ok: bool) -> None:
        self.inner.finish(ok)


class WandbLogger(RunLogger):
    """`logger=wandb`. mode: auto (online when WANDB_API_KEY is set, else offline), online, offline."""

    def __init__(self, project: str = "prr", mode: str = "auto", group: str | None = None,
                 tags: list[str] | None = None, entity: str | None = None) -> None:
        if mode not in ("auto", "online", "offline"):
            raise ValueError(f"logger.mode={mode!r} is not one of ['auto', 'online', 'offline']")
        missing = missing_wandb_packages()
        if missing:  # refused by config validation, before the run begins
            raise ValueError(f"logger=wandb needs {' and '.join(missing)}, not installed: `make install` adds them "
                             "(or pip install -e '.[wandb]'); or use logger=auto or logger=none")
        self.project, self.group, self.tags, self.entity = project, group, list(tags or []), entity
        self.mode = mode if mode != "auto" else ("online" if os.environ.get("WANDB_API_KEY") else "offline")
        self._run = None

    def start(self, run_dir: Path, config: dict[str, Any], name: str) -> None:
        try:
            import wandb
        except ImportError as err:
            raise RuntimeError("logger=wandb needs the wandb package: pip install wandb (or use logger=none)") from err
        try:
            run_figures_module()  # the run's figures go to W&B as images: fail now, not after the decode
        except ImportError as err:
            raise RuntimeError(f"logger=wandb logs the run's figures and needs matplotlib ({err}): "
                               "pip install -e '.[wandb]' (or use logger=none)") from err
        # Runs of one sweep share a group (the sweep dir), so W&B shows a sweep together.
        group = self.group if self.group is not None else sweep_group()
        self._run = wandb.init(project=self.project, entity=self.entity, group=group, tags=self.tags,
                               name=name, config=config, dir=str(run_dir), mode=self.mode, reinit="finish_previous")

    def log_run(self, summary: dict[str, Any], layers: pd.DataFrame, steps: pd.DataFrame) -> None:
        import wandb

        assert self._run is not None
        for key, value in summary.items():
            if isinstance(value, (int, float, str, bool)) or value is None:
                self._run.summary[key] = value
        if not layers.empty:
            self._run.log({"per_layer": wandb.Table(dataframe=layers)})
            self._run.log(run_images(layers, summary))
        if not steps.empty:
            # Misses |A\P| and waste |P\A| per (step, layer, batch row, KV head): their spread, not only the mean.
            self._run.log({f"hist/{col}": wandb.Histogram(steps[col].to_numpy(), num_bins=min(64, int(steps[col].max()) + 1))
                           for col in ("misses", "waste") if col in steps})
        if not steps.empty:
            per_step = steps.groupby("step")[["hits", "selected_blocks", "predicted_blocks"]].sum()
            for step, row in per_step.iterrows():
                hit = row["hits"] / max(row["selected_blocks"], 1)
                self._run.log({"decode/hit_rate": hit, "decode/predicted_blocks": row["predicted_blocks"],
                               "decode/step": int(step)})

    def finish(self, ok: bool) -> None:
        if self._run is not None:
            self._run.finish(exit_code=0 if ok else 1)
            self._run = None


def sweep_group() -> str | None:
    """The sweep directory when this process runs a Hydra multirun job (W&B group), else None."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized():
        return None
    hydra_cfg = HydraConfig.get()
    return str(hydra_cfg.sweep.dir) if hydra_cfg.mode == RunMode.MULTIRUN else None


def run_images(layers: pd.DataFrame, summary: dict[str, Any]) -> dict[str, Any]:
    """The run's per-layer figures (prr.analysis.run_figures) as W&B images, keyed figures/<name>."""
    import matplotlib.pyplot as plt
    import wandb

    run_figures = run_figures_module().run_figures
    title = f"{summary.get('model')}, {summary.get('prompt_tokens')} prompt tokens, {summary.get('device')}"
    images = {}
    for name, fig in run_figures(layers, title).items():
        images[f"figures/{name}"] = wandb.Image(fig)
        plt.close(fig)
    return images


def run_figures_module() -> Any:
    """prr.analysis.run_figures. Installed builds map analysis/ to prr.analysis (pyproject
    package-dir); a plain checkout on PYTHONPATH has no such mapping, so map the folder here."""
    import importlib
    import importlib.util
    import sys

    if "prr.analysis" not in sys.modules and importlib.util.find_spec("prr.analysis") is None:
        folder = Path(__file__).resolve().parent.parent / "analysis"
        spec = importlib.util.spec_from_file_location("prr.analysis", folder / "__init__.py",
                                                      submodule_search_locations=[str(folder)])
        if spec is None or spec.loader is None:
            raise ImportError(f"no analysis/ folder beside prr/ ({folder}) and prr.analysis is not installed")
        module = importlib.util.module_from_spec(spec)
        sys.modules["prr.analysis"] = module
        spec.loader.exec_module(module)
    return importlib.import_module("prr.analysis.run_figures")


def read_jsonl(path: Path) -> pd.DataFrame:
    """Rows of a records file. A last line cut short by a killed writer is left out (the
    file is appended one step at a time, so every earlier line is whole)."""
    import pandas as pd

    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    return pd.DataFrame([json.loads(line) for line in lines[:-1] if line.strip()])
