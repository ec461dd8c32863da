"""Results store: one pandas DataFrame from run directories, from sweep directories (one or
several), or from W&B runs (online through the API, or offline run folders on disk).

    from prr.results_store import load_runs, load_layers, load_steps, load_wandb
    runs = load_runs("multirun/locality", "multirun/hit_rate_predictors")   # one row per run
    layers = load_layers("multirun/locality")                               # one row per run x layer
    steps = load_steps("multirun/locality", columns=["overlap"])            # one row per step x layer x head
    offline = load_wandb("multirun/locality")                               # offline W&B runs under a folder
    online = load_wandb("my-entity/prr", filters={"group": "multirun/locality"})

Columns of load_runs (one row per run directory holding a summary.json):
  run_dir       absolute path of the run directory
  sweep         its parent directory (the Hydra sweep dir for multirun jobs)
  status        complete | running | failed (unfinished runs are kept, never dropped silently)
  model, task, selector, predictor, budget, runtime, backend, logger
                the config option of each group (conf/<group>/<option>.yaml), found from the
                run's `_target_`s; a class with no option file keeps its class name
  <group>.<key> every scalar of the run's resolved config.yaml (lists as their YAML text)
  <summary key> every scalar of summary.json (hit_rate, last_step_overlap, t_select_us, ...),
                nested dicts flattened with dots (calibration.alpha, budget_setup.blocks, ...)
load_layers adds the per-layer columns of layers.csv (layer, hit_rate, last_step_overlap,
t_<stage>_us, ...) to the run's identifying columns (run_dir, sweep, status and the options);
load_steps does the same for records/steps.jsonl (step, layer, batch, kv_head, hits, misses,
waste, overlap, t_<stage>_s, ...).
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pandas as pd
import yaml

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"
GROUPS = ("model", "task", "selector", "predictor", "budget", "reuse", "runtime", "backend", "logger")
KEY_COLUMNS = ("run_dir", "sweep", "status", *GROUPS)
# The summary repeats the selector/predictor/budget configs (taken from config.yaml); token ids are not a metric.
SUMMARY_SKIP = {"status", "selector", "predictor", "budget", "generated_token_ids"}
SKIP_DIRS = {"wandb", ".submitit", ".hydra", "records", "__pycache__"}
# Groups added after runs were committed: the option those runs ran (their config has no such group).
ABSENT_OPTION = {"reuse": "none"}


class ResultsError(ValueError):
    """A results path that holds nothing loadable; the message names it and what was expected."""


@functools.lru_cache(maxsize=1)
def option_files(conf_dir: Path = CONF_DIR) -> dict[tuple[str, str], list[tuple[str, dict[str, Any]]]]:
    """(group, `_target_`) -> [(option name, its YAML values)] from conf/<group>/<option>.yaml."""
    options: dict[tuple[str, str], list[tuple[str, dict[str, Any]]]] = {}
    for group in GROUPS:
        for path in sorted((conf_dir / group).glob("*.yaml")):
            values = yaml.safe_load(path.read_text()) or {}
            if values.get("_target_"):
                options.setdefault((group, values["_target_"]), []).append((path.stem, values))
    return options


def _option(group: str, node: Any, choices: dict[str, str] | None = None) -> str | None:
    """The config option a run used for `group`: Hydra's record of the choice when the run dir
    has one; else the option file whose `_target_` (and, when several share a class, values)
    match the run's config; a class with no option file keeps its class name."""
    if choices and isinstance(choices.get(group), str):
        return choices[group]
    if node is None and group in ABSENT_OPTION:
        return ABSENT_OPTION[group]
    if not isinstance(node, dict) or not node.get("_target_"):
        return None
    if group == "model":  # one class for every model: its name (zoo name, HF id or path) says which
        return str(node.get("name_or_path"))
    candidates = option_files().get((group, node["_target_"]), [])
    if not candidates:
        return node["_target_"].rsplit(".", 1)[-1]

    def matches(values: dict[str, Any]) -> int:  # keys the run has: +1 per equal value, -1 per different one
        return sum(1 if node[k] == v else -1 for k, v in values.items()
                   if k in node and not (isinstance(v, str) and "${" in v))
    return max(candidates, key=lambda c: matches(c[1]))[0]


def hydra_choices(run_dir: Path) -> dict[str, str]:
    """The group choices Hydra recorded for a run (.hydra/hydra.yaml), {} when there is none."""
    path = run_dir / ".hydra" / "hydra.yaml"
    if not path.is_file():
        return {}
    return ((yaml.safe_load(path.read_text()) or {}).get("hydra", {}).get("runtime", {}) or {}).get("choices", {}) or {}


def _flatten(prefix: str, value: Any, out: dict[str, Any]) -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            _flatten(f"{prefix}.{k}" if prefix else str(k), v, out)
    elif isinstance(value, (list, tuple)):
        if len(value) <= 16:  # short lists (dense_layers, grids) as text; long ones (token ids) left out
            out[prefix] = json.dumps(value)
    else:
        out[prefix] = value


def find_run_dirs(*paths: str | Path) -> list[Path]:
    """Every run directory (a folder holding summary.json) at or under each path, in order:
    sweep job folders sorted by job number."""
    if not paths:
        raise ResultsError("no results path given: pass run or sweep directories (e.g. multirun/locality)")
    found: list[Path] = []
    for path in map(Path, paths):
        if not path.exists():
            raise FileNotFoundError(f"results path {str(path)!r} does not exist; pass a run directory (holding "
                                    "summary.json) or a sweep directory (e.g. multirun/<experiment>)")
        runs = sorted(_walk(path), key=_job_order)
        if not runs:
            raise ResultsError(f"{str(path)!r} holds no run: no summary.json at or under it (a run directory "
                               "has one from the moment the run starts)")
        found += runs
    return found


def _walk(path: Path) -> Iterator[Path]:
    if (path / "summary.json").is_file():
        yield path
        return
    for child in sorted(p for p in path.iterdir() if p.is_dir() and p.name not in SKIP_DIRS):
        yield from _walk(child)


def _job_order(path: Path) -> tuple[str, int, str]:
    return (str(path.parent), int(path.name) if path.name.isdigit() else -1, path.name)


def run_row(run_dir: Path) -> dict[str, Any]:
    """One run as a flat dict: keys, options, config scalars, summary scalars."""
    summary = json.loads((run_dir / "summary.json").read_text())
    config_path = run_dir / "config.yaml"
    config = yaml.safe_load(config_path.read_text()) if config_path.is_file() else {}
    row: dict[str, Any] = {"run_dir": str(run_dir.resolve()), "sweep": str(run_dir.resolve().parent),
                           "status": summary.get("status")}
    choices = hydra_choices(run_dir)
    row.update({g: _option(g, config.get(g), choices) for g in GROUPS})
    _flatten("", {g: config[g] for g in config if isinstance(config[g], dict)}, row)
    if "seed" in config:
        row["seed"] = config["seed"]
    flat: dict[str, Any] = {}
    _flatten("", {k: v for k, v in summary.items() if k not in SUMMARY_SKIP}, flat)
    # summary.json writes a NaN (a rate over nothing) as null (prr.paths.strict_json_dumps): NaN again here,
    # so that a column of rates stays numeric
    row.update({k: float("nan") if v is None else v for k, v in flat.items() if k not in row})
    return row


def load_runs(*paths: str | Path) -> pd.DataFrame:
    """One row per run under the given run/sweep directories (columns: module docstring)."""
    return pd.DataFrame([run_row(d) for d in find_run_dirs(*paths)])


def _per_run_table(paths: Iterable[str | Path], read: Any, columns: list[str] | None) -> pd.DataFrame:
    frames = []
    for run_dir in find_run_dirs(*paths):
        row = run_row(run_dir)
        if row["status"] != "complete":
            continue
        table = read(run_dir)
        if table is None or table.empty:
            continue
        if columns is not None:
            missing = sorted(set(columns) - set(table.columns))
            if missing:
                raise ResultsError(f"{run_dir} has no column(s) {missing}; it has {sorted(table.columns)}")
            table = table[[c for c in table.columns if c in {"step", "layer", "batch", "kv_head", *columns}]]
        keys = {k: row[k] for k in KEY_COLUMNS}
        swept = {k: v for k, v in row.items() if "." in k and k.split(".")[0] in GROUPS and k not in table.columns}
        frames.append(table.assign(**keys, **swept))
    if not frames:
        raise ResultsError(f"no complete run with per-layer/per-step records under {[str(p) for p in paths]}")
    return pd.concat(frames, ignore_index=True)


def load_layers(*paths: str | Path) -> pd.DataFrame:
    """One row per (complete run, layer): layers.csv with the run's options and config columns."""
    def read(run_dir: Path) -> pd.DataFrame | None:
        path = run_dir / "layers.csv"
        return pd.read_csv(path) if path.is_file() else None
    return _per_run_table(paths, read, None)


def load_steps(*paths: str | Path, columns: list[str] | None = None) -> pd.DataFrame:
    """One row per (complete run, decode step, layer, batch row, KV head) from records/steps.jsonl.
    `columns` keeps only those metric columns (the index columns always stay): steps files are large."""
    from prr.sinks import read_jsonl  # the reader that skips a cut-off last line

    def read(run_dir: Path) -> pd.DataFrame | None:
        path = run_dir / "records" / "steps.jsonl"
        return read_jsonl(path) if path.is_file() else None
    return _per_run_table(paths, read, columns)


# --- W&B ---------------------------------------------------------------------------------------
def load_wandb(source: str | Path, filters: dict[str, Any] | None = None, api: Any = None) -> pd.DataFrame:
    """One row per W&B run: config columns as in load_runs (<group>.<key>, the option names) and
    the run's summary scalars, plus wandb_id, wandb_name, wandb_group, and for offline folders
    wandb_state (finished | failed | running: no exit record, i.e. still being written or killed).

    source: an existing folder -> the offline (or synced) runs under it, read from disk with
    wandb's own reader, no network; anything else -> "entity/project" through wandb.Api()
    (needs a key; `filters` is the API's MongoDB-style filter, e.g. {"group": "multirun/locality"}).
    """
    path = Path(source)
    if path.exists():
        rows = [_offline_row(d) for d in _offline_run_dirs(path)]
        if not rows:
            raise ResultsError(f"{str(path)!r} holds no W&B run folder (wandb/offline-run-* or wandb/run-*); "
                               "runs log there with logger=wandb")
        return pd.DataFrame(rows)
    if not re.fullmatch(r"[\w.-]+/[\w.-]+", str(source)):
        raise ResultsError(f"W&B source {str(source)!r} is neither an existing folder nor 'entity/project'")
    if api is None:
        import wandb

        api = wandb.Api()
    rows = []
    for run in api.runs(str(source), filters=filters or {}):
        config = {k: v for k, v in dict(run.config).items() if not k.startswith("_")}
        summary = {k: v for k, v in dict(run.summary).items() if not k.startswith("_")}
        rows.append(_wandb_row(config, summary, run.id, run.name, run.group))
    if not rows:
        raise ResultsError(f"no W&B run in {source!r} matches filters={filters}")
    return pd.DataFrame(rows)


def _wandb_row(config: dict[str, Any], summary: dict[str, Any], run_id: str, name: str | None,
               group: str | None) -> dict[str, Any]:
    row: dict[str, Any] = {"wandb_id": run_id, "wandb_name": name, "wandb_group": group}
    row.update({g: _option(g, config.get(g)) for g in GROUPS})
    _flatten("", {g: v for g, v in config.items() if isinstance(v, dict)}, row)
    for key, value in summary.items():
        if isinstance(value, (int, float, str, bool)) or value is None:
            row.setdefault(key, value)
    return row


def _offline_run_dirs(path: Path) -> list[Path]:
    return sorted({p.parent for p in path.rglob("run-*.wandb") if p.parent.name.startswith(("offline-run-", "run-"))})


def _offline_row(run_dir: Path) -> dict[str, Any]:
    """Config, summary, name and group of one W&B run folder, from its .wandb transaction log."""
    from wandb.proto import wandb_internal_pb2

    (log_file,) = run_dir.glob("run-*.wandb")
    config: dict[str, Any] = {}
    summary: dict[str, Any] = {}
    last_logged: dict[str, Any] = {}  # the last value of each logged key: W&B's summary unless set explicitly
    run_id, name, group = run_dir.name.rsplit("-", 1)[-1], None, None
    state = "running"  # no exit record (yet): still being written (wandb writes after finish() returns), or killed
    for data in wandb_log_records(log_file):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(data)
        kind = record.WhichOneof("record_type")
        if kind == "run":
            # Later run records (updates) may leave fields empty: keep what an earlier one said.
            run_id = record.run.run_id or run_id
            name = record.run.display_name or name
            group = record.run.run_group or group
            _apply_items(config, record.run.config.update)
        elif kind == "config":
            _apply_items(config, record.config.update)
        elif kind == "summary":
            _apply_items(summary, record.summary.update)
        elif kind == "history":
            _apply_items(last_logged, record.history.item)
        elif kind == "exit":
            state = "finished" if record.exit.exit_code == 0 else "failed"
    config = {k: (v.get("value") if isinstance(v, dict) and "value" in v else v) for k, v in config.items()
              if not k.startswith("_")}
    summary = {k: v for k, v in {**last_logged, **summary}.items() if not k.startswith("_")}
    return {**_wandb_row(config, summary, run_id, name, group), "wandb_state": state,
            "wandb_dir": str(run_dir.resolve())}


WANDB_BLOCK = 32768  # the .wandb file is a LevelDB-style log: 32 KiB blocks of [crc32c:4][length:2][type:1][data]
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def wandb_log_records(path: Path) -> Iterator[bytes]:
    """The serialized protobuf records of a .wandb file, in order. Records split across blocks
    are joined; a record cut off at the end (a run still writing, or killed) is left out.
    (wandb >= 0.19 no longer ships a Python reader for its own transaction log.)"""
    data = path.read_bytes()
    if data[:4] != b":W&B":
        raise ResultsError(f"{path} is not a W&B transaction log (no ':W&B' header)")
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        left = WANDB_BLOCK - pos % WANDB_BLOCK
        if left < 7:  # too little room for a header: the writer padded the block with zeros
            pos += left
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        if kind == 0:  # zero padding up to the end of the block (or of a file still being written)
            pos += left
            continue
        if pos + 7 + length > len(data):
            break
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == FULL:
            yield chunk
        elif kind == FIRST:
            pending = chunk
        elif kind == MIDDLE:
            pending += chunk
        elif kind == LAST:
            yield pending + chunk
            pending = b""
        else:
            raise ResultsError(f"{path}: unknown record type {kind} at byte {pos}")


def _apply_items(target: dict[str, Any], items: Any) -> None:
    for item in items:
        key = item.key or "/".join(item.nested_key)
        target[key] = json.loads(item.value_json)
