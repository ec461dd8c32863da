"""Two trees' whole runs side by side: bench_engine_runs.py's JSON from the tree before a change
and from the tree after it, timed in the same device call. Per case: each tree's median ms per
token, after / before with its 95% bootstrap interval over steps (the first step, which carries
the capture, left out), and whether the generated tokens are equal.

    python experiments/compare_engine_runs.py BEFORE.json AFTER.json [--out table.md] [--tolerance 0.01]

Exit 1 when a ratio's interval lies wholly outside 1 +- tolerance or the tokens differ, so a
device script can fail loudly."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from prr.bench_args import OneLineParser, markdown
from prr.intervals import median_ratio_interval

HEADER = ["case", "variant", "before ms", "after ms", "after / before [95%]", "steps", "tokens equal"]


def compare(before: dict, after: dict, tolerance: float) -> tuple[list[list], bool]:
    """-> (one row per case both trees ran, whether every case is within tolerance)."""
    old = {row["case"]: row for row in before["rows"]}
    rows, ok = [], True
    for new in after["rows"]:
        base = old.get(new["case"])
        if base is None or not new.get("latencies_ms") or not base.get("latencies_ms"):
            rows.append([new["case"], new.get("variant"), "no run", "no run", "-", 0, "-"])
            ok = False
            continue
        ratio, low, high = median_ratio_interval(new["latencies_ms"][1:], base["latencies_ms"][1:])
        same_tokens = new["generated_token_ids"] == base["generated_token_ids"]
        within = low <= 1 + tolerance and high >= 1 - tolerance
        ok = ok and within and same_tokens
        rows.append([new["case"], new["variant"], f"{base['token_latency_median_ms']:.3f}",
                     f"{new['token_latency_median_ms']:.3f}",
                     f"{ratio:.4f} [{low:.4f}, {high:.4f}]", len(new["latencies_ms"]) - 1, same_tokens])
    return rows, ok


def main() -> None:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path)
    parser.add_argument("--out", type=Path, default=None, help="also write the table here (markdown)")
    parser.add_argument("--tolerance", type=float, default=0.01)
    args = parser.parse_args()
    for path in (args.before, args.after):
        if not path.is_file():
            parser.error(f"no such file: {path} (bench_engine_runs.py --out writes <out>.json)")
    before, after = json.loads(args.before.read_text()), json.loads(args.after.read_text())
    rows, ok = compare(before, after, args.tolerance)
    table = (f"{after.get('gpu', '?')}, torch {after.get('torch', '?')}; before {args.before.name} "
             f"({before.get('date', '?')}), after {args.after.name} ({after.get('date', '?')})\n\n"
             + markdown(HEADER, rows))
    print(table)
    if args.out:
        args.out.write_text(table + "\n")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
