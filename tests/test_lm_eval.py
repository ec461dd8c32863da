"""The lm-eval model `prr`: lm-eval's command line runs it on a local task offline (CI
acceptance), its log-likelihoods equal a dense forward for the dense selector, generation
stops at `until`, and `python run.py task=lm_eval` logs lm-eval's scores like any metric."""

import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hydra import compose, initialize_config_dir

from prr.model.dense import DenseAttention
from prr.runner import run

ROOT = Path(__file__).resolve().parents[1]
TINY_ARGS = "model=tiny-random,selector=quest,predictor=ema,selector.topk_blocks=4,selector.dense_layers=[]"


def test_lm_eval_command_line_runs_the_prr_model_on_a_local_task_offline(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-m", "prr.lm_eval_model", "--model", "prr", "--model_args", TINY_ARGS,
         "--tasks", "prr_niah", "--limit", "2",  # the wrapper puts prr/tasks/lm_eval_tasks on the include path
         "--metadata", '{"context_tokens": 600}', "--output_path", str(tmp_path / "out")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    (results_file,) = list((tmp_path / "out").rglob("results_*.json"))
    results = json.loads(results_file.read_text())
    assert "string_match,none" in results["results"]["prr_niah"]
    assert results["n-samples"]["prr_niah"]["effective"] == 2


# A user's task folder: a loglikelihood task on a long context, its data made offline; it fails
# if datasets may reach the hub (prr-lm-eval sets HF_DATASETS_OFFLINE=1 unless set).
USER_TASK_YAML = """task: user_long_context
dataset_path: ""
dataset_name: ""
output_type: loglikelihood
test_split: test
custom_dataset: !function user_data.rows
doc_to_text: "{{text}}"
doc_to_target: "{{target}}"
target_delimiter: ""
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""
USER_TASK_DATA = """import datasets


def rows(**metadata):
    if not datasets.config.HF_DATASETS_OFFLINE:
        raise RuntimeError("datasets may reach the hub: HF_DATASETS_OFFLINE is not set")
    return {"test": datasets.Dataset.from_list([{"text": "Blocks of keys and values. " * 140, "target": " ok"}])}
"""


def user_task_folder(path: Path) -> Path:
    path.mkdir()
    (path / "user_long_context.yaml").write_text(USER_TASK_YAML)
    (path / "user_data.py").write_text(USER_TASK_DATA)
    return path


@pytest.mark.slow  # 17 s: make test-full (make test keeps the command line's own run)
def test_lm_eval_command_line_keeps_long_prompts_whole_up_to_the_model_context(tmp_path):
    """tiny-random's context is 4096 tokens (bytes): prompts of ~3800 tokens, longer than the old
    limit of task.context_tokens (2048) + 64, reach the model whole, with prr's own task and a
    user's task folder (--include_path=DIR) in one run, no --device and no HF_*_OFFLINE set."""
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")}
    out = subprocess.run(
        [sys.executable, "-m", "prr.lm_eval_model", "--model", "prr", "--model_args", TINY_ARGS,
         "--tasks", "prr_niah,user_long_context", f"--include_path={user_task_folder(tmp_path / 'user_tasks')}",
         "--limit", "1", "--metadata", '{"context_tokens": 3800}', "--output_path", str(tmp_path / "out")],
        cwd=ROOT, env={**env, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    (results_file,) = list((tmp_path / "out").rglob("results_*.json"))
    results = json.loads(results_file.read_text())
    assert set(results["results"]) == {"prr_niah", "user_long_context"}
    config = results["config"]
    assert config["max_length"] == 4096 and config["truncated_requests"] == 0
    prr = config["prr_config"]  # the resolved config of the run, as composed from --model_args
    assert prr["model"]["name_or_path"] == "tiny-random" and prr["selector"]["topk_blocks"] == 4
    assert prr["selector"]["dense_layers"] == [] and "block_size" in prr["runtime"] and "_target_" in prr["predictor"]
    assert "budget" in prr
    assert "is not used" not in out.stderr  # no --device given: no warning about lm-eval's default one
    assert "lost their oldest" not in out.stderr


# make test: one form of each; the rest run in make test-full (each case builds lm-eval's task index).
@pytest.mark.parametrize("form", [pytest.param("--include_path DIR", marks=pytest.mark.slow), "--include_path=DIR"])
def test_include_path_adds_the_users_folder_to_prrs_local_tasks(tmp_path, form, monkeypatch, capsys):
    from prr.lm_eval_model import main

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")  # main sets it when unset: keep this process as it was
    monkeypatch.setattr(sys, "argv", ["prr-lm-eval"])
    folder = str(user_task_folder(tmp_path / "user_tasks"))
    include = ["--include_path", folder] if form == "--include_path DIR" else [f"--include_path={folder}"]
    main(["validate", "--tasks", "prr_niah,user_long_context", *include])  # exits 1 when a task is not found
    assert "All tasks found" in capsys.readouterr().out


@pytest.mark.parametrize(("model_args", "tasks", "message"), [
    pytest.param("model=tiny-random", "no_such_task", "Tasks not found: no_such_task", marks=pytest.mark.slow),
    pytest.param("model=tiny-random,selectr=quest", "prr_niah", "selectr", marks=pytest.mark.slow),
    pytest.param("model=tiny-random,selector=qest", "prr_niah", "did you mean quest", marks=pytest.mark.slow),
    ("model=tiny-random,max_length=5000", "prr_niah", "max_length=5000 exceeds the context of model 'tiny-random' "
                                                       "(4096 tokens); use at most 4096"),
])
def test_a_bad_argument_is_one_line_and_exit_status_2_before_the_model_loads(model_args, tasks, message,
                                                                             monkeypatch, capsys):
    from prr.lm_eval_model import PRRLM, main

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr(sys, "argv", ["prr-lm-eval"])
    loads = PRRLM.model_loads_started
    with pytest.raises(SystemExit) as exit_:
        main(["--model", "prr", "--model_args", model_args, "--tasks", tasks, "--limit", "1"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert exit_.value.code == 2 and err.startswith("prr-lm-eval: error: ") and message in err
    assert PRRLM.model_loads_started == loads


def test_a_misspelled_model_arg_gets_the_closest_name_as_run_py_gives_it():
    """Issue 54: `--model_args selector=qest` ended in Hydra's "Could not find" without a "did you mean"."""
    from prr.lm_eval_model import compose_config
    from prr.override_check import BadOverride

    with pytest.raises(BadOverride, match="selector has no option 'qest'; did you mean quest"):
        compose_config({"model": "tiny-random", "selector": "qest"})


def test_an_unknown_task_is_refused_before_lm_eval_is_imported():
    """Issue 54: lm-eval's import and task index took 36-39 s before it refused an unknown task."""
    done = subprocess.run([sys.executable, "-c", "import sys; sys.modules['lm_eval.models'] = None; "
                           "from prr.lm_eval_cli import main; main()", "--model", "prr", "--tasks", "prr_niah,no_such_54"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    (line,) = done.stderr.strip().splitlines()
    assert "Tasks not found: no_such_54" in line and "prr_niah" not in line.partition("found:")[2].split(":")[0], line


def test_console_script_points_at_the_wrapper():
    (target,) = re.findall(r'^prr-lm-eval = "([\w.:]+)"$', (ROOT / "pyproject.toml").read_text(), re.M)
    module, _, name = target.partition(":")
    import importlib

    assert callable(getattr(importlib.import_module(module), name))


@pytest.fixture(scope="module")
def dense_lm():
    from prr.lm_eval_model import PRRLM

    # Requests of at most 32 + 64 tokens (bytes): rolling windows stay short (each scored token is a decode step).
    return PRRLM(model="tiny-random", selector="dense", predictor="none",
                 **{"task.context_tokens": 32, "runtime.dense_metrics_every": 1000})


def dense_logprobs(lm, ids: list[int]) -> torch.Tensor:
    """log p(ids[i] | ids[:i]) for i >= 1 under plain dense attention: [len(ids) - 1]."""
    model = lm.engine.model
    with torch.inference_mode():
        logits = model.decoder(torch.tensor([ids]), 0, DenseAttention(model.config.num_layers))[0].float()
    return torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]


def test_loglikelihood_equals_a_dense_forward_for_the_dense_selector(dense_lm):
    context, continuation = "The magic number is", " 1234567."
    (logprob, greedy), = dense_lm.loglikelihood([SimpleNamespace(args=(context, continuation))])
    ids = dense_lm.tok_encode(context + continuation)
    ref = dense_logprobs(dense_lm, ids)[len(dense_lm.tok_encode(context)) - 1:]
    assert logprob == pytest.approx(float(ref.sum()), abs=1e-3) and greedy is False


def test_loglikelihood_rolling_scores_every_token_once(dense_lm):
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    text = "Sparse attention keeps the blocks that matter. " * 3  # more bytes than max_length: several windows
    (total,) = dense_lm.loglikelihood_rolling([SimpleNamespace(args=(text,))])
    ids = dense_lm.tok_encode(text)
    windows = list(map(make_disjoint_window, get_rolling_token_windows(
        ids, dense_lm.prefix_token_id, dense_lm.max_length - 1, 1)))
    assert len(windows) > 1 and sum(len(pred) for _, pred in windows) == len(ids)  # every token scored once
    ref = 0.0
    for ctx, pred in windows:  # each window: its context, then its tokens, under plain dense attention
        if len(ctx) == 1:  # dense_logprobs scores from position 1: the first window's context is the prefix
            ref += float(dense_logprobs(dense_lm, ctx + pred).sum())
        else:
            ref += float(dense_logprobs(dense_lm, ctx + pred)[len(ctx) - 1:].sum())
    assert total == pytest.approx(ref, abs=2e-3)


def test_generate_until_stops_and_cuts_at_the_stop_string(dense_lm):
    context = "abc " * 10
    free = dense_lm.generate_until([SimpleNamespace(args=(context, {"max_gen_toks": 12, "until": []}))])[0]
    assert 0 < len(dense_lm.tok_encode(free)) <= 12
    stop = free[len(free) // 2] if free.strip() else None
    if stop:
        cut = dense_lm.generate_until([SimpleNamespace(args=(context, {"max_gen_toks": 12, "until": [stop]}))])[0]
        assert cut == free[: free.index(stop)]
    with pytest.raises(ValueError, match="decodes greedily"):
        dense_lm.generate_until([SimpleNamespace(args=(context, {"do_sample": True, "temperature": 0.7}))])


def test_requests_are_sized_from_the_model_context_by_default():
    from prr.lm_eval_model import PRRLM

    lm = PRRLM(model="tiny-random", selector="dense", predictor="none", **{"runtime.dense_metrics_every": 1000})
    assert lm.max_length == lm.engine.model.config.max_position_embeddings == 4096
    context = "Blocks of keys and values. " * 140  # 3780 tokens (bytes): beyond the old 2048 + 64
    lm.generate_until([SimpleNamespace(args=(context, {"max_gen_toks": 2, "until": []}))])
    assert lm.truncated_requests == 0


def test_a_lower_max_length_truncates_and_counts_and_warns_once_per_request_type(caplog):
    from prr.lm_eval_model import PRRLM

    lm = PRRLM(model="tiny-random", selector="dense", predictor="none", max_length=1024,
               **{"runtime.dense_metrics_every": 1000})
    assert lm.max_length == 1024 and lm.engine.max_tokens == 1024
    long, short = "Blocks of keys and values. " * 60, "abc " * 10  # 1620 and 40 tokens
    with caplog.at_level(logging.WARNING, logger="prr"):
        lm.generate_until([SimpleNamespace(args=(c, {"max_gen_toks": 2, "until": []})) for c in (long, long, short)])
        lm.loglikelihood([SimpleNamespace(args=(long, " ok")), SimpleNamespace(args=(short, " ok"))])
    assert lm.truncated_requests == 3 and lm.get_model_info()["truncated_requests"] == 3
    warnings = [r.getMessage() for r in caplog.records if r.name == "prr"]
    assert len(warnings) == 2  # one per request type, with the count
    assert "2 of 3 generate_until requests exceed max_length=1024" in warnings[0]
    assert "1 of 2 loglikelihood requests exceed max_length=1024" in warnings[1]
    assert "up to the model's context of 4096" in warnings[0]


def test_max_length_above_the_model_context_is_refused_before_loading():
    from prr.lm_eval_model import PRRLM

    loads = PRRLM.model_loads_started
    with pytest.raises(ValueError, match=r"max_length=5000 exceeds the context of model 'tiny-random' \(4096 tokens\)"):
        PRRLM(model="tiny-random", max_length=5000)
    assert PRRLM.model_loads_started == loads


@pytest.mark.slow  # ~25 s (lm-eval's import, a run); the CLI test above is the CI acceptance
def test_run_py_task_lm_eval_logs_lm_eval_scores_in_the_summary(tmp_path):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[
            "model=tiny-random", "logger=none", "task=lm_eval", "task.tasks=[prr_niah]", "task.limit=1",
            "+task.metadata.context_tokens=600", "selector.topk_blocks=4", "selector.dense_layers=[]"])
    summary = run(cfg, tmp_path / "run")
    assert summary["status"] == "complete" and "lm_eval/prr_niah/string_match" in summary
    assert summary["lm_eval/truncated_requests"] == 0  # 600-token prompts within task.context_tokens (2048)
    saved = json.loads((tmp_path / "run" / "lm_eval_results.json").read_text())
    assert saved["prr_niah"]["string_match,none"] == summary["lm_eval/prr_niah/string_match"]
    assert (tmp_path / "run" / "records" / "steps.jsonl").stat().st_size > 0  # the runtime's records, as any run


@pytest.mark.slow
def test_dense_prr_scores_like_lm_evals_hf_model_on_prompts_longer_than_4k_tokens(tmp_path):
    """Issue 23's acceptance: `prr-lm-eval --model prr` with selector=dense on a local task whose
    prompts are ~5,000 tokens (above 4K, within SmolLM2's 8K context) scores what lm-eval's own
    `hf` model scores on the converted weights, with no extra options (no max_length, no
    context flags): the prompts reach the model whole and greedy decoding matches."""
    from prr.model.loading import ensure_gguf_converted
    from prr.model.zoo import ZOO
    from prr.paths import cache_dir

    spec = ZOO["smollm2-135m"]
    weights = ensure_gguf_converted(spec.gguf_path(), cache_dir() / "models" / spec.cache_key)
    common = ["--tasks", "prr_niah", "--limit", "3", "--metadata", '{"context_tokens": 5000, "num_samples": 3}']
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    scores = {}
    for name, model in (("prr", ["-m", "prr.lm_eval_model", "--model", "prr", "--model_args",
                                 "model=smollm2-135m,selector=dense,predictor=none"]),
                        ("hf", ["-m", "lm_eval", "--model", "hf", "--model_args",
                                f"pretrained={weights},dtype=float32", "--include_path",
                                str(ROOT / "prr" / "tasks" / "lm_eval_tasks")])):
        out = subprocess.run([sys.executable, *model, *common, "--output_path", str(tmp_path / name)], cwd=ROOT,
                             env=env, capture_output=True, text=True, timeout=1800)
        assert out.returncode == 0, out.stderr[-3000:]
        (results_file,) = list((tmp_path / name).rglob("results_*.json"))
        results = json.loads(results_file.read_text())
        scores[name] = results["results"]["prr_niah"]["string_match,none"]
        if name == "prr":
            assert results["config"]["truncated_requests"] == 0 and results["config"]["max_length"] == 8192
    assert scores["prr"] == scores["hf"]
