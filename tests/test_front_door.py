"""Issue 36, the front door: every everyday fault it names, tried as a user types it.

Each refused case runs `python run.py` (or its console script) in a subprocess and asserts:
exit code 2 (130 for Ctrl-C), one or two lines on stderr, no traceback, the bad value named in
the message, and every file of an earlier, finished run unchanged (sha256: each case points
its run dir at that run). The cases that now work (the graph engine without Triton, logger=auto
without wandb, runtime=auto, budget=profiled on the eager runtime) are run too.

How long each refusal takes is measured, not asserted (tests never assert on wall time):
    python tests/test_front_door.py --repeats 5
prints each case's min / median / max wall seconds, and its CPU seconds (user + sys: what
the wall time approaches on an idle machine), with the load average; docs/reliability.md
states the slowest."""

from __future__ import annotations

import hashlib
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest

from prr.provenance import PACKAGES

ROOT = Path(__file__).resolve().parents[1]
TINY = ["model=tiny-random", "logger=none", "selector.dense_layers=[]", "task.prompt_tokens=256", "task.max_new_tokens=2",
        "selector.topk_blocks=4", "task.stop_at_eos=false"]
# Prelude for cases that need a package this install has: run run.py as if it were missing.
WITHOUT = ("import sys, runpy; {hide}; sys.argv = ['run.py', *sys.argv[1:]]; "
           "runpy.run_path('run.py', run_name='__main__')")
NO_TRITON = WITHOUT.format(hide="sys.modules['triton'] = None")  # `import triton` raises ImportError
NO_WANDB = WITHOUT.format(hide="import prr.sinks as s; s.missing_wandb_packages = lambda: ['wandb', 'matplotlib']")


@dataclass
class Case:
    name: str
    args: list[str]  # run.py's arguments ({tmp} is the test's temporary dir)
    named: list[str]  # what the message must contain
    env: dict[str, str] = field(default_factory=dict)
    prelude: str | None = None  # python -c code that runs run.py (sys.argv[1:] = args)
    points_at_run: bool = True  # add hydra.run.dir=<the finished run>
    # refused before torch is imported (the runtime group's checks, prr/runtime/settings.py, import it)
    before_torch: bool = True


REFUSED = [
    Case("unknown option", ["selector=qest"], ["selector=qest", "did you mean quest"]),
    Case("key of another group", ["selector.block_size=16"], ["selector.block_size=16", "runtime.block_size"]),
    Case("added key nobody reads", ["+foo=1"], ["+foo=1", "'foo'"]),
    Case("negative top-K", ["selector.topk_blocks=-5"], ["selector.topk_blocks=-5"]),
    Case("block size not a power of two", ["runtime.block_size=15"], ["runtime.block_size=15"]),
    Case("prompt file is a directory", ["task.prompt_file={tmp}"], ["task.prompt_file=", "is a directory"]),
    Case("prompt file missing", ["task.prompt_file={tmp}/no-such.txt"], ["no-such.txt", "does not exist"]),
    Case("run dir under a file", ["hydra.run.dir={tmp}/a-file/run"], ["hydra.run.dir=", "a-file", "is a file"],
         points_at_run=False),
    Case("PRR_CACHE_DIR is a file", [], ["PRR_CACHE_DIR=", "a-file", "not a directory"],
         env={"PRR_CACHE_DIR": "{tmp}/a-file"}),
    Case("logger=wandb without wandb", ["logger=wandb"], ["logger=wandb", "make install"], prelude=NO_WANDB),
    Case("runtime=cuda without a GPU or Triton", ["runtime=cuda"], ["runtime.device='cuda'", "no GPU driver"],
         prelude=NO_TRITON),
    # issue 54 item 14: these three imported torch first (2.1-3.2 s at load 5-6)
    Case("top-K covering the prompt", ["selector.topk_blocks=16"], ["selector.topk_blocks=16", "16 blocks"]),
    Case("block size larger than the prompt", ["runtime.block_size=512"], ["runtime.block_size=512", "256 tokens"]),
    Case("backend=triton on the CPU", ["backend=triton", "runtime=cpu"], ["backend=triton", "backend=torch"],
         env={"TRITON_INTERPRET": "0"}),
    Case("tensor parallel without torchrun or Triton", ["runtime.engine=graph", "runtime.tensor_parallel=2"],
         ["runtime.tensor_parallel=2", "torchrun --nproc_per_node 2"], prelude=NO_TRITON),
    Case("graph engine, profiled budget, every layer dense",
         ["model=tiny-random-d64", "runtime.engine=graph", "budget=profiled", "selector.dense_layers=[0,1]"],
         ["selector.dense_layers=[0, 1]", "budget=profiled"]),
    Case("oracle with the profiled budget", ["predictor=oracle", "budget=profiled"], ["predictor=oracle", "budget=profiled"]),
]


def sha256_tree(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def command(case: Case, tmp: Path, run_dir: Path | None) -> tuple[list[str], dict[str, str]]:
    args = [a.replace("{tmp}", str(tmp)) for a in [*TINY, *case.args]]
    if case.points_at_run and run_dir is not None:
        args.append(f"hydra.run.dir={run_dir}")
    head = [sys.executable, "-c", case.prelude] if case.prelude else [sys.executable, "run.py"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", **{k: v.replace("{tmp}", str(tmp)) for k, v in case.env.items()}}
    env.setdefault("PRR_CACHE_DIR", str(tmp / "cache"))
    return [*head, *args], env


def refused_lines(done: subprocess.CompletedProcess) -> list[str]:
    assert done.returncode == 2, (done.returncode, done.stderr[-3000:])
    assert "Traceback" not in done.stderr and "Traceback" not in done.stdout, done.stderr[-3000:]
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert 1 <= len(lines) <= 2, done.stderr
    return lines


@dataclass
class FinishedRun:
    tmp: Path  # the module's temporary dir (holds a-file, a plain file)
    run_dir: Path  # a finished tiny run, run as `make run` installs (no wandb) with runtime=auto
    sha256: dict[str, str]  # its files
    stdout: str


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> FinishedRun:
    tmp = tmp_path_factory.mktemp("front_door")
    (tmp / "a-file").write_text("not a directory\n")
    run_dir = tmp / "run0"
    done = subprocess.run([sys.executable, "-c", NO_WANDB, *TINY, "logger=auto", f"hydra.run.dir={run_dir}"], cwd=ROOT,
                          env={**os.environ, "PRR_CACHE_DIR": str(tmp / "cache"), "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "complete"
    return FinishedRun(tmp, run_dir, sha256_tree(run_dir), done.stdout)


@pytest.mark.parametrize("case", REFUSED, ids=[c.name for c in REFUSED])
def test_a_bad_value_is_refused_in_one_line_and_the_earlier_run_is_untouched(case, finished):
    tmp, run_dir, before = finished.tmp, finished.run_dir, finished.sha256
    argv, env = command(case, tmp, run_dir)
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    text = " ".join(refused_lines(done))
    for named in case.named:
        assert named in text, (named, text)
    assert sha256_tree(run_dir) == before


# `import torch` (and the other heavy packages) raises ImportError: a refusal that needed one would
# end in a traceback, not in the case's one line
NOTHING_HEAVY = "import sys; sys.modules.update(dict.fromkeys(('torch', 'transformers', 'pandas', 'numpy'))); "
BEFORE_TORCH = [c for c in REFUSED if c.before_torch]


@pytest.mark.parametrize("case", BEFORE_TORCH, ids=[c.name for c in BEFORE_TORCH])
def test_a_refusal_is_decided_before_torch_is_imported(case, tmp_path):
    """Issue 36: every refusal of a bad value under 3 s on an idle 2-core machine; importing
    torch alone takes 1-1.5 s there, so these refuse before it (tests/test_front_door.py
    --repeats 5 times them)."""
    (tmp_path / "a-file").write_text("not a directory\n")
    prelude = NOTHING_HEAVY + (case.prelude or WITHOUT.format(hide="pass"))
    argv, env = command(replace(case, prelude=prelude), tmp_path, tmp_path / "run")
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    text = " ".join(refused_lines(done))
    assert all(named in text for named in case.named), text


def test_an_unwritable_run_dir_is_refused_in_one_line(finished):
    """Immutable (chattr +i; as root) or read-only (chmod; as another user): named before Hydra
    writes anything, where Hydra's own mkdir or prr's `.hydra` write raised a PermissionError."""
    tmp, run_dir, before = finished.tmp, finished.run_dir, finished.sha256
    locked = tmp / "locked"
    locked.mkdir(exist_ok=True)
    if os.geteuid() == 0:
        if shutil.which("chattr") is None or subprocess.run(["chattr", "+i", str(locked)]).returncode != 0:
            pytest.skip("root without chattr +i here: no way to make a directory unwritable")
        unlock = ["chattr", "-i", str(locked)]
    else:
        locked.chmod(0o555)
        unlock = ["chmod", "755", str(locked)]
    try:
        for target in (locked, locked / "sub" / "run"):
            argv, env = command(Case("locked", [f"hydra.run.dir={target}"], [], points_at_run=False), tmp, None)
            text = " ".join(refused_lines(subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True,
                                                         timeout=120)))
            assert f"{locked} cannot be written" in text and "hydra.run.dir" in text, text
    finally:
        subprocess.run(unlock, check=True)
    assert not any(locked.iterdir()) and sha256_tree(run_dir) == before


def test_a_refused_sweep_relaunch_changes_no_file_and_collect_reads_what_the_runs_ran(finished, tmp_path):
    """A sweep relaunched with another value is refused before Hydra rewrites multirun.yaml (the
    resume sweeper is the default), and collect_sweep takes the command from the runs' records."""
    sweep = tmp_path / "sweep"
    base = [sys.executable, "run.py", "-m", *TINY, "predictor=none,last_step", f"hydra.sweep.dir={sweep}"]
    env = {**os.environ, "PRR_CACHE_DIR": str(finished.tmp / "cache"), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(ROOT)}  # experiments/*.py import this checkout's prr, whichever one pip installed
    done = subprocess.run([*base, "task.max_new_tokens=3"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    before = sha256_tree(sweep)
    assert "multirun.yaml" in before and len([f for f in before if f.endswith("summary.json")]) == 2
    again = subprocess.run([*base, "task.max_new_tokens=2"], cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=300)
    text = " ".join(refused_lines(again))
    assert str(sweep / "0") in text and "different config" in text, text
    assert sha256_tree(sweep) == before
    (sweep / "multirun.yaml").write_text((sweep / "multirun.yaml").read_text().replace("max_new_tokens=3",
                                                                                      "max_new_tokens=2"))
    collected = subprocess.run([sys.executable, "experiments/collect_sweep.py", str(sweep), str(tmp_path / "out")],
                               cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert collected.returncode == 0, collected.stderr[-3000:]
    record = json.loads((tmp_path / "out.json").read_text())
    assert "task.max_new_tokens=3" in record["command"] and "predictor=none,last_step" in record["command"]
    (commit,) = record["runs_provenance"]  # both runs: one checkout, one set of versions
    assert set(commit["versions"]) == set(PACKAGES) and "dirty" in commit["git"]


def test_another_config_relaunched_into_an_interrupted_runs_dir_is_refused(finished, tmp_path):
    """An interrupted run's records are kept for a rerun of its own config; another config is
    refused as for a finished run (issue 36: it replaced them silently)."""
    interrupted = tmp_path / "interrupted"
    shutil.copytree(finished.run_dir, interrupted)
    (interrupted / "summary.json").write_text(json.dumps({"status": "running"}))  # what kill -9 leaves
    before = sha256_tree(interrupted)
    argv, env = command(Case("other", ["task.max_new_tokens=3", f"hydra.run.dir={interrupted}"], [],
                             points_at_run=False), finished.tmp, None)
    text = " ".join(refused_lines(subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True,
                                                 timeout=300)))
    assert str(interrupted) in text and "unfinished run" in text and "'running'" in text, text
    assert sha256_tree(interrupted) == before


def test_each_run_records_its_commit_and_versions(finished):
    record = json.loads((finished.run_dir / "provenance.json").read_text())
    assert set(record["versions"]) == set(PACKAGES)
    import torch

    assert record["versions"]["torch"] == torch.__version__
    git = record["git"]
    assert git["commit"] is None or (len(git["commit"]) == 40 and isinstance(git["dirty"], bool)), git


@pytest.fixture(scope="module")
def tiny_hf_dir(tmp_path_factory) -> Path:
    """A tiny HF safetensors dir (no tokenizer) with the checksum record prr writes when it converts."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("hf") / "m"
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    digest = hashlib.sha256((folder / "model.safetensors").read_bytes()).hexdigest()
    (folder / "prr_source.json").write_text(json.dumps({"sha256": {"model.safetensors": digest}}))
    return folder


def flip_a_byte(weights: Path) -> None:
    data = weights.read_bytes()
    weights.write_bytes(data[:-5] + bytes([data[-5] ^ 0xFF]) + data[-4:])


HF = ["model=hf", "task.prompt_tokens=96", "task.max_new_tokens=2", "selector.topk_blocks=2",
      "selector.dense_layers=[]", "logger=none"]


def test_corrupt_weights_in_the_users_model_dir_are_one_line_naming_the_file(finished, tiny_hf_dir, tmp_path):
    own = tmp_path / "own"
    shutil.copytree(tiny_hf_dir, own)
    flip_a_byte(own / "model.safetensors")
    argv, env = command(Case("own", [*HF, f"model.name_or_path={own}", f"hydra.run.dir={tmp_path / 'r'}"], [],
                             points_at_run=False), finished.tmp, None)
    text = " ".join(refused_lines(subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)))
    assert str(own / "model.safetensors") in text and "checksum mismatch" in text and "delete" not in text, text
    assert json.loads((tmp_path / "r" / "summary.json").read_text())["status"] == "failed"


def test_corrupt_weights_in_prrs_cache_are_one_line_naming_the_dir_to_delete(finished, tiny_hf_dir, tmp_path):
    from prr.model.loading import CONVERTED_MARKER, gguf_cache_path

    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")  # never read: its conversion is already in the cache
    cached = gguf_cache_path(gguf, tmp_path / "cache")
    shutil.copytree(tiny_hf_dir, cached)  # what a finished conversion leaves there
    (cached / CONVERTED_MARKER).touch()
    flip_a_byte(cached / "model.safetensors")
    argv, env = command(Case("cache", [*HF, f"model.name_or_path={gguf}", f"hydra.run.dir={tmp_path / 'r'}"], [],
                             env={"PRR_CACHE_DIR": str(tmp_path / "cache")}, points_at_run=False), finished.tmp, None)
    text = " ".join(refused_lines(subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)))
    assert str(cached / "model.safetensors") in text and f"delete {cached}" in text, text


LM_EVAL = "import sys; {hide}; from prr.lm_eval_cli import main; main()"


@pytest.mark.parametrize("hide, args, named", [
    ("sys.modules['lm_eval'] = None", ["--model", "prr", "--tasks", "prr_niah"], ["lm-eval is not installed", "make install"]),
    ("pass", ["--tasks", "no_such_task_36"], ["no_such_task_36", "--model prr"]),
], ids=["before make install", "unknown task without --model prr"])
def test_prr_lm_eval_refuses_in_one_line(hide, args, named):
    done = subprocess.run([sys.executable, "-c", LM_EVAL.format(hide=hide), *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    text = " ".join(refused_lines(done))
    assert all(n in text for n in named), text


def test_ctrl_c_while_python_imports_torch_is_one_line_and_exit_130(finished):
    tmp, run_dir, before = finished.tmp, finished.run_dir, finished.sha256
    argv, env = command(Case("ctrl-c", [], []), tmp, run_dir)
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    time.sleep(0.6)  # past the interpreter's start (its handler installed), inside prr's imports or checks
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, (proc.returncode, err[-3000:])
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err and "interrupted (Ctrl-C)" in lines[0], err
    assert sha256_tree(run_dir) == before


def test_the_graph_engine_runs_on_the_cpu_without_triton(finished, tmp_path):
    """What `make run` installs has no Triton: runtime.engine=graph runs the engine's torch ops."""
    tmp = finished.tmp
    argv, env = command(Case("graph", ["runtime.engine=graph", f"hydra.run.dir={tmp_path / 'g'}"], [],
                             prelude=NO_TRITON, points_at_run=False), tmp, None)
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert json.loads((tmp_path / "g" / "summary.json").read_text())["status"] == "complete"


def test_logger_auto_without_wandb_runs_and_says_so_in_one_line(finished):
    """The fixture's run: `make run`'s install has no wandb; the default logger says so and runs."""
    said = [line for line in finished.stdout.splitlines() if "logger=auto" in line]
    assert len(said) == 1 and "wandb" in said[0] and "make install" in said[0], finished.stdout[-3000:]
    assert not (finished.run_dir / "wandb").exists()


def test_runtime_auto_says_what_it_chose_first_and_records_it(finished):
    import torch

    chosen = "cuda" if torch.cuda.is_available() else "cpu"
    assert finished.stdout.splitlines()[0].startswith(f"prr: runtime=auto chose runtime={chosen} ("), finished.stdout[:500]
    hydra_record = (finished.run_dir / ".hydra" / "hydra.yaml").read_text()
    assert f"runtime: {chosen}" in hydra_record  # the choice, not `auto`, is what results_store reads


def test_runtime_auto_takes_the_gpu_when_torch_sees_one(monkeypatch):
    import torch

    from prr.front_door import auto_runtime

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "NVIDIA H200")
    assert auto_runtime() == ("cuda", f"torch {torch.__version__} sees NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert auto_runtime()[0] == "cpu"


def test_the_auto_choice_goes_where_hydra_reads_overrides():
    from prr.front_door import with_runtime

    assert with_runtime(["a=1", "-m"], "cpu") == ["runtime=cpu", "a=1", "-m"]  # not after the flag
    assert with_runtime(["-m", "a=1"], "cuda") == ["-m", "runtime=cuda", "a=1"]
    assert with_runtime(["-m"], "cpu") == ["-m", "runtime=cpu"]
    assert with_runtime(["runtime=auto", "a=1"], "cpu") == ["runtime=cpu", "a=1"]  # replaced, not doubled
    # inside a sweep's list too: the job printed as "auto chose cuda" must run on cuda
    assert with_runtime(["-m", "runtime=auto,cpu"], "cuda") == ["-m", "runtime=cuda,cpu"]


def test_an_experiment_preset_keeps_its_own_runtime():
    """runtime=auto is replaced only where nothing chose a runtime: a GPU preset stays on cuda,
    the CPU presets on cpu, whatever machine composes them."""
    from prr.override_check import check_command_line

    for preset, runtime in (("speedup", "cuda"), ("locality", "cpu"), ("accuracy", "cpu")):
        jobs = check_command_line(["-m", f"+experiment={preset}"], ROOT / "conf", "config")
        assert {job.hydra.runtime.choices.runtime for job in jobs} == {runtime}, preset


def test_profiled_budget_on_the_eager_runtime_is_not_timed(tmp_path, monkeypatch, caplog):
    """Its stages run one after another, so the stage check can only choose |P| = 0: said in one
    line, nothing timed, nothing cached."""
    import logging

    from prr.config_check import compose_config
    from prr.runner import run

    monkeypatch.setenv("PRR_CACHE_DIR", str(tmp_path / "cache"))
    caplog.set_level(logging.INFO, logger="prr")
    summary = run(compose_config([*TINY, "budget=profiled"]), tmp_path / "run")
    setup = summary["budget_setup"]
    assert setup["profile_source"] == "not measured" and set(setup["profile_choice"].values()) == {0}
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("budget=profiled")]
    assert len(said) == 1 and "not measured" in said[0] and "one after another" in said[0], said
    assert not (tmp_path / "cache" / "budget").exists()


def time_refusals(repeats: int) -> None:
    """Each refusal's wall time over `repeats` runs (the test's cases, the same temporary files)."""
    import tempfile

    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        (tmp / "a-file").write_text("not a directory\n")
        print(f"load average before: {os.getloadavg()}, {os.cpu_count()} CPUs, {repeats} repeats")
        slowest, slowest_cpu = (0.0, ""), (0.0, "")
        for case in REFUSED:
            argv, env = command(case, tmp, tmp / "run0")
            times, cpu = [], []
            for _ in range(repeats):
                used = resource.getrusage(resource.RUSAGE_CHILDREN)
                start = time.perf_counter()
                done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
                times.append(time.perf_counter() - start)
                after = resource.getrusage(resource.RUSAGE_CHILDREN)
                cpu.append(after.ru_utime + after.ru_stime - used.ru_utime - used.ru_stime)
                assert done.returncode == 2, (case.name, done.stderr[-2000:])
            times.sort()
            cpu.sort()
            print(f"{case.name:45s} wall min {times[0]:.2f} median {times[len(times) // 2]:.2f} max {times[-1]:.2f} s"
                  f" | CPU min {cpu[0]:.2f} median {cpu[len(cpu) // 2]:.2f} max {cpu[-1]:.2f} s"
                  f" | {'before' if case.before_torch else 'after'} torch")
            slowest = max(slowest, (times[-1], case.name))
            slowest_cpu = max(slowest_cpu, (cpu[-1], case.name))
        print(f"slowest wall: {slowest[1]} {slowest[0]:.2f} s; slowest CPU (user + sys): {slowest_cpu[1]} "
              f"{slowest_cpu[0]:.2f} s; load average after: {os.getloadavg()}")


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="time each refusal of tests/test_front_door.py")
    parser.add_argument("--repeats", type=int, default=5)
    time_refusals(parser.parse_args().repeats)


# OmegaConf, interrupted mid-compose, raises an AttributeError of its half-built node; run.py's
# checks then refuse that error: the process must still end as the Ctrl-C it was
CTRL_C_TURNED_INTO_ANOTHER_ERROR = """
import os, signal
from prr.cli_exits import refuse_without_teardown, watch_ctrl_c
watch_ctrl_c()
try:
    try:
        os.kill(os.getpid(), signal.SIGINT)
    except KeyboardInterrupt:
        raise AttributeError("'NoneType' object has no attribute '_invalidate_flags_cache'")
except AttributeError as err:
    refuse_without_teardown(str(err))
"""


def test_a_ctrl_c_that_a_library_turned_into_another_error_still_exits_130_in_one_line():
    done = subprocess.run([sys.executable, "-c", CTRL_C_TURNED_INTO_ANOTHER_ERROR], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 130 and len(lines) == 1 and "interrupted (Ctrl-C)" in lines[0], done.stderr
