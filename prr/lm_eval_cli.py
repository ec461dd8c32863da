"""`prr-lm-eval`'s entry point: lm-eval is an extra (`make install`; `make run` installs no
lm-eval), so it is looked for first and, when missing, named in one line (exit status 2)
instead of an import traceback; then prr.lm_eval_model.main runs lm-eval's CLI."""

from __future__ import annotations

import importlib.util
import sys


def main(argv: list[str] | None = None) -> None:
    if importlib.util.find_spec("lm_eval") is None:
        print("prr-lm-eval: error: lm-eval is not installed: `make install` adds it (or pip install -e '.[eval]')",
              file=sys.stderr)
        sys.exit(2)
    from prr.lm_eval_model import main as lm_eval_main

    lm_eval_main(argv)
