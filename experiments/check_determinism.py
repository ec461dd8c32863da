"""Run one config twice (same seed) and compare everything but the timings.

    python experiments/check_determinism.py OUT_DIR [hydra overrides ...]

Writes OUT_DIR/a, OUT_DIR/b (two ordinary run directories) and OUT_DIR/determinism.json
(command, device, versions, date, and which columns differed); exits 1 if anything did.
Selections are compared through their per-step, per-layer, per-KV-head metrics (|A|, hits,
overlap, attention-mass recall, output error), tokens through the generated ids.
"""

from __future__ import annotations

import datetime
import json
import sys
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir

from prr.paths import strict_json_dumps
from prr.runner import run
from prr.sinks import read_jsonl

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    out, overrides = Path(sys.argv[1]), sys.argv[2:]
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides)
    summaries = [run(cfg, out / name) for name in ("a", "b")]
    frames = [read_jsonl(out / name / "records" / "steps.jsonl") for name in ("a", "b")]
    untimed = [c for c in frames[0].columns if not c.startswith("t_")]
    differing = [c for c in untimed if not frames[0][c].equals(frames[1][c])]
    tokens_equal = summaries[0]["generated_token_ids"] == summaries[1]["generated_token_ids"]
    record = {
        "command": "python " + " ".join(sys.argv),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "tokens_equal": tokens_equal,
        "rows": len(frames[0]),
        "differing_columns": differing,
        "max_abs_diff": {c: float((frames[0][c] - frames[1][c]).abs().max()) for c in differing
                         if frames[0][c].dtype.kind == "f"},
    }
    (out / "determinism.json").write_text(strict_json_dumps(record, indent=1) + "\n")
    print(json.dumps(record, indent=1))
    sys.exit(0 if tokens_equal and not differing else 1)


if __name__ == "__main__":
    main()
