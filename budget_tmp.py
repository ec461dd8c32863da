import tempfile, os
from pathlib import Path
from tests.test_one_engine import overrides, run_case
t = Path(tempfile.mkdtemp())
os.environ["PRR_CACHE_DIR"] = str(t / "cache")
base = overrides("indexer", "last_step")
serial = run_case(t, [*base, "predictor=none", "runtime.engine=eager"], "serial")
for budget, extra in (("fixed", []), ("profiled", ["budget.ratios=[1.0]", "budget.max_rounds=1"]), ("adaptive", [])):
    for engine in ("eager", "graph"):
        r = run_case(t, [*base, f"budget={budget}", *extra, f"runtime.engine={engine}"], budget + engine)
        print("RESULT", budget, engine, r["generated_token_ids"] == serial["generated_token_ids"], r.get("variant"), r.get("predicted_blocks"), r.get("hit_rate"), flush=True)
