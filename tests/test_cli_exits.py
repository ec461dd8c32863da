"""run.py's convention for ending early: a refused input exits with code 2 and one line on
stderr naming the bad value and the valid names; an interrupted run (Ctrl-C, SIGTERM) exits
with 130 and one line naming the run dir that holds its records. Never a traceback.
(docs/reliability.md lists what the user sees.)"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from prr.override_check import BadOverride, check_command_line

ROOT = Path(__file__).resolve().parents[1]
TINY = ["model=tiny-random", "logger=none", "selector.dense_layers=[]", "task.prompt_tokens=300",
        "task.max_new_tokens=10", "task.stop_at_eos=false", "selector.topk_blocks=6"]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def cli(*args, cwd):
    return subprocess.run([sys.executable, str(ROOT / "run.py"), *args], cwd=cwd, env=ENV,
                          capture_output=True, text=True, timeout=600)


def refused_line(done) -> str:
    """The one line a refused command prints on stderr (asserting that it is the only one)."""
    assert done.returncode == 2, (done.returncode, done.stderr[-3000:])
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    lines = [line for line in done.stderr.split("\n") if line.strip()]
    assert len(lines) == 1, done.stderr
    return lines[0]


def test_an_unknown_group_option_is_one_line_naming_the_options(tmp_path):
    line = refused_line(cli(*TINY, "selector=qest", f"hydra.run.dir={tmp_path / 'r'}", cwd=tmp_path))
    options = ", ".join(sorted(p.stem for p in (ROOT / "conf" / "selector").glob("*.yaml")))
    assert "selector=qest" in line and f"options: {options}" in line and "quest" in options
    assert "did you mean quest" in line
    assert not (tmp_path / "r").exists()
    helped = cli("--help", cwd=tmp_path)  # the check before Hydra leaves --help to Hydra, which lists them too
    assert helped.returncode == 0, helped.stderr
    assert f"selector: {options}" in helped.stdout


def test_an_unknown_option_in_a_sweep_is_refused_before_any_job_runs(tmp_path):
    done = cli("-m", *TINY, "selector=quest,qest", f"hydra.sweep.dir={tmp_path / 's'}", cwd=tmp_path)
    line = refused_line(done)
    assert "selector=qest" in line and "did you mean quest" in line
    assert not (tmp_path / "s").exists()  # job 0 (quest, valid) did not run either


def test_an_unknown_hydra_group_option_lists_the_installed_ones(tmp_path):
    line = refused_line(cli(*TINY, "hydra/launcher=nope", cwd=tmp_path))
    assert "hydra/launcher=nope" in line and "basic" in line


def test_a_misspelled_key_is_one_line_with_the_closest_key(tmp_path):
    line = refused_line(cli(*TINY, "selector.topk_blok=3", cwd=tmp_path))
    assert "selector.topk_blok=3" in line and "did you mean selector.topk_blocks?" in line
    assert "quest" in line  # the option whose keys these are
    line = refused_line(cli("-m", *TINY, "selector=quest,infllm", "selector.representatives=2", cwd=tmp_path))
    assert "selector.representatives=2" in line and "quest" in line  # a key of infllm only, not of quest


def test_an_unknown_top_level_key_lists_the_keys_and_adding_one_is_refused(tmp_path):
    line = refused_line(cli(*TINY, "foo=1", cwd=tmp_path))
    assert "foo=1" in line and "seed" in line and "selector" in line and "+foo=1" not in line
    # +foo=1 composes in Hydra, but nothing in prr reads foo: issue 36 refuses it instead of ignoring it
    line = refused_line(cli(*TINY, "+foo=1", cwd=tmp_path))
    assert "+foo=1" in line and "'foo'" in line and "change nothing" in line
    shown = cli(*TINY, "++seed=3", "--cfg", "job", cwd=tmp_path)  # a key prr reads may be forced (and --cfg works)
    assert shown.returncode == 0 and "seed: 3" in shown.stdout, shown.stderr[-3000:]


def test_a_presets_sweep_is_checked_under_the_group_options_its_params_choose():
    # +experiment=accuracy sweeps task=ruler_niah,...: context_tokens is a key of those, not of the default long_text
    check_command_line(["-m", "+experiment=accuracy", "task.context_tokens=512"], ROOT / "conf", "config")
    with pytest.raises(BadOverride, match=r"task \(ruler_niah\) has no key 'context_tokns'; did you mean task.context_tokens"):
        check_command_line(["-m", "+experiment=accuracy", "task.context_tokns=512"], ROOT / "conf", "config")
    with pytest.raises(BadOverride, match="selector has no option 'qest'"):
        check_command_line(["-m", "+experiment=accuracy", "selector=quest,qest"], ROOT / "conf", "config")


def test_a_sweep_without_multirun_is_one_line(tmp_path):
    line = refused_line(cli(*TINY, "selector=quest,exact", cwd=tmp_path))
    assert "selector=quest,exact" in line and "-m" in line


def test_a_flag_among_the_overrides_is_one_line(tmp_path):
    line = refused_line(cli(*TINY, "-m", "selector=quest,exact", cwd=tmp_path))  # argparse's usage text before
    assert "unrecognized arguments: selector=quest,exact" in line and "-m go before or after the overrides" in line


def test_a_relaunch_with_another_config_is_refused_in_one_line(tmp_path):
    out = tmp_path / "r"
    first = cli(*TINY, "predictor=ema", f"hydra.run.dir={out}", cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    line = refused_line(cli(*TINY, "predictor=last_step", f"hydra.run.dir={out}", cwd=tmp_path))
    assert f"{out} holds a finished run of a different config" in line


@pytest.mark.slow  # loads the real model's tokenizer (make test-full)
def test_a_prompt_file_of_too_few_tokens_is_refused_in_one_line_once_the_tokenizer_loads(tmp_path):
    prompt = tmp_path / "short.txt"
    prompt.write_text("hello world " * 200)  # 2400 bytes pass the check before loading; about 400 tokens do not
    line = refused_line(cli("logger=none", "task.prompt_tokens=1024", f"task.prompt_file={prompt}",
                            f"hydra.run.dir={tmp_path / 'r'}", cwd=tmp_path))
    assert line.startswith("error: task.prompt_tokens=1024 but the text has only ")
    assert json.loads((tmp_path / "r" / "summary.json").read_text())["status"] == "failed"
    line = refused_line(cli("logger=none", "task=perplexity", "task.context_tokens=1024", "task.score_tokens=8",
                            "task.num_samples=1", f"task.prompt_file={prompt}", f"hydra.run.dir={tmp_path / 'p'}",
                            cwd=tmp_path))
    assert line.startswith("error: the text has ") and "fewer than task.context_tokens + task.score_tokens" in line


# --- interrupts -------------------------------------------------------------------------------
def interrupt_a_run(tmp_path, signum):
    """Start a long run, send `signum` once it is decoding; its exit code, stderr and run dir."""
    out = tmp_path / "r"
    stderr_path = tmp_path / "stderr.txt"
    with open(stderr_path, "w") as stderr:  # a file, not a pipe: tqdm's bar would fill a pipe nobody reads
        # SIGINT back to its default in the child: a shell without job control starts it ignored
        proc = subprocess.Popen([sys.executable, str(ROOT / "run.py"), *TINY, "task.max_new_tokens=3000",
                                 f"hydra.run.dir={out}"], cwd=tmp_path, env=ENV, stdout=subprocess.DEVNULL,
                                stderr=stderr, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        tokens = out / "records" / "tokens.jsonl"
        deadline = time.time() + 120
        while not (tokens.exists() and tokens.read_bytes().count(b"\n") >= 3):
            if time.time() > deadline or proc.poll() is not None:
                proc.kill()
                raise AssertionError(f"the run decoded nothing within 120 s: {stderr_path.read_text()[-3000:]}")
            time.sleep(0.2)
        proc.send_signal(signum)
        returncode = proc.wait(timeout=60)
    return returncode, stderr_path.read_text(), out


def check_interrupted(returncode, stderr, out, cause):
    assert returncode == 130, (returncode, stderr[-3000:])
    assert "Traceback" not in stderr, stderr[-3000:]
    # tqdm's progress bar shares stderr; prr's line is the last one and the only one of its kind
    lines = [line for line in stderr.split("\n") if line.strip()]
    assert lines[-1].startswith(f"prr: {cause}; records kept in {out} "), stderr[-3000:]
    assert sum("records kept" in line for line in lines) == 1
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["records_kept"]["tokens.jsonl"] >= 3
    assert json.dumps(summary["records_kept"]) in lines[-1]


def test_ctrl_c_exits_130_with_one_line_naming_the_records(tmp_path):
    check_interrupted(*interrupt_a_run(tmp_path, signal.SIGINT), cause="interrupted (Ctrl-C)")


def test_sigterm_exits_130_with_one_line_naming_the_records(tmp_path):
    check_interrupted(*interrupt_a_run(tmp_path, signal.SIGTERM), cause="terminated by signal 15 (SIGTERM)")
