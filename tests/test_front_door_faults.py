"""Issue 54, the front door's third pass: each numbered case tried as a user types it.

Each refused case runs `python run.py` in a subprocess and asserts what tests/test_front_door.py
asserts of its cases: exit code 2, one or two lines on stderr, no traceback, the value or path
named, and every file of an earlier, finished run unchanged (sha256). A sweep refused before its
first job leaves no sweep dir and no multirun.yaml. Item by item: 1, 2, 3, 12, 13 and "selector=QUEST"
in FAULTS (and the sweep-product test); 4 the strict-JSON tests; 6 collect_sweep's; 7 the install
stamp's; 8 the read-only cache's; 9 the run-dir lock's; 10 the corrupt config or tokenizer's; 11 the
full disk's; 14 tests/test_front_door.py's cases, decided before torch; 15 provenance's; 5 lives in
tests/test_figures.py. The refusals are timed by `python -m tests.test_front_door_faults --repeats 3`."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.test_front_door import TINY, refused_lines, sha256_tree

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Fault:
    name: str
    args: list[str]  # run.py's overrides after TINY ({tmp}: the test's temporary dir; {run}: the finished run)
    named: list[str]  # what the message must contain
    flags: list[str] = field(default_factory=list)  # before the overrides (-m, --cfg job)
    env: dict[str, str] = field(default_factory=dict)
    absent: list[str] = field(default_factory=list)  # paths ({tmp}) that must not exist afterwards


def run_py(flags: list[str], args: list[str], tmp: Path, run_dir: Path, env: dict[str, str] | None = None,
           timeout: int = 300) -> subprocess.CompletedProcess:
    def fill(text: str) -> str:
        return text.replace("{tmp}", str(tmp)).replace("{run}", str(run_dir))

    argv = [sys.executable, "run.py", *flags, *TINY, *(fill(a) for a in args)]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PRR_CACHE_DIR": str(tmp / "cache"),
                **{k: fill(v) for k, v in (env or {}).items()}}
    return subprocess.run(argv, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout)


def refused_mid_run(done: subprocess.CompletedProcess) -> list[str]:
    """refused_lines for a run stopped after it began: its progress bars (tqdm's, on stderr) left aside."""
    assert done.returncode == 2, (done.returncode, done.stderr[-3000:])
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    lines = [line for line in done.stderr.splitlines() if line.strip() and not re.search(r"\d+%\|", line)]
    assert 1 <= len(lines) <= 2, done.stderr
    return lines


@dataclass
class Finished:
    tmp: Path
    run_dir: Path
    sha256: dict[str, str]


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Finished:
    tmp = tmp_path_factory.mktemp("faults")
    run_dir = tmp / "run0"
    (tmp / "prompt.txt").write_text("Long enough text for any prompt of these tests. " * 100)
    done = run_py([], [f"hydra.run.dir={run_dir}"], tmp, run_dir)
    assert done.returncode == 0, done.stderr[-3000:]
    return Finished(tmp, run_dir, sha256_tree(run_dir))


FAULTS = [
    Fault("1: a bad value inside a sweep list", ["selector.topk_blocks=4,abc", "hydra.sweep.dir={tmp}/s1"],
          ["selector.topk_blocks='abc'"], flags=["-m"], absent=["{tmp}/s1"]),
    Fault("1: a negative value inside a sweep list", ["selector.topk_blocks=4,-4", "hydra.sweep.dir={tmp}/s1"],
          ["selector.topk_blocks=-4"], flags=["-m"], absent=["{tmp}/s1"]),
    Fault("1: a bad value of a preset's swept key", ["+experiment=hit_rate_ema", "predictor.alpha=0.5,7",
                                                    "hydra.sweep.dir={tmp}/s1"],
          ["predictor.alpha"], flags=["-m"], absent=["{tmp}/s1"]),
    Fault("1: swept values that clash only together", ["selector.topk_blocks=4,12", "task.prompt_tokens=256,128",
                                                       "hydra.sweep.dir={tmp}/s1"],
          ["selector.topk_blocks=12", "8 blocks"], flags=["-m"], absent=["{tmp}/s1"]),
    Fault("1: a group option and a key that clash only together", ["predictor=none,ema_calibrated",
                                                                   "runtime.calibration_tokens=32,2",
                                                                   "hydra.sweep.dir={tmp}/s1"],
          ["runtime.calibration_tokens=2", "burn_in_steps"], flags=["-m"], absent=["{tmp}/s1"]),
    Fault("1: two groups' options that clash only together", ["predictor=ema,oracle", "budget=fixed,profiled",
                                                             "hydra.sweep.dir={tmp}/s1"],
          ["predictor=oracle", "budget=profiled"], flags=["-m"], absent=["{tmp}/s1"]),
    Fault("2: a sweep without -m", ["selector=quest,exact", "hydra.run.dir={run}"],
          ["selector=quest,exact", "python run.py -m selector=quest,exact"]),
    Fault("2: a list where a group takes one option", ["selector=[quest,exact]", "hydra.run.dir={run}"],
          ["selector=[quest,exact]", "one option", "-m selector=quest,exact"]),
    Fault("3: an empty run dir", ["hydra.run.dir="], ["hydra.run.dir=''", "is empty", str(ROOT)]),
    Fault("3: an empty sweep dir", ["hydra.sweep.dir=", "predictor=none,ema"], ["hydra.sweep.dir=''", "is empty"],
          flags=["-m"]),
    Fault("12: a prompt file for a model without a tokenizer", ["task.prompt_file={tmp}/prompt.txt",
                                                                  "hydra.run.dir={run}"],
          ["task.prompt_file=", "prompt.txt", "model.name_or_path='tiny-random'", "tokenizer"]),
    Fault("small: an option in capitals", ["selector=QUEST"], ["selector=QUEST", "did you mean quest?"]),
    Fault("13: -m with --cfg job", ["selector=quest,exact"], ["-m and --cfg", "drop -m"], flags=["-m", "--cfg", "job"]),
]


@pytest.mark.parametrize("fault", FAULTS, ids=[f.name for f in FAULTS])
def test_a_fault_is_refused_in_one_line_and_the_earlier_run_is_untouched(fault, finished):
    done = run_py(fault.flags, fault.args, finished.tmp, finished.run_dir, fault.env)
    text = " ".join(refused_lines(done))
    for named in fault.named:
        assert named in text, (named, text)
    for path in fault.absent:
        assert not Path(path.replace("{tmp}", str(finished.tmp))).exists(), path
    assert sha256_tree(finished.run_dir) == finished.sha256


def test_the_resume_sweeper_validates_every_job_before_launching_one(tmp_path):
    """Behind run.py's check (which leaves a sweep of more than MAX_JOBS_CHECKED jobs, or a group whose
    options set other nodes, to it): run as if run.py had not combined the groups, the sweeper refuses
    the job that does not validate before any job runs, naming it."""
    prelude = ("import runpy, sys; import prr.override_check as o; o.group_combinations = lambda *args: []; "
               "sys.argv = ['run.py', *sys.argv[1:]]; runpy.run_path('run.py', run_name='__main__')")
    sweep = tmp_path / "sweep"
    done = subprocess.run([sys.executable, "-c", prelude, "-m", *TINY, "predictor=ema,oracle", "budget=fixed,profiled",
                           f"hydra.sweep.dir={sweep}"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PRR_CACHE_DIR": str(tmp_path / "cache")})
    text = " ".join(refused_lines(done))
    assert "sweep job #3" in text and "predictor=oracle" in text and "budget=profiled" in text, text
    assert not sweep.exists()


def test_the_combined_jobs_are_the_configs_hydra_composes():
    """The swept groups' combinations run.py builds from their nodes equal Hydra's composition of each."""
    import itertools

    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from prr.override_check import check_command_line

    swept = {"selector": ["quest", "infllm"], "predictor": ["ema", "oracle"], "budget": ["fixed", "profiled"]}
    base = [*TINY, "runtime=cpu", "selector.topk_blocks=4"]
    jobs = check_command_line(["-m", *base, *(f"{g}={','.join(o)}" for g, o in swept.items())], ROOT / "conf", "config")
    built = {tuple(j.hydra.runtime.choices[g] for g in swept): OmegaConf.to_container(j, resolve=False) for j in jobs}
    assert len(built) == 8
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        for options in itertools.product(*swept.values()):
            lines = [*base, *(f"{g}={o}" for g, o in zip(swept, options, strict=True))]
            hydra_job = OmegaConf.to_container(compose("config", overrides=lines, return_hydra_config=True), resolve=False)
            ours = built[options]
            assert {k: v for k, v in ours.items() if k != "hydra"} == {k: v for k, v in hydra_job.items() if k != "hydra"}
            assert ours["hydra"]["runtime"]["choices"] == hydra_job["hydra"]["runtime"]["choices"]


def test_a_list_value_of_a_key_still_runs_as_one_job():
    """Refusing a list for a group leaves lists where a key takes one (selector.dense_layers=[0,1])."""
    from prr.override_check import check_command_line

    (job,) = check_command_line([*TINY, "selector.dense_layers=[0,1]"], ROOT / "conf", "config")
    assert list(job.selector.dense_layers) == [0, 1]


def test_every_value_of_a_swept_key_is_checked_as_its_own_job():
    from prr.override_check import check_command_line

    jobs = check_command_line(["-m", *TINY, "selector.topk_blocks=4,abc", "predictor=none,ema"], ROOT / "conf", "config")
    # each group option's job, and each with every other value of the swept key
    assert sorted((str(j.selector.topk_blocks), j.predictor._target_.rsplit(".", 1)[1]) for j in jobs) == \
        [("4", "EmaPredictor"), ("4", "NoPredictor"), ("abc", "EmaPredictor"), ("abc", "NoPredictor")]
    jobs = check_command_line(["-m", *TINY, "selector.topk_blocks=4,8,12", "task.prompt_tokens=256,128"],
                              ROOT / "conf", "config")  # every combination of the swept keys
    assert sorted((j.selector.topk_blocks, j.task.prompt_tokens) for j in jobs) == \
        [(k, t) for k in (4, 8, 12) for t in (128, 256)]


def strict_json(text: str):
    """json.loads refusing NaN and +-Infinity, as jq and browsers do."""
    def refuse(constant: str):
        raise ValueError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


def test_summary_json_is_strict_json_and_its_readers_see_nan(tmp_path, monkeypatch):
    """4: predictor=none predicts nothing, so its precision is a rate over nothing (NaN): written as
    null, read back by results_store as NaN."""
    import math

    from prr.config_check import compose_config
    from prr.results_store import load_runs
    from prr.runner import run

    monkeypatch.setenv("PRR_CACHE_DIR", str(tmp_path / "cache"))
    run(compose_config([*TINY, "predictor=none", "runtime=cpu"]), tmp_path / "run")
    summary = strict_json((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "complete" and summary["precision"] is None, summary
    strict_json((tmp_path / "run" / "provenance.json").read_text())
    (row,) = load_runs(tmp_path / "run").to_dict("records")
    assert math.isnan(row["precision"]) and row["hit_rate"] == summary["hit_rate"]


def test_every_committed_results_json_is_strict_json():
    """4: the results JSONs under experiments/ (and every other committed JSON) parse strictly."""
    listed = subprocess.run(["git", "ls-files", "*.json"], cwd=ROOT, capture_output=True, text=True)
    if listed.returncode != 0:
        pytest.skip("not a git checkout: no list of committed files")
    files = listed.stdout.split()
    assert any(f.startswith("experiments/results/") for f in files)
    for name in files:
        try:
            strict_json((ROOT / name).read_text())
        except ValueError as err:
            raise AssertionError(f"{name}: {err}") from None


def test_strict_json_dumps_writes_null_for_nan_at_any_depth():
    import numpy as np

    from prr.paths import strict_json_dumps

    text = strict_json_dumps({"a": float("nan"), "b": [1.0, float("inf"), {"c": np.float64("-inf")}], "d": (2, None)})
    assert strict_json(text) == {"a": None, "b": [1.0, None, {"c": None}], "d": [2, None]}


@pytest.mark.parametrize("recorded", [True, False], ids=["job overrides recorded", "no records: from the runs"])
def test_collect_sweep_records_what_was_swept_in_strict_json(tmp_path, recorded):
    """6: `swept` named the config values that differ, never a group: a predictor sweep recorded []."""
    import yaml

    from tests.test_results_store import write_sweep

    sweep = tmp_path / "s"
    write_sweep(sweep, [{"predictor": "none"}, {"predictor": "ema"}, {"status": "running"}])  # job 2: NaN numbers
    for job, predictor in enumerate(("none", "ema", "ema")):
        if recorded:
            (sweep / str(job) / ".hydra").mkdir()
            (sweep / str(job) / ".hydra" / "overrides.yaml").write_text(
                yaml.safe_dump(["model=tiny-random", f"predictor={predictor}"]))
    done = subprocess.run([sys.executable, "experiments/collect_sweep.py", str(sweep), str(tmp_path / "out"),
                           *([] if recorded else ["--command", "python run.py -m predictor=none,ema"])],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-3000:]
    record = strict_json((tmp_path / "out.json").read_text())
    assert record["swept"] == ["predictor"], record["swept"]
    assert record["rows"][2]["status"] == "running" and record["rows"][2]["hit_rate"] is None


def test_a_second_run_into_a_run_dir_in_use_is_refused_in_one_line(finished):
    """9: two runs into one hydra.run.dir at once: one died in a JSONDecodeError traceback. The run
    holds a lock on its dir (flock on the dir itself, no lock file); the second is refused."""
    from prr.runner import run_dir_lock

    with run_dir_lock(finished.run_dir):  # as a run in progress holds it
        done = run_py([], ["hydra.run.dir={run}"], finished.tmp, finished.run_dir)
    text = " ".join(refused_lines(done))
    assert str(finished.run_dir) in text and "another prr run" in text, text
    assert sha256_tree(finished.run_dir) == finished.sha256
    again = run_py([], ["hydra.run.dir={run}"], finished.tmp, finished.run_dir)  # the lock went with its holder
    assert again.returncode == 0 and "already holds this run, complete; skipped" in again.stdout, again.stderr[-3000:]


# Run run.py with its records' writes refused as by a full disk ({also}: more to refuse)
DISK_FULL = ("import errno, runpy, sys; import prr.sinks, prr.paths\n"
             "def full(*args, **kwargs): raise OSError(errno.ENOSPC, 'No space left on device')\n"
             "prr.sinks.JsonlWriter.write = full\n{also}\n"
             "sys.argv = ['run.py', *sys.argv[1:]]; runpy.run_path('run.py', run_name='__main__')")
REFUSE_FAILED_MARK = ("write = prr.paths.write_text_atomic\n"
                      "def refuse_failed(path, text):\n"
                      "    if '\"failed\"' in text: full()\n"
                      "    write(path, text)\n"
                      "prr.paths.write_text_atomic = refuse_failed")


@pytest.mark.parametrize("also, state", [("", "marked failed"), (REFUSE_FAILED_MARK, "could not be marked failed")],
                         ids=["summary writable", "summary not writable either"])
def test_a_full_disk_is_one_line_and_the_summary_marked_failed_where_it_can_be(finished, tmp_path, also, state):
    """11: a 46-line traceback and summary.json left at `running` before."""
    argv = [sys.executable, "-c", DISK_FULL.format(also=also), *TINY, f"hydra.run.dir={tmp_path / 'r'}"]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PRR_CACHE_DIR": str(finished.tmp / "cache")})
    text = " ".join(refused_mid_run(done))
    assert "No space left on device" in text and "disk is full" in text and str(tmp_path / "r") in text, text
    assert state in text, text
    status = strict_json((tmp_path / "r" / "summary.json").read_text())["status"]
    assert status == ("failed" if state == "marked failed" else "running")


def locked_dir(folder: Path) -> list[str]:
    """Make folder unwritable (chattr +i as root, chmod 555 otherwise); returns the command that undoes it."""
    if os.geteuid() == 0:
        if shutil.which("chattr") is None or subprocess.run(["chattr", "+i", str(folder)]).returncode != 0:
            pytest.skip("root without chattr +i here: no way to make a directory unwritable")
        return ["chattr", "-i", str(folder)]
    folder.chmod(0o555)
    return ["chmod", "755", str(folder)]


def test_a_read_only_cache_dir_before_the_first_conversion_is_one_line(finished, tmp_path):
    """8: a 34-line PermissionError (EROFS) traceback from the conversion's temp dir."""
    cache = tmp_path / "cache"
    cache.mkdir()
    unlock = locked_dir(cache)
    try:
        argv = [sys.executable, "run.py", "model=smollm2-135m", "logger=none", "hydra.run.dir={run}"]
        done = subprocess.run([a.replace("{run}", str(finished.run_dir)) for a in argv], cwd=ROOT, capture_output=True,
                              text=True, timeout=300, env={**os.environ, "PRR_CACHE_DIR": str(cache)})
    finally:
        subprocess.run(unlock, check=True)
    text = " ".join(refused_lines(done))
    assert f"PRR_CACHE_DIR={str(cache)!r}" in text and "smollm2-135m" in text and "not converted" in text, text
    assert not any(cache.iterdir()) and sha256_tree(finished.run_dir) == finished.sha256


def test_a_cache_made_read_only_during_the_run_is_a_config_error_naming_it(tmp_path):
    """8, past run.py's check (the cache turned read-only since): the conversion's temp dir is refused in one line."""
    from prr.config_check import ConfigError
    from prr.model.loading import ensure_gguf_converted

    cache = tmp_path / "cache"
    cache.mkdir()
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    unlock = locked_dir(cache)
    try:
        with pytest.raises(ConfigError) as refused:
            ensure_gguf_converted(gguf, cache / "models" / "m")
    finally:
        subprocess.run(unlock, check=True)
    (problem,) = refused.value.problems
    assert str(cache) in problem and "PRR_CACHE_DIR" in problem, problem


@pytest.fixture(scope="module")
def cached_conversion(tmp_path_factory) -> tuple[Path, Path, Path]:
    """(the .gguf named on the command line, its conversion in prr's cache, the cache): a tiny HF
    dir as a finished conversion leaves it, every file's sha256 recorded as prr records it now."""
    import hashlib

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from prr.model.loading import CONVERTED_MARKER, gguf_cache_path

    tmp = tmp_path_factory.mktemp("conversion")
    gguf = tmp / "model.gguf"
    gguf.write_bytes(b"GGUF")  # never read: its conversion is already in the cache
    cached = gguf_cache_path(gguf, tmp / "cache")
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(cached)
    (cached / "tokenizer.json").write_text('{"version": "1.0"}')  # stands for the converted tokenizer
    digests = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in cached.iterdir() if p.is_file()}
    (cached / CONVERTED_MARKER).write_text(json.dumps({"sha256": digests}))
    return gguf, cached, tmp / "cache"


HF = ["task.prompt_tokens=96", "task.max_new_tokens=2", "selector.topk_blocks=2", "selector.dense_layers=[]",
      "logger=none"]


def cut_in_half(data: bytes) -> bytes:
    return data[:len(data) // 2]


def one_digit_changed(data: bytes) -> bytes:  # still valid JSON: only the checksum tells
    return data.replace(b'"intermediate_size": 64', b'"intermediate_size": 65')


@pytest.mark.parametrize("damaged, damage, record, said", [
    ("config.json", one_digit_changed, True, "checksum mismatch"),
    ("tokenizer.json", cut_in_half, True, "checksum mismatch"),
    ("config.json", cut_in_half, True, "not a model config"),  # refused before torch: run.py reads the config first
    ("tokenizer.json", cut_in_half, False, "tokenizer files cannot be loaded"),  # a conversion that recorded
], ids=["config changed", "tokenizer recorded", "config not JSON", "tokenizer unrecorded"])  # only its weights
def test_a_corrupt_config_or_tokenizer_in_prrs_cache_names_the_dir_to_delete(cached_conversion, tmp_path,
                                                                              damaged, damage, record, said):
    """10: 48-55-line tracebacks; only the safetensors were checksummed."""
    from prr.model.loading import CONVERTED_MARKER

    gguf, original, cache = cached_conversion
    work_cache = tmp_path / "cache"
    shutil.copytree(cache, work_cache)
    cached = work_cache / original.relative_to(cache)
    if not record:
        marker = json.loads((cached / CONVERTED_MARKER).read_text())
        (cached / CONVERTED_MARKER).write_text(json.dumps({"sha256": {"model.safetensors":
                                                                      marker["sha256"]["model.safetensors"]}}))
    data = (cached / damaged).read_bytes()
    assert damage(data) != data
    (cached / damaged).write_bytes(damage(data))
    argv = [sys.executable, "run.py", "model=hf", f"model.name_or_path={gguf}", *HF, f"hydra.run.dir={tmp_path / 'r'}"]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PRR_CACHE_DIR": str(work_cache), "OMP_NUM_THREADS": "1"})
    text = " ".join(refused_lines(done))
    assert said in text and f"delete {cached}" in text, text


def test_the_install_stamp_belongs_to_the_interpreter(tmp_path):
    """7: the stamp lived in the checkout, so a new venv (or PYTHON=) after a first install skipped the
    install and the run died in `ModuleNotFoundError: omegaconf`. Now it lives in the venv."""
    if shutil.which("make") is None:
        pytest.skip("no make here")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)

    def stamp(python: str) -> str:
        return subprocess.run(["make", "-s", "print-test-stamp", f"PYTHON={python}"], cwd=ROOT, capture_output=True,
                              text=True, timeout=60, check=True).stdout.strip()

    fresh = stamp(str(venv / "bin" / "python"))
    assert fresh.startswith(str(venv) + os.sep) and fresh != stamp(sys.executable), fresh
    # make -q: 1 where the target is out of date, so `make run` with the new venv installs first
    pending = subprocess.run(["make", "-q", fresh, f"PYTHON={venv / 'bin' / 'python'}"], cwd=ROOT, capture_output=True,
                             timeout=60)
    assert pending.returncode == 1


def test_provenance_records_the_inputs_versions_and_machine(finished, cached_conversion, tmp_path):
    """15: a run dir could not show that its inputs were the same."""
    import hashlib

    from prr.model.loading import CONVERTED_MARKER
    from prr.provenance import inputs, weights_record

    record = strict_json((finished.run_dir / "provenance.json").read_text())
    assert {"hydra-core", "omegaconf", "numpy", "tokenizers"} <= set(record["versions"])
    assert all(record["versions"][p] for p in ("hydra-core", "omegaconf", "numpy", "tokenizers")), record["versions"]
    assert record["machine"]["cpu"] and record["machine"]["cpu_count"] and "gpu" in record["machine"]
    assert record["inputs"] == {"weights": {"model": "tiny-random", "random_init_seed": 0}, "prompt_file": None}

    prompt = tmp_path / "prompt.txt"
    prompt.write_text("some text\n")
    seen = inputs({"model": {"name_or_path": "tiny-random"}, "task": {"prompt_file": str(prompt)}})
    assert seen["prompt_file"] == {"path": str(prompt), "sha256": hashlib.sha256(b"some text\n").hexdigest()}

    gguf, cached, cache = cached_conversion  # a conversion: prr_source.json's record of every file
    recorded = json.loads((cached / CONVERTED_MARKER).read_text())["sha256"]
    assert weights_record(str(gguf), str(cache))["sha256"] == recorded
    fresh = weights_record(str(gguf), str(tmp_path / "empty-cache"))  # not converted yet: the GGUF's own sha256
    assert fresh["source_sha256"] == hashlib.sha256(b"GGUF").hexdigest() and fresh["converted"] is None
    own = tmp_path / "own"  # a directory of the user's: each safetensors file's sha256, computed
    shutil.copytree(cached, own)
    (own / CONVERTED_MARKER).unlink()
    weights = (own / "model.safetensors").read_bytes()
    assert weights_record(str(own))["sha256"] == {"model.safetensors": hashlib.sha256(weights).hexdigest()}


def time_faults(repeats: int) -> None:
    """Each refused case of FAULTS, timed as tests/test_front_door.py times its cases (wall and the
    child's CPU seconds), into a temporary dir (the run dir a fresh one)."""
    import resource
    import tempfile
    import time

    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        (tmp / "prompt.txt").write_text("Long enough text for any prompt of these tests. " * 100)
        print(f"load average before: {os.getloadavg()}, {os.cpu_count()} CPUs, {repeats} repeats")
        slowest = (0.0, "")
        for fault in FAULTS:
            times, cpu = [], []
            for _ in range(repeats):
                used = resource.getrusage(resource.RUSAGE_CHILDREN)
                start = time.perf_counter()
                done = run_py(fault.flags, fault.args, tmp, tmp / "run0", fault.env)
                times.append(time.perf_counter() - start)
                after = resource.getrusage(resource.RUSAGE_CHILDREN)
                cpu.append(after.ru_utime + after.ru_stime - used.ru_utime - used.ru_stime)
                assert done.returncode == 2, (fault.name, done.stderr[-2000:])
            times.sort()
            cpu.sort()
            print(f"{fault.name:50s} wall min {times[0]:.2f} median {times[len(times) // 2]:.2f} max {times[-1]:.2f} s"
                  f" | CPU max {cpu[-1]:.2f} s")
            slowest = max(slowest, (times[-1], fault.name))
        print(f"slowest wall: {slowest[1]} {slowest[0]:.2f} s; load average after: {os.getloadavg()}")


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="time each refused case of tests/test_front_door_faults.py")
    parser.add_argument("--repeats", type=int, default=5)
    time_faults(parser.parse_args().repeats)
