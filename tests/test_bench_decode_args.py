"""experiments/bench_decode.py's argument checks, on the CPU (its timings need a GPU)."""

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("bench_decode", ROOT / "experiments" / "bench_decode.py")
bd = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = bd
_spec.loader.exec_module(bd)


@pytest.mark.parametrize("argv,message", [
    (["--dtype", "float32"], "--dtype float32 applies to the stage map only: add --parts stage"),
    (["--dtype", "float32", "--parts", "stage,token"], "applies to the stage map only"),
    (["--dtype", "float16", "--parts", "stage"], "invalid choice: 'float16'"),
])
def test_bad_arguments_are_one_line_before_any_work(argv, message, monkeypatch, capsys):
    monkeypatch.setattr("sys.argv", ["bench_decode.py", *argv])
    with pytest.raises(SystemExit) as exit_:
        bd.main()
    assert exit_.value.code == 2 and message in capsys.readouterr().err
